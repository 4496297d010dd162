"""The test suite in parallel pytest processes on one machine, so that the host time of the GPU tests (Python,
launches, compiles) overlaps: the whole GPU suite takes longer than one 600 s call on an H100 when run serially.

    python -m bench.pytest_shards --shards 3 [--log-dir DIR] [pytest arguments: files, folders, node ids, options]

Test files (a folder stands for the ``test_*.py`` files under it; node ids such as ``file::test`` stay whole) are dealt
to the shards largest first, each to the shard with the fewest bytes so far; options go to every shard. Each
shard runs ``python -m pytest -q -x`` with its own log (``pytest_shard<i>.log`` under --log-dir); its last line
is printed as it ends. The exit status is 0 when every shard passed, else that of the first shard to fail.
Tests are never timed, so sharing the GPU changes no result; a test that needs most of the GPU's memory skips
itself when another shard holds it (tests/test_adversarial_numerics.py says so in its skip reason).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path


def split_args(args: list[str]) -> tuple[list[str], list[str]]:
    """(test units, options): a folder becomes the test_*.py files under it (sorted), a file or node id stays one unit;
    anything that starts with '-' is an option, and so is the value after an option that takes one."""
    units, options = [], []
    takes_value = {"-k", "-m", "-p", "-c", "-o", "--deselect", "--ignore", "--rootdir", "--maxfail", "--tb"}
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith("-"):
            options.append(a)
            if a in takes_value and i + 1 < len(args):
                options.append(args[i + 1])
                i += 1
        elif Path(a).is_dir():
            units += [str(p) for p in sorted(Path(a).rglob("test_*.py"))]
        else:
            units.append(a)
        i += 1
    return units, options


def deal(units: list[str], shards: int) -> list[list[str]]:
    """The units over at most ``shards`` non-empty shards, largest file first to the lightest shard (a node id
    weighs as its file); each shard keeps the units' given order."""
    def size(unit: str) -> int:
        path = Path(unit.split("::")[0])
        return path.stat().st_size if path.is_file() else 0

    n = max(1, min(shards, len(units)))
    load, chosen = [0] * n, [[] for _ in range(n)]
    for unit in sorted(units, key=size, reverse=True):
        i = load.index(min(load))
        chosen[i].append(unit)
        load[i] += size(unit)
    order = {u: k for k, u in enumerate(units)}
    return [sorted(c, key=order.__getitem__) for c in chosen]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 usage="python -m bench.pytest_shards --shards N [--log-dir DIR] [pytest args]")
    ap.add_argument("--shards", type=int, default=3, help="parallel pytest processes (default 3)")
    ap.add_argument("--log-dir", default=".", help="where pytest_shard<i>.log go (default: here)")
    args, rest = ap.parse_known_args(argv)
    if args.shards < 1:
        ap.error(f"--shards must be at least 1, got {args.shards}")
    units, options = split_args(rest or ["tests"])
    if not units:
        ap.error("no test files: name files, folders or node ids (default: tests)")
    missing = [u for u in units if not Path(u.split("::")[0]).exists()]
    if missing:
        ap.error(f"no such test file: {', '.join(missing)}")
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    start = time.time()
    procs = []
    for i, shard in enumerate(deal(units, args.shards)):
        log = log_dir / f"pytest_shard{i}.log"
        with open(log, "w") as f:
            f.write("files: " + " ".join(shard) + "\n")
            f.flush()
            procs.append((i, log, subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-x", *options, *shard],
                                                   stdout=f, stderr=subprocess.STDOUT)))
    status = 0
    pending = list(procs)
    while pending:
        for item in list(pending):
            i, log, p = item
            if p.poll() is None:
                continue
            pending.remove(item)
            last = log.read_text().rstrip().splitlines()[-1:] or ["(no output)"]
            print(f"shard {i} (exit {p.returncode}, {time.time() - start:.0f} s): {last[0]}", flush=True)
            if p.returncode != 0 and status == 0:
                status = p.returncode
        time.sleep(0.5)
    return status


if __name__ == "__main__":
    sys.exit(main())
