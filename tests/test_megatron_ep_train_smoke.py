"""Smoke test of bench/examples/megatron_ep_train.py on the CPU: two gloo processes (EP = 2, all-to-all dispatcher),
the numerical check of the FP8 dispatch + split backward and a few timed steps of three variants."""

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
VARIANTS = ("moegemm_fp8_dispatch_split", "moegemm_bf16", "sequential_mlp")


@pytest.mark.skipif(torch.cuda.is_available(), reason="--cpu redirects torch.cuda calls; runs on GPU-less machines")
def test_megatron_ep_train_cpu(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "bench.examples.megatron_ep_train", "--cpu", "--out", str(tmp_path), "--variants", ",".join(VARIANTS)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| variant | tokens/s per GPU |" in proc.stdout
    result = json.loads((tmp_path / "megatron_ep_train.json").read_text())
    assert all(c["passed"] for c in result["check"].values())
    assert [r["variant"] for r in result["rows"]] == list(VARIANTS)
    for row in result["rows"]:
        assert row["tokens_per_s_per_gpu"] > 0 and math.isfinite(row["final_loss"])
    assert result["meta"]["command"].startswith("torchrun --nproc_per_node 2 ")
