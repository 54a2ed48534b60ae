"""Stage costs measured from the model: the F, B, W of each stage, the activation
transfer and the fixed cost of a tick.

The schedule search prices candidates with per-stage F/B/W times (docs/design.md
sec. 3). Unit costs ignore the model; FLOP counts ignore what the hardware
does with them. So `costs="measure"` compiles each virtual stage's F, B and W
exactly as the lowering runs them (the split backward of
`lowering/compute/stage_backward.py`; the first stage's B is empty), and its F
and fused BW as a schedule that does not split it runs them (a split F also
stores what W reads), on the device that holds that stage, times each (median
of a few runs after a warm-up, a stage's ops round robin), and times a
ppermute of the boundary buffer between neighbouring devices.
With v chunks per device, the chunks of position p are taken as the
interleaved ones (p, p + P, ...) and their times add up.

The compiled program is a loop of ticks, and a tick costs something even
when every device idles: the loop step, a conditional per lane (on a GPU
each executed `lax.cond` copies its predicate to the host and waits) and the
ppermutes of the two message channels. `tick_seconds` times a loop of idle
ticks of that shape on all the pipeline's devices; it becomes `Costs.tick`,
which the tick packer pays once per tick, so it packs ops into fewer ticks
when ticks are dear.

Results are cached per (model, loss, shapes, devices, chunks): a pipeline and
its failure variants measure once.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as PS

from pjit_pipe.frontend.planning.stage_programs import ones_on, stage_programs
from pjit_pipe.ir.costs import Costs
from pjit_pipe.lowering import ChunkLayout, FlatSpec, LossLayout, StageVjp


@dataclass(frozen=True)
class StageTimes:
    """Median seconds of one microbatch's ops per virtual stage, C, and the fixed
    cost of one tick of the compiled loop (`tick_seconds`). `f`, `b`, `w`: the
    stage compiled with its backward split (the first stage's B is empty and
    its W is the whole backward); `f_fused`, `bw`: compiled with a fused
    backward, as a schedule without B and W runs it (`Costs.f_fused`, `Costs.bw`);
    `fbw`: the loss stage's F and backward as one program (`Costs.fbw`; 0: not
    timed)."""

    f: tuple[float, ...]
    b: tuple[float, ...]
    w: tuple[float, ...]
    bw: tuple[float, ...]
    f_fused: tuple[float, ...]
    c: float
    tick: float = 0.0
    fbw: float = 0.0

    def costs(self, positions: int, layout: Sequence[int] | None = None) -> Costs:
        """Per-position Costs in milliseconds: the times of the virtual stages each
        position holds, summed (`layout[s]`: the position of virtual stage s, as in
        `Schedule.layout`; None: s % positions, the interleaved layout)."""
        where = list(layout) if layout is not None else [s % positions for s in range(len(self.f))]

        def per_position(times: Sequence[float]) -> list[float]:
            return [
                1e3 * sum(t for t, q in zip(times, where, strict=True) if q == p)
                for p in range(positions)
            ]

        f_fused, bw = per_position(self.f_fused), per_position(self.bw)
        # Costs.fbw is in units of a position's F + BW: the loss stage's measured
        # saving, as a ratio, scales each position's (only the loss stage's is read).
        apart = self.f_fused[-1] + self.bw[-1]
        ratio = self.fbw / apart if self.fbw > 0 and apart > 0 else None
        return Costs(
            f=per_position(self.f),
            b=per_position(self.b),
            w=per_position(self.w),
            c=1e3 * self.c,
            tick=1e3 * self.tick,
            f_fused=f_fused,
            bw=bw,
            fbw=None
            if ratio is None
            else [(f + g) * ratio for f, g in zip(f_fused, bw, strict=True)],
        )

    def as_dict(self, positions: int, layout: Sequence[int] | None = None) -> dict[str, Any]:
        """JSON form: per-position costs (ms), the fused F and BW, the tick's fixed cost
        (ms), and the CLI's `--costs` text (split costs; the tick goes to `--tick-cost`,
        the fused F and BW, and the loss stage's F and backward as one program, to
        `--fused-costs`, `fused_costs_arg`)."""
        costs = self.costs(positions, layout)
        mean = lambda v: sum(v) / len(v)  # noqa: E731
        cli = ",".join(f"{mean(v):.4g}" for v in (costs.f, costs.b, costs.w)) + f",{costs.c:.4g}"
        fused = [costs.f_fused, costs.bw] + ([] if costs.fbw is None else [costs.fbw])
        return {
            "f": costs.f,
            "b": costs.b,
            "w": costs.w,
            "f_fused": costs.f_fused,
            "bw": costs.bw,
            "fbw": costs.fbw,
            "c": costs.c,
            "tick": costs.tick,
            "costs_arg": cli,
            "fused_costs_arg": ",".join(f"{mean(v):.4g}" for v in fused),
        }


def sample_seconds(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Wall times of `repeats` calls of each callable after one warm-up, run
    round-robin (so a change of machine load hits every callable alike)."""
    for f in fns.values():
        jax.block_until_ready(f())
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(f())
            times[k].append(time.perf_counter() - start)
    return times


def median_seconds(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median wall time of each callable after one warm-up, run round-robin."""
    return {k: statistics.median(v) for k, v in sample_seconds(fns, repeats).items()}


def _elements(tree: Any) -> int:
    """Elements of a boundary buffer (at least 1): what a timed ppermute sends."""
    return max(1, int(sum(np.prod(a.shape) for a in jax.tree.leaves(tree))))


def _transfer_loop(mesh: Mesh, size: int, steps: int) -> Callable[[], Any]:
    """A compiled loop of `steps` ppermutes of a `size`-element float32 buffer down
    the stage axis of `mesh`'s first replica, each sending what the last received."""
    row = Mesh(np.asarray(mesh.devices)[:1], mesh.axis_names)
    pairs = [(i, i + 1) for i in range(mesh.shape["stage"] - 1)]

    def device(b):
        step = lambda b, _: (lax.ppermute(b, "stage", pairs), None)  # noqa: E731
        return lax.scan(step, b, None, length=steps)[0]

    loop = jax.jit(
        jax.shard_map(
            device, mesh=row, in_specs=PS("stage"), out_specs=PS("stage"), check_vma=False
        )
    )
    buf = jax.device_put(
        jnp.ones((mesh.shape["stage"] * size,), jnp.float32), NamedSharding(row, PS("stage"))
    )
    return lambda: loop(buf)


def _transfer(mesh: Mesh, aval: Any, repeats: int, steps: int = 100) -> float:
    """Seconds of one ppermute of `aval` between neighbouring stages inside a compiled
    program (0 with one stage): the step of a loop of ppermutes (`_per_step_seconds`),
    so the cost of calling a program, about a millisecond on CPU, is not counted
    as the transfer's."""
    if mesh.shape["stage"] == 1:
        return 0.0
    size = _elements(aval)
    return _per_step_seconds(lambda n: _transfer_loop(mesh, size, n), steps, repeats)


def _per_step_seconds(make: Callable[[int], Callable[[], Any]], steps: int, repeats: int) -> float:
    """Seconds one step of a compiled loop costs: programs of `steps` and 2 * `steps`
    steps (`make(n)`), called alternately; the median over the pairs of their
    difference over `steps` (the cost of calling a program cancels out). Never
    below zero (timing noise)."""
    times = sample_seconds({"short": make(steps), "long": make(2 * steps)}, repeats)
    pairs = zip(times["short"], times["long"], strict=True)
    extra = [(long - short) / steps for short, long in pairs]
    return max(0.0, statistics.median(extra))


# Idle ticks per timed loop: enough that the loop, not the call, dominates the time.
IDLE_TICKS = 200


def _idle_loop(mesh: Mesh, size: int, lanes: int, ticks: int) -> Callable[[], Any]:
    """A compiled loop of `ticks` idle ticks shaped like the tick body's
    (lowering/compute/tick.py) on every device of `mesh`: read the lanes' message rows
    from a (2P + 1, size) message store in one gather, run `lanes` two-way
    conds whose predicate comes from the tick's row (all idle: branch 0 passes
    through), ppermute an activation down and a gradient up the stage axis,
    and write what arrives into the store. What it costs per tick is what a
    tick costs besides its ops."""
    D, P = mesh.shape["data"], mesh.shape["stage"]
    slots = 2 * P + 1
    down = [(i, i + 1) for i in range(P - 1)]
    up = [(i + 1, i) for i in range(P - 1)]

    # Carried: store, (2P + 1, size) float32, the device's message store (the last
    # row is the scratch slot). A row: the lanes' branch ids (all 0: idle), then the
    # slots the received activation and gradient go to.
    def tick(store, row):
        read = jnp.take(store, row[:lanes], axis=0, mode="clip")
        act = grad = jnp.zeros((size,), jnp.float32)
        for lane in range(lanes):  # F, then B, then the W/BW of each chunk
            run = lambda m, lane=lane: m + read[lane]  # noqa: E731
            if lane == 0:
                act = lax.cond(row[lane] > 0, run, lambda m: m, act)
            else:
                grad = lax.cond(row[lane] > 0, run, lambda m: m, grad)
        got_act = lax.ppermute(act, "stage", down) if down else act
        got_grad = lax.ppermute(grad, "stage", up) if up else grad
        store = store.at[row[lanes]].set(got_act).at[row[lanes + 1]].set(got_grad)
        return store, None

    def device(store, rows):
        out, _ = lax.scan(tick, store[0, 0], rows)
        return out[None, None]

    loop = jax.jit(
        jax.shard_map(
            device,
            mesh=mesh,
            in_specs=(PS("data", "stage"), PS()),
            out_specs=PS("data", "stage"),
            check_vma=False,
        )
    )
    store = jax.device_put(
        jnp.zeros((D, P, slots, size), jnp.float32), NamedSharding(mesh, PS("data", "stage"))
    )
    # Every lane idle (branch 0); the received messages go to the scratch slot.
    rows = np.zeros((ticks, lanes + 2), np.int32)
    rows[:, lanes:] = slots - 1
    rows = jax.device_put(rows, NamedSharding(mesh, PS()))
    return lambda: loop(store, rows)


def tick_seconds(
    mesh: Mesh, message: Any, chunks: int = 1, repeats: int = 5, ticks: int = IDLE_TICKS
) -> float:
    """Seconds one tick of the compiled loop costs besides its ops, on `mesh`'s devices.

    The step of loops of `ticks` and 2 * `ticks` idle ticks (`_per_step_seconds`
    of `_idle_loop`, with the F, B and one W/BW cond per chunk of the real tick
    body, and a ppermute of the boundary buffer `message` per channel). On a
    GPU the same loop pays each cond's predicate copy to the host (none with
    command-buffer conditionals) and each ppermute's launch."""
    size, lanes = _elements(message), 2 + chunks
    return _per_step_seconds(lambda n: _idle_loop(mesh, size, lanes, n), ticks, repeats)


_CACHE: dict[Any, tuple[Any, StageTimes]] = {}


def measure_stage_times(
    stage_fns: Sequence[Callable],
    loss_fn: Callable,
    stage_params: Sequence[Any],
    x_mb: Any,
    y_mb: Any,
    mesh: Mesh,
    key: Any = None,
    repeats: int = 5,
) -> StageTimes:
    """Time every virtual stage's F, B, W, BW on its device (and the loss stage's F
    and backward as one program), one boundary transfer, and an idle tick on the
    whole mesh.

    `stage_params`, `x_mb`, `y_mb`: shapes of one microbatch (arrays or
    ShapeDtypeStructs). With `key` (hashable: model, loss and shapes), the
    result is cached per (key, devices)."""
    devices = tuple(d.id for d in np.asarray(mesh.devices).flat)
    full_key = None if key is None else (key, devices, len(stage_fns))
    if full_key in _CACHE:
        return _CACHE[full_key][1]
    S, positions = len(stage_fns), mesh.shape["stage"]
    avals = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)), stage_params
    )
    loss = LossLayout(loss_fn).vector
    split = StageVjp(stage_fns, loss, avals, x_mb, y_mb, split=range(S))
    fused = StageVjp(stage_fns, loss, avals, x_mb, y_mb)
    row = np.asarray(mesh.devices)[0]
    # The lowering keeps a chunk's parameters flat where size classes would cost
    # too much memory (lowering/layout/param_layout.py); its ops then slice their weights.
    flat = FlatSpec(avals)
    chunk_stages = [range(c * positions, (c + 1) * positions) for c in range(S // positions)]
    sliced = {s: ChunkLayout(flat, stages).flat for stages in chunk_stages for s in stages}
    times: dict[int, dict[str, float]] = {}
    for s in range(S):  # fused and split ops of a stage in one round robin
        packed = flat if sliced[s] else None
        ops = stage_programs(fused, s, row[s % positions], y_mb, packed)
        if s in split.split:
            more = stage_programs(split, s, row[s % positions], y_mb, packed)
            ops |= {f"split {k}": op for k, op in more.items()}
        times[s] = median_seconds(ops, repeats)
    got = lambda s, op: times[s].get(f"split {op}", times[s].get(op, 0.0))  # noqa: E731
    # The largest boundary message; a single stage sends none, and its idle tick is
    # priced with the microbatch's input in the message buffer instead.
    boundaries = fused.act_avals[1:] or fused.act_avals[:1]
    msg = max(boundaries, key=lambda a: sum(np.prod(x.shape) for x in jax.tree.leaves(a)))
    result = StageTimes(
        f=tuple(got(s, "F") for s in range(S)),
        b=tuple(got(s, "B") for s in range(S)),
        w=tuple(times[s].get("split W", times[s]["BW"]) for s in range(S)),
        bw=tuple(times[s]["BW"] for s in range(S)),
        f_fused=tuple(times[s]["F"] for s in range(S)),
        fbw=times[S - 1]["FBW"],
        c=_transfer(mesh, msg, repeats) if S > 1 else 0.0,
        tick=tick_seconds(mesh, msg, S // positions, repeats),
    )
    if full_key is not None:
        _CACHE[full_key] = (stage_fns, result)  # keeps the functions (and key ids) alive
    return result


def segment_times(stage_fns: Sequence[Callable], params: Sequence[Any], x_mb: Any) -> list[float]:
    """Median seconds of each segment's forward + backward (`jax.vjp`) on the default
    device, for balancing stages by measured time (`balance="time"`)."""
    times, act = [], x_mb
    for fn, p in zip(stage_fns, params, strict=True):
        a = ones_on(act, jax.devices()[0])
        pp = ones_on(
            jax.tree.map(lambda v: jax.ShapeDtypeStruct(np.shape(v), jnp.result_type(v)), p),
            jax.devices()[0],
        )

        def fwd_bwd(p, a, fn=fn):
            out, pull = jax.vjp(fn, p, a)
            return pull(jax.tree.map(jnp.ones_like, out))

        step = jax.jit(fwd_bwd)
        times.append(median_seconds({"t": lambda step=step, p=pp, a=a: step(p, a)}, 3)["t"])
        act = jax.eval_shape(fn, pp, a)
    return times
