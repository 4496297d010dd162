"""results.md from results.json: render_markdown (ceilings, probe findings, fc1 and MLP tables,
accuracy, the training step, host sweep, jitter), the grouped-GEMM targets table and the summary; no GPU
needed."""

from __future__ import annotations

import math

from bench.workloads import SHAPES

from bench.suite.variants import BASELINE, VBY

# TFLOP/s targets of the grouped-GEMM problems (bench.workloads.GEMM_SHAPES), fc1 forward.
GEMM_TARGETS = {"GEMM 4x8192 N=4096 K=7168": 1300.0, "GEMM 64x2304 N=2816 K=2048": 1100.0}


def _f(v, spec=".3f", na="n/a"):
    if v is None or isinstance(v, str):
        return na if v is None else v
    try:
        return format(v, spec)
    except (TypeError, ValueError):
        return str(v)


def _table(headers, rows):
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(out)


def _status_cell(r):
    st = r.get("status")
    if st == "ok":
        return None
    reason = (r.get("reason") or "").replace("|", "/")
    return f"{st}: {reason[:120]}"


def render_markdown(res: dict) -> str:
    m, ce = res.get("meta", {}), res.get("ceilings", {})
    parts = [f"# moegemm benchmark\n\n{m.get('device', '?')} (sm {m.get('capability')}, {m.get('sm_count')} SMs), "
             f"torch {m.get('versions', {}).get('torch')}, CUDA {m.get('versions', {}).get('cuda')}, "
             f"commit {str(m.get('git_commit'))[:12]}{' (dirty)' if m.get('git_dirty') else ''}, {m.get('date_utc')}"
             f"{', --quick' if m.get('quick') else ''}, {m.get('elapsed_s', '?')} s.\n"]
    parts.append("## Ceilings (measured in this run)\n\n" + _table(["ceiling", "value", "how"], [
        ["dense bf16 GEMM", _f(ce.get("bf16_tflops"), ".0f") + " TFLOP/s", ce.get("bf16_how", ce.get("bf16_error", ""))],
        ["dense fp8 GEMM", _f(ce.get("fp8_tflops"), ".0f") + " TFLOP/s", ce.get("fp8_how", ce.get("fp8_error", ""))],
        ["device copy bandwidth", _f(ce.get("copy_gbps"), ".0f") + " GB/s", ce.get("copy_how", ce.get("copy_error", ""))],
    ]))
    if res.get("unavailable"):
        parts.append("Not run (unavailable here): " + "; ".join(
            f"{VBY[k].label if k in VBY else k}: {why}" for k, why in res["unavailable"].items()))
    bad = [(k, s, d) for k, st in res.get("probes", {}).items() for s, d in st.items()
           if d.get("status") not in ("ok", "unsupported")]
    if bad:
        parts.append("Probe findings (small case in a child process):\n\n" + _table(
            ["variant", "stage", "status", "reason"],
            [[VBY[k].label if k in VBY else k, s, d.get("status"), str(d.get("reason"))[:160].replace("|", "/")]
             for k, s, d in bad]))
    recs = res.get("records", [])
    titles = {"fc1": "GroupedLinear forward (fc1: K = hidden, N = 2*ffn), no grad",
              "mlp": "Expert MLP forward + backward (fc1 -> silu(gate)*up*probs -> fc2; dx, dprobs, dW1, dW2)"}
    for sec in ("fc1", "mlp"):
        rows = []
        for r in recs:
            if r["section"] != sec:
                continue
            st = _status_cell(r)
            head = [r["shape"], r["splits"], r["label"]]
            if st:
                rows.append(head + [st] + [""] * 8)
                continue
            host = _f(r.get("host_us"), ".0f") + (" (idle*)" if r.get("host_gpu_went_idle") else "")
            rows.append(head + [_f(r.get("ms")), _f(r.get("tflops"), ".0f"), _f(100 * r["frac_peak"], ".0f") if "frac_peak" in r else "n/a",
                                _f(100 * r["frac_roofline"], ".0f") if "frac_roofline" in r else "n/a",
                                _f(r.get("speedup_vs_torch_bf16"), ".2f") + "x" if r.get("speedup_vs_torch_bf16") else "n/a",
                                host, str(r.get("syncs", "?")), _f(r.get("peak_extra_mib"), ".0f"),
                                _f((r.get("err") or {}).get("y"), ".2e")])
        if rows:
            parts.append(f"## {titles[sec]}\n\nmedian ms of CUDA-event timed iterations; % peak = TFLOP/s over "
                         "the dense ceiling of the same precision; % roofline = max(FLOP/peak, min bytes/copy BW) "
                         "over the time; host = host us per call with the GPU busy (idle* = the call waited for "
                         "the GPU: a sync or a full launch queue); syncs = synchronising calls torch reports per "
                         "call; peak = peak extra MiB; err = relative Frobenius error of the output vs float64.\n\n"
                         + _table(["shape", "splits", "variant", "ms", "TFLOP/s", "% peak", "% roofline",
                                   "vs torch bf16", "host us", "syncs", "peak MiB", "err y"], rows))
    acc = [[r["shape"], r["splits"], r["label"]] + [_f(r["err"].get(k), ".2e") for k in ("y", "dx", "dprobs", "dW1", "dW2")]
           for r in recs if r["section"] == "mlp" and r.get("status") == "ok" and r.get("err")]
    if acc:
        parts.append("## Accuracy of the MLP vs float64 (relative Frobenius error)\n\n"
                     + _table(["shape", "splits", "variant", "y", "dx", "dprobs", "dW1", "dW2"], acc))
    notes = sorted({(r["label"], r["note"]) for r in recs if r.get("note")})
    if notes:
        parts.append("Notes: " + "; ".join(f"{a}: {b}" for a, b in notes) + ".")
    train = render_training(res)
    if train:
        parts.append(train)
    sweep = res.get("host_sweep", [])
    if sweep:
        Es = sorted({r["E"] for r in sweep})
        rows = []

        op_name = {"fc1": "fc1 fwd", "mlp": "MLP fwd+bwd"}

        def label_of(key):
            return VBY[key].label if key in VBY else key

        by_point = {(x["op"], x["variant"], x["E"]): x for x in sweep}

        def record_of(op, key, E):
            return by_point.get((op, key, E))

        for op in ("fc1", "mlp"):
            for key in dict.fromkeys(r["variant"] for r in sweep if r["op"] == op):
                cells = []
                for E in Es:
                    r = record_of(op, key, E)
                    if r is None:
                        cells.append("")
                    elif r.get("status") != "ok":
                        cells.append(r.get("status", "?"))
                    else:
                        cells.append(_f(r.get("host_us"), ".0f") + ("*" if r.get("host_gpu_went_idle") else "")
                                     + (f" ({r['syncs']} sync)" if r.get("syncs") else ""))
                rows.append([op_name[op], label_of(key)] + cells)
        # moegemm's fp8 variants over torch._grouped_mm's in the same batches: a ratio the host's own speed, which
        # moves between runs, leaves alone (the target is at most 0.5x)
        def host_of(op, key, E):
            r = record_of(op, key, E)
            return r.get("host_us") if r and r.get("status") == "ok" and not r.get("host_gpu_went_idle") else None

        for op in ("fc1", "mlp"):
            for key in [k for k in dict.fromkeys(r["variant"] for r in sweep if r["op"] == op) if k.startswith("moegemm_fp8")]:
                cells = []
                for E in Es:
                    mo, base = host_of(op, key, E), host_of(op, "torch_bf16", E)
                    cells.append(_f(mo / base, ".2f") + "x" if mo and base else "")
                if any(cells):
                    rows.append([op_name[op], f"{label_of(key)} / torch._grouped_mm bf16"] + cells)
        h, f, t = (sweep[0].get(k) for k in ("hidden", "ffn", "T"))
        parts.append(f"## Host overhead per call vs number of experts (us; hidden={h}, ffn={f}, T={t}, Zipf splits; "
                     "GPU kept busy by torch.cuda._sleep; * = the call waited for the GPU; the last rows: moegemm fp8's "
                     "host time over torch._grouped_mm's in the same run)\n\n"
                     + _table(["op", "variant"] + [f"E={E}" for E in Es], rows))
    jit = res.get("jitter", [])
    if jit:
        rows = []
        for r in jit:
            if r.get("status") != "ok":
                rows.append([r["label"], r["shape"], _status_cell(r), "", "", "", ""])
            else:
                rows.append([r["label"], r["shape"], r["n"], _f(r["p50_ms"]), _f(r["p99_ms"]), _f(r["max_ms"]),
                             _f(r["p99_ms"] / r["p50_ms"], ".2f")])
        parts.append("## Jitter: synchronised MLP fwd+bwd iterations (host wall time per iteration, Zipf splits)\n\n"
                     + _table(["variant", "shape", "n", "p50 ms", "p99 ms", "max ms", "p99/p50"], rows))
    if res.get("skipped"):
        parts.append("Skipped: " + "; ".join(res["skipped"]))
    parts.append(render_summary(res))
    return "\n\n".join(parts) + "\n"


# The training step's columns (variant keys, short names); "vs" columns compare the first with the others.
TRAIN_COLUMNS = [("torch_bf16", "torch bf16"), ("moegemm_bf16", "moegemm bf16"), ("moegemm_fp8_wcache", "moegemm fp8"),
                 ("deepgemm_fp8_wcache", "DeepGEMM fp8")]
TRAIN_VS = [("moegemm_fp8_wcache", "moegemm_bf16"), ("moegemm_fp8_wcache", "deepgemm_fp8_wcache")]


def render_training(res: dict) -> str:
    """The training-step table: per shape and GA, ms per optimizer step of each variant (speed-up over
    torch bf16), moegemm fp8 over moegemm bf16 and over DeepGEMM, and the main_grad check."""
    recs = res.get("train", [])
    if not recs:
        return ""
    names = dict(TRAIN_COLUMNS)
    cols = [k for k, _ in TRAIN_COLUMNS if any(r["variant"] == k for r in recs)]
    cols += [k for k in dict.fromkeys(r["variant"] for r in recs) if k not in cols]
    vs = [(a, b) for a, b in TRAIN_VS if a in cols and b in cols]

    def short_name(k):
        return names.get(k) or (VBY[k].label if k in VBY else k)

    rows, ratios = [], {}  # ratios: (column, GA) -> the speed-ups of every row, for the geometric means
    for shape, kind in dict.fromkeys((r["shape"], r.get("splits", "zipf")) for r in recs):
        mine = [r for r in recs if r["shape"] == shape and r.get("splits", "zipf") == kind]
        for ga in sorted({r["ga"] for r in mine}):
            got = {r["variant"]: r for r in mine if r["ga"] == ga}
            cells, checks = [], []
            for k in cols:
                r = got.get(k)
                if r is None:
                    cells.append("")
                    checks.append("")
                elif r.get("status") != "ok":
                    cells.append(_status_cell(r)[:60])
                    checks.append("n/a")
                else:
                    sp = r.get("speedup_vs_torch_bf16")
                    cells.append(_f(r["ms"]) + (f" ({sp:.2f}x)" if sp and k != BASELINE else ""))
                    checks.append(_f(r.get("main_grad_ratio"), ".3f"))
                    if sp and k != BASELINE:
                        ratios.setdefault((f"{short_name(k)} vs torch bf16", ga), []).append(sp)
            for a, b in vs:
                ra, rb = got.get(a), got.get(b)
                ok = ra and rb and ra.get("status") == "ok" and rb.get("status") == "ok"
                cells.append(f"{rb['ms'] / ra['ms']:.2f}x" if ok else "n/a")
                if ok:
                    ratios.setdefault((f"{short_name(a)} vs {short_name(b)}", ga), []).append(rb["ms"] / ra["ms"])
            r0 = next(iter(got.values()))
            first = ga == min(x["ga"] for x in mine)
            rows.append([shape if first else "", kind if first else "",
                         f"{r0['E']}/{r0['hidden']}/{r0['ffn']}/{r0['T']}" if first else "",
                         ga] + cells + [" / ".join(checks) if ga != 1 else ""])
    heads = (["shape", "splits", "E/hidden/ffn/T", "GA"] + [f"{short_name(k)} ms" for k in cols]
             + [f"{short_name(a)} vs {short_name(b)}" for a, b in vs] + ["main_grad GA/GA=1"])
    means = [[name, ga, len(xs), f"{math.exp(sum(map(math.log, xs)) / len(xs)):.2f}x", f"{min(xs):.2f}x"]
             for (name, ga), xs in sorted(ratios.items(), key=lambda kv: (kv[0][1], kv[0][0]))]
    return ("## Training step (Megatron style): GA micro-batches of expert-MLP fwd+bwd, main_grad accumulation, "
            "one weight update\n\n"
            "ms per optimizer step: main_grad (fp32) zeroed, GA micro-batches of forward + backward (dx and dprobs "
            "computed too) with each weight gradient accumulated into main_grad (by the wgrad GEMM where the variant "
            "fuses it: moegemm, DeepGEMM; torch's bf16 gradients added in fp32), then an in-place SGD update, so every "
            "FP8 weight copy is made once per step (moegemm's automatic FP8 weight cache; the DeepGEMM peer's cache "
            "keyed on the weights' version). Median of CUDA-event timed steps; (x) = speed-up over torch "
            "bf16 at the same GA. main_grad GA/GA=1: the norm of main_grad after the step over its norm after a GA=1 "
            "step, per variant in column order (GA expected).\n\n"
            + _table(heads, rows)
            + ("\n\nSpeed-ups over the rows above (every shape and kind of splits measured), per GA:\n\n"
               + _table(["speed-up", "GA", "rows", "geometric mean", "lowest"], means) if means else ""))


def render_gemm_targets(recs) -> str:
    rows = []
    for shape, target in GEMM_TARGETS.items():
        got = {r["variant"]: r for r in recs if r["shape"] == shape and r["section"] == "fc1" and r.get("status") == "ok"}
        if not got:
            continue
        cell = lambda k: _f(got[k]["tflops"], ".0f") if k in got else "n/a"  # noqa: E731
        rows.append([shape, f"{target:.0f}", cell("moegemm_fp8"), cell("moegemm_fp8_gemm"), cell("torch_fp8_gemm"),
                     cell("torch_fp8"), cell(BASELINE)])
    if not rows:
        return ""
    return ("## Grouped FP8 GEMM targets (fc1 forward, balanced groups; TFLOP/s)\n\n"
            + _table(["problem", "target", "moegemm fp8 (quantization included)", "moegemm GEMM only",
                      "torch fp8 rowwise GEMM only", "torch fp8 rowwise (quantization included)",
                      "torch._grouped_mm bf16"], rows) + "\n\n")


def render_summary(res: dict) -> str:
    recs = res.get("records", [])
    rows = []
    points = list(dict.fromkeys((r["shape"], r["splits"]) for r in recs if r["shape"] in SHAPES))
    for shape, splits in points:
        def get(key, sec):
            return next((r for r in recs if r["shape"] == shape and r["splits"] == splits and r["variant"] == key
                         and r["section"] == sec and r.get("status") == "ok"), None)
        mo, base, mo1 = get("moegemm_fp8", "mlp"), get(BASELINE, "mlp"), get("moegemm_fp8", "fc1")
        peers = [r for r in recs if r["shape"] == shape and r["splits"] == splits and r["section"] == "mlp"
                 and r.get("status") == "ok" and not r["aux"] and not r["variant"].startswith("moegemm")]
        best = min(peers, key=lambda r: r["ms"]) if peers else None
        def x(a, b):  # speed-up a/b as text
            return f"{a / b:.2f}x" if a and b else "n/a"
        rows.append([shape, splits, _f(mo["ms"]) if mo else "n/a", _f(base["ms"]) if base else "n/a",
                     x(base and base["ms"], mo and mo["ms"]),
                     f"{best['label']} {best['ms']:.3f}" if best else "n/a",
                     x(best and best["ms"], mo and mo["ms"]),
                     _f(mo1.get("speedup_vs_torch_bf16"), ".2f") + "x" if mo1 and mo1.get("speedup_vs_torch_bf16") else "n/a",
                     (_f(mo.get("host_us"), ".0f") if mo else "n/a") + " / " + (_f(base.get("host_us"), ".0f") if base else "n/a"),
                     _f((mo.get("err") or {}).get("y"), ".2e") if mo else "n/a"])
    return (render_gemm_targets(recs) + "## Summary: moegemm fp8_blockwise\n\nMLP fwd+bwd ms, speed-ups over torch._grouped_mm bf16 and over "
            "the fastest peer measured here, fc1 forward speed-up, host us per MLP call (moegemm / torch bf16), "
            "output error vs float64.\n\n"
            + _table(["shape", "splits", "moegemm ms", "torch bf16 ms", "vs torch bf16", "best peer ms",
                      "vs best peer", "fc1 vs torch bf16", "host us", "err y"], rows))
