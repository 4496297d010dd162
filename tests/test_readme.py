"""README.md as a user meets it: every ```python snippet runs as written, the two shell commands keep the
form CI (.ci/run) extracts them in, and the links into docs/design.md point at headings that exist.

The snippets run in order in one fresh interpreter, as a reader would paste them into one prompt (the
quick start defines what the later snippets use): on the CPU (GPUs hidden, so the reference path runs),
and on a Hopper GPU where there is one (the CUDA path). Snippets that import megatron-core run on their
own, where it is installed."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import requires_cuda

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DESIGN = os.path.join(ROOT, "docs", "design.md")


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def snippets() -> list:
    return re.findall(r"^```python\n(.*?)^```", read(README), re.S | re.M)


def needs_megatron(code: str) -> bool:
    return re.search(r"^\s*(from|import) (megatron|moegemm\.megatron)\b", code, re.M) is not None


def run_python(code: str, gpu: bool) -> None:
    """``code`` in a fresh interpreter that imports this checkout's moegemm; fails with its output."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"README snippet failed:\n{code}\n--- output ---\n{proc.stdout}\n{proc.stderr}"


def test_readme_has_snippets():
    codes = snippets()
    assert codes, "README.md has no ```python snippet"
    assert "moegemm.GroupedMLP" in codes[0], "the first snippet is the quick start"


def test_snippets_run_on_cpu():
    run_python("\n".join(c for c in snippets() if not needs_megatron(c)), gpu=False)


@requires_cuda
def test_snippets_run_on_gpu():
    run_python("\n".join(c for c in snippets() if not needs_megatron(c)), gpu=True)


def test_megatron_snippets_run():
    pytest.importorskip("megatron.core")
    codes = [c for c in snippets() if needs_megatron(c)]
    assert codes, "README shows no megatron-core snippet"
    for code in codes:
        run_python(code, gpu=False)


def test_commands_in_the_form_ci_extracts():
    """.ci/run takes the first line starting with four spaces and `pip install torch` (the install) and the first
    with four spaces and `python -m pytest` (the tests), and runs them in a fresh virtual environment."""
    text = read(README)
    install = re.search(r"^    (pip install torch.*)$", text, re.M)
    tests = re.search(r"^    (python -m pytest.*)$", text, re.M)
    assert install and tests, "README lost the install or test command CI runs"
    assert "pip install ." in install.group(1) and "third_party/cutlass.txt" in install.group(1)
    assert tests.group(1).split()[-1] == "tests"
    ci = read(os.path.join(ROOT, ".ci", "run"))
    assert "'^    pip install torch'" in ci and "'^    python -m pytest'" in ci


@pytest.mark.parametrize("path", ["README.md", "bench/README.md", "docs/contributing.md"])
def test_no_stale_counts(path):
    """README, bench/README.md and the contributors' guide state no counts that drift as the project changes: no
    test tallies ("848 passed"), and the number of translation units only if it is the build's
    (``moegemm._build.sources()``)."""
    from moegemm import _build

    text = read(os.path.join(ROOT, path))
    assert not re.search(r"\d+\s+(passed|skipped|failed|tests?\b)", text), re.findall(r".*\d+\s+(?:passed|skipped).*", text)
    for n in re.findall(r"(\d+) translation units", text):
        assert int(n) == len(_build.sources()), (f"{path} says {n} translation units; the build has "
                                                 f"{len(_build.sources())}")


def test_committed_test_logs_say_what_their_index_quotes():
    """bench/results/README.md may quote a committed test log's tally (a record of that run, not of the suite
    today): each quoted count is the one on the log's summary line."""
    if not os.path.isdir(os.path.join(ROOT, "bench", "results")):
        pytest.skip("no committed results here (an sdist carries none)")
    index = read(os.path.join(ROOT, "bench", "results", "README.md"))
    rows = re.findall(r"^\| `([^`]+\.log)` \|([^|]*)\|", index, re.M)
    for name, text in rows:
        log = read(os.path.join(ROOT, "bench", "results", name)).strip().splitlines()
        summary = log[-1]
        for n, word in re.findall(r"(\d+) (passed|skipped|failed|deselected)", text):
            assert re.search(rf"\b{n} {word}\b", summary), (f"bench/results/README.md quotes {n} {word} for {name}; "
                                                             f"its summary: {summary}")


def test_skip_reasons_are_the_tests():
    """Every skip reason README's Tests section quotes is one the tests give (word for word)."""
    section = read(README).split("## Tests", 1)[1].split("\n## ", 1)[0]
    quoted = re.findall(r'"([^"]+)"', section.replace("\n", " "))
    assert len(quoted) >= 3, section
    sources = "".join(read(os.path.join(ROOT, "tests", f)) for f in sorted(os.listdir(os.path.join(ROOT, "tests")))
                      if f.endswith(".py"))
    sources = re.sub(r'"\s*\n\s*"', "", sources)  # reasons split over implicitly joined string literals
    missing = [q for q in quoted if q not in sources]
    assert not missing, f"README quotes skip reasons no test gives: {missing}"


def test_cpu_install_command():
    """Beside the default install (PyPI's CUDA torch, the line CI runs), a copyable line that installs torch's CPU
    build first and then exactly what the default line installs."""
    text = read(README)
    lines = re.findall(r"^    (pip install .*)$", text, re.M)
    default = next(line for line in lines if line.startswith("pip install torch"))
    cpu = [line for line in lines if "download.pytorch.org/whl/cpu" in line]
    assert len(cpu) == 1, "README lost its CPU install line (or has two)"
    assert lines.index(default) < lines.index(cpu[0]), "the default (GPU) install line must come first: CI runs it"
    first, rest = cpu[0].split(" && ", 1)
    assert first == "pip install --index-url https://download.pytorch.org/whl/cpu torch"
    assert rest == "pip install " + default[len("pip install torch "):], (rest, default)
    assert not re.search(r"^    pip install torch", cpu[0]), "CI would run the CPU line instead of the default one"


def anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_into_design_resolve():
    """Every link to a section of docs/design.md (``design.md#`` and the anchor), in README, docs/ or a source
    comment, and every in-page link of docs/design.md, names one of its headings."""
    anchors = {anchor(h) for h in re.findall(r"^#+ (.+)$", read(DESIGN), re.M)}
    cited = {}
    for folder, _, files in os.walk(ROOT):
        if os.sep + "." in folder or "__pycache__" in folder:
            continue
        for name in files:
            if name.endswith((".md", ".py", ".h", ".cuh", ".cu", ".cpp", ".sh")):
                path = os.path.join(folder, name)
                text = read(path)
                local = re.findall(r"\]\(#([\w-]+)\)", text) if path == DESIGN else []
                for a in re.findall(r"design\.md#([\w-]+)", text) + local:
                    cited.setdefault(a, os.path.relpath(path, ROOT))
    assert "errors" in cited  # README cites at least this one
    missing = {a: where for a, where in cited.items() if a not in anchors}
    assert not missing, f"links to sections docs/design.md does not have: {missing}"
