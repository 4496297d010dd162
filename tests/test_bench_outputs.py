"""No bench command changes a file of the repository unless ``--out`` says so: without it, each writes under
``$XDG_CACHE_HOME/moegemm-bench/<command>/`` (bench/outputs.py); with it, where asked. The documented CPU
command (``python -m bench.examples.train_moe_lm --tiny``) runs for real in a child process; the other
writers run in this process with their training or plotting replaced (CPU, no matplotlib needed)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import outputs

REPO = Path(__file__).resolve().parents[1]


def _tracked_results() -> dict:
    """sha256 of every file under bench/ (its code and the committed results), by path; caches left out."""
    return {str(p.relative_to(REPO)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((REPO / "bench").rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


@pytest.fixture
def results_dir(tmp_path):
    """Results as a run writes them, in a folder standing for bench/results (a copy of no committed file)."""
    d = tmp_path / "results"
    d.mkdir()
    (d / "lm_loss.json").write_text(json.dumps(_fake_results()))
    (d / "results.json").write_text(json.dumps({"meta": {}}))
    return d


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "moegemm-bench"


def test_default_dir_is_outside_the_repository(cache, monkeypatch):
    assert outputs.default_dir("suite") == cache / "suite"
    monkeypatch.delenv("XDG_CACHE_HOME")
    home = Path(os.path.expanduser("~"))
    assert outputs.default_dir("x") == home / ".cache" / "moegemm-bench" / "x"
    assert REPO not in outputs.default_dir("x").parents or home in REPO.parents


def test_out_helpers(cache, tmp_path):
    assert outputs.out_dir(None, "a") == cache / "a" and (cache / "a").is_dir()
    assert outputs.out_dir(str(tmp_path / "given"), "a") == tmp_path / "given" and (tmp_path / "given").is_dir()
    assert outputs.out_file(None, "b", "r.json") == cache / "b" / "r.json" and (cache / "b").is_dir()
    assert outputs.out_file(str(tmp_path / "d" / "x.json"), "b", "r.json") == tmp_path / "d" / "x.json"


def _writers() -> list:
    """(file, line) of every bench script's output option whose default is not None."""
    bad = []
    for path in sorted((REPO / "bench").rglob("*.py")):
        if "results" in path.parts:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            m = re.search(r'add_argument\("--(out|json|md|plot|png|log|csv|keep)"[^)]*default=([^,)]+)', line)
            if m and m.group(2).strip() != "None":
                bad.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
            if re.search(r'default=[^,)]*bench/results', line):
                bad.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
    return bad


def test_no_output_option_defaults_into_the_repository():
    assert _writers() == []
    gpu_run = (REPO / "bench" / "gpu_run.sh").read_text()
    assert 'OUT=${OUT:-${XDG_CACHE_HOME:-$HOME/.cache}/moegemm-bench/gpu_run}' in gpu_run


def test_train_moe_lm_tiny_writes_outside_the_tree(cache):
    """README's CPU command, cut to two steps of one run: the committed train_moe_lm.json stays as it is."""
    before = _tracked_results()
    env = dict(os.environ, PYTHONPATH=str(REPO), XDG_CACHE_HOME=str(cache.parent), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "bench.examples.train_moe_lm", "--tiny", "--recipes", "bf16",
                           "--stop-at", "2"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = cache / "train_moe_lm" / "train_moe_lm.json"
    assert f"wrote {out}" in proc.stdout
    result = json.loads(out.read_text())
    assert list(result["runs"]) == ["bf16"] and len(result["runs"]["bf16"]["train_loss"]) == 2
    assert _tracked_results() == before


def _fake_results():
    return {"device": "cpu", "args": {}, "runs": {"bf16": {"losses": [1.0], "eval_loss": 1.0},
                                                 "fp8_blockwise": {"losses": [1.1], "eval_loss": 1.1}}}


def test_train_lm_default_and_out(cache, tmp_path, results_dir, monkeypatch):
    from bench.examples import train_lm

    before = _tracked_results()
    plots = []
    monkeypatch.setattr(train_lm, "load_corpus", lambda n: train_lm.torch.zeros(1000, dtype=train_lm.torch.long))
    monkeypatch.setattr(train_lm, "train", lambda recipe, data, args, device: _fake_results()["runs"][recipe])
    monkeypatch.setattr(train_lm, "plot", lambda results, path: plots.append(path))
    monkeypatch.setattr(train_lm, "require_module", lambda script, module: None)  # matplotlib, which plot imports
    for argv, folder in ((["train_lm"], cache / "train_lm"), (["train_lm", "--out", str(tmp_path / "o")], tmp_path / "o")):
        monkeypatch.setattr(sys, "argv", argv)
        train_lm.main()
        assert json.loads((folder / "lm_loss.json").read_text())["runs"]["bf16"]["eval_loss"] == 1.0
        assert plots[-1] == str(folder / "lm_loss.png")
    monkeypatch.setattr(sys, "argv", ["train_lm", "--plot", str(results_dir / "lm_loss.json")])
    train_lm.main()  # the PNG of a JSON (a committed one, say): not beside it
    assert not (results_dir / "lm_loss.png").exists()
    assert plots[-1] == str(cache / "train_lm" / "lm_loss.png")
    assert _tracked_results() == before


def test_train_moe_lm_plot_only_default_and_out(cache, tmp_path, results_dir, monkeypatch):
    from bench.examples import train_moe_lm

    before = _tracked_results()
    plots = []
    monkeypatch.setattr(train_moe_lm, "plot", lambda results, path: plots.append(path))
    monkeypatch.setattr(train_moe_lm, "require_module", lambda script, module: None)
    monkeypatch.setattr(train_moe_lm, "print_summary", lambda results: None)
    monkeypatch.setattr(train_moe_lm, "compare", lambda results: {})
    committed = str(results_dir / "train_moe_lm.json")
    Path(committed).write_text(json.dumps({"args": {}, "runs": {"bf16": {}}}))
    monkeypatch.setattr(sys, "argv", ["train_moe_lm", "--plot-only", committed])
    train_moe_lm.main()
    assert plots[-1] == str(cache / "train_moe_lm" / "train_moe_lm.png")
    target = tmp_path / "mine.json"
    monkeypatch.setattr(sys, "argv", ["train_moe_lm", "--plot-only", committed, "--out", str(target)])
    train_moe_lm.main()
    assert plots[-1] == str(tmp_path / "mine.png")
    monkeypatch.setattr(sys, "argv", ["train_moe_lm", "--plot-only", committed, committed])  # merged: written
    train_moe_lm.main()
    assert (cache / "train_moe_lm" / "train_moe_lm.json").is_file()
    assert _tracked_results() == before


def test_suite_plot_default_and_out(cache, tmp_path, results_dir, monkeypatch, capsys):
    from bench.suite import plot

    before = _tracked_results()
    seen = []
    monkeypatch.setattr(plot, "make_plots", lambda res, out_dir: seen.append(Path(out_dir)) or [])
    monkeypatch.setattr(plot, "require_module", lambda script, module: None)
    assert plot.main([str(results_dir / "results.json")]) == 0
    assert seen[-1] == cache / "suite"  # not results.json's folder
    assert plot.main([str(results_dir / "results.json"), "--out", str(tmp_path / "p")]) == 0
    assert seen[-1] == tmp_path / "p"
    assert _tracked_results() == before


def test_suite_out_defaults_outside(cache):
    from bench.suite.__main__ import parse_args

    assert parse_args(["--quick"]).out is None  # main() resolves it with bench.outputs.out_dir(None, "suite")
    assert parse_args(["--out", "bench/results"]).out == "bench/results"
    text = (REPO / "bench" / "suite" / "__main__.py").read_text()
    assert 'args.out = str(out_dir(args.out, "suite"))' in text


def test_every_committed_result_is_described():
    """bench/results/README.md names every file of bench/results (what it is, the GPU, commit and command), and
    names no file that is not there."""
    folder = REPO / "bench" / "results"
    readme = (folder / "README.md").read_text()
    files = {p.name for p in folder.iterdir() if p.is_file() and p.name != "README.md"}
    named = set(re.findall(r"`([\w.]+\.(?:md|json|png|log))`", readme))
    assert files - named == set(), "files not described in bench/results/README.md"
    assert named - files == set(), "bench/results/README.md names files that are not there"
