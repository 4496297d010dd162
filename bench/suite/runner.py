"""The run: Runner measures the sections in order (peers loaded, probes, ceilings, the model shapes and
issue 6's GEMM problems, the host-overhead sweep over E, jitter) within the time budget, guards every
variant, writes results.json after every section, then results.md and the plots."""

from __future__ import annotations

import json
import math
import time
import traceback
from pathlib import Path

import torch

from bench.workloads import GEMM_SHAPES, SHAPES, SMALL_EXPERTS, balanced_splits, small_experts_splits, zipf_splits

from bench.suite import plot
from bench.suite.cases import Case, mlp_errors, reference, rel_err
from bench.suite.implementations import UNAVAILABLE, build_fc1, build_mlp, load_variants, make_step
from bench.suite.measure import count_syncs, host_overhead, jitter, measure_ceilings, peak_extra_mib, time_op
from bench.suite.meta import collect_meta
from bench.suite.probes import PROBE_SPLITS, PROBES, gate, run_probes
from bench.suite.report import render_markdown
from bench.suite.shared import DEV, cuda_alive, free, log, short
from bench.suite.variants import BASELINE, VARIANTS, VBY

SWEEP_E = (8, 32, 128, 256)
SWEEP_SHAPE = (1024, 512, 8192)  # hidden, ffn, T for the host-overhead sweep (Zipf splits)
JITTER_SHAPE = "DeepSeek-V2-Lite"


class Runner:
    def __init__(self, args, cfg):
        self.args, self.cfg = args, cfg
        self.t_start = time.time()
        self.res = {"meta": {}, "config": cfg, "unavailable": {}, "probes": {}, "ceilings": {}, "records": [],
                    "host_sweep": [], "jitter": [], "skipped": []}
        self.out = Path(args.out)
        self.dead = None  # reason once the CUDA context is lost

    def elapsed(self):
        return time.time() - self.t_start

    def over_budget(self, reserve=0.0):
        return self.elapsed() + reserve > self.cfg["budget_s"]

    def save(self):
        self.res["meta"]["elapsed_s"] = round(self.elapsed(), 1)
        self.out.mkdir(parents=True, exist_ok=True)
        with open(self.out / "results.json", "w") as f:
            json.dump(_clean(self.res), f, indent=1)

    def selected(self, aux=True):
        keys = [v.key for v in VARIANTS if aux or not v.aux]
        if self.args.variants:
            pats = [p.strip() for p in self.args.variants.split(",") if p.strip()]
            keys = [k for k in keys if k == BASELINE or any(p in k for p in pats)]
        return [k for k in keys if k not in UNAVAILABLE]

    def guarded(self, rec, what, f):
        """Run f(); on an exception record it; detect a lost CUDA context (stops the run)."""
        if self.dead:
            rec.update(status="skipped", reason=self.dead)
            return
        try:
            f()
            rec.setdefault("status", "ok")
        except Exception as exc:
            rec["status"], rec["reason"] = "error", short(exc)
            log(f"[bench]   {what}: {short(exc)}")
            if self.args.verbose:
                traceback.print_exc()
            if not cuda_alive():
                self.dead = f"CUDA context lost after {what}: {short(exc)}"
                log("[bench] " + self.dead)

    # -------------------------------------------------------------------------------- model shapes
    def run_point(self, shape, E, H, F, T, kind_name, splits, ops=("fc1", "mlp")):
        c = Case(shape, E, H, F, splits, DEV, seed=0)
        t0 = time.time()
        ref = reference(c, fc1_only="mlp" not in ops)
        log(f"[bench] {shape} {kind_name}: E={E} H={H} F={F} T={T} empty={splits.count(0)} "
            f"({c.kind}); float64 reference {time.time() - t0:.1f} s")
        recs = []
        for key in self.selected():
            v = VBY[key]
            for op in (o for o in v.ops if o in ops):
                rec = {"section": op, "shape": shape, "E": E, "hidden": H, "ffn": F, "T": T, "splits": kind_name,
                       "split_kind": c.kind, "n_empty": splits.count(0), "variant": key, "label": v.label,
                       "precision": v.precision, "aux": v.aux, "flops": c.flops(op), "min_bytes": c.min_bytes(op),
                       "gemm_target": shape in GEMM_SHAPES}
                if key == "torch_fp8" and op == "mlp" and c.kind != "aligned":
                    rec["note"] = "wgrad in bf16 (torch._grouped_mm): FP8 2d x 2d needs non-empty 16-row groups"
                recs.append(rec)
                self.res["records"].append(rec)
                why = gate(key, op, c.kind)
                if why:
                    rec.update(status="n/a", reason=why)
                    continue
                if self.over_budget():
                    rec.update(status="skipped", reason="time budget")
                    continue
                t1 = time.time()
                self.guarded(rec, f"{shape}/{kind_name}/{key}/{op}", lambda: self._measure(rec, key, op, c, ref))
                free()
                log(f"[bench]   {op:3s} {v.label:45s} {rec.get('status'):7s} "
                    f"{('%.3f ms' % rec['ms']) if 'ms' in rec else ''} ({time.time() - t1:.1f} s)")
        base = {r["section"]: r.get("ms") for r in recs if r["variant"] == BASELINE and r.get("status") == "ok"}
        for r in recs:
            if r.get("status") == "ok" and base.get(r["section"]):
                r["speedup_vs_torch_bf16"] = base[r["section"]] / r["ms"]
        c = ref = None  # (not del: the lambdas above read them)
        free()

    def _measure(self, rec, key, op, c, ref):
        cfg = self.cfg
        ce = self.res["ceilings"]
        if op == "fc1":
            with torch.no_grad():
                fn = build_fc1(key, c)
                y = fn()
                torch.cuda.synchronize()
                rec["err"] = {"y": rel_err(y, ref["h"])}
                del y
                rec["syncs"] = count_syncs(fn)
                rec["peak_extra_mib"] = peak_extra_mib(fn)
                rec.update(time_op(fn, cfg["fc1_target_s"], cfg["min_iters"], cfg["max_iters"], cfg["warmup"]))
                rec.update(host_overhead(fn, cfg["host_reps"]))
        else:
            impl = build_mlp(key, c)
            rec["err"] = mlp_errors(impl, c, ref)
            fn = make_step(impl, c)
            rec["syncs"] = count_syncs(fn)
            rec["peak_extra_mib"] = peak_extra_mib(fn)
            rec.update(time_op(fn, cfg["mlp_target_s"], cfg["min_iters"], cfg["max_iters"], cfg["warmup"]))
            rec.update(host_overhead(fn, cfg["host_reps"]))
        rec["tflops"] = rec["flops"] / rec["ms"] / 1e9
        peak = ce.get("fp8_tflops" if rec["precision"] == "fp8" else "bf16_tflops")
        if peak:
            rec["frac_peak"] = rec["tflops"] / peak
        if peak and ce.get("copy_gbps"):
            t_lb = max(rec["flops"] / (peak * 1e9), rec["min_bytes"] / (ce["copy_gbps"] * 1e6))  # ms
            rec["frac_roofline"] = t_lb / rec["ms"]

    # ------------------------------------------------------------------------------ host sweep (E)
    def run_sweep(self):
        H, F, T = SWEEP_SHAPE
        for E in SWEEP_E:
            if self.dead or self.over_budget(reserve=self.cfg["jitter_reserve_s"]):
                self.res["skipped"].append(f"host sweep E={E}: " + (self.dead or "time budget"))
                continue
            splits = zipf_splits(E, T)
            c = Case("sweep", E, H, F, splits, DEV, seed=2)
            for key in self.selected(aux=False):
                for op in VBY[key].ops:
                    rec = {"op": op, "E": E, "hidden": H, "ffn": F, "T": T, "splits": "zipf", "variant": key,
                           "label": VBY[key].label}
                    self.res["host_sweep"].append(rec)
                    why = gate(key, op, c.kind)
                    if why:
                        rec.update(status="n/a", reason=why)
                        continue

                    def go(rec=rec, key=key, op=op):
                        if op == "fc1":
                            with torch.no_grad():
                                fn = build_fc1(key, c)
                                fn()
                                rec["syncs"] = count_syncs(fn)
                                rec.update(host_overhead(fn, self.cfg["sweep_reps"]))
                        else:
                            fn = make_step(build_mlp(key, c), c)
                            fn()
                            rec["syncs"] = count_syncs(fn)
                            rec.update(host_overhead(fn, self.cfg["sweep_reps"]))
                    self.guarded(rec, f"sweep/E={E}/{key}/{op}", go)
                    free()
            log(f"[bench] host sweep E={E} done ({self.elapsed():.0f} s)")
            c = None
            free()
            self.save()

    # ---------------------------------------------------------------------------------- jitter
    def run_jitter(self):
        E, H, F, T = SHAPES[JITTER_SHAPE]
        splits = zipf_splits(E, T)
        jv = self.cfg["jitter_variants"]
        keys = [k for k in self.selected(aux=False) if jv == "all" or k in jv]
        c = Case(JITTER_SHAPE, E, H, F, splits, DEV, seed=3)
        for i, key in enumerate(keys):
            rec = {"shape": JITTER_SHAPE, "splits": "zipf", "variant": key, "label": VBY[key].label}
            self.res["jitter"].append(rec)
            why = gate(key, "mlp", c.kind)
            if why:
                rec.update(status="n/a", reason=why)
                continue
            left = self.cfg["budget_s"] - self.elapsed() - 5.0
            per = min(self.cfg["jitter_seconds"], left / (len(keys) - i))
            if per < 1.0:
                rec.update(status="skipped", reason="time budget")
                continue

            def go(rec=rec, key=key, per=per):
                fn = make_step(build_mlp(key, c), c)
                rec.update(jitter(fn, self.cfg["jitter_iters"], per))
                rec["time_cap_s"] = round(per, 1)
            self.guarded(rec, f"jitter/{key}", go)
            free()
            log(f"[bench] jitter {VBY[key].label}: {rec.get('status')} n={rec.get('n')}")
        c = None
        free()

    # ------------------------------------------------------------------------------------ main
    def run(self):
        args, cfg = self.args, self.cfg
        self.res["meta"] = collect_meta(args)
        load_variants()
        self.res["unavailable"] = dict(UNAVAILABLE)
        for k, why in UNAVAILABLE.items():
            log(f"[bench] unavailable: {VBY[k].label}: {why}")
        self.save()
        if not args.no_probe:
            t0 = time.time()
            keys = self.selected()
            log(f"[bench] probing {len(keys)} variants in child processes ...")
            kinds = ["unaligned"] + (["aligned"] if "balanced" in cfg["splits"] else [])  # sweep, jitter: Zipf
            kinds = [k for k in PROBE_SPLITS if k in kinds]
            PROBES.update(run_probes(keys, kinds, cfg["probe_timeout_s"]))
            self.res["probes"] = PROBES
            bad = [(k, s, d) for k, st in PROBES.items() for s, d in st.items() if d["status"] not in ("ok", "unsupported")]
            for k, s, d in bad:
                log(f"[bench] probe {k} {s}: {d['status']}: {d.get('reason')}")
            log(f"[bench] probes done ({time.time() - t0:.0f} s)")
            self.save()
        self.res["ceilings"] = measure_ceilings(cfg)
        log(f"[bench] ceilings: {self.res['ceilings']}")
        self.save()
        for shape, (E, H, F, T) in {**SHAPES, **SMALL_EXPERTS}.items():
            if args.shapes and not any(s.lower() in shape.lower() for s in args.shapes.split(",")):
                continue
            small = shape in SMALL_EXPERTS  # its own skew (a quarter of the experts empty), Zipf only
            for kind_name in (["zipf"] if small else cfg["splits"]):
                if self.dead or self.over_budget(reserve=cfg["sweep_reserve_s"] + cfg["jitter_reserve_s"]):
                    self.res["skipped"].append(f"{shape}/{kind_name}: " + (self.dead or "time budget"))
                    continue
                splits = (small_experts_splits(E, T) if small else
                          zipf_splits(E, T) if kind_name == "zipf" else balanced_splits(E, T))
                pt = {}
                self.guarded(pt, f"{shape}/{kind_name}", lambda: self.run_point(shape, E, H, F, T, kind_name, splits))
                if pt.get("status") != "ok":
                    self.res["skipped"].append(f"{shape}/{kind_name}: {pt.get('status')}: {pt.get('reason')}")
                free()
                self.save()
        for shape, (E, K, N, T) in cfg["gemm_shapes"].items():
            if args.shapes and not any(s.lower() in shape.lower() for s in args.shapes.split(",")):
                continue
            if self.dead or self.over_budget(reserve=cfg["sweep_reserve_s"] + cfg["jitter_reserve_s"]):
                self.res["skipped"].append(f"{shape}: " + (self.dead or "time budget"))
                continue
            pt = {}
            self.guarded(pt, shape, lambda: self.run_point(shape, E, K, N // 2, T, "balanced", balanced_splits(E, T),
                                                           ops=("fc1",)))
            free()
            self.save()
        if not args.no_sweep:
            self.run_sweep()
            self.save()
        if not args.no_jitter and not self.dead:
            self.run_jitter()
        self.save()
        md = render_markdown(self.res)
        (self.out / "results.md").write_text(md)
        print(md, flush=True)
        if not args.no_plots:
            try:
                for p in plot.make_plots(self.res, self.out):
                    log(f"[bench] wrote {p}")
            except ImportError as exc:
                log(f"[bench] no plots ({short(exc)}): run `python -m bench.suite.plot {self.out / 'results.json'}` "
                    "on a machine with matplotlib")
            except Exception as exc:
                log(f"[bench] plotting failed: {short(exc)}")
        log(f"[bench] done in {self.elapsed():.0f} s; results in {self.out}")
        return 0 if not self.dead else 2


def _clean(o):
    if isinstance(o, float):
        return o if math.isfinite(o) else str(o)
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    if isinstance(o, (str, int, bool)) or o is None:
        return o
    return str(o)
