"""The benchmark suite: moegemm next to its peers, side by side in one process (``python -m bench.suite``),
and the tools that look inside one of its measurements (``profile_mlp``, ``host_breakdown``)."""
