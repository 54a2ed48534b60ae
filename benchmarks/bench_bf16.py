"""bf16 compute over float32 parameters (Flax mixed precision) against float32.

For the tiny GPT or the tiny Llama on a DxP mesh, builds the adam train step
with the modules' dtype float32 and bfloat16 and prints, for each:
- the message bytes per tick: the tick loop's collective-permutes (one
  activation, one cotangent message) in the program jax lowers, and in the
  program XLA compiled for this backend (XLA's CPU backend widens bf16
  collective-permutes to f32, so on CPU the wire bytes do not shrink);
- XLA's temporary bytes of the compiled value_and_grad program;
- the median train step time over `--rounds` rounds of alternating calls, and
  the median of the per-round bf16/f32 ratios.

Run: python -m benchmarks.bench_bf16 [--model gpt|llama] [--mesh 2x4] [--rounds N]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import dataclasses
import re
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import optax

import pjit_pipe as pp
from benchmarks.common import round_times
from pjit_pipe.models.gpt import GPT, GPTConfig, lm_loss
from pjit_pipe.models.llama import Llama, LlamaConfig

_PERMUTE = re.compile(r"= (\w+)\[([\d,]*)\]\S* collective-permute\(")
_BYTES = {"f32": 4, "bf16": 2, "f16": 2}


def tick_message_bytes(hlo: str, elements: set[int]) -> int:
    """Bytes of the tick loop's collective-permutes: those shaped like a message
    buffer (`elements` values each; one activation and one cotangent per tick).
    Others (the parameter gradients gathered after the loop) are left out."""
    found = [
        (d, np.prod([int(n) for n in dims.split(",") if n])) for d, dims in _PERMUTE.findall(hlo)
    ]
    return sum(_BYTES[d] * int(n) for d, n in found if int(n) in elements)


def _model(name: str, dtype):
    if name == "llama":
        return Llama(LlamaConfig.tiny(tensor_parallel=False, dtype=dtype))
    return GPT(dataclasses.replace(GPTConfig.tiny(), dtype=dtype))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("gpt", "llama"), default="gpt")
    parser.add_argument("--mesh", default="2x4", help="DxP")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)
    data, stages = (int(n) for n in args.mesh.split("x"))
    x = jax.random.randint(jax.random.key(1), (args.batch, 32), 0, 96)
    y = jnp.roll(x, -1, axis=1)
    params = jax.jit(_model(args.model, jnp.float32).init)(jax.random.key(0), x)
    rows, programs = {}, {}
    for dtype in (jnp.float32, jnp.bfloat16):
        name = jnp.dtype(dtype).name
        pm = pp.pipeline(
            _model(args.model, dtype),
            stages=stages,
            microbatches=args.microbatches,
            schedule=args.schedule,
            mesh=pp.make_mesh(data=data, stage=stages),
            optimizer=optax.adam(1e-3),
        )
        _, program = pm.program(params, x, y, lm_loss)
        lowered = program._vg.lower(*program._examples)
        compiled = lowered.compile()
        spec = program._low.msg_spec.sizes
        rows[name] = {
            "spec": sum(n * jnp.dtype(d).itemsize for d, n in spec.items()),
            "lowered": tick_message_bytes(lowered.as_text(dialect="hlo"), set(spec.values())),
            "compiled": tick_message_bytes(compiled.as_text(), set(spec.values())),
            "temp": compiled.memory_analysis().temp_size_in_bytes,
        }
        step = pm.train_step(lm_loss, donate=False)
        state = step.init(params, (x, y))
        programs[name] = lambda step=step, state=state: step(state, (x, y))[1]
    times = round_times(programs, args.rounds)
    print(
        f"{args.model} on {args.mesh} ({args.schedule}, m={args.microbatches}, batch {args.batch})"
    )
    print(
        f"{'compute':>9} {'msg spec B':>10} {'lowered B/tick':>14} {'compiled B/tick':>15} "
        f"{'temp B':>9} {'step ms':>8}"
    )
    for name, row in rows.items():
        ms = 1e3 * statistics.median(times[name])
        print(
            f"{name:>9} {row['spec']:>10} {row['lowered']:>14} {row['compiled']:>15} "
            f"{row['temp']:>9} {ms:>8.1f}"
        )
    ratios = [b / f for b, f in zip(times["bfloat16"], times["float32"], strict=True)]
    print(f"bf16 / f32 step time, median of per-round ratios: {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
