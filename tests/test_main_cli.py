"""``python -m moegemm`` as a user runs it: its usage names the command, its help has no reST markup, and a
bad ``--shape`` or ``--iters`` is an argparse error (exit status 2, one line naming the argument), never a
traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moegemm import __main__ as cli
from moegemm.layout import MAX_TOKENS

ROOT = Path(__file__).resolve().parent.parent


def _run(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-m", "moegemm", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_help_names_the_command_without_rst():
    proc = _run("--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m moegemm [-h]"), proc.stdout[:200]
    assert "``" not in proc.stdout and "__main__.py" not in proc.stdout
    assert "python -m moegemm: the first run." in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--shape", "nosuch"], "argument --shape: expected 4 arguments"),
    (["--shape", "nosuch", "1", "2", "3"], "argument --shape: invalid int value: 'nosuch'"),
    (["--shape", "0", "256", "128", "10"], "argument --shape: E (experts) must be in [1, 1024], got 0"),
    (["--shape", "2000", "256", "128", "10"], "argument --shape: E (experts) must be in [1, 1024], got 2000"),
    (["--shape", "8", "100", "128", "10"], "argument --shape: HIDDEN must be a positive multiple of 16, got 100"),
    (["--shape", "8", "256", "-16", "10"], "argument --shape: FFN must be a positive multiple of 16, got -16"),
    (["--shape", "8", "256", "128", "0"], f"argument --shape: T (routed tokens) must be in [1, {MAX_TOKENS}], got 0"),
    (["--shape", "8", "256", "128", str(MAX_TOKENS + 1)],
     f"argument --shape: T (routed tokens) must be in [1, {MAX_TOKENS}], got {MAX_TOKENS + 1}"),
    (["--iters", "0"], "argument --iters: must be at least 1, got 0"),
])
def test_bad_arguments_are_usage_errors(args, message, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(args)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == f"python -m moegemm: error: {message}", err
    assert "Traceback" not in err


def test_bad_shape_in_a_child_process():
    proc = _run("--shape", "8", "100", "128", "10")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == ("python -m moegemm: error: argument --shape: HIDDEN must be a "
                                                    "positive multiple of 16, got 100"), proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_small_shape_runs_on_the_reference(capsys, monkeypatch):
    monkeypatch.setattr(cli.torch.cuda, "is_available", lambda: False)
    assert cli.main(["--shape", "4", "32", "16", "64"]) == 0
    out = capsys.readouterr().out
    assert "E=4 hidden=32 ffn=16 T=64" in out and "moegemm: OK" in out
