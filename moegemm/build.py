"""Prebuild the CUDA extension: ``python -m moegemm.build``.
``python -m moegemm.build --check`` only compiles every csrc/ translation unit (no GPU needed; CI)."""

import argparse
import sys

from ._build import compile_check, load_extension

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true", help="compile-only check of every csrc/ translation unit")
    ap.add_argument("--jobs", type=int, default=2, help="parallel compiler processes for --check (~4 GB each)")
    args = ap.parse_args()
    if args.check:
        sys.exit(1 if compile_check(args.jobs) else 0)
    load_extension()
