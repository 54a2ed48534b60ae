"""CPU kernels of the pipelined step and a failure variant against a plain step.

XLA's CPU compile is mostly LLVM work per kernel: every fusion (and every op
left unfused) becomes one kernel, and kernels whose fused computations are
identical are compiled once (so the same-shaped stages of one program, or two
copies of one block, cost one kernel each). On 2 busy cores bench_compile
put the pipelined step's XLA compile at 1.8-2.3x the plain step's, for 2.5x
its distinct kernels and 1.2x its HLO instructions (the HLO passes take about
a tenth of it; the LLVM work per kernel the rest). Unlike the seconds, the
count does not depend on machine load. A kernel bakes in its static slice
offsets: two leaves of one size at different offsets of a flat row are two
kernels.

For each program (the tiny GPT of bench_compile: 2x4 mesh, zb-h1, m=8) this
compiles once with XLA's dump on and prints
- fusions: fusion instructions in the optimized module (every copy);
- kernels: the object files XLA compiled (distinct kernels), and their
  optimized LLVM IR in KiB;
and, for the pipelined programs, the kernels of each op function (its name
scope, "F stage 0", "OPT stage 3", "OPT rows", ...; tick_ops.py, optimizer.py,
row_optimizer.py) that no
earlier op made, in program order: what each op adds to the compile.

Run: python -m benchmarks.bench_kernels
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import collections
import re
import sys
import tempfile
from typing import Any

import jax

from benchmarks.bench_compile import FAILED, pipeline, plain_jitted, setup
from pjit_pipe.models import lm_loss

# An op function's name scope (tick_ops._named, the optimizer's update).
SCOPE = re.compile(r"\b((?:F\+BW|BW|F|B|W|OPT) stage \d+|OPT rows)")


def kernels(lowered: Any) -> dict[str, Any]:
    """Compile `lowered` with XLA's dump on: its fusions, kernels, their IR size
    and, per name scope, its kernels (a kernel counted where it first appears)."""
    with tempfile.TemporaryDirectory() as dump:
        compiled = lowered.compile(compiler_options={"xla_dump_to": dump})
        files = os.listdir(dump)
        objects = [f for f in files if f.endswith(".o")]
        ir = sum(os.path.getsize(os.path.join(dump, f)) for f in files if f.endswith("opt.ll"))
    text = compiled.as_text()
    op_names: dict[str, str] = {}
    fusions, computation = 0, ""
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if head:
            computation = head.group(1)
            continue
        inst = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = .*?\)(?:,|\s|$)", line)
        if not inst:
            continue
        if " fusion(" in line and not computation.startswith("fused"):
            fusions += 1
        name = re.search(r'op_name="([^"]*)"', line)
        op_names.setdefault(inst.group(1), name.group(1) if name else "")
    scopes: collections.Counter[str] = collections.Counter()
    for f in objects:
        kernel = re.sub(r"^.*obj-file\.(__compute_module_)?|(_kernel_module)?\.o$", "", f)
        op_name = op_names.get(kernel, "")
        scope = SCOPE.search(op_name)
        if scope:
            scopes[scope.group(1)] += 1
        else:
            scopes["tick loop" if "/while/body" in op_name else "outside the ops"] += 1
    return {"fusions": fusions, "kernels": len(objects), "ir_kib": ir / 1024, "scopes": scopes}


def plain_lowered(model: Any, batch: tuple) -> Any:
    """The unpipelined value_and_grad + adamw step of bench_compile, lowered."""
    jitted, args = plain_jitted(model, batch)
    return jitted.trace(*args).lower()


def pipelined_lowered(pm: Any, state: Any, batch: tuple) -> Any:
    """The train step's device program (bench_compile.pipelined_step's), lowered."""
    step = pm.train_step(lm_loss, donate=False)
    program, _ = step._state_program(state, batch)
    sharding = jax.sharding.NamedSharding(pm.device_mesh, jax.sharding.PartitionSpec())
    x, y = (jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in batch)
    jitted = program._device_steps[(False, step._skips(program))].jitted
    return jitted.trace(*program.layout.avals(), x, y).lower()


def main(argv: list[str]) -> None:
    del argv
    model, batch = setup()
    pm = pipeline(model)
    params = jax.jit(pm.init)(jax.random.key(0), batch[0])
    state = pm.train_step(lm_loss, donate=False).init(params, batch)
    rows = {
        "plain step": kernels(plain_lowered(model, batch)),
        "pipelined step": kernels(pipelined_lowered(pm, state, batch)),
        f"variant {FAILED[0]}:{FAILED[1]} down": kernels(
            pipelined_lowered(pm.with_failures([FAILED]), state, batch)
        ),
    }
    base = rows["plain step"]["kernels"]
    print(f"{'program':<22}{'fusions':>9}{'kernels':>9}{'x plain':>9}{'IR KiB':>9}")
    for name, r in rows.items():
        print(
            f"{name:<22}{r['fusions']:9d}{r['kernels']:9d}"
            f"{r['kernels'] / base:9.2f}{r['ir_kib']:9.0f}"
        )
    for name in list(rows)[1:]:
        print(f"\n{name}: kernels first made by")
        for scope, n in rows[name]["scopes"].most_common():
            print(f"  {scope:<18}{n:5d}")


if __name__ == "__main__":
    main(sys.argv[1:])
