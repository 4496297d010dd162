"""The just-in-time build's cache under many processes and faults (``moegemm/_build.py``).

On the CPU, with torch's ``load`` replaced by ``fake_load`` (torch's own lock file in the build folder, a
"build" that writes the .so when it is missing and may sleep, hang or leave a running child behind):
starts at once build once and the others wait and say for whom; a build killed with SIGKILL (its lock
file left behind, a compiler it started still running) does not block the next start, which waits for
that compiler to end and then builds; a truncated, unrecorded or foreign .so is never reused; a file
system without ``flock`` falls back to torch's lock; a prebuilt extension that does not load says why.

On a Hopper GPU, with real builds (``test_build_*``, about 3 minutes together with 16 cores): eight
processes start at once on an empty cache and one of them builds; a build killed part-way is followed
by a start that finishes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.utils.cpp_extension

from moegemm import _build

from conftest import requires_cuda

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent


# ----------------------------------------------------------------------------------------- the fake build
def _note(what: str) -> None:
    """One line ``<what> <pid> <time>`` in the file named by $FAKE_LOG (shared by all processes)."""
    log = os.environ.get("FAKE_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{what} {os.getpid()} {time.time():.3f}\n")


def _lines(log: Path, what: str) -> list:
    return [line.split() for line in log.read_text().splitlines() if line.split()[0] == what] if log.exists() else []


def fake_load(name, sources, build_directory, verbose=False, **kwargs):
    """``torch.utils.cpp_extension.load`` as the cache sees it. Like torch: the first to create the lock
    file ``<build_directory>/lock`` runs the build and removes it, anyone else waits until it is gone (here
    at most $FAKE_WAIT_S, then raises: torch would wait forever). The build writes the .so when it is
    missing. $FAKE_READY=n: it first waits until n processes noted "ready"; $FAKE_BUILD_S: it takes that
    long; $FAKE_HANG (a path): it starts a child in the build folder that runs until that file exists (a
    compiler at work; at most a minute), then never ends."""
    from torch.utils.file_baton import FileBaton

    so = os.path.join(build_directory, name + ".so")
    baton = FileBaton(os.path.join(build_directory, "lock"))
    if baton.try_acquire():
        try:
            if not os.path.isfile(so):
                _fake_build(so, build_directory)
        finally:
            baton.release()
    else:
        deadline = time.monotonic() + float(os.environ.get("FAKE_WAIT_S", "20"))
        while os.path.exists(baton.lock_file_path):
            if time.monotonic() > deadline:
                raise RuntimeError("hung on torch's build lock")
            time.sleep(0.05)
    _note("loaded")
    return so


def _fake_build(so: str, build_directory: str) -> None:
    marker = os.path.join(build_directory, "building")
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        _note("overlap")
    _note("build")
    log, ready = os.environ.get("FAKE_LOG"), int(os.environ.get("FAKE_READY", "0"))
    deadline = time.monotonic() + 60
    while ready and len(_lines(Path(log), "ready")) < ready and time.monotonic() < deadline:
        time.sleep(0.05)
    if os.environ.get("FAKE_HANG"):
        subprocess.Popen(["sh", "-c", 'for i in $(seq 600); do [ -e "$FAKE_HANG" ] && exit 0; sleep 0.1; done'],
                         cwd=build_directory, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
        _note("hanging")
        while True:
            time.sleep(1)
    time.sleep(float(os.environ.get("FAKE_BUILD_S", "0")))
    print("[1/2] c++ -c binding.cpp -o binding.o", flush=True)  # ninja's lines, for the progress display
    with open(so, "wb") as f:
        f.write(b"\x7fELF" + os.urandom(4096))
    print(f"[2/2] c++ binding.o -shared -o {os.path.basename(so)}", flush=True)
    os.remove(marker)


def fake_load_library(path: str) -> str:
    """``_build.load_library`` for the fake .so: notes "checked" (a load of a checked .so, no build step)."""
    assert Path(path).read_bytes().startswith(b"\x7fELF")
    _note("checked")
    return path


CHILD = f"""
import sys
sys.path[:0] = [{str(ROOT)!r}, {str(TESTS)!r}]
import torch.utils.cpp_extension
from moegemm import _build
import test_build_cache as t
torch.utils.cpp_extension.load = t.fake_load
_build.load_library = t.fake_load_library
_build.include_dirs = lambda: []
t._note("ready")
print("ready:", _build.jit_build_and_load())
"""


def _spawn(tmp_path: Path, **env):
    full = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"), FAKE_LOG=str(tmp_path / "log"), MAX_JOBS="2",
                **{k: str(v) for k, v in env.items()})
    return subprocess.Popen([sys.executable, "-c", CHILD], cwd=ROOT, env=full, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty extensions root, ``fake_load`` in place of torch's ``load``; the build folder's path."""
    for var, value in (("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext")), ("FAKE_LOG", str(tmp_path / "log")),
                       ("MAX_JOBS", "2"), ("TORCH_CUDA_ARCH_LIST", "9.0a"), ("NINJA_STATUS", "[%f/%t] ")):
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", fake_load)
    monkeypatch.setattr(_build, "load_library", fake_load_library)
    monkeypatch.setattr(_build, "include_dirs", lambda: [])
    return Path(_build.build_directory())


def _builds(tmp_path: Path) -> int:
    return len(_lines(tmp_path / "log", "build"))


# ----------------------------------------------------------------------------------------- CPU: many starts
def test_starts_at_once_build_once(tmp_path):
    """Three processes start together on an empty cache: one builds (while the others are already
    waiting), the others say whom they wait for, then load the same .so; no two builds overlap."""
    n = 3
    procs = [_spawn(tmp_path, FAKE_READY=n, FAKE_BUILD_S=1.5) for _ in range(n)]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    builders = _lines(tmp_path / "log", "build")
    assert len(builders) == 1 and not _lines(tmp_path / "log", "overlap")
    builder = int(builders[0][1])
    waited = [err for p, (_, err) in zip(procs, outs) if p.pid != builder]
    assert all(f"moegemm: waiting for pid {builder} on " in err for err in waited), waited
    assert sum("moegemm: building the CUDA extension" in err for _, err in outs) == 1
    assert len(_lines(tmp_path / "log", "checked")) == n - 1  # what the builder built, checked and loaded
    assert len({out.split("ready:")[1].strip() for out, _ in outs}) == 1
    build_dir = tmp_path / "ext" / _build.NAME
    assert not (build_dir / "lock").exists() and _build.read_manifest(str(build_dir)) is not None


def test_killed_build_does_not_block_the_next_start(tmp_path):
    """A build killed with SIGKILL leaves torch's lock file and a compiler still running in the folder
    (only the Python process was killed). The next start waits for that compiler, removes the lock file,
    builds and loads, in bounded time (torch's own lock would make it wait forever)."""
    compiler_done = tmp_path / "compiler-done"
    first = _spawn(tmp_path, FAKE_HANG=compiler_done)
    deadline = time.monotonic() + 120
    while not _lines(tmp_path / "log", "hanging"):
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.communicate()
    build_dir = tmp_path / "ext" / _build.NAME
    assert (build_dir / "lock").exists() and not (build_dir / f"{_build.NAME}.so").exists()
    start = time.monotonic()
    second = _spawn(tmp_path)
    # its first line of its own (torch may warn first, e.g. "No CUDA runtime is found" on a machine without
    # a GPU): it waits for the compiler, which ends when told
    first_line = ""
    for _ in range(20):
        first_line = second.stderr.readline()
        if first_line.startswith("moegemm:") or not first_line:
            break
    assert first_line.startswith("moegemm: waiting for ") and "process(es) of an interrupted build" in first_line, \
        first_line
    assert not _lines(tmp_path / "log", "loaded")
    compiler_done.write_text("")
    out, err = second.communicate(timeout=120)
    assert second.returncode == 0, err
    assert "moegemm: removed the lock file of an interrupted build" in err, err
    assert _builds(tmp_path) == 2 and (build_dir / f"{_build.NAME}.so").exists()  # the killed one's and this
    assert time.monotonic() - start < 60


# ----------------------------------------------------------------------------------------- CPU: one process
def test_lock_records_its_holder(cache):
    with _build.build_lock(str(cache)) as held:
        assert held
        text = Path(_build.lock_path(str(cache))).read_text()
        assert text.startswith(f"pid {os.getpid()} on ")
    assert Path(_build.lock_path(str(cache))).read_text() == ""
    assert Path(_build.lock_path(str(cache))).parent == cache.parent  # beside the folder a rebuild empties


def test_loads_share_the_lock_builds_do_not(cache):
    """Loading a checked .so takes the lock shared (any number at once); building takes it alone."""
    import fcntl

    with _build.build_lock(str(cache), shared=True) as first:
        with _build.build_lock(str(cache), shared=True) as second:
            assert first and second
        fd = os.open(_build.lock_path(str(cache)), os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)


def test_stale_torch_lock_is_removed(cache, tmp_path, capsys):
    (cache / "lock").write_text("")
    _build.jit_build_and_load()
    assert not (cache / "lock").exists() and _builds(tmp_path) == 1
    assert "removed the lock file of an interrupted build" in capsys.readouterr().err


def test_valid_cache_is_reused(cache, tmp_path, capsys):
    path = _build.jit_build_and_load()
    manifest = _build.read_manifest(str(cache))
    assert manifest["sha256"] == _build.file_sha256(path) and manifest["size"] == os.path.getsize(path)
    assert manifest["toolchain"]["torch"] == torch.__version__ and manifest["toolchain"]["cuda"] == torch.version.cuda
    capsys.readouterr()
    assert _build.jit_build_and_load() == path
    assert _builds(tmp_path) == 1 and _build.read_manifest(str(cache)) == manifest
    assert len(_lines(tmp_path / "log", "loaded")) == 1  # torch's load ran once, for the build
    assert len(_lines(tmp_path / "log", "checked")) == 1  # then the checked .so was loaded as it is
    assert capsys.readouterr().err == ""  # nothing to say


def _cached_so(cache: Path) -> Path:
    _build.jit_build_and_load()
    (cache / "kernel.cuda.o").write_bytes(b"object")  # an object file of the build
    return cache / f"{_build.NAME}.so"


def _tamper_manifest(cache: Path, change) -> None:
    path = cache / _build.MANIFEST
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("fault", ["truncated", "changed", "no manifest", "bad manifest", "other sources"])
def test_damaged_so_is_relinked_never_loaded(cache, tmp_path, capsys, fault):
    """The .so is removed (objects kept: ninja relinks), never handed to the loader."""
    so = _cached_so(cache)
    good = so.read_bytes()
    if fault == "truncated":
        so.write_bytes(good[: len(good) // 2])
    elif fault == "changed":
        so.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    elif fault == "no manifest":
        (cache / _build.MANIFEST).unlink()
    elif fault == "bad manifest":
        (cache / _build.MANIFEST).write_text("{ not json")
    else:
        _tamper_manifest(cache, lambda m: m.update(sources="0" * 64))
    capsys.readouterr()
    _build.jit_build_and_load()
    err = capsys.readouterr().err
    assert "not reusing the cached extension" in err and "building the CUDA extension" in err
    assert _builds(tmp_path) == 2 and (cache / "kernel.cuda.o").exists()
    assert _build.check_cached(str(cache), {"toolchain": _build.toolchain(),
                                            "sources": _build.read_manifest(str(cache))["sources"]}) is None


@pytest.mark.parametrize("key", ["torch", "cuda", "python", "nvcc"])
def test_foreign_toolchain_empties_the_folder(cache, tmp_path, capsys, key):
    """Built by another torch, CUDA, Python or nvcc: objects included, nothing is reused."""
    _cached_so(cache)
    _tamper_manifest(cache, lambda m: m["toolchain"].update({key: "other"}))
    capsys.readouterr()
    _build.jit_build_and_load()
    err = capsys.readouterr().err
    assert "built by another toolchain" in err and f"{key} other ->" in err
    assert _builds(tmp_path) == 2 and not (cache / "kernel.cuda.o").exists()


def test_missing_so_is_built_and_its_old_manifest_dropped(cache, tmp_path):
    so = _cached_so(cache)
    so.unlink()
    _build.jit_build_and_load()
    assert _builds(tmp_path) == 2 and _build.read_manifest(str(cache))["sha256"] == _build.file_sha256(str(so))


def test_without_flock_falls_back_to_torch_lock(cache, tmp_path, capsys, monkeypatch):
    """A file system without locks: a warning, and torch's lock file is left alone (it may be a live
    build's)."""
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    monkeypatch.setenv("FAKE_WAIT_S", "0.5")
    (cache / "lock").write_text("")
    with pytest.raises(RuntimeError, match="hung on torch's build lock"):
        _build.jit_build_and_load()
    assert "cannot lock" in capsys.readouterr().err and (cache / "lock").exists()
    (cache / "lock").unlink()
    _build.jit_build_and_load()
    assert _builds(tmp_path) == 1


def test_empty_folder_refuses_other_folders(tmp_path):
    (tmp_path / "keep").write_text("")
    with pytest.raises(RuntimeError, match="refusing"):
        _build.empty_folder(str(tmp_path))
    assert (tmp_path / "keep").exists()


def test_prebuilt_that_does_not_load_says_why(tmp_path):
    bad = tmp_path / "_C.cpython-311-x86_64-linux-gnu.so"
    bad.write_bytes(b"\x7fELF" + b"\0" * 16)  # truncated
    with pytest.raises(RuntimeError, match="prebuilt extension .* does not load") as err:
        _build.load_prebuilt(bad)
    assert str(bad) in str(err.value) and "delete it" in str(err.value)


# ----------------------------------------------------------------------------------------- GPU: real builds
LOAD = "import moegemm._build as b; print('ready:', b.load_extension())"
jit_only = pytest.mark.skipif(_build.prebuilt_extension() is not None,
                              reason="a prebuilt extension (setup.py) is loaded instead of the just-in-time cache")


def _real_env(tmp_path: Path) -> dict:
    """A fresh extensions root; every process may use the whole machine (one of them builds)."""
    return dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"), MAX_JOBS=str(_build.default_jobs()),
                PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))


@requires_cuda
@jit_only
def test_build_eight_ranks_build_once(tmp_path):
    """As ``torchrun --nproc_per_node 8`` on an empty cache: eight processes load the extension at once;
    one builds (about a minute with 16 cores), the others wait for it and load what it built."""
    env = _real_env(tmp_path)
    procs = [subprocess.Popen([sys.executable, "-c", LOAD], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(8)]
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and "ready:" in out, err[-3000:]
    errs = [err for _, err in outs]
    assert sum("moegemm: building the CUDA extension" in e for e in errs) == 1, errs
    assert sum("moegemm: extension built in" in e for e in errs) == 1, errs
    assert sum("moegemm: waiting for pid" in e for e in errs) >= 1, errs
    assert len({out.split("ready:")[1].strip() for out, _ in outs}) == 1
    build_dir = tmp_path / "ext" / _build.NAME
    assert not (build_dir / "lock").exists() and sorted(p.name for p in build_dir.glob("*.so")) == [f"{_build.NAME}.so"]
    manifest = _build.read_manifest(str(build_dir))
    assert manifest["sha256"] == _build.file_sha256(str(build_dir / f"{_build.NAME}.so"))


@requires_cuda
@jit_only
def test_build_killed_then_next_start_finishes(tmp_path):
    """A build killed with SIGKILL (its whole process group, as a preempted node or Ctrl-C) once its first
    object file is written; the next start removes the lock file torch left behind, finishes the build
    and loads it, well within the bound."""
    env = _real_env(tmp_path)
    build_dir = tmp_path / "ext" / _build.NAME
    first = subprocess.Popen([sys.executable, "-c", LOAD], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 600
    while not list(build_dir.glob("*.o")):
        assert first.poll() is None, "the build ended before it could be killed"
        assert time.monotonic() < deadline, "no object file after 600 s"
        time.sleep(0.2)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    assert (build_dir / "lock").exists(), "the killed build left no lock file: nothing was tested"
    start = time.monotonic()
    second = subprocess.run([sys.executable, "-c", LOAD], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert second.returncode == 0 and "ready:" in second.stdout, second.stderr[-3000:]
    assert "moegemm: removed the lock file of an interrupted build" in second.stderr
    assert time.monotonic() - start < 600
