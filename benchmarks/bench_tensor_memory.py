"""What a device holds with weights split over 'tensor', and with ZeRO over 'data'.

The tiny GPT with Megatron's annotations (pjit_pipe/models/gpt.py, megatron=True), adam:
the largest training state a device holds between steps
(`state.device_bytes()`) and XLA's memory analysis of the compiled train step
(arguments, outputs, temporaries), for (data=2, stage=2) with tensor = 1 and
2, and for (data=4, stage=2) without and with zero=True.

Run: python -m benchmarks.bench_tensor_memory
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses

import jax
import optax

import pjit_pipe as pp
from pjit_pipe.frontend.cutter.tensor_split import unbox
from pjit_pipe.models import GPT, GPTConfig, lm_loss


def measure(shape: tuple[int, int, int], zero: bool) -> dict[str, int]:
    """State bytes per device (largest) and the compiled step's memory analysis."""
    config = dataclasses.replace(GPTConfig.tiny(), megatron=True)
    model = GPT(config)
    tokens = jax.random.randint(jax.random.key(0), (16, config.seq_len + 1), 0, config.vocab)
    x, y = tokens[:, :-1], tokens[:, 1:]
    boxed = model.init(jax.random.key(1), x)
    pm = pp.pipeline(
        model,
        stages=2,
        microbatches=2,
        mesh=pp.make_mesh(*shape),
        optimizer=optax.adam(1e-3),
        zero=zero,
    )
    step = pm.train_step(lm_loss)
    state = step.init(boxed, (x, y))
    step.compile(state, (x, y))
    plain, box = unbox(boxed)
    _, program = pm.program(plain, x, y, lm_loss, boxed=box)
    analysis = program.device_memory_analysis()
    return {
        "state": max(state.device_bytes().values()),
        "arguments": analysis.argument_size_in_bytes,
        "outputs": analysis.output_size_in_bytes,
        "temporaries": analysis.temp_size_in_bytes,
    }


def main() -> None:
    pairs = {
        "2x2x1 -> 2x2x2": (measure((2, 2, 1), False), measure((2, 2, 2), False)),
        "4x2 -> 4x2 zero": (measure((4, 2, 1), False), measure((4, 2, 1), True)),
    }
    for name, (before, after) in pairs.items():
        print(f"{name:<18}{'before':>12}{'after':>12}   ratio")
        for key in before:
            a, b = before[key], after[key]
            print(f"  {key:<16}{a:>12,}{b:>12,}   {b / a:.2f}x")


if __name__ == "__main__":
    main()
