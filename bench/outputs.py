"""Where the bench commands write their results: ``--out`` when given, else outside the repository.

The rule: no bench command changes a file of the repository unless asked to with ``--out`` (the committed
results in bench/results/ are rewritten only by a command line that names them). By default each command
writes under ``$XDG_CACHE_HOME/moegemm-bench/<command>/`` (``~/.cache/moegemm-bench/<command>/``) and says
where. Torch-free (the commands import it before torch)."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def default_root() -> Path:
    """``$XDG_CACHE_HOME/moegemm-bench``, else ``~/.cache/moegemm-bench``."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "moegemm-bench"


def default_dir(command: str) -> Path:
    """The folder a command writes to without ``--out`` (``command``: its short name, e.g. ``"suite"``)."""
    return default_root() / command


def out_dir(out, command: str) -> Path:
    """The output folder: ``out`` (``--out DIR``) when given, else ``default_dir(command)``; created."""
    d = Path(out) if out else default_dir(command)
    d.mkdir(parents=True, exist_ok=True)
    return d


def out_file(out, command: str, name: str) -> Path:
    """An output file: ``out`` (``--out PATH``) when given, else ``default_dir(command) / name``; its folder created."""
    p = Path(out) if out else default_dir(command) / name
    p.parent.mkdir(parents=True, exist_ok=True)
    return p


def describe(command: str) -> str:
    """For ``--out``'s help: where the command writes without it."""
    return f"default: {default_dir(command)}, outside the repository"
