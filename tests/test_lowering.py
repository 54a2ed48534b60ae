"""The lowered pipeline program against jax.value_and_grad of the unpipelined model.

Matrix: value_and_grad and five adam steps for every schedule kind of
make_schedule on meshes 1x4, 2x2 and 2x4 (m = 4 per replica); hand-built
chunked schedules (interleaved layout with BW, V layout with split B/W) on 2x2
and 1x4; remat on one case; the memory bound at P=4, m=16. Kinds that make_schedule does not implement yet are skipped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

from pjit_pipe.errors import BatchError, CutError, MeshError
from pjit_pipe.ir.ops import BW, B, F, W
from pjit_pipe.ir.schedule import ScheduleError, interleaved_layout, v_layout
from pjit_pipe.ir.ticks import PackedTicks
from pjit_pipe.lowering import LoweringOptions, lower
from pjit_pipe.passes import fuse_stage
from pjit_pipe.schedules import KINDS, make_schedule
from pjit_pipe.schedules.common import replicated
from tests.tiers import EXHAUSTIVE

VOCAB, SEQ, CLASSES, MB = 13, 3, 5, 2
WIDTHS = (6, 9, 4, 7, 5, 8, 6, 7, 5)  # stage s maps WIDTHS[s] -> WIDTHS[s + 1]
CHUNKED = {"interleaved-1f1b": 2, "zb-v": 2}
# async-1f1b steps once per microbatch: tests/test_async_lowering.py checks it.
SYNC_KINDS = tuple(k for k in KINDS if k != "async-1f1b")
# Every kind on two replicas (2x4); the 2x2 mesh (another stage count) for the
# kinds whose layout depends on it (chunked, V-shaped) and 1f1b. The same
# pipelines on one replica (1x4) run only when asked: the 2x4 rows run them with a
# gradient reduction on top, and test_combination_matrix.py trains every kind on D = 1.
KIND_MESHES = [
    pytest.param(k, (D, 4), marks=EXHAUSTIVE if D == 1 else (), id=f"{k}-{D}x4")
    for k in SYNC_KINDS
    for D in (1, 2)
] + [pytest.param(k, (2, 2), id=f"{k}-2x2") for k in ("1f1b", "interleaved-1f1b", "zb-v")]


def tiny_model(num_stages: int, seed: int = 0):
    """Embedding stage, dense stages of uneven widths, a softmax-cross-entropy head."""
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 2 * num_stages + 2))
    fns, params = [], []
    for s in range(num_stages):
        d_in, d_out = WIDTHS[s], WIDTHS[s + 1]
        if s == 0:
            p = {"emb": jax.random.normal(next(keys), (VOCAB, d_out))}
        else:
            p = {
                "w": jax.random.normal(next(keys), (d_in, d_out)) / np.sqrt(d_in),
                "b": 0.1 * jax.random.normal(next(keys), (d_out,)),
            }
        if s == num_stages - 1:
            p["head"] = jax.random.normal(next(keys), (d_out, CLASSES))
        params.append(p)

        def fn(p, a, first=s == 0, last=s == num_stages - 1):
            h = jnp.tanh(p["emb"][a].mean(axis=1)) if first else jnp.tanh(a @ p["w"] + p["b"])
            return h @ p["head"] if last else h

        fns.append(fn)
    return fns, params


def xent(logits, y):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


def batch(n: int, seed: int):
    kx, ky = jax.random.split(jax.random.PRNGKey(seed))
    return jax.random.randint(kx, (n, SEQ), 0, VOCAB), jax.random.randint(ky, (n,), 0, CLASSES)


def reference_loss(fns, params, x, y):
    a = x
    for f, p in zip(fns, params, strict=True):
        a = f(p, a)
    return xent(a, y)


def reference_value_and_grad(fns, params, x, y):
    """`jax.value_and_grad` of the unpipelined model, jitted: one compile, where
    eager dispatch compiles each of its ops (most of a small test's time)."""
    return jax.jit(jax.value_and_grad(lambda p, x, y: reference_loss(fns, p, x, y)))(params, x, y)


def unpipelined_training(fns, params, opt, batches):
    """Plain optax steps on the unpipelined model: (final params, loss of each step)."""

    @jax.jit
    def step(params, state, x, y):
        loss, g = reference_value_and_grad(fns, params, x, y)
        upd, state = opt.update(g, state, params)
        return optax.apply_updates(params, upd), state, loss

    state, losses = opt.init(params), []
    for x, y in batches:
        params, state, loss = step(params, state, x, y)
        losses.append(float(loss))
    return params, losses


def mesh_of(D: int, P: int) -> Mesh:
    return Mesh(np.array(jax.devices()[: D * P]).reshape(D, P), ("data", "stage"))


def assert_trees_close(got, want, rel=1e-5):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape
        scale = max(float(np.max(np.abs(b))), 1e-12)
        assert float(np.max(np.abs(a - b))) <= rel * scale


def schedule_or_skip(kind: str, P: int, m: int, D: int):
    v = CHUNKED.get(kind, 1)
    try:
        return make_schedule(kind, P, m, chunks=v, replicas=D), v
    except ScheduleError as e:
        if "not implemented yet" in str(e):
            pytest.skip(str(e))
        raise


def chunked_schedule(P: int, v: int, m: int, D: int, layout, split: bool):
    """All forwards of each held chunk in stage order, then the backwards in reverse."""
    held = {p: sorted(s for s, q in enumerate(layout) if q == p) for p in range(P)}

    def program(p, r):
        ops = [F(s, j, r) for s in held[p] for j in range(m)]
        for s in reversed(held[p]):
            for j in range(m):
                ops += [B(s, j, r), W(s, j, r)] if split else [BW(s, j, r)]
        return ops

    return replicated("chunked", P, m, D, program, chunks=v, layout=tuple(layout))


def check_value_and_grad(sched, D: int, P: int, remat: bool = False, ticks=None):
    """The compiled program of `sched` (running the tick table `ticks`, None: the
    lowering's own) gives jax.value_and_grad's numbers on the tiny model."""
    fns, params = tiny_model(P * sched.chunks)
    x, y = batch(D * sched.microbatches * MB, seed=1)
    step = lower(
        ticks or sched, fns, xent, mesh_of(D, P), params, x, y, LoweringOptions(remat=remat)
    )
    loss, grads = step.value_and_grad(params, x, y)
    ref_loss, ref_grads = reference_value_and_grad(fns, params, x, y)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert_trees_close(grads, ref_grads)


@pytest.mark.parametrize(("kind", "mesh_shape"), KIND_MESHES)
def test_value_and_grad_matches_unpipelined(kind, mesh_shape):
    D, P = mesh_shape
    sched, _ = schedule_or_skip(kind, P, 4, D)
    check_value_and_grad(sched, D, P)


@pytest.mark.parametrize(("kind", "mesh_shape"), KIND_MESHES)
def test_adam_steps_match_unpipelined(kind, mesh_shape):
    (D, P), m = mesh_shape, 4
    sched, v = schedule_or_skip(kind, P, m, D)
    fns, params = tiny_model(P * v)
    opt = optax.adam(1e-2)
    x, y = batch(D * m * MB, seed=1)
    step = lower(sched, fns, xent, mesh_of(D, P), params, x, y, LoweringOptions(optimizer=opt))
    batches = [batch(D * m * MB, seed=10 + i) for i in range(5)]
    ref_params, ref_losses = unpipelined_training(fns, params, opt, batches)
    state = step.init_opt_state(params)
    for (x, y), ref_loss in zip(batches, ref_losses, strict=True):
        params, state, loss = step.train_step(params, state, x, y)
        assert abs(float(loss) - ref_loss) <= 1e-5 * abs(ref_loss)
    assert_trees_close(params, ref_params)


def test_interleaved_layout_with_fused_backward():
    sched = chunked_schedule(2, 2, 4, 2, interleaved_layout(2, 2), split=False)
    check_value_and_grad(sched, 2, 2)


def test_v_layout_with_split_backward():
    sched = chunked_schedule(4, 2, 4, 1, v_layout(4), split=True)
    check_value_and_grad(sched, 1, 4)


def test_some_stages_fused_others_split():
    """What passes.fuse_backward makes: zb-h1 with stages 1 and 3 run fused, 0 and 2 split."""
    sched = fuse_stage(fuse_stage(make_schedule("zb-h1", 4, 4), 1), 3)
    check_value_and_grad(sched, 1, 4)


def test_remat_matches_unpipelined():
    check_value_and_grad(make_schedule("1f1b", 4, 4, replicas=2), 2, 4, remat=True)


def uniform_model(num_stages: int, width: int = 6, seed: int = 0):
    """The same dense layer shape on every stage: chunks are uniform, so the
    lowering keeps their gradients as trees instead of flat rows."""
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 2 * num_stages))
    params = [
        {
            "w": jax.random.normal(next(keys), (width, width)) / np.sqrt(width),
            "b": 0.1 * jax.random.normal(next(keys), (width,)),
        }
        for _ in range(num_stages)
    ]
    return [lambda p, a: jnp.tanh(a @ p["w"] + p["b"])] * num_stages, params


def uniform_batch(n: int, seed: int, width: int = 6):
    kx, ky = jax.random.split(jax.random.PRNGKey(seed))
    return jax.random.normal(kx, (n, width)), jax.random.randint(ky, (n,), 0, width)


@pytest.mark.parametrize(
    "kind, D, P", [("1f1b", 1, 1), ("interleaved-1f1b", 2, 2)], ids=["1f1b-1x1", "interleaved-2x2"]
)
def test_uniform_stages_match_unpipelined(kind, D, P):
    sched, v = schedule_or_skip(kind, P, 4, D)
    fns, params = uniform_model(P * v)
    x, y = uniform_batch(D * 4 * MB, seed=1)
    step = lower(sched, fns, xent, mesh_of(D, P), params, x, y)
    assert step._low.param_spec.classes  # every op reads its leaves whole
    assert all(layout.same for layout in step._low.layouts)
    loss, grads = step.value_and_grad(params, x, y)
    ref_loss, ref_grads = reference_value_and_grad(fns, params, x, y)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert_trees_close(grads, ref_grads)


def class_model(num_stages: int, width: int = 8, seed: int = 0, lopsided: bool = False):
    """Dense stages of one width behind a narrower input layer, a head on the last:
    the stages differ but share most leaf sizes, so the device keeps their
    parameters in size classes (lowering/layout/param_layout.py). `lopsided`
    gives the first stage a wide input table and the last a wide projection
    before its head, of two other sizes: classes of every stage would then hold
    both on every device, so the device keeps flat rows and each chunk (the
    stages it holds share their sizes) enters classes of its own in the loop,
    with a switch on entry."""
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 5 * num_stages))
    params = []
    for s in range(num_stages):
        d_in = 2 if s == 0 else width
        p = {
            "w": jax.random.normal(next(keys), (d_in, width)) / np.sqrt(d_in),
            "b": 0.1 * jax.random.normal(next(keys), (width,)),
        }
        if s == 0 and lopsided:
            p["table"] = jax.random.normal(next(keys), (16 * width, d_in)) / np.sqrt(d_in)
        if s == num_stages - 1:
            if lopsided:
                p["wide"] = jax.random.normal(next(keys), (width, 7 * width)) / np.sqrt(width)
            p["head"] = jax.random.normal(next(keys), (width, CLASSES)) / np.sqrt(width)
        params.append(p)

    def fn(p, a):
        if "table" in p:
            a = a + jnp.tanh(a @ p["table"].T) @ p["table"] / p["table"].shape[0]
        h = jnp.tanh(a @ p["w"] + p["b"])
        if "wide" in p:
            h = jnp.tanh(h @ p["wide"]) @ p["wide"].T / p["wide"].shape[1]
        return h @ p["head"] if "head" in p else h

    return [fn] * num_stages, params


@pytest.mark.parametrize(
    "kind, D, P, lopsided",
    [("zb-h1", 1, 4, False), ("interleaved-1f1b", 2, 2, False), ("interleaved-1f1b", 2, 2, True)],
    ids=["zb-h1-1x4", "interleaved-2x2", "interleaved-2x2-in-loop"],
)
def test_size_classes_match_value_and_grad_and_adam(kind, D, P, lopsided):
    sched, v = schedule_or_skip(kind, P, 4, D)
    fns, params = class_model(P * v, lopsided=lopsided)
    x, y = uniform_batch(D * 4 * MB, seed=1, width=2)
    y = y % CLASSES
    opt = optax.adam(1e-2)
    step = lower(sched, fns, xent, mesh_of(D, P), params, x, y, LoweringOptions(optimizer=opt))
    layouts = step._low.layouts
    # The device's buffers are classes, or (lopsided) each chunk enters its own.
    assert step._low.param_spec.classes != lopsided
    assert all(layout.flat != lopsided for layout in layouts)
    assert not all(layout.same for layout in layouts)  # positions lay out differently
    # The W-pool keeps some of its leaves in size classes, at no cost in bytes.
    pool = step._low.st.w_spec
    assert pool.total_bytes() == pool.without_classes().total_bytes()
    assert any("#" in key for key in pool.sizes)
    loss, grads = step.value_and_grad(params, x, y)
    ref_loss, ref_grads = reference_value_and_grad(fns, params, x, y)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert_trees_close(grads, ref_grads)
    batches = [uniform_batch(D * 4 * MB, seed=20 + i, width=2) for i in range(3)]
    batches = [(bx, by % CLASSES) for bx, by in batches]
    ref_params, ref_losses = unpipelined_training(fns, params, opt, batches)
    state = step.init_opt_state(params)
    for (bx, by), ref in zip(batches, ref_losses, strict=True):
        params, state, loss = step.train_step(params, state, bx, by)
        assert abs(float(loss) - ref) <= 1e-5 * abs(ref)
    assert_trees_close(params, ref_params)


@pytest.mark.parametrize("kind, P, lopsided", [("zb-h1", 4, False), ("interleaved-1f1b", 2, True)])
def test_size_classes_step_inside_the_loop(kind, P, lopsided):
    """Two iterations in one call: the optimizer steps inside the loop on the
    device's classes, or (lopsided) on its flat rows, the new parameters
    re-entering the chunks' classes after each step."""
    m = 4
    sched, v = schedule_or_skip(kind, P, m, 1)
    fns, params = class_model(P * v, lopsided=lopsided)
    opt = optax.sgd(0.5, momentum=0.9)
    batches = [uniform_batch(m * MB, seed=40 + i, width=2) for i in range(2)]
    batches = [(bx, by % CLASSES) for bx, by in batches]
    xs, ys = (jnp.stack(b) for b in zip(*batches, strict=True))
    step = lower(
        PackedTicks.one_op_per_tick(sched, 2),
        fns,
        xent,
        mesh_of(1, P),
        params,
        *batches[0],
        LoweringOptions(optimizer=opt),
    )
    assert step._low.param_spec.classes != lopsided
    assert all(layout.flat != lopsided for layout in step._low.layouts)
    assert not step._low.layouts[0].same
    got, _, losses = step.train_step(params, step.init_opt_state(params), xs, ys)
    ref, want = unpipelined_training(fns, params, opt, batches)
    np.testing.assert_allclose(np.asarray(losses), want, rtol=1e-5)
    assert_trees_close(got, ref)


def test_uniform_stages_step_inside_the_loop():
    """Three iterations in one call (each stage's optimizer step inside the tick
    loop); SGD with momentum, which unlike adam sees the gradients' scale."""
    P, m = 4, 4
    fns, params = uniform_model(P)
    opt = optax.sgd(0.5, momentum=0.9)
    batches = [uniform_batch(m * MB, seed=30 + i) for i in range(3)]
    xs, ys = (jnp.stack(b) for b in zip(*batches, strict=True))
    sched = make_schedule("1f1b", P, m)
    step = lower(
        PackedTicks.one_op_per_tick(sched, 3),
        fns,
        xent,
        mesh_of(1, P),
        params,
        *batches[0],
        LoweringOptions(optimizer=opt),
    )
    got, _, losses = step.train_step(params, step.init_opt_state(params), xs, ys)
    ref, want = unpipelined_training(fns, params, opt, batches)
    np.testing.assert_allclose(np.asarray(losses), want, rtol=1e-5)
    assert_trees_close(got, ref)


def test_memory_follows_the_schedule():
    """Activation-heavy model, P=4, m=16: 1F1B keeps at most P microbatches in flight."""
    P, m, width, rows = 4, 16, 64, 512

    def dense_stack(p, a):
        for w in p["w"]:
            a = jnp.tanh(a @ w)
        return a

    keys = iter(jax.random.split(jax.random.PRNGKey(0), 4 * P))
    params = [
        {"w": [jax.random.normal(next(keys), (width, width)) / 8 for _ in range(4)]}
        for _ in range(P)
    ]
    fns = [dense_stack] * P
    x = jax.random.normal(jax.random.PRNGKey(1), (m * rows, width))
    y = jnp.zeros((m * rows,), jnp.int32)

    def loss(out, y):
        return jnp.mean(out**2) + 0.0 * y.sum()

    temp, store, plans = {}, {}, {}
    for kind in ("gpipe", "1f1b", "zb-h1"):
        try:
            sched = make_schedule(kind, P, m)
        except ScheduleError as e:
            if "not implemented yet" not in str(e):
                raise
            continue
        step = lower(sched, fns, loss, mesh_of(1, P), params, x, y)
        temp[kind] = step.memory_analysis().temp_size_in_bytes
        low = step._low
        plans[kind] = low.plan
        store[kind] = (
            low.plan.res_slots * low.st.w_spec.total_bytes()
            + low.plan.bres_slots * low.st.b_spec.total_bytes()
        )
    assert temp["1f1b"] <= temp["gpipe"] / 2, temp
    if "zb-h1" in temp:
        # As many microbatches in flight to their last backward op as 1f1b; B frees
        # the split stages' vjp residuals (their B-pool row) before W, so that pool
        # holds one fewer (stages.py).
        assert plans["zb-h1"].res_slots == plans["1f1b"].res_slots == P
        assert plans["zb-h1"].bres_slots == P - 1
        # Beyond the residual stores, the split adds only B's and W's working buffers.
        assert temp["zb-h1"] - store["zb-h1"] <= 1.5 * (temp["1f1b"] - store["1f1b"]), (
            temp,
            store,
        )


def test_bad_inputs_are_rejected_before_compiling():
    fns, params = tiny_model(4)
    x, y = batch(16, seed=1)
    sched = make_schedule("1f1b", 4, 4)
    with pytest.raises(MeshError, match="does not match"):
        lower(sched, fns, xent, mesh_of(2, 4), params, x, y)
    with pytest.raises(BatchError, match="not divisible"):
        lower(sched, fns, xent, mesh_of(1, 4), params, x[:14], y[:14])
    with pytest.raises(CutError, match="one entry per virtual stage"):
        lower(sched, fns[:3], xent, mesh_of(1, 4), params[:3], x, y)
    broken = sched.replace(programs={**sched.programs, (0, 0): sched.programs[(0, 0)][1:]})
    with pytest.raises(ScheduleError):
        lower(broken, fns, xent, mesh_of(1, 4), params, x, y)
    with pytest.raises(ValueError, match="floating scalar"):
        lower(sched, fns, lambda out, y: out, mesh_of(1, 4), params, x, y)
    with pytest.raises(ValueError, match="optimizer"):
        lower(sched, fns, xent, mesh_of(1, 4), params, x, y).init_opt_state(params)
