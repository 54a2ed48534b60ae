"""Full-size models on one device: pjit_pipe's train step against a plain optax
gradient-accumulation step, with throughput, memory and model FLOPs utilization.

    python -m benchmarks.bench_models [--model gpt2-124m|llama] [--kinds 1f1b,zb-v,...]
        [--microbatches M] [--mb-size B] [--seq S] [--dtype f32|bf16]
        [--rounds N] [--peak-tflops T] [--quick] [--width D --layers L]
        [--skip-nonfinite on|off|both] [--clock wall|cpu] [--trace DIR]

Models (pjit_pipe/models):
- gpt2-124m: GPT2LM at GPT-2 small (vocab 50257, 1024 positions, d 768, 12
  heads, 12 layers, tied head); m=8 x 8 sequences of 1024 by default.
  `--dtype bf16` casts the parameters to bfloat16 (the model has no compute
  dtype of its own, so it computes in its parameters' dtype); f32 by default.
- llama: `LlamaConfig.gpu()` (d 1024, 24 layers, about 340M parameters,
  untied), without tensor-parallel annotations (the mesh is 1x1);
  `--dtype` is its compute dtype, the parameters stay float32; bf16 by
  default, m=8 x 4 sequences of 1024.
`--quick` shrinks either to a tiny size (and 3 rounds) that runs on a CPU;
on a CPU backend it is always quick. `--width D --layers L` set the quick
GPT-2's width and depth (D/64 heads, at least 2; a context of 128 positions),
e.g. the d256 4-layer GPT-2 of the CPU rows:

    python -m benchmarks.bench_models --width 256 --layers 4 --seq 64 \
        --kinds 1f1b,zb-h1,zb-v,interleaved-1f1b,async-1f1b --skip-nonfinite both

`--clock cpu` times each call in this process's CPU seconds (all its threads)
instead of wall seconds: on a CPU shared with other work the wall ratios
scatter, the CPU ones much less (the step ms column is then CPU ms).

`--skip-nonfinite` picks the pipelined steps' non-finite check
(PipelineOptions.skip_nonfinite): `on` (the default: skipped where the
schedule allows it), `off`, or `both`, which times each kind both ways (rows
`kind` and `kind/off`; async-1f1b, which steps in its loop, has one row).

`--trace DIR` records two more steps of each program with `jax.profiler.trace`
after the timing rounds, in DIR/<program>/ with a Perfetto trace
(`perfetto_trace.json.gz`, Chrome's JSON trace format: on a GPU it holds every
kernel's start and duration), to see where a kind's extra time goes.

Both programs run on the first device. The plain step is a jitted `lax.scan`
of `jax.value_and_grad` over the m microbatches (benchmarks/common.py
scan_accumulation) and an `optax.adamw` update; each kind is
`pp.pipeline(model, stages=1, microbatches=m, schedule=kind,
mesh=pp.make_mesh(1, 1), optimizer=optax.adamw(...)).train_step(lm_loss)`
(interleaved-1f1b and zb-v with two chunks). With one stage there is no
bubble: every kind does the plain step's work, so the ratio is what the
tick-synchronous program costs over the plainest loop. Both donate their
state. Each program's first call is timed alone (building the step and its
state, trace, compile, one step); then every program runs one warm-up call
and `--rounds` rounds, in reverse order every other round (common.round_times), and the ratio is the median of
the per-round ratios to the plain step. Every program takes the same number
of steps from the same parameters on the same batch, so the loss the last
step returns (the loss before its update) is compared with the plain one;
async-1f1b updates after every microbatch (docs/async.md), so its loss differs
by design; with it, m - 1 optax updates alone are timed too (the algorithm's own
cost beyond the plain step's one update), and the last line gives async-1f1b's
ratio less them: what the program structure costs.

Columns: step ms (median), ratio to plain [quartiles], tokens/s (m*B*S /
step), first call s, peak GiB, MFU, loss relative error against plain.

Peak GiB is `device.memory_stats()["peak_bytes_in_use"]` after the program's
first call (n/a where the backend reports none, as on CPU). jax has no way to
reset that peak, so it is the process's running peak: the plain step runs
first, and a row shows its own program's peak only where it rises above the
rows before it. For one kind's own peak, run it alone: `--kinds zb-v`.

MFU = model FLOPs per step / step time / peak, where
    model FLOPs per step = 6 * N * tokens + 12 * L * d * S^2 * sequences,
tokens = m * B * S, sequences = m * B, N the parameters that enter a matrix
multiply (all but lookup-only tables: GPT-2's position table, Llama's untied
token table), L layers, d the model width. The first term is the forward and
backward matmuls (2 + 4 FLOPs a parameter a token), the second the attention
scores and their weighted sum over the full S x S matrix (PaLM's count; the
causal half is not subtracted, and remat's recomputation is not counted).
The peak is `--peak-tflops`, by default the bf16 dense peak of an H100/H200
(989 TFLOP/s) when the device's kind names one, else MFU is n/a; for f32
runs the same bf16 peak is the denominator.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import pjit_pipe as pp
from benchmarks.common import quartiles, round_times, scan_accumulation
from pjit_pipe.models import GPT2LM, GPT2Config, Llama, LlamaConfig, lm_loss
from pjit_pipe.schedules import KINDS

DEFAULT_KINDS = "1f1b,zb-h1,gpipe,zb-v,interleaved-1f1b,async-1f1b"
CHUNKED = ("interleaved-1f1b", "zb-v")  # two chunks on the one device
IN_LOOP = ("async-1f1b",)  # steps its optimizer in the loop: no non-finite check
SKIP_CHOICES = {"on": (None,), "off": (False,), "both": (None, False)}
HOPPER_BF16_TFLOPS = 989.0  # dense bf16 peak of an H100 SXM / H200
LEARNING_RATE = 1e-4


@dataclasses.dataclass(frozen=True)
class ModelCase:
    """A model, its sizes for the FLOP count, and the batch shape it trains on."""

    name: str
    module: Any
    cast: Any  # parameters' dtype (gpt2 bf16), or None to keep float32
    layers: int
    width: int
    seq: int
    vocab: int
    lookup_only: tuple[str, ...]  # top-level parameter names used only as tables


def build_case(
    name: str, dtype: str, seq: int | None, quick: bool, width: int | None, layers: int | None
) -> ModelCase:
    """The model `name` ("gpt2-124m" or "llama") at full size, or tiny with `quick`
    (a quick GPT-2 `width` wide and `layers` deep where given)."""
    compute = jnp.bfloat16 if dtype == "bf16" else jnp.float32
    if name == "gpt2-124m":
        sizes = dict(vocab=50257, n_positions=1024, d_model=768, n_heads=12, n_layers=12)
        if quick:
            sizes = dict(vocab=64, n_positions=16, d_model=32, n_heads=2, n_layers=2)
            if width or layers:
                d = width or 32
                sizes.update(n_positions=128, d_model=d, n_heads=max(2, d // 64))
                sizes.update(n_layers=layers or 2)
        config = GPT2Config(**sizes)
        cast = jnp.bfloat16 if dtype == "bf16" else None
        seq = _within(seq, config.n_positions)
        return ModelCase(
            name, GPT2LM(config), cast, config.n_layers, config.d_model, seq, config.vocab, ("wpe",)
        )
    make = LlamaConfig.tiny if quick else LlamaConfig.gpu
    config = make(tensor_parallel=False, dtype=compute)
    seq = _within(seq, config.seq_len)
    lookup = () if config.tie_embeddings else ("embed",)
    return ModelCase(
        name, Llama(config), None, config.n_layers, config.d_model, seq, config.vocab, lookup
    )


def _within(seq: int | None, context: int) -> int:
    """`seq` (default: the whole `context`), refused past the model's context."""
    if seq is not None and not 1 <= seq <= context:
        raise ValueError(
            f"--seq: {seq} is outside the model's context 1..{context}; pass one in it"
        )
    return seq or context


def matmul_params(params: Any, lookup_only: tuple[str, ...]) -> int:
    """Parameters that enter a matrix multiply: all but the top-level lookup-only tables."""
    tree = params["params"]
    return sum(a.size for k, v in tree.items() if k not in lookup_only for a in jax.tree.leaves(v))


def model_flops(case: ModelCase, n_matmul: int, sequences: int) -> float:
    """6 * N * tokens + 12 * L * d * S^2 * sequences (see the module docstring)."""
    tokens = sequences * case.seq
    return 6.0 * n_matmul * tokens + 12.0 * case.layers * case.width * case.seq**2 * sequences


def peak_tflops(device: Any, given: float | None) -> float | None:
    """`given`, else the H100/H200 bf16 dense peak where the device kind names one."""
    if given is not None:
        return given
    kind = device.device_kind.upper()
    return HOPPER_BF16_TFLOPS if "H100" in kind or "H200" in kind else None


def peak_bytes(device: Any) -> int | None:
    """The process's peak device bytes so far, where the backend reports it."""
    stats = device.memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def plain_step(case: ModelCase, optimizer: Any, m: int) -> Callable:
    """step((params, opt_state), x, y) -> ((params, opt_state), loss): scan_accumulation's
    mean loss and gradients over m microbatches, then the optax update; state donated."""
    accumulate = scan_accumulation(lambda p, xb: case.module.apply(p, xb), lm_loss, m)

    def step(state, x, y):
        params, opt_state = state
        loss, grads = accumulate(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return jax.jit(step, donate_argnums=0)


def optax_updates(optimizer: Any, n: int) -> Callable:
    """step((params, opt_state), grads) -> ((params, opt_state), 0.0): `n` optax
    updates alone, what async-1f1b's per-microbatch steps add to a plain step's one
    (the algorithm's own cost); state donated."""

    def step(state, grads):
        def update(_, state):
            params, opt_state = state
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        return jax.lax.fori_loop(0, n, update, state), jnp.float32(0)

    return jax.jit(step, donate_argnums=0)


class Stepper:
    """A train step and the state it carries: each call takes one step and keeps the
    new state, so repeated calls (the timing rounds) train on."""

    def __init__(self, step: Any, state: Any, batch: tuple[Any, Any], pipelined: bool):
        self.step, self.state, self.batch, self.pipelined = step, state, batch, pipelined
        self.loss = None

    def __call__(self) -> Any:
        if self.pipelined:
            self.state, self.loss = self.step(self.state, self.batch)
        else:
            self.state, self.loss = self.step(self.state, *self.batch)
        return self.loss


@dataclasses.dataclass(frozen=True)
class Row:
    """One program's figures; `ratio` is (q1, median, q3) of the per-round ratios."""

    name: str
    step_ms: float
    ratio: tuple[float, float, float]
    tokens_per_s: float
    first_s: float
    peak_gib: float | None
    mfu: float | None
    loss: float
    loss_err: float


def initial(case: ModelCase, sequences: int, device: Any) -> tuple[Any, jax.Array, jax.Array]:
    """(parameters, tokens, next-token targets) on `device`: random tokens, a batch of
    `sequences` rows of case.seq; every program starts from these."""
    x = jax.random.randint(jax.random.key(1), (sequences, case.seq), 0, case.vocab, jnp.int32)
    x = jax.device_put(x, device)
    y = jnp.roll(x, -1, axis=1)
    params = jax.jit(case.module.init)(jax.random.key(0), x[:1])
    if case.cast is not None:
        params = jax.tree.map(lambda a: a.astype(case.cast), params)
    return params, x, y


def run(args: argparse.Namespace, case: ModelCase) -> list[Row]:
    """Time the plain step and every kind on `case`, print and return the rows."""
    device = jax.devices()[0]
    m, rows_per_mb = args.microbatches, args.mb_size
    params, x, y = initial(case, m * rows_per_mb, device)
    optimizer = optax.adamw(LEARNING_RATE)
    n_matmul = matmul_params(params, case.lookup_only)
    n_all = sum(a.size for a in jax.tree.leaves(params))
    flops = model_flops(case, n_matmul, m * rows_per_mb)
    peak = peak_tflops(device, args.peak_tflops)
    print(
        f"{args.model} ({'tiny' if args.quick else 'full'}), {n_all / 1e6:.4g}M parameters"
        f" ({n_matmul / 1e6:.4g}M in matmuls), {args.dtype}, m={m} x {rows_per_mb} sequences"
        f" of {case.seq}; {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}",
        flush=True,
    )
    print(
        f"model FLOPs a step {flops / 1e12:.3f} T; peak "
        + (f"{peak:g} TFLOP/s" if peak else "unknown (pass --peak-tflops): MFU n/a"),
        flush=True,
    )

    steppers: dict[str, Stepper] = {}
    firsts: dict[str, tuple[float, float | None]] = {}

    def first_call(name: str, build: Callable[[], Stepper]) -> None:
        """Build `name`'s step and state and take its first step, timed together."""
        start = time.perf_counter()
        stepper = build()
        jax.block_until_ready(stepper())
        used = peak_bytes(device)
        firsts[name] = (time.perf_counter() - start, used / 2**30 if used is not None else None)
        steppers[name] = stepper
        print(f"   compiled {name}: first call {firsts[name][0]:.1f} s", flush=True)

    def copy(tree: Any) -> Any:  # each program owns (and donates) its own state
        return jax.tree.map(jnp.copy, tree)

    def plain() -> Stepper:
        state = (copy(params), optimizer.init(params))
        return Stepper(plain_step(case, optimizer, m), state, (x, y), pipelined=False)

    def pipelined(kind: str, skip: bool | None) -> Stepper:
        pm = pp.pipeline(
            case.module,
            stages=1,
            microbatches=m,
            schedule=kind,
            mesh=pp.make_mesh(data=1, stage=1, devices=[device]),
            chunks=2 if kind in CHUNKED else None,
            optimizer=optimizer,
            skip_nonfinite=skip,
        )
        step = pm.train_step(lm_loss)
        return Stepper(step, step.init(copy(params), (x, y)), (x, y), pipelined=True)

    first_call("plain", plain)
    extra = f"optax x{m - 1}"  # the updates async-1f1b takes beyond the plain step's one
    if "async-1f1b" in args.kinds:
        state = (copy(params), optimizer.init(params))
        grads = jax.tree.map(lambda a: jnp.full_like(a, 1e-3), params)
        first_call(extra, lambda: Stepper(optax_updates(optimizer, m - 1), state, (grads,), False))
    for kind in args.kinds:
        for skip in args.skip_nonfinite:
            if skip is False and kind in IN_LOOP:
                continue  # never checks: its row with the default is the row
            name = kind if skip is None or kind in IN_LOOP else f"{kind}/off"
            if name not in firsts:
                first_call(name, lambda kind=kind, skip=skip: pipelined(kind, skip))

    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    times = round_times(steppers, args.rounds, clock)
    base = times["plain"]
    base_loss = float(steppers["plain"].loss)
    rows = []
    for name, t in times.items():
        if name == extra:
            continue
        step_s = statistics.median(t)
        loss = float(steppers[name].loss)
        rows.append(
            Row(
                name,
                step_s * 1e3,
                quartiles([a / b for a, b in zip(t, base, strict=True)]),
                m * rows_per_mb * case.seq / step_s,
                firsts[name][0],
                firsts[name][1],
                flops / step_s / (peak * 1e12) if peak else None,
                loss,
                abs(loss - base_loss) / abs(base_loss),
            )
        )
    if args.trace:
        for name, stepper in steppers.items():
            folder = os.path.join(args.trace, name.replace("/", "-"))
            with jax.profiler.trace(folder, create_perfetto_trace=True):
                for _ in range(2):
                    jax.block_until_ready(stepper())
        print(f"   traces of two steps each in {args.trace}/<program>/", flush=True)
    steps = args.rounds + 2 + (2 if args.trace else 0)
    print(
        f"{args.rounds} rounds; each program took {steps} steps; ratio = median per-round"
        f" ratio; {args.clock} time"
    )
    print(
        f"   {'program':17s} {'step ms':>9} {'ratio [q1, q3]':>22} {'tokens/s':>10}"
        f" {'first s':>8} {'peak GiB':>9} {'MFU':>6}  loss (rel err to plain)"
    )
    for r in rows:
        q1, med, q3 = r.ratio
        gib = f"{r.peak_gib:9.2f}" if r.peak_gib is not None else f"{'n/a':>9}"
        mfu = f"{r.mfu:6.1%}" if r.mfu is not None else f"{'n/a':>6}"
        print(
            f"   {r.name:17s} {r.step_ms:9.2f} {med:7.3f}x [{q1:.3f}, {q3:.3f}]"
            f" {r.tokens_per_s:10.0f} {r.first_s:8.1f} {gib} {mfu}  {r.loss:.6f} ({r.loss_err:.1e})"
        )
    if "async-1f1b" in times:
        print(
            "   async-1f1b steps the optimizer after every microbatch's backward (docs/async.md):"
            f" {m} updates a step, so its loss is not the plain step's"
        )
        own = [(a - u) / b for a, u, b in zip(times["async-1f1b"], times[extra], base, strict=True)]
        q1, med, q3 = quartiles(own)
        print(
            f"   {m - 1} optax updates alone take {statistics.median(times[extra]) * 1e3:.2f} ms;"
            f" async-1f1b less them: {med:.3f}x the plain step [{q1:.3f}, {q3:.3f}]"
        )
    return rows


def main(argv: list[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("gpt2-124m", "llama"), default="gpt2-124m")
    ap.add_argument("--kinds", default=DEFAULT_KINDS, help="comma-separated schedule kinds")
    ap.add_argument("--microbatches", type=int, help="m (default 8; 2 with --quick)")
    ap.add_argument("--mb-size", type=int, help="sequences a microbatch (gpt2 8, llama 4; 2 quick)")
    ap.add_argument("--seq", type=int, help="sequence length (default: the model's context)")
    ap.add_argument(
        "--dtype", choices=("f32", "bf16"), help="gpt2: parameters (f32); llama: compute (bf16)"
    )
    ap.add_argument("--rounds", type=int, help="timing rounds (default 20; 3 with --quick)")
    ap.add_argument("--peak-tflops", type=float, help="device peak for MFU (H100/H200: 989)")
    ap.add_argument("--quick", action="store_true", help="a tiny model that runs on a CPU")
    ap.add_argument("--width", type=int, help="quick GPT-2's d_model (default 32)")
    ap.add_argument("--layers", type=int, help="quick GPT-2's layers (default 2)")
    ap.add_argument(
        "--skip-nonfinite",
        choices=tuple(SKIP_CHOICES),
        default="on",
        help="the non-finite check: on (default), off, or both (a row each)",
    )
    ap.add_argument(
        "--clock", choices=("wall", "cpu"), default="wall", help="wall or process CPU time"
    )
    ap.add_argument("--trace", metavar="DIR", help="profile two more steps of each program")
    args = ap.parse_args(argv)
    if not args.quick and jax.default_backend() == "cpu":
        print("no accelerator: the tiny size (--quick); a full-size step takes minutes on a CPU")
        args.quick = True
    args.kinds = [k for k in args.kinds.split(",") if k]
    args.skip_nonfinite = SKIP_CHOICES[args.skip_nonfinite]
    unknown = sorted(set(args.kinds) - set(KINDS))
    if unknown or not args.kinds:
        ap.error(f"--kinds: unknown {unknown}; choose from {', '.join(KINDS)}")
    args.microbatches = args.microbatches or (2 if args.quick else 8)
    default_rows = 8 if args.model == "gpt2-124m" else 4
    args.mb_size = args.mb_size or (2 if args.quick else default_rows)
    args.dtype = args.dtype or ("f32" if args.model == "gpt2-124m" else "bf16")
    args.rounds = args.rounds or (3 if args.quick else 20)
    try:
        case = build_case(args.model, args.dtype, args.seq, args.quick, args.width, args.layers)
    except ValueError as e:
        ap.error(str(e))
    return run(args, case)


if __name__ == "__main__":
    main()
