"""Smoke test of bench/examples/megatron_ep_train.py on the CPU: four gloo processes (EP = 4, megatron's GPTModel,
alltoall dispatcher, megatron's 1F1B EP-overlap schedule), in one launch: the numerical check of the FP8 dispatch,
a timed step of each variant, the loss-curve mode and the repeat check, with their JSON files."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("megatron.core")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ("moegemm_fp8", "sequential_mlp", "te_grouped_mlp", "moegemm_fp8_dispatch_split")


def _te_imports() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


@pytest.mark.skipif(torch.cuda.is_available(), reason="--cpu redirects torch.cuda calls; runs on GPU-less machines")
def test_megatron_ep_train_cpu(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
           "-m", "bench.examples.megatron_ep_train", "--cpu", "--out", str(tmp_path), "--variants", ",".join(VARIANTS),
           "--warmup", "0", "--steps", "1", "--loss-steps", "2", "--repeat-check", "--repeat-steps", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "check: PASS" in proc.stdout and "repeat check: PASS" in proc.stdout and "all: PASS" in proc.stdout

    result = json.loads((tmp_path / "megatron_ep_train.json").read_text())
    meta = result["meta"]
    assert meta["world_size"] == meta["expert_parallel_size"] == 4 and meta["settings"]["experts"] == 8
    assert meta["command"].startswith("torchrun --nproc_per_node 4 -m bench.examples.megatron_ep_train --cpu")
    assert all(c["passed"] for c in result["check"].values()) and len(result["check"]) == 2
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == list(VARIANTS)
    assert rows["te_grouped_mlp"]["status"].startswith("not installed") != _te_imports()
    ran = [r for r in rows.values() if r["status"] == "ok"]
    for row in ran:
        assert row["tokens_per_s_per_gpu"] > 0 and math.isfinite(row["final_loss"])
        assert row["host_syncs_per_step"] is None  # counted on a GPU only
    assert [rows[v]["overlap"] for v in ("moegemm_fp8", "sequential_mlp")] == ["megatron", "megatron"]
    assert rows["moegemm_fp8"]["delay_wgrad_compute"] and rows["moegemm_fp8"]["num_sms"] is None
    assert rows["moegemm_fp8_dispatch_split"]["overlap"] == "dispatch-wgrad"
    # megatron's 1F1B schedule and the plain schedule with the FP8 dispatch train the same model alike
    assert abs(rows["moegemm_fp8"]["final_loss"] - rows["moegemm_fp8_dispatch_split"]["final_loss"]) < 1e-3
    assert set(result["acceptance"]) == {"moegemm_fp8 / sequential_mlp"}
    assert result["sync_check"] is None
    assert "| moegemm_fp8 | megatron |" in (tmp_path / "megatron_ep_train.md").read_text()

    loss = json.loads((tmp_path / "megatron_ep_train_loss.json").read_text())
    assert [(r["variant"], r["data_seed"]) for r in loss["runs"].values()] == \
        [("sequential_mlp", 0), ("sequential_mlp", 1), ("moegemm_fp8", 0)]
    assert all(len(r["losses"]) == 2 and all(math.isfinite(x) for x in r["losses"]) for r in loss["runs"].values())
    assert loss["passed"] and loss["fp8_deviation"] <= loss["bf16_spread"]

    repeat = json.loads((tmp_path / "megatron_ep_train_repeat.json").read_text())
    assert repeat["passed"] and [r["variant"] for r in repeat["rows"]] == [v for v in VARIANTS if v != "te_grouped_mlp"]
    assert all(r["losses_bitwise"] and r["params_bitwise"] and r["max_param_diff"] == 0 for r in repeat["rows"])


def test_presets_and_helpers():
    """The GPU run's pieces that the CPU launch cannot reach: the V2-Lite preset, the TE key layout, the sync
    check and the acceptance ratios, the loss-curve distance."""
    from bench.examples import megatron_ep_train as m

    args = m.parse_args(["--model", "v2-lite-4l"])
    assert (args.layers, args.experts, args.topk, args.hidden, args.ffn, args.vocab) == (4, 64, 6, 2048, 1408, 8192)
    assert args.micro * args.seq * args.batch == 16384 and args.overlap == "megatron"
    assert m.parse_args(["--cpu", "--experts", "16"]).experts == 16 and m.parse_args(["--cpu"]).hidden == 256

    sd = {"decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight": 1, "decoder.final_layernorm.weight": 2}
    assert m.to_te_layout(sd) == {"decoder.layers.0.mlp.experts.linear_fc1.weight3": 1,
                                  "decoder.final_layernorm.weight": 2}

    def row(variant, tps, syncs, experts):
        return dict(variant=variant, status="ok", tokens_per_s_per_gpu=tps, host_syncs_per_step=syncs, experts=experts)

    rows = [row("moegemm_fp8", 300.0, 8, "moegemm"), row("moegemm_fp8_sms", 330.0, 8, "moegemm"),
            row("moegemm_bf16", 240.0, 9, "moegemm"), row("sequential_mlp", 150.0, 8, "sequential")]
    acc = m.acceptance(rows)
    assert acc["moegemm_fp8 / sequential_mlp"] == dict(ratio=2.0, target=1.5, meets=True)
    assert acc["moegemm_fp8 / moegemm_bf16"] == dict(ratio=1.25, target=1.2, meets=True)
    assert acc["moegemm_fp8_sms / moegemm_bf16"]["ratio"] == pytest.approx(1.375)
    check = m.sync_check(rows)
    assert check["sequential_mlp"] == 8 and not check["passed"]  # moegemm_bf16 synchronized once more
    assert m.sync_check(rows[:3]) is None

    assert m.moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert m.curve_distance([1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 2.0, 2.0], 1) == 1.0
