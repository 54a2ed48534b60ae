"""`pjit-pipe train` keeps its compiled programs in a per-user folder by default:
a second run writes no executable (each compile is a cache hit), and
`--no-cache` writes nothing anywhere.

Each run is a fresh process, since JAX opens its cache folder once per process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ["-m", "pjit_pipe", "train", "--model", "mlp", "--mesh", "1x2", "--steps", "2", "--json"]


def train(env: dict[str, str], *extra: str) -> list[float]:
    """Run a tiny `train` in a fresh process; the loss of each step."""
    proc = subprocess.run(
        [sys.executable, *TRAIN, *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line)["loss"] for line in proc.stdout.splitlines()]


def entries(folder: Path) -> set[str]:
    """The executables in a JAX cache folder (a hit rewrites only the '-atime' files)."""
    return {p.name for p in folder.rglob("*-cache")} if folder.exists() else set()


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """The environment of a user with no JAX cache of their own, XDG_CACHE_HOME in tmp_path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


@pytest.mark.slow
def test_a_second_run_loads_every_program_from_the_user_cache(env, tmp_path):
    folder = tmp_path / "xdg" / "pjit_pipe" / "jax"
    first = train(env)
    written = entries(folder)
    assert written, "the first run cached nothing"
    assert train(env) == first  # the same steps, from the loaded programs
    assert entries(folder) == written  # every compile was a hit: nothing new written


@pytest.mark.slow
def test_no_cache_writes_nothing(env, tmp_path):
    env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path / "jax")  # JAX's own cache is off too
    train(env, "--no-cache")
    assert not entries(tmp_path / "xdg") and not entries(tmp_path / "jax")
    train(env, "--cache-dir", str(tmp_path / "mine"))
    assert entries(tmp_path / "mine") and not entries(tmp_path / "xdg")
