"""Prebuild the CUDA extension into the just-in-time cache: ``python -m moegemm.build`` (on a GPU
machine; ``pip install --no-build-isolation .`` builds it into the package instead).

Without a CUDA build of torch, the CUDA toolkit or a GPU it stops at once and says which is missing (one
line, exit status 1); so does ``--check`` without nvcc, the CUDA toolkit's headers, CUTLASS's or torch's.

``python -m moegemm.build --check`` only compiles every csrc/ translation unit (no GPU needed; CI):
the kernels with nvcc for sm_90a, the binding against torch's headers in the C++ standard they
demand. ``--torch-include DIR`` checks the binding against another torch's headers (``torch/include``
unpacked from a wheel) and ``--binding-only`` skips the kernels, which include no torch header."""

import argparse
import sys

from ._build import (BuildEnvironmentError, compile_check, load_extension, prebuilt_extension,
                     require_build_environment)

if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m moegemm.build", description=__doc__.replace("``", ""),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compile-only check of every csrc/ translation unit")
    ap.add_argument("--jobs", type=int, default=2, help="parallel compiler processes for --check (~4 GB each)")
    ap.add_argument("--torch-include", metavar="DIR", help="--check: a torch/include folder (default: installed torch's)")
    ap.add_argument("--binding-only", action="store_true", help="--check: only the binding (the TU with torch headers)")
    args = ap.parse_args()
    if args.check:
        try:
            failures = compile_check(args.jobs, args.torch_include, args.binding_only)
        except BuildEnvironmentError as e:
            sys.exit(str(e))
        sys.exit(1 if failures else 0)
    try:
        require_build_environment(toolkit=prebuilt_extension() is None)  # a prebuilt one needs no toolkit
        path = load_extension()
    except BuildEnvironmentError as e:
        sys.exit(str(e))
    print(f"moegemm: extension ready: {path}")
