"""Prebuild the CUDA extension: ``python -m moegemm.build``."""

from ._build import load_extension

if __name__ == "__main__":
    load_extension()
