"""bench/pytest_shards.py: test files dealt over parallel pytest processes, each with its own log, the exit status
that of the first failing shard."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench import pytest_shards

REPO = Path(__file__).resolve().parents[1]


def _write(path: Path, tests: dict) -> Path:
    path.write_text("".join(f"def test_{name}():\n    assert {body}\n\n" for name, body in tests.items()))
    return path


def test_folders_expand_and_options_stay_whole(tmp_path):
    a = _write(tmp_path / "test_a.py", {"x": "True"})
    b = _write(tmp_path / "test_b.py", {"y": "True"})
    (tmp_path / "helper.py").write_text("")
    units, options = pytest_shards.split_args([str(tmp_path), "-k", "x or y", f"{a}::test_x", "--tb=short"])
    assert units == [str(a), str(b), f"{a}::test_x"]
    assert options == ["-k", "x or y", "--tb=short"]


def test_largest_files_go_to_the_lightest_shard(tmp_path):
    files = [_write(tmp_path / f"test_{i}.py", {f"t{j}": "True" for j in range(n)}) for i, n in enumerate((40, 5, 20, 18))]
    names = [str(f) for f in files]
    shards = pytest_shards.deal(names, 2)
    assert sorted(sum(shards, [])) == sorted(names)  # every file once
    assert shards == [[names[0]], [names[1], names[2], names[3]]]  # 40 alone; 20 + 18 + 5 beside it, in given order
    assert pytest_shards.deal(names[:1], 3) == [[names[0]]]  # no empty shard


def test_shards_run_in_parallel_and_a_failure_sets_the_status(tmp_path):
    good = _write(tmp_path / "test_good.py", {"one": "1 + 1 == 2"})
    bad = _write(tmp_path / "test_bad.py", {"two": "1 + 1 == 3"})
    cmd = [sys.executable, "-m", "bench.pytest_shards", "--shards", "2", "--log-dir", str(tmp_path / "logs"),
           "-p", "no:cacheprovider"]
    run = subprocess.run(cmd + [str(good), str(bad)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    logs = sorted((tmp_path / "logs").glob("pytest_shard*.log"))
    assert len(logs) == 2
    text = "".join(log.read_text() for log in logs)
    assert "1 passed" in text and "1 failed" in text
    assert run.stdout.count("shard ") == 2
    ok = subprocess.run(cmd + [str(good)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "1 passed" in ok.stdout


def test_bad_arguments_are_refused(tmp_path):
    for args, message in ((["--shards", "0"], "--shards must be at least 1"),
                          ([str(tmp_path / "test_missing.py")], "no such test file")):
        run = subprocess.run([sys.executable, "-m", "bench.pytest_shards", *args], cwd=REPO, capture_output=True,
                             text=True, timeout=60)
        assert run.returncode == 2 and message in run.stderr
