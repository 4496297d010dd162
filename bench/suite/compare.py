"""Did a change cost anything? Two builds on the suite, point by point.

    python -m bench.suite.compare --base A1/results.json A2/results.json --head B1/results.json B2/results.json

Each file is the results.json of a `python -m bench.suite` run, every run with the same options, the two
builds' runs taken in turns on one machine (gpu_run.sh's COMPARE_BASE does that). Per point (section, shape,
splits, variant; training steps per GA) each build's best time over its runs, and head over base; per section
and variant the geometric mean of those ratios; then the points more than --flag % slower, each with the spread
of each build's own runs (max over min): a point whose runs of one build differ by more than the change says
nothing about it. Points that either build lacks, or that failed in one, are left out and counted.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict

PROG = "python -m bench.suite.compare"


def points(result: dict) -> dict:
    """{(section, shape, splits, variant): ms} of one results.json: the fc1 and MLP records and the training
    steps (section "train GA=<ga>"), those that ran."""
    out = {}
    for r in result.get("records", []):
        if r.get("status") == "ok" and r.get("ms"):
            out[(r["section"], r["shape"], r["splits"], r["variant"])] = float(r["ms"])
    for r in result.get("train", []):
        if r.get("status") == "ok" and r.get("ms"):
            out[(f"train GA={r['ga']}", r["shape"], r["splits"], r["variant"])] = float(r["ms"])
    return out


def best_of(runs: list) -> tuple:
    """({point: best ms}, {point: max / min over the runs}) over the points every run has."""
    keys = set.intersection(*(set(r) for r in runs)) if runs else set()
    best = {k: min(r[k] for r in runs) for k in keys}
    spread = {k: max(r[k] for r in runs) / min(r[k] for r in runs) for k in keys}
    return best, spread


def compare(base_runs: list, head_runs: list, flag_pct: float) -> dict:
    base, base_spread = best_of(base_runs)
    head, head_spread = best_of(head_runs)
    common = sorted(set(base) & set(head))
    ratios = {k: head[k] / base[k] for k in common}
    groups = defaultdict(list)
    for (section, _, _, variant), ratio in ratios.items():
        groups[(section, variant)].append(ratio)
    geomeans = {g: math.exp(sum(math.log(r) for r in rs) / len(rs)) for g, rs in sorted(groups.items())}
    slower = [(k, ratios[k], base_spread[k], head_spread[k]) for k in common if ratios[k] > 1 + flag_pct / 100]
    slower.sort(key=lambda row: -row[1])
    return {"ratios": ratios, "geomeans": geomeans, "group_sizes": {g: len(rs) for g, rs in groups.items()},
            "slower": slower, "left_out": len(set(base) ^ set(head))}


def markdown(c: dict, flag_pct: float, runs: tuple) -> str:
    lines = [f"Head over base, best of {runs[0]} base and {runs[1]} head runs per point (time ratio: below 1 is faster).", "",
             "| section | variant | points | geometric mean |", "|---|---|---:|---:|"]
    for (section, variant), g in c["geomeans"].items():
        lines.append(f"| {section} | {variant} | {c['group_sizes'][(section, variant)]} | {g:.3f} |")
    lines += ["", f"{len(c['ratios'])} points compared, {c['left_out']} in one build only; "
                  f"{len(c['slower'])} more than {flag_pct:g} % slower:", ""]
    if c["slower"]:
        lines += ["| section | shape | splits | variant | head / base | base runs' spread | head runs' spread |",
                  "|---|---|---|---|---:|---:|---:|"]
        for (section, shape, splits, variant), ratio, bs, hs in c["slower"]:
            lines.append(f"| {section} | {shape} | {splits} | {variant} | {ratio:.3f} | {bs:.3f} | {hs:.3f} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", nargs="+", required=True, help="results.json of the base build's runs")
    ap.add_argument("--head", nargs="+", required=True, help="results.json of the head build's runs")
    ap.add_argument("--flag", type=float, default=1.0, help="list the points more than this many percent slower (default 1)")
    ap.add_argument("--md", default=None, help="also write the tables to this markdown file")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)

    def load(paths):
        runs = []
        for path in paths:
            with open(path) as f:
                runs.append(points(json.load(f)))
        return runs

    c = compare(load(args.base), load(args.head), args.flag)
    text = markdown(c, args.flag, (len(args.base), len(args.head)))
    sys.stdout.write(text)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)
    return 0 if c["ratios"] else 1


if __name__ == "__main__":
    sys.exit(main())
