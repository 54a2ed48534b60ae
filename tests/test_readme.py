"""Every code block of README.md and docs/*.md runs, so the docs cannot rot.

A fence's info string says what a block is and how it is checked:

- ```python: runs. The python blocks of one file tell one story (the first
  defines the mesh, the batch and the parameters the later ones use), so they
  run in order in one namespace, in a scratch directory (examples write
  checkpoints and pictures there).
- ```sh: every line runs in order, in the same kind of scratch directory
  (which links `pjit_pipe/` so that paths such as the bundled profiles
  resolve). A `pjit-pipe ...` line runs the CLI in this process (on the
  suite's 8 virtual CPU devices; a leading `NAME=value` is dropped, since the
  suite sets those flags itself) and must exit 0. A benchmark line (`python
  benchmarks/NAME.py ...` or `python -m benchmarks.NAME ...`) is checked, not
  run (benchmarks take minutes): the script must exist and define every
  `--flag` the line gives it. A `make
  TARGET [VAR=value]` line must name a Makefile target and variables it
  lets the command line set. Any other command fails the test.
  A `\\` at the end of a line continues it; `#` starts a comment.
- ```python no-run and ```sh no-run: shown, not run. Only for what cannot run
  here: commands that need a GPU or several processes.
- ```text: output samples and pictures in text; not run.

A fence without an info string fails the test, so every new block chooses.
Examples keep to tiny models and few steps. A file whose blocks compile a
pipeline is marked slow (the inner loop, `make test-quick`, skips it).
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

import pjit_pipe.models  # noqa: F401  (the docs' `from models...` imports: this checkout's, before chdir)

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.S | re.M)
KNOWN_INFO = {"python", "sh", "python no-run", "sh no-run", "text"}
LINE_LIMITS = {"README.md": 250}  # every docs/*.md: 400
HISTORY = re.compile(r"session[- ]?[0-9]+|prototype|acceptance", re.I)
SLOW_PYTHON = re.compile(r"pipeline\(|plan_pipeline|train_step|ResilientTrainer")
SLOW_SHELL = re.compile(r"^pjit-pipe (train|demo|probe|plan)\b", re.M)


def blocks(path: Path) -> list[tuple[int, str, str]]:
    """(line number, info string, source) of each fenced block of a markdown file."""
    text = path.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m[1].strip(), m[2]) for m in FENCE.finditer(text)]


def python_blocks(path: Path) -> list[tuple[int, str]]:
    return [(line, source) for line, info, source in blocks(path) if info == "python"]


def shell_commands(path: Path) -> list[tuple[int, list[str]]]:
    """(line number, argv) of each command of the file's ```sh blocks."""
    commands = []
    for line, info, source in blocks(path):
        if info != "sh":
            continue
        joined = source.replace("\\\n", " ")
        for offset, text in enumerate(joined.splitlines()):
            argv = shlex.split(text, comments=True)
            while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):
                argv = argv[1:]
            if argv:
                commands.append((line + 1 + offset, argv))
    return commands


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _params(kind: str) -> list:
    params = []
    for path in DOCS:
        if kind == "python":
            sources = [source for _, source in python_blocks(path)]
            if not sources:
                continue
            slow = any(SLOW_PYTHON.search(source) for source in sources)
        else:
            commands = shell_commands(path)
            if not commands:
                continue
            slow = any(SLOW_SHELL.search(" ".join(argv)) for _, argv in commands)
        marks = [pytest.mark.slow] if slow else []
        params.append(pytest.param(path, id=_name(path), marks=marks))
    return params


def test_every_fence_says_what_it_is():
    for path in DOCS:
        for line, info, _ in blocks(path):
            assert info in KNOWN_INFO, f"{_name(path)}:{line}: fence info {info!r}"


def test_the_docs_are_short_and_say_what_is_there_today():
    for path in DOCS:
        text = path.read_text()
        limit = LINE_LIMITS.get(path.name if path.parent == ROOT else "", 400)
        assert text.count("\n") <= limit, f"{_name(path)}: over {limit} lines"
        found = HISTORY.search(text)
        assert found is None, f"{_name(path)}: {found[0]!r}: history belongs in git log"


def test_the_readme_shows_the_training_step():
    sources = [source for _, source in python_blocks(ROOT / "README.md")]
    assert len(sources) >= 3
    assert any("train_step" in source for source in sources)


@pytest.fixture
def scratch(tmp_path, monkeypatch) -> Path:
    """A scratch working directory in which `pjit_pipe/...` paths resolve."""
    (tmp_path / "pjit_pipe").symlink_to(ROOT / "pjit_pipe")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("path", _params("python"))
def test_every_python_block_runs(path, scratch):
    namespace: dict = {"__name__": "docs"}
    for line, source in python_blocks(path):
        code = compile(source, f"{_name(path)}, block at line {line}", "exec")
        exec(code, namespace)  # a failure names the block's line in its traceback


def _benchmark_script(argv: list[str]) -> tuple[Path, list[str]] | None:
    """The script and arguments of `python benchmarks/NAME.py ...` or `python -m benchmarks.NAME`."""
    if len(argv) > 1 and argv[1].startswith("benchmarks/") and argv[1].endswith(".py"):
        return ROOT / argv[1], argv[2:]
    if len(argv) > 2 and argv[1] == "-m" and argv[2].startswith("benchmarks."):
        return ROOT / "benchmarks" / f"{argv[2].split('.', 1)[1]}.py", argv[3:]
    return None


def _check_benchmark_line(where: str, script: Path, args: list[str]) -> None:
    assert script.is_file(), f"{where}: no {script.relative_to(ROOT)}"
    source = script.read_text()
    for flag in (arg.split("=")[0] for arg in args if arg.startswith("--")):
        assert f'"{flag}"' in source, f"{where}: {script.name} defines no {flag}"


def _check_make_line(where: str, argv: list[str]) -> None:
    makefile = (ROOT / "Makefile").read_text()
    for arg in argv[1:]:
        if "=" in arg:  # VAR=value: the Makefile must let the command line set VAR
            var = arg.split("=", 1)[0]
            assert re.search(rf"^{re.escape(var)} \?=", makefile, re.M), f"{where}: {var}"
        else:
            assert re.search(rf"^{re.escape(arg)}:", makefile, re.M), f"{where}: make {arg}"


@pytest.mark.parametrize("path", _params("shell"))
def test_every_shell_command_runs(path, scratch):
    from pjit_pipe.cli import main

    for line, argv in shell_commands(path):
        where = f"{_name(path)}:{line}: {shlex.join(argv)}"
        if argv[0] == "pjit-pipe":
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                status = main(argv[1:])
            assert status == 0, f"{where}: exit {status}: {err.getvalue()[-500:]}"
        elif argv[0] == "python" and _benchmark_script(argv):
            _check_benchmark_line(where, *_benchmark_script(argv))
        elif argv[0] == "make":
            _check_make_line(where, argv)
        else:
            pytest.fail(f"{where}: not a command this test knows how to check")
