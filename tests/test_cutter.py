"""The stage cutter on the models people train: pytree boundaries (masks,
integer positions), remat/jit/vmap'd blocks, tied embeddings (linen and NNX),
HF-style dict inputs, and the cut report. Cut-only tests compose the stage
functions; pipelined ones compare with jax.value_and_grad of the plain model."""

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import pjit_pipe as pp
from pjit_pipe.frontend import cut_module
from pjit_pipe.frontend.cutter.analysis import liveness
from pjit_pipe.frontend.opt_state import merge_opt_state, split_opt_state
from pjit_pipe.models import CNN, GPT2LM, GPT2Config, gpt2_batch, lm_loss
from pjit_pipe.runtime.checkpoint import Checkpoints
from tests.numerics import rel_err
from tests.test_frontend import compose


class MaskedCarry(nn.Module):
    """(hidden, bool mask, int positions) cross every marker; the mask is made from x."""

    @nn.compact
    def __call__(self, x):
        mask = x[..., 0] > 0
        pos = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
        h = nn.Dense(8, name="inp")(x)
        for i in range(3):
            h, mask, pos = pp.boundary((h, mask, pos))
            h = h + jnp.tanh(nn.Dense(8, name=f"blk{i}")(h)) * mask[..., None]
            h = h + 0.01 * pos[..., None]
        return nn.Dense(2, name="out")(h).mean(1)


class Block(nn.Module):
    @nn.compact
    def __call__(self, h):
        return h + jnp.tanh(nn.Dense(h.shape[-1])(h))


class Transformed(nn.Module):
    """Blocks wrapped in nn.remat, nn.jit and nn.vmap: each is one clean cut."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8, name="inp")(x)
        h = nn.remat(Block)(name="remat")(h)
        h = nn.jit(Block)(name="jit")(h)
        vmapped = nn.vmap(
            Block, variable_axes={"params": None}, split_rngs={"params": False}, in_axes=0
        )
        h = vmapped(name="vmap")(h)
        return nn.Dense(2, name="out")(h)


class NNXRematBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, h):
        return h + nnx.remat(lambda lin, h: jnp.tanh(lin(h)))(self.lin, h)


class NNXTiedLM(nnx.Module):
    """An NNX embedding used for lookup and as the head (Embed.attend); remat'd blocks."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(32, 8, rngs=rngs)
        self.blocks = nnx.List([NNXRematBlock(rngs) for _ in range(3)])

    def __call__(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.embed.attend(h)


def test_pytree_boundary_carries_mask_and_integer_positions():
    x = jax.random.normal(jax.random.key(1), (4, 5, 3))
    model = MaskedCarry()
    params = jax.jit(model.init)(jax.random.key(0), x)
    cut = cut_module(model, params, x, 4)
    assert [cut.events[b].kind for b in cut.bounds[1:]] == ["boundary"] * 3
    dtypes = [a.dtype for a in cut.events[cut.bounds[1]].act]
    assert dtypes == [jnp.float32, jnp.bool_, jnp.int32]
    out = jax.jit(lambda p, x: compose(cut, p, x))(params, x)
    assert rel_err(out, model.apply(params, x)) < 1e-6


def test_remat_jit_vmap_blocks_are_clean_cuts():
    x = jax.random.normal(jax.random.key(1), (4, 3))
    model = Transformed()
    params = jax.jit(model.init)(jax.random.key(0), x)
    cut = cut_module(model, params, x, 4)
    assert cut.keys == (("inp",), ("remat",), ("jit",), ("out", "vmap"))
    out = jax.jit(lambda p, x: compose(cut, p, x))(params, x)
    assert rel_err(out, model.apply(params, x)) < 1e-6


def test_cuts_on_several_threads_leave_linen_untouched():
    """Failure variants compile on several threads (runtime/variants.py), each
    tracing the model. The cutter's hooks into linen's transforms must not leak
    between them: swapped in and out per cut, they raced and left a finished
    cut's hook in place, and every later linen trace of a transformed child
    then failed; and two traces at once saw each other's modules (one runs at a
    time now). Afterwards a plain init and apply run as before."""
    import threading

    x = jax.random.normal(jax.random.key(1), (4, 3))
    model = Transformed()
    params = jax.jit(model.init)(jax.random.key(0), x)
    want = model.apply(params, x)
    errors: list[BaseException] = []

    def cut_repeatedly():
        try:
            for _ in range(4):
                cut = cut_module(model, params, x, 4)
                assert cut.keys == (("inp",), ("remat",), ("jit",), ("out", "vmap"))
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=cut_repeatedly) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    again = model.init(jax.random.key(0), x)  # no cut active: linen as it was
    assert rel_err(model.apply(again, x), want) < 1e-6


def test_liveness_looks_into_remat_jit_scan_and_cond():
    def f(a, b, c, d):
        u = jax.checkpoint(lambda a, b: a * 2)(a, b)  # b unused inside
        v = jax.jit(lambda c, d: c + 1)(c, d)  # d unused inside
        s, _ = jax.lax.scan(lambda carry, _: (carry * u, None), v, None, length=3)
        return jax.lax.cond(True, lambda s, b: s, lambda s, b: -s, s, b)

    avals = [jax.ShapeDtypeStruct((2,), jnp.float32)] * 4
    live = liveness(jax.make_jaxpr(f)(*avals).jaxpr)
    assert live.used == (True, False, True, False)


def test_hf_style_dict_input_tied_embedding_cut():
    """The cut only (test_hf_style_lm_tied_remat_mask_matches_jax runs it)."""
    cfg = GPT2Config(remat=True)
    model = GPT2LM(cfg)
    x, _ = gpt2_batch(jax.random.key(1), 4, cfg)
    params = jax.eval_shape(lambda k: model.init(k, **x), jax.random.key(0))
    cut = cut_module(model, params, x, 4)
    assert cut.shared == {"wte": (0, 3)}
    assert [len(cut.events[b].act) for b in cut.bounds[1:]] == [2, 2, 2]  # (hidden, mask)
    report = cut.describe()
    assert "shared wte: held by stages 0, 3" in report
    assert "int32[4, 16]" in report and "float32[4, 16, 32]" in report


def test_nnx_embed_attend_is_shared():
    model = NNXTiedLM(nnx.Rngs(0))
    ids = jax.random.randint(jax.random.key(1), (4, 6), 0, 32)
    pm = pp.pipeline(model, stages=2, microbatches=2, schedule="1f1b")
    params = pm.init(None, None)
    cut = pm.cut(params, ids)
    assert cut.shared == {"embed": (0, 1)}
    out = jax.jit(lambda p, x: compose(cut, p, x))(params, ids)
    assert rel_err(out, model(ids)) < 1e-6


class ScanBlock(nn.Module):
    dropout: float = 0.0

    @nn.compact
    def __call__(self, h, mask):
        h_new = jnp.tanh(nn.Dense(h.shape[-1])(h))
        if self.dropout:
            h_new = nn.Dropout(self.dropout, deterministic=False)(h_new)
        return h + h_new * mask, None


class YsBlock(nn.Module):
    @nn.compact
    def __call__(self, h, mask):
        h = h + jnp.tanh(nn.Dense(h.shape[-1])(h)) * mask
        return h, h


class ScanStack(nn.Module):
    """MaxText's layout: one nn.scan over `layers` blocks with stacked parameters; a
    mask made from x is broadcast to every iteration. `ys`: return the per-layer
    outputs too (which stops cuts between iterations). `dropout`: in every block,
    with one dropout key per layer (split_rngs)."""

    layers: int = 6
    ys: bool = False
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x):
        mask = (x[..., :1] > -1.0).astype(x.dtype)
        h = nn.Dense(8, name="inp")(x)
        stack = nn.scan(
            YsBlock if self.ys else functools.partial(ScanBlock, dropout=self.dropout),
            variable_axes={"params": 0},
            split_rngs={"params": True, "dropout": True},
            in_axes=(nn.broadcast,),
            length=self.layers,
        )
        h, _ = stack(name="stack")(h, mask)
        return nn.Dense(2, name="out")(h)


def test_scan_stack_is_cut_between_iterations():
    x = jax.random.normal(jax.random.key(1), (2, 3))
    model = ScanStack()
    params = jax.jit(model.init)(jax.random.key(0), x)
    cut = cut_module(model, params, x, 4)
    assert cut.keys == (
        ("inp", "stack[0:1]"),
        ("stack[1:3]",),
        ("stack[3:5]",),
        ("out", "stack[5:6]"),
    )
    assert "stage 0: inp, stack[0]\n" in cut.describe()
    assert "stage 1 (cut before stack[1]): stack[1], stack[2]\n" in cut.describe()
    stage_params = cut.split(params)
    assert stage_params[1]["stack[1:3]"]["Dense_0"]["kernel"].shape == (2, 8, 8)
    np.testing.assert_array_equal(
        stage_params[2]["stack[3:5]"]["Dense_0"]["kernel"],
        params["params"]["stack"]["Dense_0"]["kernel"][3:5],
    )
    assert jax.tree.all(jax.tree.map(np.array_equal, cut.merge(stage_params), params))
    composed = jax.jit(lambda p, x: compose(cut, p, x))(params, x)
    assert rel_err(composed, jax.jit(model.apply)(params, x)) < 1e-6
    # adam's moments follow the rows, and merge back into optimizer.init's tree
    opt = optax.adam(1e-3)
    state = jax.tree.map(lambda a: a + 1.0, opt.init(params))
    stage_states = split_opt_state(cut, state, params)
    assert stage_states[1][0].mu["stack[1:3]"]["Dense_0"]["bias"].shape == (2, 8)
    merged = merge_opt_state(cut, stage_states, state, params)
    assert jax.tree.all(jax.tree.map(np.array_equal, merged, state))


def test_scan_whose_per_layer_outputs_are_used_is_named_when_it_blocks_a_cut():
    x = jnp.ones((2, 3))
    model = ScanStack(layers=4, ys=True)
    params = jax.eval_shape(model.init, jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"stack \(nn.scan\) runs its layers inside one scan"):
        cut_module(model, params, x, 4)
    with pytest.warns(UserWarning, match="imbalanced"):
        assert cut_module(model, params, x, 3).keys == (("inp",), ("stack",), ("out",))


class JitRoot(nn.Module):
    """gemma's Transformer layout: nn.jit (static argument names) on the root's call."""

    @functools.partial(nn.jit, static_argnames=("self", "scale"))
    @nn.compact
    def __call__(self, x, scale=2.0):
        return nn.Dense(2, name="b")(jnp.tanh(nn.Dense(4, name="a")(x))) * scale


def _logged(fn):
    @functools.wraps(fn)
    def logged(self, x):
        return fn(self, x)

    return logged


class LoggedJitRoot(nn.Module):
    """nn.jit under another decorator: not seen through."""

    @_logged
    @nn.jit
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2, name="b")(jnp.tanh(nn.Dense(4, name="a")(x)))


class RematRoot(nn.Module):
    @nn.remat
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2, name="b")(jnp.tanh(nn.Dense(4, name="a")(x)))


def test_jit_on_the_root_is_seen_through_and_a_hidden_one_refused_by_name():
    x = jax.random.normal(jax.random.key(1), (2, 3))
    for root in (JitRoot(), RematRoot()):
        params = jax.jit(root.init)(jax.random.key(0), x)
        cut = cut_module(root, params, x, 2)
        assert cut.keys == (("a",), ("b",))
        out = jax.jit(lambda p, x, cut=cut: compose(cut, p, x))(params, x)
        assert rel_err(out, root.apply(params, x)) < 1e-6
    params = jax.eval_shape(LoggedJitRoot().init, jax.random.key(0), x)
    with pytest.raises(
        ValueError, match=r"LoggedJitRoot.__call__ runs inside a Flax transform that"
    ) as refusal:
        cut_module(LoggedJitRoot(), params, x, 2)
    assert "__wrapped__" in str(refusal.value)


class BlockList(nn.Module):
    """Hugging Face's layout: a collection module that calls numbered blocks."""

    layers: int

    def setup(self):
        self.blocks = [Block(name=str(i)) for i in range(self.layers)]

    def __call__(self, h):
        for block in self.blocks:
            h = block(h)
        return h


class Decoder(nn.Module):
    def setup(self):
        self.embed = nn.Dense(8)
        self.layers = BlockList(3)
        self.norm = nn.LayerNorm()

    def __call__(self, x):
        return self.norm(self.layers(self.embed(x)))


class Wrapped(nn.Module):
    """Blocks two levels down (model.layers.N), a head beside the decoder."""

    def setup(self):
        self.model = Decoder()
        self.head = nn.Dense(2)

    def __call__(self, x):
        return self.head(self.model(x))


def test_blocks_deep_in_the_model_are_cut_and_split_points_name_any_depth():
    x = jax.random.normal(jax.random.key(1), (2, 3))
    model = Wrapped()
    params = jax.jit(model.init)(jax.random.key(0), x)
    want = model.apply(params, x)
    cut = cut_module(model, params, x, 3)
    assert [cut.events[b].name for b in cut.bounds[1:]] == ["model.layers.1", "model.layers.2"]
    assert cut.keys[1] == ("model/layers/1",)
    assert "stage 1 (cut before model.layers.1): model.layers.1\n" in cut.describe()
    out = jax.jit(lambda p, x: compose(cut, p, x))(params, x)
    assert rel_err(out, want) < 1e-6
    # A point inside a block is found (the block becomes a container), and refused
    # by what the code after it reads: the block's residual input.
    with pytest.raises(
        ValueError,
        match=r"'model.layers.1.Dense_0' is not a clean cut: .* the output of model.layers.0",
    ):
        cut_module(model, params, x, 2, split_points=["model.layers.1.Dense_0"])
    with pytest.raises(ValueError, match=r"unknown cut point 'model.layer.1'.*'model.layers.1'"):
        cut_module(model, params, x, 2, split_points=["model.layer.1"])


class TiedHeads(nn.Module):
    """An embedding whose table the head applies without calling the embedding:
    through another module's `apply` with the transposed table (Hugging Face's
    GPT-2), a plain `h @ table.T`, or `Embed.attend`."""

    head: str

    def setup(self):
        self.wte = nn.Embed(16, 8)
        self.blocks = [Block(name=f"block{i}") for i in range(2)]
        self.lm_head = nn.Dense(16, use_bias=False)

    def __call__(self, ids):
        h = self.wte(ids)
        for block in self.blocks:
            h = block(h)
        table = self.variables["params"]["wte"]["embedding"]
        if self.head == "apply":
            return self.lm_head.apply({"params": {"kernel": table.T}}, h)
        if self.head == "matmul":
            return h @ table.T
        return self.wte.attend(h)


@pytest.mark.parametrize("head", ["apply", "matmul", "attend"])
def test_heads_that_apply_a_tied_table_share_it(head):
    ids = jax.random.randint(jax.random.key(1), (2, 5), 0, 16)
    model = TiedHeads(head)
    params = jax.jit(model.init)(jax.random.key(0), ids)
    cut = cut_module(model, params, ids, 2)
    assert cut.shared == {"wte": (0, 1)}
    out = jax.jit(lambda p, x: compose(cut, p, x))(params, ids)
    assert rel_err(out, model.apply(params, ids)) < 1e-6


class SkipOver(nn.Module):
    """a's output is added after c: the cuts before b and c are not clean."""

    @nn.compact
    def __call__(self, x):
        a = nn.Dense(4, name="a")(x)
        h = nn.Dense(4, name="c")(nn.Dense(4, name="b")(a)) + a
        return nn.Dense(4, name="d")(h)


def test_refusal_names_each_dropped_cut_and_what_it_reads():
    x = jnp.ones((2, 4))
    params = jax.eval_shape(SkipOver().init, jax.random.key(0), x)
    with pytest.raises(
        ValueError,
        match=r"1 clean cut points \(d\).*cuts dropped .*: c \(the code after it reads the output of a\)",
    ):
        cut_module(SkipOver(), params, x, 3)
    with pytest.raises(ValueError, match=r"split_points: 'c' is not a clean cut: .*output of a"):
        cut_module(SkipOver(), params, x, 2, split_points=["c"])
    assert cut_module(SkipOver(), params, x, 2, split_points=["d"]).keys == (
        ("a", "b", "c"),
        ("d",),
    )


def test_imbalanced_cut_warns_and_describe_reports_it():
    x = jnp.ones((2, 256))
    lopsided = nn.Sequential([nn.Dense(256), nn.Dense(4), nn.Dense(4)])
    params = lopsided.init(jax.random.key(0), x)
    with pytest.warns(UserWarning, match=r"imbalanced.*largest [0-9.]+x the mean"):
        cut = cut_module(lopsided, params, x, 3)
    assert "imbalance (largest / mean cost)" in cut.describe()
    even = nn.Sequential([nn.Dense(8) for _ in range(4)])
    params = even.init(jax.random.key(0), x[:, :8])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cut_module(even, params, x[:, :8], 4)


def test_flax_docs_cnn_cuts_at_its_layers():
    """The cut only (test_flax_docs_cnn_pipelines runs it)."""
    x = jax.random.normal(jax.random.key(1), (2, 8, 8, 1))
    model = CNN()
    params = jax.eval_shape(model.init, jax.random.key(0), x)  # shapes suffice
    cut = cut_module(model, params, x, 4)
    assert cut.keys == (("Conv_0",), ("Conv_1",), ("Dense_0",), ("Dense_1",))


# ---- pipelined: loss and gradients equal jax.value_and_grad ----


def _gpt2_case(mesh, kind, remat=True, batch=8, microbatches=2):
    cfg = GPT2Config(remat=remat)
    model = GPT2LM(cfg)
    x, y = gpt2_batch(jax.random.key(1), batch, cfg)
    pm = pp.pipeline(model, stages=4, microbatches=microbatches, schedule=kind, mesh=mesh)
    params = jax.jit(lambda k: model.init(k, **x))(jax.random.key(0))
    loss, grads = pm.value_and_grad(lm_loss)(params, x, y)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(lambda p: lm_loss(model.apply(p, **x), y)))(
        params
    )
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    assert rel_err(loss, ref_loss) < 1e-5
    assert rel_err(grads, ref_grads) < 1e-5


def test_hf_style_lm_tied_remat_mask_matches_jax():
    """One quick case: dict input, (hidden, mask) carry, tied head, remat'd blocks."""
    _gpt2_case(pp.make_mesh(data=1, stage=4), "1f1b")


# The quick test runs 1x4 1f1b; the suite adds the opposite corner (2x4 zb-h1).
# Every (mesh, kind) pair of 1x4/2x4 x 1f1b/zb-h1 passed when this landed; the
# suite keeps two to stay within its time budget.
MATRIX = [(2, "zb-h1")]


@pytest.mark.slow
@pytest.mark.parametrize("data,kind", MATRIX)
def test_hf_style_lm_matrix(data, kind):
    _gpt2_case(pp.make_mesh(data=data, stage=4), kind, remat=data == 1)


@pytest.mark.slow
@pytest.mark.parametrize("data,kind", [(1, "1f1b"), (2, "zb-h1")])
def test_masked_carry_matrix(data, kind):
    model = MaskedCarry()
    x = jax.random.normal(jax.random.key(1), (8, 5, 3))
    y = jax.random.normal(jax.random.key(2), (8, 2))
    pm = pp.pipeline(
        model, stages=4, microbatches=2, schedule=kind, mesh=pp.make_mesh(data=data, stage=4)
    )
    params = jax.jit(pm.init)(jax.random.key(0), x)
    mse = lambda out, y: jnp.mean((out - y) ** 2)  # noqa: E731
    loss, grads = pm.value_and_grad(mse)(params, x, y)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(lambda p: mse(model.apply(p, x), y)))(params)
    assert rel_err(loss, ref_loss) < 1e-5
    assert rel_err(grads, ref_grads) < 1e-5


def _scan_case(data, kind, dropout=0.0):
    """An nn.scan stack of 6 layers cut into 4 stages: loss and gradients (stacked,
    in the module's tree) equal jax.value_and_grad's; with dropout, that of the
    unpipelined model applied to each microbatch i with key fold_in(key, i)."""
    model = ScanStack(dropout=dropout)
    x = jax.random.normal(jax.random.key(1), (8, 3))
    y = jax.random.normal(jax.random.key(2), (8, 2))
    pm = pp.pipeline(
        model, stages=4, microbatches=2, schedule=kind, mesh=pp.make_mesh(data=data, stage=4)
    )
    params = jax.jit(model.init)(jax.random.key(0), x)
    mse = lambda out, y: jnp.mean((out - y) ** 2)  # noqa: E731
    key, count = jax.random.key(7), 2 * data
    rows = len(x) // count

    def reference(p):
        losses = [
            mse(
                model.apply(
                    p, x[i * rows : (i + 1) * rows], rngs={"dropout": jax.random.fold_in(key, i)}
                ),
                y[i * rows : (i + 1) * rows],
            )
            for i in range(count)
        ]
        return jnp.mean(jnp.stack(losses))

    loss, grads = pm.value_and_grad(mse)(params, x, y, rngs=key if dropout else None)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(reference))(params)
    assert pm.cut(params, x).rows == {
        "stack[0:1]": (0, 1),
        "stack[1:3]": (1, 3),
        "stack[3:5]": (3, 5),
        "stack[5:6]": (5, 6),
    }
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    assert rel_err(loss, ref_loss) < 1e-5
    assert rel_err(grads, ref_grads) < 1e-5


def test_scan_stack_with_dropout_in_four_stages_matches_jax():
    """Each stage also takes its rows of the per-layer dropout keys."""
    _scan_case(1, "1f1b", dropout=0.5)


# 2x4 zb-h1 here; 1x4 1f1b, 1x4 zb-h1 and 2x4 1f1b passed when this landed.
@pytest.mark.slow
def test_scan_stack_in_four_stages_matrix():
    _scan_case(2, "zb-h1")


@pytest.mark.slow
def test_scan_stack_trains_like_optax_and_checkpoints_in_the_module_layout(tmp_path):
    """Clipped adam on a scan stack split over 4 stages: three steps equal plain
    optax; the module-layout state (one stacked tree) round-trips a checkpoint."""
    model = ScanStack()
    x = jax.random.normal(jax.random.key(1), (8, 3))
    y = jax.random.normal(jax.random.key(2), (8, 2))
    opt = optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2, eps=1e-3))
    pm = pp.pipeline(
        model,
        stages=4,
        microbatches=2,
        schedule="1f1b",
        mesh=pp.make_mesh(data=2, stage=4),
        optimizer=opt,
    )
    params = jax.jit(pm.init)(jax.random.key(0), x)
    mse = lambda out, y: jnp.mean((out - y) ** 2)  # noqa: E731
    step = pm.train_step(mse)
    state = step.init(params, (x, y))
    ref_p, ref_o = params, opt.init(params)

    @jax.jit
    def reference_step(ref_p, ref_o):
        ref_loss, g = jax.value_and_grad(lambda p: mse(model.apply(p, x), y))(ref_p)
        upd, ref_o = opt.update(g, ref_o, ref_p)
        return optax.apply_updates(ref_p, upd), ref_o, ref_loss, optax.global_norm(g)

    for _ in range(3):
        state, loss = step(state, (x, y))
        ref_p, ref_o, ref_loss, norm = reference_step(ref_p, ref_o)
        assert float(norm) > 0.2  # the clip is active
        assert rel_err(loss, ref_loss) < 1e-5
    assert rel_err(state.params, ref_p) < 1e-5
    assert rel_err(state.opt_state[1][0].mu, ref_o[1][0].mu) < 1e-5
    saved = state.module_state()
    checkpoints = Checkpoints(tmp_path, every=1)
    assert checkpoints.save(state)
    checkpoints.wait()
    restored, _ = checkpoints.restore(step, (x, y), jax.eval_shape(lambda: params))
    checkpoints.close()
    assert jax.tree.all(jax.tree.map(np.array_equal, restored.params, saved["params"]))
    assert jax.tree.all(jax.tree.map(np.array_equal, restored.opt_state, saved["opt_state"]))


@pytest.mark.slow
def test_nnx_tied_lm_matches_jax():
    model = NNXTiedLM(nnx.Rngs(0))
    ids = jax.random.randint(jax.random.key(1), (8, 6), 0, 32)
    targets = jnp.roll(ids, -1, axis=1)
    pm = pp.pipeline(
        model, stages=4, microbatches=2, schedule="zb-h1", mesh=pp.make_mesh(data=2, stage=4)
    )
    params = pm.init(None, None)
    loss, grads = pm.value_and_grad(lm_loss)(params, ids, targets)
    ref_loss, ref_grads = nnx.value_and_grad(lambda m: lm_loss(m(ids), targets))(model)
    assert rel_err(loss, ref_loss) < 1e-5
    assert rel_err(grads, nnx.to_pure_dict(ref_grads)) < 1e-5


@pytest.mark.slow
def test_tied_clipped_adam_steps_match_optax_and_copies_stay_equal():
    cfg = GPT2Config(n_layers=3)
    model = GPT2LM(cfg)
    x, y = gpt2_batch(jax.random.key(1), 8, cfg)
    # The key bias of attention has a zero gradient in exact arithmetic; adam's
    # default eps would turn its rounding noise into full-size steps in either run.
    # The clip is active (the gradient norm is far above 0.1): it must see the
    # tied embedding once, although two stages hold it.
    opt = optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2, eps=1e-3))
    pm = pp.pipeline(
        model,
        stages=4,
        microbatches=2,
        schedule="1f1b",
        mesh=pp.make_mesh(data=2, stage=4),
        optimizer=opt,
    )
    params = jax.jit(pm.init)(jax.random.key(0), x)
    step = pm.train_step(lm_loss)
    state = step.init(params, (x, y))
    ref_p, ref_o = params, opt.init(params)

    @jax.jit
    def reference_step(ref_p, ref_o):
        ref_loss, g = jax.value_and_grad(lambda p: lm_loss(model.apply(p, **x), y))(ref_p)
        upd, ref_o = opt.update(g, ref_o, ref_p)
        return optax.apply_updates(ref_p, upd), ref_o, ref_loss, optax.global_norm(g)

    for _ in range(3):
        state, loss = step(state, (x, y))
        ref_p, ref_o, ref_loss, norm = reference_step(ref_p, ref_o)
        assert float(norm) > 0.2
        assert rel_err(loss, ref_loss) < 1e-5
    assert rel_err(state.params, ref_p) < 1e-5
    # Both holders' copies of the embedding, as the program returns them, agree to
    # rounding: the same update, fused differently in each stage's branch.
    cut, program = pm.program(state.params, x, y, lm_loss)
    assert cut.shared == {"wte": (0, 3)}
    opt_stages = split_opt_state(cut, state.opt_state, state.params)
    stage_params, opt_stages, x, y = pm.place((cut.split(state.params), opt_stages, x, y))
    stage_params, _, _ = program.train_step(stage_params, opt_stages, x, y)
    first, last = stage_params[0]["wte"]["embedding"], stage_params[3]["wte"]["embedding"]
    np.testing.assert_allclose(first, last, rtol=1e-6, atol=1e-7)
    before = np.asarray(state.params["params"]["wte"]["embedding"])
    assert float(np.max(np.abs(np.asarray(first) - before))) > 1e-4


@pytest.mark.slow
def test_tied_lm_through_a_failure_matches_jax():
    cfg = GPT2Config(remat=False)
    model = GPT2LM(cfg)
    x, y = gpt2_batch(jax.random.key(1), 8, cfg)
    pm = pp.pipeline(
        model, stages=4, microbatches=2, schedule="1f1b", mesh=pp.make_mesh(data=2, stage=4)
    )
    params = jax.jit(pm.init)(jax.random.key(0), x)
    loss, grads = pm.with_failures([(0, 3)]).value_and_grad(lm_loss)(params, x, y)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(lambda p: lm_loss(model.apply(p, **x), y)))(
        params
    )
    assert rel_err(loss, ref_loss) < 1e-5
    assert rel_err(grads, ref_grads) < 1e-5


@pytest.mark.slow
def test_flax_docs_cnn_pipelines():
    model = CNN()
    x = jax.random.normal(jax.random.key(1), (8, 8, 8, 1))
    labels = jax.random.randint(jax.random.key(2), (8,), 0, 10)
    xent = lambda out, y: optax.softmax_cross_entropy_with_integer_labels(out, y).mean()  # noqa: E731
    pm = pp.pipeline(model, stages=4, microbatches=2, schedule="zb-h1")
    params = jax.jit(pm.init)(jax.random.key(0), x)
    loss, grads = pm.value_and_grad(xent)(params, x, labels)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(lambda p: xent(model.apply(p, x), labels)))(
        params
    )
    assert rel_err(loss, ref_loss) < 1e-5
    assert rel_err(grads, ref_grads) < 1e-5


def _hf_blocks_lm():
    """HF transformers' own Flax GPT-2 block (attention mask, causal attention) in a
    root that keeps the blocks at the top level, with the head tied to wte."""
    transformers = pytest.importorskip("transformers")
    hf_gpt2 = pytest.importorskip(
        "transformers.models.gpt2.modeling_flax_gpt2",
        reason="transformers 5 has no Flax modules: pip install -e '.[models]' for transformers 4",
    )
    FlaxGPT2Block = hf_gpt2.FlaxGPT2Block

    class HFBlocksLM(nn.Module):
        config: transformers.GPT2Config

        def setup(self):
            c = self.config
            self.wte = nn.Embed(c.vocab_size, c.n_embd)
            self.wpe = nn.Embed(c.n_positions, c.n_embd)
            self.h = [FlaxGPT2Block(c, name=str(i)) for i in range(c.n_layer)]
            self.ln_f = nn.LayerNorm(epsilon=c.layer_norm_epsilon)

        def __call__(self, input_ids, attention_mask, position_ids):
            h = self.wte(input_ids) + self.wpe(position_ids)
            for block in self.h:
                h = block(h, attention_mask, deterministic=True)[0]
            return self.wte.attend(self.ln_f(h))

    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=4, n_head=2)
    return HFBlocksLM(config)


@pytest.mark.slow
def test_hf_transformers_gpt2_blocks_match_jax():
    model = _hf_blocks_lm()
    x, y = gpt2_batch(jax.random.key(1), 8, GPT2Config())
    pm = pp.pipeline(
        model, stages=4, microbatches=2, schedule="zb-h1", mesh=pp.make_mesh(data=2, stage=4)
    )
    params = jax.jit(pm.init)(jax.random.key(0), x)
    assert pm.cut(params, x).shared == {"wte": (0, 3)}
    loss, grads = pm.value_and_grad(lm_loss)(params, x, y)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(lambda p: lm_loss(model.apply(p, **x), y)))(
        params
    )
    assert rel_err(loss, ref_loss) < 1e-5
    assert rel_err(grads, ref_grads) < 1e-5
