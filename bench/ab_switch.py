"""The switch of the one-build A/B tools (bench.gemm.ab, bench.bandwidth.ab, bench.gemm.power's sustained form): a
kernel's launcher reads an environment variable at every launch and picks the form under test; a tool names the
variable and its values (the first the reference form), sets it before each call or capture, and may skip its bitwise
comparison."""

from __future__ import annotations

import argparse
import os


def add_switch_arguments(ap: argparse.ArgumentParser, required: bool = True, bitwise: bool = True) -> None:
    """--env, --values and (bitwise) --no-bitwise; optional together unless `required`."""
    ap.add_argument("--env", required=required, help="the environment variable the kernel's launcher reads at each launch")
    ap.add_argument("--values", required=required, help="its values, comma-separated: the first is the reference form")
    if bitwise:
        ap.add_argument("--no-bitwise", action="store_true", help="skip the bitwise comparison")


def switch_values(args: argparse.Namespace) -> list:
    """The values of --values, in order (none without them)."""
    return [v.strip() for v in (args.values or "").split(",") if v.strip()]


def switch_setter(args: argparse.Namespace):
    """use(v): the switch set to v for the launches that follow."""
    def use(v: str) -> None:
        os.environ[args.env] = v
    return use
