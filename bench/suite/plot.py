"""PNG plots of a benchmark run (needs matplotlib; any machine, no GPU):

    python -m bench.suite.plot bench/results/results.json [--out DIR]   # default: ~/.cache/moegemm-bench/suite

speedup.png        speed-up over torch._grouped_mm bf16, grouped bars per model shape and variant
                   (rows: fc1 forward, MLP forward+backward; columns: the m_splits kinds measured)
host_overhead.png  host microseconds per call (GPU kept busy) against the number of experts E
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from bench.outputs import describe, out_dir
from bench.preflight import require_module

SECTIONS = {"fc1": "fc1 forward", "mlp": "MLP forward+backward"}


def _num(v):
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _speedup_plot(res, plt, path):
    recs = [r for r in res.get("records", []) if not r.get("aux") and not r.get("gemm_target")]
    splits = list(dict.fromkeys(r["splits"] for r in recs))
    secs = [s for s in SECTIONS if any(r["section"] == s for r in recs)]
    if not recs or not splits or not secs:
        return None
    shapes = list(dict.fromkeys(r["shape"] for r in recs))
    variants = list(dict.fromkeys(r["variant"] for r in recs))
    labels = {r["variant"]: r.get("label", r["variant"]) for r in recs}
    cmap = plt.get_cmap("tab10")
    colors = {v: cmap(i % 10) for i, v in enumerate(variants)}
    fig, axes = plt.subplots(len(secs), len(splits), figsize=(6.5 * len(splits), 4.2 * len(secs)), squeeze=False)
    width = 0.8 / max(1, len(variants))
    for i, sec in enumerate(secs):
        for j, sp in enumerate(splits):
            ax = axes[i][j]
            for k, v in enumerate(variants):
                xs, ys, na = [], [], []
                for s_idx, shape in enumerate(shapes):
                    r = next((x for x in recs if x["section"] == sec and x["splits"] == sp and x["shape"] == shape
                              and x["variant"] == v), None)
                    x = s_idx - 0.4 + width * (k + 0.5)
                    val = _num(r.get("speedup_vs_torch_bf16")) if r else None
                    if val is not None:
                        xs.append(x)
                        ys.append(val)
                    elif r is not None:
                        na.append(x)
                bars = ax.bar(xs, ys, width, color=colors[v])
                for b, y in zip(bars, ys):
                    ax.text(b.get_x() + b.get_width() / 2, y, f"{y:.2f}", ha="center", va="bottom", fontsize=6,
                            rotation=90)
                for x in na:
                    ax.text(x, 0.02, "n/a", ha="center", va="bottom", fontsize=6, rotation=90, color=colors[v],
                            transform=ax.get_xaxis_transform())
            ax.axhline(1.0, color="black", lw=0.8, ls="--")
            ax.set_xticks(range(len(shapes)))
            ax.set_xticklabels(shapes, fontsize=8)
            ax.set_ylabel("speed-up over torch._grouped_mm bf16")
            ax.set_title(f"{SECTIONS[sec]}, {sp} m_splits", fontsize=10)
            ax.grid(axis="y", alpha=0.3)
    from matplotlib.patches import Patch

    handles = [Patch(color=colors[v], label=labels[v]) for v in variants]
    fig.legend(handles=handles, loc="lower center", ncol=min(4, len(variants)), fontsize=8, frameon=False)
    m = res.get("meta", {})
    fig.suptitle(f"moegemm vs peers on {m.get('device', '?')} (torch {m.get('versions', {}).get('torch')}, "
                 f"commit {str(m.get('git_commit'))[:10]})", fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 0.96))
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def _host_plot(res, plt, path):
    recs = [r for r in res.get("host_sweep", []) if r.get("status") == "ok" and _num(r.get("host_us"))]
    if not recs:
        return None
    ops = [o for o in SECTIONS if any(r["op"] == o for r in recs)]
    variants = list(dict.fromkeys(r["variant"] for r in recs))
    labels = {r["variant"]: r.get("label", r["variant"]) for r in recs}
    cmap = plt.get_cmap("tab10")
    fig, axes = plt.subplots(1, len(ops), figsize=(6.5 * len(ops), 4.5), squeeze=False)
    for i, op in enumerate(ops):
        ax = axes[0][i]
        for k, v in enumerate(variants):
            pts = sorted((r["E"], r["host_us"], bool(r.get("host_gpu_went_idle"))) for r in recs
                         if r["op"] == op and r["variant"] == v)
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=cmap(k % 10), label=labels[v])
            idle = [p for p in pts if p[2]]
            if idle:
                ax.scatter([p[0] for p in idle], [p[1] for p in idle], marker="x", s=80, color="black", zorder=5)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        Es = sorted({r["E"] for r in recs})
        ax.set_xticks(Es)
        ax.set_xticklabels([str(e) for e in Es])
        ax.set_xlabel("experts E")
        ax.set_ylabel("host us per call (GPU busy)")
        ax.set_title(f"{SECTIONS[op]} (x: the call waited for the GPU)", fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    r0 = recs[0]
    fig.suptitle(f"host overhead, hidden={r0.get('hidden')}, ffn={r0.get('ffn')}, T={r0.get('T')}, "
                 f"{r0.get('splits')} splits, {res.get('meta', {}).get('device', '?')}", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def make_plots(res: dict, out_dir) -> list:
    """Write the PNGs for a results dict; returns their paths. Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [_speedup_plot(res, plt, out / "speedup.png"), _host_plot(res, plt, out / "host_overhead.png")]
    return [str(p) for p in paths if p is not None]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.suite.plot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="results.json written by python -m bench.suite")
    ap.add_argument("--out", default=None, help=f"output folder ({describe('suite')})")
    args = ap.parse_args(argv)
    require_module("python -m bench.suite.plot", "matplotlib")
    path = Path(args.results)
    with open(path) as f:
        res = json.load(f)
    for p in make_plots(res, out_dir(args.out, "suite")):
        print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
