"""Which (variant, op, split kind) may run in this process: combinations known to be impossible
(static_unsupported), and the probes, one child process per variant (`python -m bench.suite --probe KEY`) that runs
it on tiny aligned and unaligned cases, so that a device-side assert kills the child and not the run;
gate() answers from both. Also in child processes: the JIT prewarm (Prewarm, prewarm_main) of variants
that compile kernels at their first call on a new shape (DeepGEMM)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from bench.suite.cases import Case, mlp_errors, reference, rel_err
from bench.suite.implementations import UNAVAILABLE, build_fc1, build_mlp, load_variants, make_step
from bench.suite.shared import DEV, REPO, cuda_alive, log, short
from bench.suite.variants import VBY

PROBE_E, PROBE_H, PROBE_F = 8, 256, 128
PROBE_SPLITS = {"aligned": [32] * 8, "unaligned": [0, 1, 3, 17, 0, 30, 64, 13]}
PROBE_TAG = "@@PROBE "


def static_unsupported(key, op, kind):
    """Combinations that are known to be impossible (reason), or None."""
    if op not in VBY[key].ops:
        return f"measured for {'/'.join(VBY[key].ops)} only"
    if key == "torchao_fp8" and op == "mlp" and kind == "unaligned":
        return ("wgrad needs non-empty 16-row groups: torch._scaled_grouped_mm 2d x 2d device-asserts otherwise "
                "(GroupMMCommon.cuh) and torchao 0.18 does not pad (pad_token_groups=True unsupported)")
    return None


def probe_main(key: str, kinds) -> int:
    """Child process: run `key` on tiny aligned and unaligned cases, one line per stage (flushed), so that
    the parent knows which stage killed the process if one does."""
    def emit(**kw):
        print(PROBE_TAG + json.dumps(kw), flush=True)

    torch.manual_seed(0)
    load_variants(only=key)
    if key in UNAVAILABLE:
        emit(stage="*", status="error", reason=UNAVAILABLE[key])
        emit(stage="done", status="ok")
        return 0
    v = VBY[key]
    tol = 0.15 if v.precision == "fp8" else 0.03
    for kind in kinds:
        splits = PROBE_SPLITS[kind]
        c = Case("probe", PROBE_E, PROBE_H, PROBE_F, splits, DEV, seed=1)
        ref = reference(c)
        for op in v.ops:
            stage = f"{kind}.{op}"
            why = static_unsupported(key, op, kind)
            if why:
                emit(stage=stage, status="unsupported", reason=why)
                continue
            try:
                if op == "fc1":
                    with torch.no_grad():
                        y = build_fc1(key, c)()
                        torch.cuda.synchronize()
                        errs = {"y": rel_err(y, ref["h"])}
                else:
                    errs = mlp_errors(build_mlp(key, c), c, ref)
                    torch.cuda.synchronize()
                vals = [e for e in errs.values() if isinstance(e, float)]
                worst = max(vals, default=0.0)
                ok = all(math.isfinite(e) and e <= tol for e in vals)
                emit(stage=stage, status="ok" if ok else "error", errs=errs,
                     reason=None if ok else f"wrong result on the probe case: rel err {worst:.3g} > {tol}")
            except Exception as exc:
                emit(stage=stage, status="error", reason=short(exc))
                if not cuda_alive():
                    emit(stage=stage, status="crash", reason="CUDA context lost: " + short(exc))
                    return 3
    emit(stage="done", status="ok")
    return 0


def run_probes(keys, kinds, timeout_s) -> dict:
    """{key: {stage: {"status":..., "reason":...}}} from one child process per variant, run in parallel."""
    procs, logs = {}, {}
    tmp = Path(tempfile.mkdtemp(prefix="moegemm_probe_"))
    for k in keys:
        fo, fe = open(tmp / f"{k}.out", "w"), open(tmp / f"{k}.err", "w")  # files: no pipe can fill up
        logs[k] = (fo, fe)
        procs[k] = subprocess.Popen([sys.executable, "-m", "bench.suite", "--probe", k,
                                     "--probe-kinds", ",".join(kinds)], cwd=str(REPO),
                                    stdout=fo, stderr=fe, env=os.environ.copy())
    deadline = time.time() + timeout_s
    res = {}
    for k, p in procs.items():
        timed_out = False
        try:
            p.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            timed_out = True
        for f in logs[k]:
            f.close()
        out = (tmp / f"{k}.out").read_text(errors="replace")
        err = (tmp / f"{k}.err").read_text(errors="replace")
        stages, done = {}, False
        for line in out.splitlines():
            if line.startswith(PROBE_TAG):
                try:
                    d = json.loads(line[len(PROBE_TAG):])
                except ValueError:
                    continue
                if d.get("stage") == "done":
                    done = True
                elif d.get("stage") == "*":
                    for kind in kinds:
                        for op in VBY[k].ops:
                            stages[f"{kind}.{op}"] = {"status": d["status"], "reason": d.get("reason")}
                else:
                    stages[d["stage"]] = {kk: vv for kk, vv in d.items() if kk != "stage"}
        if not done:
            tail = (err or "").strip().splitlines()[-3:]
            why = ("timed out after %.0f s" % timeout_s) if timed_out else f"exit code {p.returncode}"
            why += (": " + " | ".join(tail))[:400] if tail else ""
            crashed = any(d.get("status") == "crash" for d in stages.values())
            for kind in kinds:
                for op in VBY[k].ops:
                    st = f"{kind}.{op}"
                    if st in stages:
                        continue
                    if not crashed:
                        stages[st] = {"status": "crash", "reason": f"probe process died here ({why})"}
                        crashed = True
                    else:
                        stages[st] = {"status": "not run", "reason": f"probe process died earlier ({why})"}
        res[k] = stages
    log(f"[bench] probe logs under {tmp}")
    return res


PROBES: dict = {}


def gate(key, op, kind):
    """None when (variant, op, split kind) may run in this process, else the reason it may not."""
    why = static_unsupported(key, op, kind)
    if why:
        return why
    st = PROBES.get(key, {}).get(f"{kind}.{op}")
    if st is None or st["status"] in ("ok", "error"):
        return None
    return f"not run: probe {st['status']} ({st.get('reason')})"


# ------------------------------------------------------------------------------------- JIT prewarm
class Prewarm:
    """Runs every point of the run once (the MLP's forward and backward, or fc1 where only fc1 is
    measured) with variant ``key``, one child process per point (`python -m bench.suite --prewarm KEY
    --prewarm-job FILE:I`), at most ``max_par`` at a time, in the background: a peer that compiles each
    kernel at its first call on a new shape (DeepGEMM: nvcc, seconds per kernel, cached on disk) then finds
    them compiled when it is timed, instead of compiling them one after another inside the time budget.
    A point that fails here is only logged (the timed run compiles what is missing)."""

    def __init__(self, key, jobs, max_par):
        self.key, self.jobs, self.max_par = key, jobs, max(1, max_par)
        self.tmp = Path(tempfile.mkdtemp(prefix="moegemm_prewarm_"))
        self.spec = self.tmp / "jobs.json"
        self.spec.write_text(json.dumps(jobs))
        self.pending, self.running, self.status = list(range(len(jobs))), {}, {}
        self.t0, self.stop, self.error = time.time(), threading.Event(), None
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._drive, daemon=True)
        self.thread.start()

    def _drive(self):
        try:
            self._loop()
        except Exception as exc:  # noqa: BLE001 - reported by wait(); the timed run compiles what is missing
            self.error = short(exc)

    def _loop(self):
        while not self.stop.is_set():
            with self.lock:
                for i, (p, f) in list(self.running.items()):
                    if p.poll() is not None:
                        f.close()
                        self.status[i] = "ok" if p.returncode == 0 else f"exit code {p.returncode}"
                        del self.running[i]
                while self.pending and len(self.running) < self.max_par:
                    i = self.pending.pop(0)
                    f = open(self.tmp / f"{i}.log", "w")
                    p = subprocess.Popen([sys.executable, "-m", "bench.suite", "--prewarm", self.key,
                                          "--prewarm-job", f"{self.spec}:{i}"], cwd=str(REPO), stdout=f,
                                         stderr=subprocess.STDOUT, env=os.environ.copy())
                    self.running[i] = (p, f)
                if not self.pending and not self.running:
                    return
            time.sleep(0.2)

    def wait(self, timeout_s) -> dict:
        """Wait until every point ran or ``timeout_s`` after the start; then stop what still runs. A
        summary: points, seconds, the points that failed (with the last line of their output)."""
        self.thread.join(max(0.0, self.t0 + timeout_s - time.time()))
        self.stop.set()
        self.thread.join()
        with self.lock:
            for i, (p, f) in self.running.items():
                p.kill()
                p.wait()
                f.close()
                self.status[i] = f"stopped after {timeout_s:.0f} s"
            for i in self.pending:
                self.status[i] = "not started"
            self.running, self.pending = {}, []
        failed = {}
        for i, st in sorted(self.status.items()):
            if st != "ok":
                path = self.tmp / f"{i}.log"
                out = path.read_text(errors="replace").strip().splitlines() if path.is_file() else []
                failed[self.jobs[i]["name"]] = st + (": " + out[-1][:200] if out else "")
        return {"variant": self.key, "points": len(self.jobs), "seconds": round(time.time() - self.t0, 1),
                "failed": failed, "error": self.error, "logs": str(self.tmp)}


def prewarm_main(key: str, job_ref: str) -> int:
    """Child process: run point I of the job file once with ``key`` (so that its kernels get compiled)."""
    path, i = job_ref.rsplit(":", 1)
    job = json.loads(Path(path).read_text())[int(i)]
    load_variants(only=key)
    if key in UNAVAILABLE:
        print(f"prewarm {key}: unavailable: {UNAVAILABLE[key]}", flush=True)
        return 1
    t0 = time.time()
    c = Case(job["name"], job["E"], job["H"], job["F"], job["splits"], DEV, seed=0)
    if "mlp" in job["ops"] and "mlp" in VBY[key].ops:
        make_step(build_mlp(key, c), c)()
    elif "fc1" in VBY[key].ops:
        with torch.no_grad():
            build_fc1(key, c)()
    torch.cuda.synchronize()
    print(f"prewarm {key} {job['name']}: {time.time() - t0:.1f} s", flush=True)
    return 0
