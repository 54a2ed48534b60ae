"""Every ```python block of the README runs, in order, as one script.

The blocks tell one story (the first defines the mesh, the batch and the
parameters the later ones use), so they run in one namespace, in a scratch
directory (the checkpoint example writes files). Shell blocks (``` without a
language) are not run.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import pjit_pipe.models  # noqa: F401  (the README's `from models...` imports: this checkout's, before chdir)

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, source) of each ```python block."""
    return [(text.count("\n", 0, m.start()) + 1, m[1]) for m in FENCE.finditer(text)]


def test_the_readme_has_python_blocks():
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 5
    assert any("train_step" in source for _, source in blocks)


@pytest.mark.slow
def test_every_python_block_of_the_readme_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "readme"}
    for line, source in python_blocks(README.read_text()):
        code = compile(source, f"README.md, block at line {line}", "exec")
        exec(code, namespace)  # a failure names the block's line in its traceback
