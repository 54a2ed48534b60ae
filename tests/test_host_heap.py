"""CPU temporaries kept on the heap (lowering/host_heap.py): the threshold rule in
closed form, and glibc's observable behaviour in a fresh process (malloc's
settings are process-wide): a block over 32 MiB is mapped afresh before
`keep_on_heap` and served from the heap after it, for a plain jitted function
and for a compiled pipeline step."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pjit_pipe.lowering.host_heap import GLIBC_DYNAMIC_CAP, heap_threshold

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def _has_mallinfo2() -> bool:
    try:
        ctypes.CDLL(None).mallinfo2  # noqa: B018
        return True
    except AttributeError:
        return False


needs_glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not _has_mallinfo2(),
    reason="glibc >= 2.33 (mallinfo2) only",
)

# In the child: `mapped_by(n)`, the bytes glibc mapped with mmap to serve one
# malloc(n) (read from mallinfo2's hblkhd while the block is held).
PRELUDE = textwrap.dedent(
    """
    import ctypes, json, os, sys
    libc = ctypes.CDLL(None)
    class Info(ctypes.Structure):
        _fields_ = [(f, ctypes.c_size_t) for f in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
            "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc.mallinfo2.restype = Info
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    def mapped_by(n):
        before = libc.mallinfo2().hblkhd
        block = libc.malloc(n)
        mapped = libc.mallinfo2().hblkhd - before
        libc.free(block)
        return mapped
    """
)


def _child(body: str, env: dict[str, str] | None = None) -> dict:
    code = PRELUDE + textwrap.dedent(body)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", **(env or {})},
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_threshold_is_the_next_power_of_two_above_a_block_glibc_would_map():
    assert heap_threshold(0) is None
    assert heap_threshold(GLIBC_DYNAMIC_CAP) is None  # glibc keeps it itself
    assert heap_threshold(GLIBC_DYNAMIC_CAP + 1) == 64 * MiB
    assert heap_threshold(39 * MiB) == 64 * MiB
    assert heap_threshold(64 * MiB) == 128 * MiB  # above the block, not at it
    assert heap_threshold(3 * 2**30) is None  # past what mallopt takes (a C int)


JITTED = """
    import jax, jax.numpy as jnp
    from pjit_pipe.lowering import host_heap
    f = jax.jit(lambda x: jnp.sort(jnp.sin(x))[::7].sum())
    compiled = f.lower(jax.ShapeDtypeStruct((10 * 2**20,), jnp.float32)).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    block = 40 * 2**20
    before = mapped_by(block)
    kept = host_heap.keep_on_heap(compiled)
    print(json.dumps(dict(temp=temp, before=before, kept=kept, after=mapped_by(block),
                          again=host_heap.keep_on_heap(compiled))))
"""


@needs_glibc
def test_a_large_cpu_block_is_mapped_before_and_kept_on_the_heap_after():
    got = _child(JITTED)
    assert got["temp"] > GLIBC_DYNAMIC_CAP  # the example needs a block glibc maps
    assert got["before"] >= 40 * MiB  # glibc's default: a fresh mapping
    assert got["kept"] == heap_threshold(got["temp"])
    assert got["after"] == 0  # served from the heap
    assert got["again"] == got["kept"]  # raised once, never lowered


@needs_glibc
def test_the_environment_switch_turns_it_off():
    got = _child(JITTED, env={"PJIT_PIPE_HOST_HEAP": "0"})
    assert got["kept"] is None and got["after"] >= 40 * MiB


@needs_glibc
@pytest.mark.slow
def test_a_compiled_pipeline_step_keeps_its_block_on_the_heap():
    # Wide residual blocks: the loop's copy of the parameters (size classes) alone
    # is about 64 MiB, so the step's block is over glibc's cap.
    got = _child(
        """
        import jax, numpy as np, optax
        import pjit_pipe as pp
        from pjit_pipe.lowering import host_heap
        from pjit_pipe.models.mlp import ResidualMLP, mse_loss
        model = ResidualMLP(d_model=1024, hidden=2048, n_layers=4, d_out=8)
        x, y = np.ones((4, 16), np.float32), np.ones((4, 8), np.float32)
        params = model.init(jax.random.key(0), x)
        mesh = pp.make_mesh(data=1, stage=1, devices=jax.devices()[:1])
        pm = pp.pipeline(model, stages=1, microbatches=2, mesh=mesh, optimizer=optax.adam(1e-3))
        step = pm.train_step(mse_loss)
        state = step.init(params, (x, y))
        print(json.dumps(dict(before=host_heap.current_threshold(),
                              seconds=step.compile(state, (x, y)),
                              kept=host_heap.current_threshold())))
        """
    )
    assert got["before"] is None
    assert got["kept"] is not None and got["kept"] > GLIBC_DYNAMIC_CAP
