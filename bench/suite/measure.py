"""Measurement on the device: time_op (CUDA-event median), host_overhead (enqueue time with the GPU kept
busy), count_syncs, peak_extra_mib, jitter of synchronised iterations, and the dense ceilings of the run
(measure_ceilings)."""

from __future__ import annotations

import gc
import statistics
import time
import warnings

import torch

from bench.suite.shared import BF16, DEV, FP8, free, short


def _pct(sorted_vals, p):
    return sorted_vals[min(len(sorted_vals) - 1, max(0, int(round(p * (len(sorted_vals) - 1)))))]


def time_op(fn, target_s, min_iters, max_iters, warmup) -> dict:
    """Median of per-iteration CUDA-event times over back-to-back iterations (the host may run ahead,
    as in training; a host-bound or syncing variant shows its host time here too)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    est = time.perf_counter() - t0
    n = int(min(max_iters, max(min_iters, target_s / max(est, 1e-6))))
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for a, b in evs:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    ts = sorted(a.elapsed_time(b) for a, b in evs)
    return {"ms": statistics.median(ts), "ms_p10": _pct(ts, 0.1), "ms_p90": _pct(ts, 0.9), "iters": n}


def time_interleaved(calls: dict, rounds: int, iters: int, lead: int | None = None) -> dict:
    """ms per call of each of ``calls``: in each round every call runs ``lead`` times untimed (default: ``iters``),
    then ``iters`` times back to back between two CUDA events; the median over the rounds. The lead puts the GPU
    in the call's own state (its clock under the power cap, its operands in L2) before the timed calls: without
    it the same kernel, timed as two entries of one table, differed by up to 11 % on power-capped GEMMs (H100),
    each timed in the state its neighbour left. The order reverses from one round to the next, so that every
    call's average place in it is the same (docs/performance.md, Reading the figures)."""
    for fn in calls.values():  # warm-up
        fn()
    times = {v: [] for v in calls}
    keys = list(calls)
    lead = iters if lead is None else lead
    for r in range(rounds):
        for v in keys if r % 2 == 0 else keys[::-1]:
            fn = calls[v]
            for _ in range(lead):
                fn()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(iters):
                fn()
            b.record()
            b.synchronize()
            times[v].append(a.elapsed_time(b) / iters)
    return {v: statistics.median(t) for v, t in times.items()}


_CYCLES_PER_MS = None


def cycles_per_ms() -> float:
    global _CYCLES_PER_MS
    if _CYCLES_PER_MS is None:
        torch.cuda._sleep(1000)
        torch.cuda.synchronize()
        cyc, best = 20_000_000, float("inf")
        for _ in range(3):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.cuda._sleep(cyc)
            b.record()
            torch.cuda.synchronize()
            best = min(best, a.elapsed_time(b))
        _CYCLES_PER_MS = cyc / best
    return _CYCLES_PER_MS


def host_overhead(fn, reps, target_s=2e-3, max_calls=20) -> dict:
    """Host wall time per call while the GPU is busy with a torch.cuda._sleep enqueued before a batch of
    back-to-back calls (about ``target_s`` of host work, at most ``max_calls``), so the calls only
    enqueue; the median over ``reps`` batches. 'gpu_went_idle' counts the batches during which the sleep
    ran out: a call synchronised with the device (or filled the launch queue), so the time includes GPU
    waiting. The garbage collector is off during the batches; an exception of fn propagates."""
    out = host_overhead_interleaved([fn], reps, target_s, max_calls)[0]
    if "error" in out:
        raise RuntimeError(out["error"])
    return out


def host_overhead_interleaved(fns, reps, target_s=2e-3, max_calls=20) -> list:
    """host_overhead of each of ``fns``, their batches taken in turn (rep 1 of each, then rep 2 of each, ...), so
    that a drift of the host's speed during the measurement falls on every callable alike and their ratios hold
    within a run. The garbage collector is off during the batches (as in timeit). A callable that raises gets
    {"error": message} and leaves the rotation."""
    plans = []
    for fn in fns:
        try:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn()
            est = time.perf_counter() - t0
            del out
            torch.cuda.synchronize()
            n = max(1, min(max_calls, int(target_s / max(est, 1e-6))))
            sleep_ms = min(max(2.0, 3e3 * n * est + 1.0), 2000.0)
            plans.append({"n": n, "cyc": int(sleep_ms * cycles_per_ms()), "times": [], "idle": 0})
        except Exception as exc:  # noqa: BLE001 - recorded for the caller
            plans.append({"error": short(exc)})
    gc.collect()
    gc.disable()
    try:
        for _ in range(reps):
            for fn, pl in zip(fns, plans):
                if "error" in pl:
                    continue
                try:
                    torch.cuda._sleep(pl["cyc"])
                    ev = torch.cuda.Event()
                    ev.record()
                    t0 = time.perf_counter()
                    for _ in range(pl["n"]):
                        out = fn()
                        del out
                    t1 = time.perf_counter()
                    pl["idle"] += int(ev.query())
                    pl["times"].append((t1 - t0) / pl["n"])
                    torch.cuda.synchronize()
                except Exception as exc:  # noqa: BLE001 - recorded for the caller
                    pl.clear()
                    pl["error"] = short(exc)
    finally:
        gc.enable()
    return [pl if "error" in pl else {"host_us": statistics.median(pl["times"]) * 1e6, "host_gpu_went_idle": pl["idle"],
                                      "host_reps": reps, "host_calls_per_rep": pl["n"]} for pl in plans]


def count_syncs(fn) -> int:
    """Synchronising CUDA operations torch reports during one call (torch.cuda.set_sync_debug_mode). Not counted:
    the note torch gives once per process when the mode is first set ("Synchronization debug mode is a prototype
    feature ..."), which the first measured call of a run would otherwise show as one sync."""
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode(prev)
    del out
    torch.cuda.synchronize()
    texts = [str(w.message).lower() for w in caught]
    return sum(1 for t in texts if "synchroniz" in t and "prototype feature" not in t)


def peak_extra_mib(fn) -> float:
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del out
    return (peak - base) / 2 ** 20


def jitter(fn, n, max_s) -> dict:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    ts, end = [], time.perf_counter() + max_s
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
        if time.perf_counter() > end:
            break
    ts.sort()
    return {"n": len(ts), "p50_ms": _pct(ts, 0.5) * 1e3, "p99_ms": _pct(ts, 0.99) * 1e3, "max_ms": ts[-1] * 1e3,
            "mean_ms": statistics.fmean(ts) * 1e3}


def measure_ceilings(cfg) -> dict:
    out = {}
    n = cfg["ceiling_n"]
    g = torch.Generator(device=DEV)
    g.manual_seed(1)
    a = torch.randn(n, n, device=DEV, dtype=BF16, generator=g)
    b = torch.randn(n, n, device=DEV, dtype=BF16, generator=g)
    try:
        t = time_op(lambda: torch.mm(a, b), cfg["ceiling_s"], 10, 200, 5)
        out["bf16_tflops"] = 2.0 * n ** 3 / t["ms"] / 1e9
        out["bf16_how"] = f"torch.mm bf16 {n}^3"
    except Exception as exc:
        out["bf16_error"] = short(exc)
    try:
        a8, bt8 = a.to(FP8), b.t().contiguous().to(FP8)
        b8 = bt8.t()  # column-major [K, N]
        try:
            sa = torch.ones(n, 1, device=DEV, dtype=torch.float32)
            sb = torch.ones(1, n, device=DEV, dtype=torch.float32)
            f = lambda: torch._scaled_mm(a8, b8, sa, sb, out_dtype=BF16, use_fast_accum=True)  # noqa: E731
            f()
            how = f"torch._scaled_mm fp8 e4m3 rowwise {n}^3, fast accum"
        except Exception as exc:
            out["fp8_rowwise_error"] = short(exc)
            one = torch.ones((), device=DEV, dtype=torch.float32)
            f = lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=BF16, use_fast_accum=True)  # noqa: E731
            how = f"torch._scaled_mm fp8 e4m3 tensorwise {n}^3, fast accum"
        t = time_op(f, cfg["ceiling_s"], 10, 300, 5)
        out["fp8_tflops"], out["fp8_how"] = 2.0 * n ** 3 / t["ms"] / 1e9, how
    except Exception as exc:
        out["fp8_error"] = short(exc)
    a = b = None  # (not del: the lambdas above read them)
    free()
    try:
        src = torch.randn(cfg["copy_elems"], device=DEV, dtype=BF16)
        dst = torch.empty_like(src)
        t = time_op(lambda: dst.copy_(src), cfg["ceiling_s"], 10, 200, 3)
        out["copy_gbps"] = 2.0 * src.numel() * src.element_size() / t["ms"] / 1e6
        out["copy_how"] = f"{src.numel() * 2 / 2**30:.0f} GiB device-to-device copy_, read + write bytes"
        src = dst = None
    except Exception as exc:
        out["copy_error"] = short(exc)
    free()
    return out
