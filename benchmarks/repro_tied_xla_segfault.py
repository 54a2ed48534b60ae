"""Minimal reproduction of the jax 0.11 compiler crash that tied weights hit.

jax 0.11.2 (CPU backend; Shardy partitioner) kills the process with SIGSEGV in
`sdy::ManualComputationUnusedInputsPattern` (the canonicalizer of
`sdy.manual_computation`, which is what a shard_map lowers to) whenever a
shard_map receives a zero-size operand. jax 0.10.2 and 0.12.0.1 compile the
same programs. Two ways to get a zero-size operand without asking for one:

- `whole`: `a.at[0:n].add(b)` over the whole of a length-n row inside the
  body lowers to a scatter whose index array is a zero-size numpy constant;
  shard_map hoists the body's constants into operands. This is why
  lowering/layout/shared.py concatenates the tied-gradient buffer rather
  than scattering into it.
- `operand`: a zero-size array passed to the shard_map directly.

`part` (`a.at[0:2].add(b)`, a non-empty index) is the control that compiles.
Each case runs in a child process, so the crash is reported, not suffered:

    python -m benchmarks.repro_tied_xla_segfault
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

CASES = ("part", "whole", "operand")


def _child(case: str) -> None:
    """Compile and run one case on two virtual CPU devices."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2,), ("x",))
    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x")))

    def run(body, *args):
        specs = (P("x"),) + (P(),) * (len(args) - 1)
        f = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("x"), check_vma=False)
        print(jax.jit(f)(*args))

    if case == "part":
        run(lambda a: a.at[0:2].add(1.0), x)
    elif case == "whole":
        run(lambda a: a.at[0 : a.shape[0]].add(1.0), x)
    else:
        run(lambda a, e: a + e.sum(), x, jnp.zeros((0,), jnp.int32))


def main() -> None:
    """Run each case in a child and print how it ended."""
    import jax

    print(f"jax {jax.__version__}")
    for case in CASES:
        argv = [sys.executable, "-m", "benchmarks.repro_tied_xla_segfault", case]
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode < 0:
            ended = f"killed by {signal.Signals(-done.returncode).name}"
        else:
            ended = f"exit {done.returncode}"
        print(f"{case:8s} {ended}")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        _child(sys.argv[1])
    else:
        main()
