"""The training step of one torchtitan MoE layer (router, reorder, experts, combine) with its experts on moegemm
and on torchtitan's own paths, side by side in one process (``docs/torchtitan.md``).

    python -m bench.examples.torchtitan_layer --out /tmp/titan_layer          # a Hopper GPU; DeepSeek-V2-Lite sizes
    python -m bench.examples.torchtitan_layer --tiny --out /tmp/titan_tiny    # any machine: small sizes, CPU smoke run

The layer is torchtitan 0.3.0's ``MoE`` built from its config helpers (softmax router, top-k, the stock token
dispatcher, no shared experts) with bf16 weights (what FSDP2's mixed precision hands a layer) and bf16 tokens
``[batch, seq, dim]``. Variants (``--variants``), every one with the same weights and inputs:

* ``moegemm_fp8``: ``MoegemmExpertsConverter``'s default (``moegemm.torchtitan``): ``MoegemmGroupedExperts``,
  ``fp8_blockwise``, with the FP8 weight cache (weights unchanged between steps: the copies are reused, as between
  micro-batches and for recomputation), the router's scores applied inside the experts' op (``MoegemmRoutedExperts``);
* ``moegemm_fp8_requant``: the same, ``moegemm.weights_changed()`` before every step (the cache re-quantizes every
  step: one micro-batch per optimizer step);
* ``moegemm_fp8_unfused``: ``moegemm_fp8`` with ``fuse_scores=False`` (torchtitan's ``RoutedExperts``: the scores
  multiply the experts' output in ``combine``): the experts module alone swapped;
* ``moegemm_bf16``: ``moegemm_fp8`` with the ``bf16`` recipe;
* ``torchtitan_bf16``: torchtitan's ``GroupedExperts`` (``torch._grouped_mm``, SwiGLU in eager ops): the baseline;
* ``torchao_fp8``: torchtitan's ``Float8GroupedExpertsConverter`` (torchao FP8 rowwise grouped GEMMs, its padding
  token dispatcher), when torchao imports and the GPU has FP8.

Modes (``--modes``): ``eager``, and ``compile`` (``layer.compile(fullgraph=True)``, inductor, as torchtitan compiles
its blocks; the FP8 weight cache works in both).
Timed (CUDA events, median of ``--iters`` after ``--warmup``): the forward, and forward + backward (the input's
and every parameter's gradient; gradients set to None between steps, outside the timed region). Peak memory: the
most allocated during a step beyond what was allocated before it. Errors (eager, once per variant): the layer's
output and the three expert weight gradients against float64 (the experts and the combine recomputed in float64
from the same routing), ‖out − ref‖ / ‖ref‖.

Writes ``torchtitan_layer.json`` and ``torchtitan_layer.md`` into ``--out`` (default: ``~/.cache/moegemm-bench/torchtitan_layer/``,
outside the checkout) and prints the table. Needs torchtitan 0.3.0 (``docs/torchtitan.md``
lists the wheels); on a machine without a Hopper GPU only ``--tiny`` makes sense (moegemm's reference path).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

from bench.outputs import describe, out_dir

PROG = "python -m bench.examples.torchtitan_layer"
VARIANTS = ["moegemm_fp8", "moegemm_fp8_requant", "moegemm_fp8_unfused", "moegemm_bf16", "torchtitan_bf16",
            "torchao_fp8"]
BASELINE, FP8_PEER = "torchtitan_bf16", "torchao_fp8"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help=f"folder for torchtitan_layer.json / .md ({describe('torchtitan_layer')})")
    p.add_argument("--tiny", action="store_true", help="small sizes, few iterations: a smoke run (CPU or GPU)")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=1408, help="each expert's hidden size")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=4096, help="tokens per sequence (routed tokens: batch * seq * top-k)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--modes", default=None, help="eager,compile (default: both; --tiny: eager)")
    p.add_argument("--iters", type=int, default=None, help="timed steps (default 20; --tiny: 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5; --tiny: 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    a = p.parse_args(argv)
    if a.tiny:
        for k, v in dict(dim=256, hidden=256, experts=8, top_k=2, batch=2, seq=64).items():
            if getattr(a, k) == p.get_default(k):
                setattr(a, k, v)
    a.modes = (a.modes or ("eager" if a.tiny else "eager,compile")).split(",")
    a.iters = a.iters if a.iters is not None else (2 if a.tiny else 20)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.tiny else 5)
    a.variants = [v for v in a.variants.split(",") if v]
    unknown = set(a.variants) - set(VARIANTS)
    if unknown or set(a.modes) - {"eager", "compile"}:
        p.error(f"unknown variants {sorted(unknown)} or modes {a.modes}")
    return a


# ------------------------------------------------------------------------------------------ the layer
def moe_config(a, variant: str, mode: str):
    import functools

    import torch
    from torchtitan.models.common.config_utils import make_moe_config, make_routed_experts_config, make_router_config

    init = {"weight": functools.partial(torch.nn.init.trunc_normal_, std=0.02)}
    einit = {k: functools.partial(torch.nn.init.trunc_normal_, std=0.02) for k in ("w1_EFD", "w2_EDF", "w3_EFD")}
    cfg = make_moe_config(
        num_experts=a.experts,
        router=make_router_config(dim=a.dim, num_experts=a.experts, gate_param_init=init, top_k=a.top_k,
                                  score_func="softmax"),
        routed_experts=make_routed_experts_config(dim=a.dim, hidden_dim=a.hidden, num_experts=a.experts,
                                                  top_k=a.top_k, param_init=einit, comm_backend="standard"))
    if variant.startswith("moegemm"):
        from moegemm.torchtitan import MoegemmExpertsConverter

        recipe = "bf16" if variant == "moegemm_bf16" else "fp8_blockwise"
        fuse = variant != "moegemm_fp8_unfused"
        cfg = MoegemmExpertsConverter.Config(recipe=recipe, fuse_scores=fuse).build().convert(cfg)
    elif variant == "torchao_fp8":
        from torchtitan.components.quantization import Float8GroupedExpertsConverter

        cfg = Float8GroupedExpertsConverter.Config(model_compile_enabled=mode == "compile").build().convert(cfg)
    return cfg


def build_layer(a, variant: str, mode: str, state: dict, device):
    import torch

    with torch.device(device):
        layer = moe_config(a, variant, mode).build()
    layer.load_state_dict(state)  # the same weights for every variant
    layer = layer.to(torch.bfloat16)  # bf16 weights, as FSDP2's mixed precision hands them to the layer
    layer._init_self_buffers(buffer_device=device)  # its load-balancing counters back in fp32
    layer.train()
    if mode == "compile":
        torch._dynamo.config.capture_scalar_outputs = True  # as torchtitan's apply_compile
        layer.compile(backend="inductor", fullgraph=True)
    return layer


def unavailable(variant: str, device) -> str:
    """Why ``variant`` cannot run here ('' if it can)."""
    import torch

    if variant == "torchao_fp8":
        if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
            return "torchao's FP8 grouped GEMMs need a CUDA GPU with FP8 (sm_89+)"
        try:
            os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")  # its Triton path needs no C++ extension
            import torchao.prototype.moe_training  # noqa: F401
        except Exception as e:  # noqa: BLE001 - any import failure means: not here
            return f"torchao does not import ({type(e).__name__}: {e})"
    return ""


# ------------------------------------------------------------------------------------------- timing
def sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Clock:
    """CUDA events on a GPU, the host's clock (after a sync) elsewhere; milliseconds."""

    def __init__(self, device):
        import torch

        self.device, self.cuda = device, device.type == "cuda"
        self.start = torch.cuda.Event(enable_timing=True) if self.cuda else None
        self.mid = torch.cuda.Event(enable_timing=True) if self.cuda else None
        self.end = torch.cuda.Event(enable_timing=True) if self.cuda else None

    def mark(self, which: str):
        if self.cuda:
            getattr(self, which).record()
        else:
            setattr(self, which, time.perf_counter())

    def read(self):
        sync(self.device)
        if self.cuda:
            return self.start.elapsed_time(self.mid), self.start.elapsed_time(self.end)
        return (self.mid - self.start) * 1e3, (self.end - self.start) * 1e3


def time_steps(a, layer, x, dy, variant: str, device):
    """(median forward ms, median forward+backward ms, peak extra MiB) of the layer's training step."""
    import torch

    import moegemm

    def step(clock=None):
        layer.zero_grad(set_to_none=True)
        xx = x.detach().requires_grad_()
        if variant == "moegemm_fp8_requant":
            moegemm.weights_changed()
        if clock:
            clock.mark("start")
        y = layer(xx)
        if clock:
            clock.mark("mid")
        y.backward(dy)
        if clock:
            clock.mark("end")
        return clock.read() if clock else None

    for _ in range(a.warmup):
        step()
    sync(device)
    cuda = device.type == "cuda"
    if cuda:
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    fwd, total = [], []
    for _ in range(a.iters):
        f, t = step(Clock(device))
        fwd.append(f)
        total.append(t)
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20 if cuda else None
    return statistics.median(fwd), statistics.median(total), peak


# ------------------------------------------------------------------------------------------- errors
def routing(layer, x):
    """The router's (top-k scores, top-k expert ids) of the layer for ``x`` (no grad)."""
    import torch

    with torch.no_grad():
        scores, ids, _ = layer.router(x, layer.expert_bias_E)
    return scores, ids


def reference64(x, w1, w3, w2, scores, ids, dy):
    """The layer's output and its expert weight gradients in float64 for the given routing: tokens sorted by
    expert, SwiGLU experts, scaled by their scores, summed back (torchtitan's combine)."""
    import torch
    import torch.nn.functional as F

    T, D = x.shape[0] * x.shape[1], x.shape[2]
    K = ids.shape[-1]
    W = [w.detach().double().requires_grad_() for w in (w1, w3, w2)]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // K
    xs = x.reshape(T, D).double()[tok]
    counts = torch.bincount(flat, minlength=w1.shape[0]).tolist()
    out, start = [], 0
    for e, m in enumerate(counts):
        xe = xs[start:start + m]
        out.append((F.silu(xe @ W[0][e].T) * (xe @ W[1][e].T)) @ W[2][e].T)
        start += m
    routed = torch.cat(out) * scores.reshape(-1)[order, None].double()
    y = torch.zeros(T, D, dtype=torch.float64, device=x.device).index_add_(0, tok, routed)
    y.backward(dy.reshape(T, D).double())
    return y.detach().reshape(x.shape), [w.grad for w in W]


def rel(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def errors(layer, x, dy, ref):
    """Relative errors of the layer's output and expert weight gradients against ``ref`` (``reference64``)."""
    layer.zero_grad(set_to_none=True)
    y = layer(x.detach().requires_grad_())
    y.backward(dy)
    experts = layer.routed_experts.inner_experts
    grads = [getattr(p.grad, "_data", p.grad) for p in (experts.w1_EFD, experts.w3_EFD, experts.w2_EDF)]
    y64, g64 = ref
    return {"y": rel(y.detach(), y64), "dw1": rel(grads[0], g64[0]), "dw3": rel(grads[1], g64[1]),
            "dw2": rel(grads[2], g64[2])}


# --------------------------------------------------------------------------------------------- report
def table(rows: list, meta: dict) -> str:
    def speedup(r, base):
        b = next((q for q in rows if q["variant"] == base and q["mode"] == r["mode"] and q.get("step_ms")), None)
        return f"{b['step_ms'] / r['step_ms']:.2f}x" if b and r.get("step_ms") else "-"

    lines = [f"torchtitan MoE layer step: {meta['shape']}; {meta['device']}; torch {meta['torch']}, torchtitan "
             f"{meta['torchtitan']}, torchao {meta['torchao']}; moegemm commit {meta['commit']}", "",
             "| variant | mode | fwd ms | fwd+bwd ms | vs torchtitan bf16 | vs torchao fp8 | peak MiB | err y | err dw1 "
             "| err dw3 | err dw2 |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("skipped"):
            lines.append(f"| {r['variant']} | {r['mode']} | skipped: {r['skipped']} |||||||||")
            continue
        e = r.get("errors") or {}
        cells = [r["variant"], r["mode"], f"{r['fwd_ms']:.3f}", f"{r['step_ms']:.3f}", speedup(r, BASELINE),
                 speedup(r, FP8_PEER), f"{r['peak_mib']:.0f}" if r.get("peak_mib") is not None else "-"]
        cells += [f"{e[k]:.2e}" if k in e else "-" for k in ("y", "dw1", "dw3", "dw2")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def commit() -> str:
    import subprocess

    sha = os.environ.get("MOEGEMM_COMMIT")
    if sha:
        return sha
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)), check=True).stdout.strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def main(argv=None) -> dict:
    a = parse_args(argv)
    import torch

    try:
        import torchtitan  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"{PROG} needs torchtitan 0.3.0 (docs/torchtitan.md: the packages to install), and it does "
                         f"not import here ({e}); nothing was run.")
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        if device.index is None:  # "cuda": the current device, named by index for the generators and set_device
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    elif not a.tiny:
        print(f"{PROG}: no GPU, so moegemm runs its slow reference path; use --tiny for a smoke run", file=sys.stderr)
    torch.manual_seed(a.seed)
    with torch.device(device):  # the weights, drawn once with torchtitan's initializers
        stock = moe_config(a, BASELINE, "eager").build()
        stock.init_states(buffer_device=device)
    state = stock.state_dict()
    del stock
    gen = torch.Generator(device=device).manual_seed(a.seed + 1)
    x = torch.randn(a.batch, a.seq, a.dim, device=device, dtype=torch.bfloat16, generator=gen)
    dy = torch.randn(x.shape, device=device, dtype=torch.bfloat16, generator=gen)

    # the float64 reference, from the (shared) routing of these weights
    probe = build_layer(a, BASELINE, "eager", state, device)
    scores, ids = routing(probe, x)
    ex = probe.routed_experts.inner_experts
    ref = reference64(x, ex.w1_EFD, ex.w3_EFD, ex.w2_EDF, scores, ids, dy)
    del probe, ex

    import moegemm

    try:
        import torchao

        ao_version = torchao.__version__
    except Exception:  # noqa: BLE001
        ao_version = "not importable"
    import torchtitan as tt

    meta = {"shape": f"dim {a.dim}, hidden {a.hidden}, {a.experts} experts, top-{a.top_k}, "
                     f"{a.batch}x{a.seq} tokens ({a.batch * a.seq * a.top_k} routed)",
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor()})",
            "torch": torch.__version__, "torchtitan": getattr(tt, "__version__", "0.3.0"), "torchao": ao_version,
            "moegemm": moegemm.__version__, "commit": commit(), "iters": a.iters, "warmup": a.warmup}
    rows = []
    for mode in a.modes:
        for variant in a.variants:
            why = unavailable(variant, device)
            row = {"variant": variant, "mode": mode}
            if why:
                rows.append(dict(row, skipped=why))
                print(f"{variant} ({mode}): skipped: {why}", flush=True)
                continue
            try:
                layer = build_layer(a, variant, mode, state, device)
                if mode == "eager":
                    row["errors"] = errors(layer, x, dy, ref)
                row["fwd_ms"], row["step_ms"], row["peak_mib"] = time_steps(a, layer, x, dy, variant, device)
            except Exception as e:  # noqa: BLE001 - one variant failing must not lose the others
                row["skipped"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            rows.append(row)
            print(f"{variant} ({mode}): " + ", ".join(f"{k}={v}" for k, v in row.items()
                                                      if k not in ("variant", "mode")), flush=True)
            layer = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
    md = table(rows, meta)
    out = str(out_dir(a.out, "torchtitan_layer"))
    with open(os.path.join(out, "torchtitan_layer.json"), "w") as f:
        json.dump({"meta": meta, "args": vars(a), "rows": rows}, f, indent=1)
    with open(os.path.join(out, "torchtitan_layer.md"), "w") as f:
        f.write(md)
    print(md)
    print(f"written: {os.path.join(out, 'torchtitan_layer.json')} and .md")
    return {"meta": meta, "rows": rows}


if __name__ == "__main__":
    main()
