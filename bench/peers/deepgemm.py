"""DeepGEMM (github.com/deepseek-ai/DeepGEMM) as a peer of moegemm's FP8 grouped GEMMs: its m-grouped
contiguous FP8 GEMM (fprop, bf16 out) and its k-grouped FP8 GEMM (wgrad, accumulated into fp32), timed on
given token splits with operands quantized beforehand. SM90 (H100/H200) only.

No DeepGEMM code lives here. A public source tree is carried to the GPU machine (``.peers/DeepGEMM``, not
committed) and built there with its own ``setup.py build`` (~80 s on 16 cores). A source snapshot lacks
DeepGEMM's git submodules, so ``third-party/cutlass/include/{cutlass,cute}`` are pointed at the headers of
the ``nvidia-cutlass`` package (carried as a wheel) and ``third-party/fmt/include`` must be carried in the
tree (fmt's public source). Every process that runs DeepGEMM must preload the system C++ library:
without it, the first GEMM call of every process crashed in DeepGEMM's JIT (two copies of libstdc++ in one
process: SIGSEGV in the recursive std::regex of its include parser; docs/performance.md, Peers). The JIT compiles each kernel with
nvcc at its first call (a few seconds each, cached under ``<root>/jit_cache``).

    LD_PRELOAD=$(g++ -print-file-name=libstdc++.so.6) python -m bench.peers.deepgemm --build --json $OUT/deepgemm.json
    python -m bench.gemm.vs_deepgemm $OUT/deepgemm.json    # moegemm's GEMMs on the same splits

What a side-by-side GEMM table can call: ``aligned_splits`` (DeepGEMM's 128-row groups), ``build`` and
``load``, ``fprop`` / ``wgrad`` (the GEMM alone on pre-quantized operands), and ``quantize_rows`` /
``quantize_blocks`` / ``quantize_cols`` (those operands from bf16, in DeepGEMM's scale layouts).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.preflight import require_cuda_gpu, require_cuda_toolkit

PROG = "python -m bench.peers.deepgemm"
REPO = Path(__file__).resolve().parents[2]
DEFAULT_SRC = REPO / ".peers" / "DeepGEMM"
DEFAULT_ROOT = Path("/tmp/deepgemm_peer")
ALIGN = 128  # rows of a contiguous group (M for fprop, K for wgrad), DeepGEMM's requirement on SM90
GEMMS = {  # name: (kind, the GEMM's two dimensions besides the tokens, from hidden H and ffn F)
    "fc1_fprop": ("fprop", lambda H, F: {"K": H, "N": 2 * F}),
    "fc2_fprop": ("fprop", lambda H, F: {"K": F, "N": H}),
    "fc1_wgrad": ("wgrad", lambda H, F: {"M": 2 * F, "N": H}),
    "fc2_wgrad": ("wgrad", lambda H, F: {"M": H, "N": F}),
}
PRELOAD = "LD_PRELOAD=$(g++ -print-file-name=libstdc++.so.6)"


def aligned_splits(E: int, T: int, weights=None) -> list:
    """Tokens per expert, each a multiple of 128, summing to round(T / 128) * 128, as close to proportional
    to ``weights`` (default: equal) as that granularity allows (largest remainder first)."""
    units = max(0, round(T / ALIGN))
    w = [1.0] * E if weights is None else [float(x) for x in weights]
    exact = [units * x / (sum(w) or 1.0) for x in w]
    counts = [math.floor(v) for v in exact]
    for e in sorted(range(E), key=lambda e: (counts[e] - exact[e], e))[: units - sum(counts)]:
        counts[e] += 1
    return [c * ALIGN for c in counts]


# ------------------------------------------------------------------------------------------------ build
def _cutlass_headers() -> Path:
    """include/ of the nvidia-cutlass package (found without importing it: its import parses sys.argv)."""
    spec = importlib.util.find_spec("cutlass_library")
    inc = Path(spec.origin).parent / "source" / "include" if spec and spec.origin else None
    if inc is None or not (inc / "cutlass" / "cutlass.h").is_file():
        raise RuntimeError("DeepGEMM needs the CUTLASS headers of the nvidia-cutlass package, which is not installed")
    return inc


def _built_package(work: Path) -> Path | None:
    found = sorted(work.glob("build/lib*/deep_gemm/_C*.so"))
    return found[0].parent if found else None


def build(src: Path = DEFAULT_SRC, root: Path = DEFAULT_ROOT) -> Path:
    """Build DeepGEMM from the source tree ``src`` in a copy under ``root`` (``setup.py build``; its output
    in ``root/build.log``) and return the built package's folder. A finished build of the same source for
    the same torch is reused."""
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    cuda_home = os.environ.get("CUDA_HOME") or CUDA_HOME
    if not cuda_home:
        raise RuntimeError("DeepGEMM's build needs the CUDA toolkit: set CUDA_HOME to its folder")
    src, root = Path(src), Path(root)
    work, log_path, stamp_path = root / "src", root / "build.log", root / "build.stamp"
    if not (src / "setup.py").is_file() or not (src / "deep_gemm" / "__init__.py").is_file():
        raise RuntimeError(f"no DeepGEMM source tree at {src} (carry one there, or pass --src)")
    if not (src / "third-party" / "fmt" / "include" / "fmt" / "format.h").is_file():
        raise RuntimeError(f"DeepGEMM needs fmt's headers at {src}/third-party/fmt/include (carry fmt's source there)")
    source_id = (src / "PEER_SOURCE.txt").read_text() if (src / "PEER_SOURCE.txt").is_file() else str(src.resolve())
    stamp = f"{source_id}|torch {torch.__version__}|python {sys.version.split()[0]}"
    built = _built_package(work)
    if built is not None and stamp_path.is_file() and stamp_path.read_text() == stamp:
        print(f"[deepgemm] reusing the build in {built}", flush=True)
        return built
    cutlass = _cutlass_headers()
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(src, work, ignore=shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", ".git"))
    inc = work / "third-party" / "cutlass" / "include"
    inc.mkdir(parents=True, exist_ok=True)
    for name in ("cutlass", "cute"):
        link = inc / name
        if link.is_symlink() or link.is_file():
            link.unlink()
        elif link.is_dir():
            shutil.rmtree(link)
        link.symlink_to(cutlass / name, target_is_directory=True)
    env = dict(os.environ, CUDA_HOME=cuda_home)
    env.setdefault("MAX_JOBS", str(os.cpu_count() or 8))
    print(f"[deepgemm] building {src} in {work} (log {log_path})", flush=True)
    t0 = time.time()
    with open(log_path, "w") as log:
        rc = subprocess.run([sys.executable, "setup.py", "build"], cwd=work, env=env, stdout=log,
                            stderr=subprocess.STDOUT, timeout=1800).returncode
    built = _built_package(work)
    if rc != 0 or built is None:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"DeepGEMM's setup.py build failed (exit status {rc}); the end of {log_path}:\n{tail}")
    stamp_path.write_text(stamp)
    print(f"[deepgemm] built in {time.time() - t0:.0f} s: {built}", flush=True)
    return built


def load(package: Path, root: Path = DEFAULT_ROOT):
    """Import the built ``deep_gemm`` package from its folder (by path: nothing is added to sys.path),
    with its JIT cache under ``root``."""
    if "libstdc++" not in os.environ.get("LD_PRELOAD", ""):
        raise RuntimeError(f"DeepGEMM crashes at its first GEMM unless the system libstdc++ is preloaded: "
                           f"run with {PRELOAD}")
    from torch.utils.cpp_extension import CUDA_HOME

    os.environ.setdefault("DG_JIT_CACHE_DIR", str(Path(root) / "jit_cache"))
    if CUDA_HOME:
        os.environ.setdefault("CUDA_HOME", CUDA_HOME)  # DeepGEMM's JIT looks for nvcc there
    spec = importlib.util.spec_from_file_location("deep_gemm", Path(package) / "__init__.py",
                                                  submodule_search_locations=[str(package)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["deep_gemm"] = module
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------------- operands and GEMMs
def pad_groups(t, counts):
    """t [sum(counts), C] with each group's rows padded with zero rows to a multiple of ALIGN, as DeepGEMM's
    contiguous layout requires: (the padded tensor, the padded counts: DeepGEMM's host sizes)."""
    import torch

    padded = [-(-c // ALIGN) * ALIGN for c in counts]
    out = torch.zeros(sum(padded), t.shape[1], device=t.device, dtype=t.dtype)
    src = dst = 0
    for c, cp in zip(counts, padded):
        out[dst:dst + c] = t[src:src + c]
        src, dst = src + c, dst + cp
    return out, padded


def quantize_rows(t):
    """FP8 e4m3 of t [R, C] in 1x128 blocks along each row: (q [R, C], fp32 scales [R, C/128])."""
    import torch

    R, C = t.shape
    v = t.view(R, C // 128, 128).float()
    s = v.abs().amax(dim=2).clamp(min=1e-4) / 448.0
    return (v / s.unsqueeze(2)).to(torch.float8_e4m3fn).view(R, C), s


def quantize_blocks(w):
    """FP8 e4m3 of w [..., N, K] (one matrix, or a stack of them) in 128x128 blocks: (q [..., N, K], fp32
    scales [..., ceil(N/128), K/128])."""
    import torch

    *lead, N, K = w.shape
    Np = -(-N // 128) * 128
    padded = w
    if Np != N:
        padded = torch.zeros(*lead, Np, K, dtype=w.dtype, device=w.device)
        padded[..., :N, :] = w
    v = padded.reshape(*lead, Np // 128, 128, K // 128, 128).float()
    s = v.abs().amax(dim=(-3, -1), keepdim=True).clamp(min=1e-4) / 448.0
    q = (v / s).to(torch.float8_e4m3fn).view(*lead, Np, K)[..., :N, :].contiguous()
    return q, s.view(*lead, Np // 128, K // 128)


def quantize_cols(t):
    """FP8 e4m3 of t [T, C] (T a multiple of 128) in 128x1 blocks along the tokens: (q [T, C], fp32 [T/128, C])."""
    import torch

    T, C = t.shape
    v = t.view(T // 128, 128, C).float()
    s = v.abs().amax(dim=1).clamp(min=1e-4) / 448.0
    return (v / s.unsqueeze(1)).to(torch.float8_e4m3fn).view(T, C), s


def fprop(dg, xq, sx, wq, sw, counts):
    """out [T, N] bf16 = x_e W_e^T over each expert's contiguous rows (``m_grouped_fp8_gemm_nt_contiguous``)
    on operands from quantize_rows (x [T, K]) and quantize_blocks (W [E, N, K]); every count a multiple of
    128. Returns (call, out): the call runs the GEMM alone; the scale layout DeepGEMM wants and each row's
    expert index are made here, once."""
    import torch

    T, K = xq.shape
    E, N = wq.shape[0], wq.shape[1]
    m_indices = torch.repeat_interleave(torch.arange(E, device=xq.device, dtype=torch.int32),
                                        torch.tensor(counts, device=xq.device)).to(torch.int32).contiguous()
    if hasattr(dg, "transform_sf_into_required_layout"):
        sx = dg.transform_sf_into_required_layout(sf=sx, mn=T, k=K, recipe=(1, 128, 128), is_sfa=True)
    else:
        sx = dg.get_mn_major_tma_aligned_tensor(sx)
    out = torch.empty(T, N, device=xq.device, dtype=torch.bfloat16)
    gemm = getattr(dg, "m_grouped_fp8_gemm_nt_contiguous", None) or dg.m_grouped_fp8_fp4_gemm_nt_contiguous
    return (lambda: gemm((xq, sx), (wq, sw), out, m_indices)), out


def k_major(q, counts, device_counts=None):
    """q [T, C] token-major (FP8, each group's rows a multiple of 128, groups of ``counts`` rows one after
    another) -> each group's rows transposed, [C, k_e], one group after another, flat: the K-major operand
    of the k-grouped GEMM on SM90. Two copies: every 128-token tile transposed ([128, C] -> [C, 128]),
    then the 128-byte chunks in their places: chunk b (of n) of group e's column c goes to chunk
    first_e * C + c * n + b. ``device_counts``: the counts already on q's device (else copied there: a
    host-to-device copy from pageable memory, which waits for the stream)."""
    import torch

    T, C = q.shape
    nt, dev = T // 128, q.device
    if device_counts is None:
        device_counts = torch.tensor(counts, device=dev)
    per_group = device_counts.to(torch.int64) // 128
    first = torch.cumsum(per_group, 0) - per_group
    group = torch.repeat_interleave(torch.arange(len(counts), device=dev), per_group, output_size=nt)
    first, n = first[group], per_group[group]
    b = torch.arange(nt, device=dev) - first
    dest = (first * C + b).unsqueeze(1) + torch.arange(C, device=dev).unsqueeze(0) * n.unsqueeze(1)
    tiles = q.view(torch.uint8).view(nt, 128, C).transpose(1, 2).contiguous()
    out = torch.empty(nt * C, 128, dtype=torch.uint8, device=dev)
    out.index_copy_(0, dest.view(-1), tiles.view(nt * C, 128))
    return out.view(q.dtype).view(-1)


def wgrad(dg, aq, sa, bq, sb, counts):
    """d[e] [M, N] fp32 += a_e^T b_e over each expert's tokens (``k_grouped_fp8_gemm_nt_contiguous``,
    accumulating in place) on operands from quantize_cols (a [T, M], b [T, N]); every count a multiple of
    128. Returns (call, d): the call runs the GEMM alone; the per-expert transposes of DeepGEMM's K-major
    layout (``k_major``) and its scale layout are made here, once."""
    import torch

    M, N, E, dev = aq.shape[1], bq.shape[1], len(counts), aq.device
    a_flat, b_flat = k_major(aq, counts), k_major(bq, counts)
    sa_t, sb_t = sa.t(), sb.t()  # [M, T/128], [N, T/128]: MN-major
    if hasattr(dg, "get_mn_major_tma_aligned_tensor"):
        sa_t, sb_t = dg.get_mn_major_tma_aligned_tensor(sa_t), dg.get_mn_major_tma_aligned_tensor(sb_t)
    ks, ks_t = list(counts), torch.tensor(counts, device=dev, dtype=torch.int32)
    d = torch.zeros(E, M, N, device=dev, dtype=torch.float32)
    return (lambda: dg.k_grouped_fp8_gemm_nt_contiguous((a_flat, sa_t), (b_flat, sb_t), d, ks, ks_t, d)), d


def fprop_from_bf16(dg, x, w, counts):
    """fprop on bf16 operands as DeepGEMM's users prepare them: x [sum(counts), K] with each group's rows padded to
    ALIGN (pad_groups) in 1x128 blocks, W [E, N, K] in 128x128 blocks (one expert at a time: a stack's fp32 copy
    would not fit beside the largest problems). Returns fprop's (call, out); out has the padded rows."""
    import torch

    xp, padded = pad_groups(x, counts)
    xq, sx = quantize_rows(xp)
    E, N, K = w.shape
    wq = torch.empty(E, N, K, device=w.device, dtype=torch.float8_e4m3fn)
    sw = torch.empty(E, -(-N // 128), K // 128, device=w.device)
    for e in range(E):
        wq[e], sw[e] = quantize_blocks(w[e])
    return fprop(dg, xq, sx, wq, sw, padded)


def wgrad_from_bf16(dg, a, b, counts):
    """wgrad on bf16 operands as DeepGEMM's users prepare them: a [sum(counts), M] and b [sum(counts), N] with each
    group's tokens padded to ALIGN (pad_groups), in 128x1 blocks along the tokens. Returns wgrad's (call, d)."""
    ap, padded = pad_groups(a, counts)
    bp, _ = pad_groups(b, counts)
    aq, sa = quantize_cols(ap)
    bq, sb = quantize_cols(bp)
    return wgrad(dg, aq, sa, bq, sb, padded)


# ------------------------------------------------------------------------------------ the timing run
def _rel_err(out, ref) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30))


def _checked_experts(counts) -> list:
    E = len(counts)
    return [e for e in sorted({0, E // 3, (2 * E) // 3, E - 1}) if counts[e] > 0]


def time_gemm(dg, gemm: str, E: int, H: int, F: int, counts: list, iters: int, warmup: int, check: bool,
              seed: int) -> dict:
    """One GEMM of the expert MLP on random operands with these splits: the first call's time (the JIT
    compile), the relative error of a few experts against the dequantized operands' product, and the
    median time of ``iters`` calls (bench/suite/measure.py's time_op)."""
    import torch

    from bench.suite.measure import time_op

    kind, dims = GEMMS[gemm][0], GEMMS[gemm][1](H, F)
    T, dev = sum(counts), "cuda"
    torch.manual_seed(seed)
    starts = [sum(counts[:e]) for e in range(E + 1)]
    if kind == "fprop":
        K, N = dims["K"], dims["N"]
        xq, sx = quantize_rows(torch.randn(T, K, device=dev, dtype=torch.bfloat16))
        wq = torch.empty(E, N, K, device=dev, dtype=torch.float8_e4m3fn)
        sw = torch.empty(E, -(-N // 128), K // 128, device=dev, dtype=torch.float32)
        for e in range(E):
            wq[e], sw[e] = quantize_blocks(torch.randn(N, K, device=dev, dtype=torch.bfloat16))
        call, out = fprop(dg, xq, sx, wq, sw, counts)
        flops = 2.0 * T * N * K

        def error(e):
            x = xq[starts[e]:starts[e + 1]].float() * sx[starts[e]:starts[e + 1]].repeat_interleave(128, dim=1)
            w = wq[e].float() * sw[e].repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)
            return _rel_err(out[starts[e]:starts[e + 1]].float(), x @ w.t())
    else:
        M, N = dims["M"], dims["N"]
        aq, sa = quantize_cols(torch.randn(T, M, device=dev, dtype=torch.bfloat16))
        bq, sb = quantize_cols(torch.randn(T, N, device=dev, dtype=torch.bfloat16))
        call, out = wgrad(dg, aq, sa, bq, sb, counts)
        flops = 2.0 * T * M * N

        def error(e):
            s0, s1 = starts[e], starts[e + 1]
            a = aq[s0:s1].float() * sa[s0 // 128:s1 // 128].repeat_interleave(128, dim=0)
            b = bq[s0:s1].float() * sb[s0 // 128:s1 // 128].repeat_interleave(128, dim=0)
            return _rel_err(out[e], a.t() @ b)
    torch.cuda.synchronize()
    t0 = time.time()
    call()  # compiles the kernel
    torch.cuda.synchronize()
    rec = {"first_call_s": round(time.time() - t0, 2), "flops": flops}
    if check:
        if kind == "wgrad":  # one accumulation into zeros
            out.zero_()
            call()
        rec["rel_err"] = max((error(e) for e in _checked_experts(counts)), default=None)
    rec.update(time_op(call, 0.0, iters, iters, warmup))
    rec["tflops"] = flops / rec["ms"] / 1e9
    return rec


def _counts_text(counts: list) -> str:
    """[2048x8, 1920] for runs of equal counts."""
    runs, i = [], 0
    while i < len(counts):
        j = i
        while j < len(counts) and counts[j] == counts[i]:
            j += 1
        runs.append(f"{counts[i]}x{j - i}" if j - i > 1 else str(counts[i]))
        i = j
    return "[" + ", ".join(runs) + "]"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", action="store_true", help="build DeepGEMM from --src into --root first")
    ap.add_argument("--src", default=str(DEFAULT_SRC), help="DeepGEMM source tree (default: .peers/DeepGEMM)")
    ap.add_argument("--root", default=str(DEFAULT_ROOT), help=f"build and JIT-cache folder (default: {DEFAULT_ROOT})")
    ap.add_argument("--shapes", default=None, help="comma-separated substrings of the model shapes (default: all)")
    ap.add_argument("--gemms", default=None, help=f"comma-separated subset of {','.join(GEMMS)}")
    ap.add_argument("--splits", default="balanced", choices=("balanced", "zipf"),
                    help="tokens per expert (moegemm's balanced or Zipf splits), rounded to multiples of 128")
    ap.add_argument("--iters", type=int, default=50, help="timed calls per GEMM (median)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--no-check", action="store_true", help="skip the comparison with the dequantized product")
    ap.add_argument("--json", default=None, help="write the splits and results here (rewritten after every GEMM)")
    args = ap.parse_args(argv)
    require_cuda_gpu(PROG, hopper=True)
    require_cuda_toolkit(PROG)
    import torch
    from bench.workloads import SHAPES, SMALL_EXPERTS, zipf_splits

    root = Path(args.root)
    try:
        package = build(args.src, root) if args.build else _built_package(root / "src")
        if package is None:
            raise RuntimeError(f"no DeepGEMM build under {root} (run with --build)")
        dg = load(package, root)
    except RuntimeError as exc:
        raise SystemExit(f"{PROG}: {exc}")
    shapes = {n: s for n, s in {**SHAPES, **SMALL_EXPERTS}.items()
              if not args.shapes or any(k.strip().lower() in n.lower() for k in args.shapes.split(","))}
    gemms = [g for g in GEMMS if not args.gemms or g in args.gemms.split(",")]
    doc = {"meta": {"peer": "DeepGEMM", "version": getattr(dg, "__version__", None), "package": str(package),
                    "device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
                    "argv": sys.argv[1:], "date": time.strftime("%Y-%m-%d %H:%M:%S")},
           "splits": {}, "results": []}

    def save():
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(doc, indent=1))

    torch.backends.cuda.matmul.allow_tf32 = False
    for i, (name, (E, H, F, T)) in enumerate(shapes.items()):
        counts = aligned_splits(E, T, zipf_splits(E, T) if args.splits == "zipf" else None)
        doc["splits"][name] = {"E": E, "hidden": H, "ffn": F, "tokens_per_expert": counts}
        print(f"{name}: E={E} hidden={H} ffn={F}, {sum(counts)} tokens {_counts_text(counts)}", flush=True)
        for j, gemm in enumerate(gemms):
            rec = {"shape": name, "gemm": gemm, "E": E, "T": sum(counts), **GEMMS[gemm][1](H, F)}
            try:
                rec.update(time_gemm(dg, gemm, E, H, F, counts, args.iters, args.warmup, not args.no_check,
                                     seed=1000 + 10 * i + j))
                err = rec.get("rel_err")
                print(f"  {gemm:9s} {rec['ms']:8.3f} ms {rec['tflops']:7.0f} TFLOP/s  rel err "
                      f"{'n/a' if err is None else f'{err:.1e}'}  first call {rec['first_call_s']:.1f} s", flush=True)
            except Exception as exc:  # noqa: BLE001 - recorded; the next GEMM may still run
                rec["error"] = f"{type(exc).__name__}: {exc}"[:1000]
                print(f"  {gemm:9s} failed: {rec['error']}", flush=True)
            doc["results"].append(rec)
            save()
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            except Exception as exc:  # noqa: BLE001 - a sticky CUDA error: no kernel can run in this process
                raise SystemExit(f"{PROG}: the CUDA context is unusable after {name} {gemm} ({exc})")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
