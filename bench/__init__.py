"""moegemm's benchmarks and investigation tools (bench/README.md says which is which). Every script runs
as a module from the repository root, e.g. ``python -m bench.suite --quick``."""
