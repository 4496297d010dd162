"""The run: Runner measures the sections in order (peers loaded, probes and the JIT prewarm, ceilings, the
model shapes and the grouped-GEMM problems, the training step, the host-overhead sweep over E, jitter) within
the time budget, guards every variant, writes results.json after every section, then results.md and the
plots. What comes before the measurements (loading the variants, DeepGEMM's build among them, the probes
and the JIT prewarm) is the run's setup: recorded, and left out of the time budget."""

from __future__ import annotations

import json
import math
import os
import time
import traceback
from pathlib import Path

import torch

from bench.workloads import GEMM_SHAPES, SHAPES, SMALL_EXPERTS, balanced_splits, small_experts_splits, zipf_splits

from bench.suite import plot
from bench.suite.cases import Case, mlp_errors, reference, rel_err
from bench.suite.implementations import UNAVAILABLE, build_fc1, build_mlp, jit_prewarm, load_variants, make_step
from bench.suite.measure import (count_syncs, host_overhead, host_overhead_interleaved, jitter, measure_ceilings,
                                 peak_extra_mib, time_op)
from bench.suite.meta import collect_meta
from bench.suite.probes import PROBE_SPLITS, PROBES, Prewarm, gate, run_probes
from bench.suite.report import render_markdown
from bench.suite.shared import DEV, cuda_alive, free, log, short
from bench.suite.training import TrainStep
from bench.suite.variants import BASELINE, VARIANTS, VBY

SWEEP_E = (8, 32, 128, 256)
SWEEP_SHAPE = (1024, 512, 8192)  # hidden, ffn, T for the host-overhead sweep (Zipf splits)
JITTER_SHAPE = "DeepSeek-V2-Lite"


def _wanted(shape, shapes_arg) -> bool:
    return not shapes_arg or any(s.strip().lower() in shape.lower() for s in shapes_arg.split(",") if s.strip())


def model_points(cfg, shapes_arg) -> list:
    """(shape, E, H, F, T, splits name, splits, ops) of the model-shape points and the grouped-GEMM problems
    (fc1 only), in the order they run."""
    pts = []
    for shape, (E, H, F, T) in {**SHAPES, **SMALL_EXPERTS}.items():
        if not _wanted(shape, shapes_arg):
            continue
        small = shape in SMALL_EXPERTS  # its own skew (a quarter of the experts empty), Zipf only
        for kind_name in (["zipf"] if small else cfg["splits"]):
            splits = (small_experts_splits(E, T) if small else
                      zipf_splits(E, T) if kind_name == "zipf" else balanced_splits(E, T))
            pts.append((shape, E, H, F, T, kind_name, splits, ("fc1", "mlp")))
    for shape, (E, K, N, T) in cfg["gemm_shapes"].items():
        if _wanted(shape, shapes_arg):
            pts.append((shape, E, K, N // 2, T, "balanced", balanced_splits(E, T), ("fc1",)))
    return pts


def train_points(cfg, shapes_arg) -> list:
    """(shape, E, H, F, T, splits name, splits) of the training-step section: the model points of the run
    (each model shape with each kind of splits of cfg["splits"]; small experts with its own)."""
    return [p[:7] for p in model_points(cfg, shapes_arg) if "mlp" in p[7]]


def prewarm_jobs(cfg, args, ops) -> list:
    """Every distinct problem the run will give a variant measured on ``ops``: the model points, the
    training step's, the host sweep's (bench/suite/probes.py's Prewarm runs each once)."""
    jobs, seen = [], set()

    def add(name, E, H, F, splits, want):
        want = tuple(o for o in want if o in ops)
        key = (E, H, F, tuple(splits), want)
        if want and key not in seen:
            seen.add(key)
            jobs.append({"name": name, "E": E, "H": H, "F": F, "splits": list(splits), "ops": list(want)})

    for shape, E, H, F, T, kind_name, splits, want in model_points(cfg, args.shapes):
        add(f"{shape} {kind_name}", E, H, F, splits, want)
    if not args.no_train:
        for shape, E, H, F, T, kind_name, splits in train_points(cfg, args.shapes):
            add(f"{shape} {kind_name}", E, H, F, splits, ("fc1", "mlp"))
    if not args.no_sweep:
        H, F, T = SWEEP_SHAPE
        for E in SWEEP_E:
            add(f"sweep E={E}", E, H, F, zipf_splits(E, T), ("fc1", "mlp"))
    return jobs


class Runner:
    def __init__(self, args, cfg):
        self.args, self.cfg = args, cfg
        self.t_start = time.time()
        self.res = {"meta": {}, "config": cfg, "unavailable": {}, "probes": {}, "prewarm": [], "ceilings": {},
                    "records": [], "train": [], "host_sweep": [], "jitter": [], "skipped": []}
        self.out = Path(args.out)
        self.dead = None  # reason once the CUDA context is lost
        self.setup_s = 0.0  # loading the variants, probes, JIT prewarm: outside the budget

    def elapsed(self):
        return time.time() - self.t_start

    def budget_elapsed(self):
        return self.elapsed() - self.setup_s

    def over_budget(self, reserve=0.0):
        return self.budget_elapsed() + reserve > self.cfg["budget_s"]

    def reserve(self, *sections):
        """The seconds kept for the later sections named (those this run has)."""
        args, cfg = self.args, self.cfg
        on = {"train": not args.no_train, "sweep": not args.no_sweep, "jitter": not args.no_jitter}
        return sum(cfg[f"{s}_reserve_s"] for s in sections if on[s])

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

    # ------------------------------------------------------------------------------ training step
    def run_training(self):
        """The training step (bench/suite/training.py) per model point (shape and kind of splits), for
        each GA of cfg["train_ga"] and each variant of cfg["train_variants"] selected here."""
        cfg = self.cfg
        keys = [k for k in cfg["train_variants"] if k in self.selected()]
        for shape, E, H, F, T, kind_name, splits in train_points(cfg, self.args.shapes):
            if self.dead or self.over_budget(reserve=self.reserve("sweep", "jitter")):
                self.res["skipped"].append(f"training step {shape} {kind_name}: " + (self.dead or "time budget"))
                continue
            c = Case(shape, E, H, F, splits, DEV, seed=4)
            log(f"[bench] training step {shape} {kind_name}: E={E} H={H} F={F} T={T} empty={splits.count(0)}, "
                f"GA {', '.join(map(str, cfg['train_ga']))}")
            for key in keys:
                self._train_variant(c, key, kind_name)
                free()
            c = None
            free()
            self.save()

    def _train_variant(self, c, key, kind_name):
        cfg, v = self.cfg, VBY[key]
        recs = []
        for ga in cfg["train_ga"]:
            rec = {"shape": c.name, "E": c.E, "hidden": c.H, "ffn": c.F, "T": c.T, "splits": kind_name,
                   "n_empty": c.splits.count(0), "variant": key, "label": v.label, "precision": v.precision,
                   "ga": ga, "flops": ga * c.flops("mlp")}
            self.res["train"].append(rec)
            recs.append(rec)
        why = gate(key, "mlp", c.kind)
        if why:
            for rec in recs:
                rec.update(status="n/a", reason=why)
            return
        state = {}
        for rec in recs:
            if state.get("failed"):
                rec.update(status="error", reason=state["failed"])
                continue
            if self.over_budget(reserve=self.reserve("sweep", "jitter")):
                rec.update(status="skipped", reason="time budget")
                continue

            def go(rec=rec):
                if "step" not in state:
                    state["step"] = TrainStep(key, c)
                st = state["step"]
                rec.update(time_op(lambda: st.run(rec["ga"]), cfg["train_target_s"], cfg["train_min_iters"],
                                   cfg["train_max_iters"], cfg["train_warmup"]))
                rec["main_grad_norm"] = st.main_grad_norm()
            t1 = time.time()
            self.guarded(rec, f"train/{c.name}/{key}/GA={rec['ga']}", go)
            if rec.get("status") == "error" and "step" not in state:
                state["failed"] = rec["reason"]
            log(f"[bench]   train {v.label:45s} GA={rec['ga']} {rec.get('status'):7s} "
                f"{('%.3f ms' % rec['ms']) if 'ms' in rec else ''} ({time.time() - t1:.1f} s)")
        state.clear()
        one = next((r for r in recs if r["ga"] == 1 and r.get("status") == "ok"), None)
        for rec in recs:
            if rec.get("status") == "ok" and one and one.get("main_grad_norm"):
                rec["main_grad_ratio"] = rec["main_grad_norm"] / one["main_grad_norm"]  # GA expected
        same = lambda r: r["shape"] == c.name and r["splits"] == kind_name  # noqa: E731
        base = {r["ga"]: r.get("ms") for r in self.res["train"]
                if same(r) and r["variant"] == BASELINE and r.get("status") == "ok"}
        for r in self.res["train"]:
            if same(r) and r.get("status") == "ok" and base.get(r["ga"]):
                r["speedup_vs_torch_bf16"] = base[r["ga"]] / r["ms"]

    # ------------------------------------------------------------------------------ host sweep (E)
    def run_sweep(self):
        H, F, T = SWEEP_SHAPE
        for E in SWEEP_E:
            if self.dead or self.over_budget(reserve=self.reserve("jitter")):
                self.res["skipped"].append(f"host sweep E={E}: " + (self.dead or "time budget"))
                continue
            splits = zipf_splits(E, T)
            c = Case("sweep", E, H, F, splits, DEV, seed=2)
            # the peers, and GroupedLinear / GroupedMLP with their automatic FP8 weight cache (the layers as
            # Megatron's micro-batches after the first call them: the fc1 forward with cached weights)
            keys = self.selected(aux=False) + [k for k in self.selected(aux=True) if k == "moegemm_fp8_wcache"]
            for op in ("fc1", "mlp"):
                # every variant of the op built first, then their batches measured in turn (host_overhead_interleaved:
                # the ratios to torch's hold within the run even as the host's speed drifts)
                built = []
                for key in [k for k in keys if op in VBY[k].ops]:
                    rec = {"op": op, "E": E, "hidden": H, "ffn": F, "T": T, "splits": "zipf", "variant": key,
                           "label": VBY[key].label}
                    self.res["host_sweep"].append(rec)
                    why = gate(key, op, c.kind)
                    if why:
                        rec.update(status="n/a", reason=why)
                        continue

                    def prepare(rec=rec, key=key):
                        with torch.set_grad_enabled(op == "mlp"):
                            fn = build_fc1(key, c) if op == "fc1" else make_step(build_mlp(key, c), c)
                            fn()
                            rec["syncs"] = count_syncs(fn)
                        built.append((rec, fn))
                    self.guarded(rec, f"sweep/E={E}/{key}/{op}", prepare)
                if built and not self.dead:
                    with torch.set_grad_enabled(op == "mlp"):
                        measured = host_overhead_interleaved([fn for _, fn in built], self.cfg["sweep_reps"])
                    for (rec, _), m in zip(built, measured):
                        if "error" in m:
                            rec["status"], rec["reason"] = "error", m["error"]
                            log(f"[bench]   sweep/E={E}/{rec['variant']}/{op}: {m['error']}")
                        else:
                            rec.update(m)
                    if any("error" in m for m in measured) and not cuda_alive():
                        self.dead = f"CUDA context lost in the host sweep at E={E} ({op})"
                        log("[bench] " + self.dead)
                built = None
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
            left = self.cfg["budget_s"] - self.budget_elapsed() - 5.0
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
    def start_prewarm(self):
        """One Prewarm per builder module whose variants compile kernels at their first call (DeepGEMM), with
        its first selected variant: every point of this run once, in child processes, in the background."""
        out, families = [], set()
        max_par = max(1, min(self.cfg["prewarm_max_par"], (os.cpu_count() or 8) // 2))
        for key in self.selected():
            fam = VBY[key].family
            if fam in families or not jit_prewarm(key):
                continue
            families.add(fam)
            jobs = prewarm_jobs(self.cfg, self.args, VBY[key].ops)
            if jobs:
                log(f"[bench] JIT prewarm of {VBY[key].label}: {len(jobs)} points in child processes "
                    f"({max_par} at a time)")
                out.append(Prewarm(key, jobs, max_par))
        return out

    def run(self):
        args, cfg = self.args, self.cfg
        self.res["meta"] = collect_meta(args)
        t_setup = time.time()
        for key in self.selected():
            load_variants(only=key)  # DeepGEMM: its build, the first time
        self.res["unavailable"] = dict(UNAVAILABLE)
        for k, why in UNAVAILABLE.items():
            log(f"[bench] unavailable: {VBY[k].label}: {why}")
        self.save()
        warm = self.start_prewarm() if not args.no_prewarm else []
        if not args.no_probe:
            t0 = time.time()
            keys = self.selected()
            log(f"[bench] probing {len(keys)} variants in child processes ...")
            kinds = ["unaligned"] + (["aligned"] if "balanced" in cfg["splits"] else [])  # sweep, jitter: Zipf
            kinds = [k for k in PROBE_SPLITS if k in kinds]
            timeout = cfg["probe_timeout_s"] + (cfg["probe_jit_extra_s"] if any(map(jit_prewarm, keys)) else 0.0)
            PROBES.update(run_probes(keys, kinds, timeout))
            self.res["probes"] = PROBES
            bad = [(k, s, d) for k, st in PROBES.items() for s, d in st.items() if d["status"] not in ("ok", "unsupported")]
            for k, s, d in bad:
                log(f"[bench] probe {k} {s}: {d['status']}: {d.get('reason')}")
            log(f"[bench] probes done ({time.time() - t0:.0f} s)")
            self.save()
        for w in warm:  # before the ceilings: the GPU must be idle when they are measured
            rec = w.wait(cfg["prewarm_timeout_s"])
            self.res["prewarm"].append(rec)
            log(f"[bench] JIT prewarm of {VBY[rec['variant']].label}: {rec['points']} points, {rec['seconds']:.0f} s"
                + (f"; failed: {rec['failed']}" if rec["failed"] else "") + (f"; {rec['error']}" if rec["error"] else ""))
        self.setup_s = time.time() - t_setup
        self.res["meta"]["setup_s"] = round(self.setup_s, 1)
        log(f"[bench] setup (variants loaded, probes, JIT prewarm) {self.setup_s:.0f} s, outside the time budget")
        self.res["ceilings"] = measure_ceilings(cfg)
        log(f"[bench] ceilings: {self.res['ceilings']}")
        self.save()
        for shape, E, H, F, T, kind_name, splits, ops in model_points(cfg, args.shapes):
            name = f"{shape}/{kind_name}" if "mlp" in ops else shape
            if self.dead or self.over_budget(reserve=self.reserve("train", "sweep", "jitter")):
                self.res["skipped"].append(f"{name}: " + (self.dead or "time budget"))
                continue
            pt = {}
            self.guarded(pt, name, lambda: self.run_point(shape, E, H, F, T, kind_name, splits, ops=ops))
            if pt.get("status") != "ok":
                self.res["skipped"].append(f"{name}: {pt.get('status')}: {pt.get('reason')}")
            free()
            self.save()
        if not args.no_train:
            self.run_training()
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
