"""bench/gemm/contention.py's markdown tables (``--md``), from rows shaped as the tool records them: every
measured value lands in its row and column, and a part with no rows leaves no table. CPU only."""

from __future__ import annotations

import random

from bench.gemm.contention import markdown


def _gemm_rows(rng: random.Random) -> list:
    rows = []
    for shape in ("DeepSeek-V3-EP8", "Small experts E=64"):
        for gemm in ("fp8 fprop", "bf16 wgrad"):
            alone = rng.uniform(0.1, 3.0)
            for k in (0, 8, 33):
                for budget in ([None] if k == 0 else [None, 132 - k]):
                    ratio = rng.uniform(0.7, 1.9)
                    rows.append({"shape": shape, "gemm": gemm, "held": k, "budget": budget, "ms": ratio * alone,
                                 "alone_ms": alone, "over_ideal": ratio, "gpu": "test"})
    return rows


def _cells(md: str, first: str) -> list:
    line = next(ln for ln in md.splitlines() if ln.startswith(f"| {first} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_gemm_table_places_each_ratio_under_its_k_and_budget():
    rng = random.Random(7)
    rows = _gemm_rows(rng)
    md = markdown(rows, 132, "GPU X, commit abc")
    assert md.startswith("GPU X, commit abc\n")
    header = _cells(md, "shape")
    assert header == ["shape", "GEMM", "alone ms", "k=8", "k=8 b", "k=33", "k=33 b"]
    for r in rows:
        if r["held"] == 0:
            continue
        cells = _cells(md, f"{r['shape']} | {r['gemm']}")
        assert cells[2] == f"{r['alone_ms']:.3f}"
        col = header.index(f"k={r['held']}{' b' if r['budget'] else ''}")
        assert cells[col] == f"{r['over_ideal']:.2f}"
    assert "fc1 forward" not in md and "training step" not in md


def test_fc1_and_step_tables():
    rows = [{"fc1_forward": [8, 1024, 1024, 8192], "held": k, "ms": ms, "queued_ms": q, "one_launch": False}
            for k, ms, q in ((0, 0.066, 0.045), (8, 0.0712, 0.0452), (33, 0.0805, 0.0461))]
    rows.append({"mlp_step": "Mixtral-8x7B", "held": 24, "ms": 23.342, "alone_ms": 21.188, "over_ideal": 0.9})
    md = markdown(rows, 132, "GPU Y")
    assert "queued behind a spin" in md
    assert _cells(md, "shape")[:8] == ["shape", "path", "alone", "k=8", "k=33", "alone q", "k=8 q", "k=33 q"]
    assert _cells(md, "8 x 1024 x 1024 x 8192") == ["8 x 1024 x 1024 x 8192", "two launches", "0.066", "0.071", "0.081",
                                                    "0.045", "0.045", "0.046"]
    assert _cells(md, "Mixtral-8x7B") == ["Mixtral-8x7B", "21.188", "24", "23.342", "0.90"]
    assert "alone x 132" not in md  # no GEMM rows: no GEMM table


def test_md_heading_names_gpu_commit_and_command(monkeypatch):
    """The --md heading from the tool's own arguments (which have no --quick): the GPU, its SMs, the commit measured
    (MOEGEMM_COMMIT, as on the GPU machine) and the command."""
    import argparse

    from bench.gemm.contention import PROG, md_heading
    monkeypatch.setenv("MOEGEMM_COMMIT", "abc1234")
    args = argparse.Namespace(only="fc1", md="out.md", reps=15)
    heading = md_heading("GPU X", 124, args, ["--only", "fc1", "--reps", "15"])
    assert heading.startswith("GPU X (124 SMs), commit abc1234, torch ")
    assert heading.endswith(f"`{PROG} --only fc1 --reps 15`")
