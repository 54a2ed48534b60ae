"""What a device holds with weights split over 'tensor', and with ZeRO over 'data'.

The tiny GPT with Megatron's annotations (pjit_pipe/models/gpt.py, megatron=True), adam:
the largest training state a device holds between steps
(`state.device_bytes()`) and XLA's memory analysis of the compiled train step
(arguments, outputs, temporaries), for (data=2, stage=2) with tensor = 1 and
2, and for (data=4, stage=2) without and with zero=True.

Then, per device from `state.device_bytes()`, the bundled Llama (an `nn.scan`
stack with Megatron annotations) untied and with its embedding tied to the
head, adam: ZeRO at D = 4 against the replicated state on (4, 2, 1), and
tensor = 2 against tensor = 1 on (2, 2, *).

Run: python -m benchmarks.bench_tensor_memory [--models-only]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses
import sys

import jax
import optax

import pjit_pipe as pp
from pjit_pipe.frontend.cutter.tensor_split import unbox
from pjit_pipe.models import GPT, GPTConfig, lm_loss
from pjit_pipe.models.llama import Llama, LlamaConfig


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


def llama_state(tied: bool, shape: tuple[int, int, int], zero: bool) -> int:
    """The largest training state (bytes) a device holds, the Llama on `shape`."""
    config = LlamaConfig.tiny(
        vocab=256,
        seq_len=16,
        d_model=64,
        n_heads=4,
        n_kv_heads=2,
        n_layers=4,
        d_ff=256,
        tie_embeddings=tied,
    )
    model = Llama(config)
    tokens = jax.random.randint(jax.random.key(0), (16, config.seq_len + 1), 0, config.vocab)
    x, y = tokens[:, :-1], tokens[:, 1:]
    boxed = jax.jit(model.init)(jax.random.key(1), x)
    pm = pp.pipeline(
        model,
        stages=shape[1],
        microbatches=2,
        mesh=pp.make_mesh(*shape),
        optimizer=optax.adam(1e-3),
        zero=zero,
    )
    state = pm.train_step(lm_loss).init(boxed, (x, y))
    return max(state.device_bytes().values())


def model_table() -> None:
    """State bytes per device of the scan-stacked and the tied Llama."""
    print(f"{'model':<12}{'change':<26}{'before':>12}{'after':>12}   ratio")
    for tied in (False, True):
        name = "scan-tied" if tied else "scan"
        pairs = {
            "4x2x1 -> 4x2x1 zero": (((4, 2, 1), False), ((4, 2, 1), True)),
            "2x2x1 -> 2x2x2": (((2, 2, 1), False), ((2, 2, 2), False)),
        }
        for change, (before, after) in pairs.items():
            a, b = llama_state(tied, *before), llama_state(tied, *after)
            print(f"{name:<12}{change:<26}{a:>12,}{b:>12,}   {b / a:.2f}x")


def main() -> None:
    model_table()
    if "--models-only" in sys.argv[1:]:
        return
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
