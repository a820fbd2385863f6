"""The mixture-of-experts reference models (models/moe.py): scanned and unrolled stacks compute the
same step, dropless routing computes every routed token, capacity routing drops exactly what does
not fit, the full-size shapes have the parameters they should, and a planned step is the plain step."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import shardplan
from shardplan.models import moe
from shardplan.models.train import reference

TINY = ["mixtral-tiny", "mixtral-tiny-dropless", "deepseek-tiny"]


def _stacked(params, n_layers: int) -> dict:
    """Unrolled parameters (a list of blocks) in the scanned layout (leaves stacked by layer)."""
    pure = nnx.to_pure_dict(params)
    blocks = pure["layers"]["blocks"]
    pure["layers"]["blocks"] = jax.tree.map(lambda *a: jnp.stack(a), *[blocks[i] for i in range(n_layers)])
    return pure


@pytest.mark.parametrize("name", TINY)
def test_scanned_and_unrolled_steps_agree(name):
    """The same parameters, stacked for the scan: the same loss and the same updated parameters;
    the loss is the cross-entropy plus aux_loss_coef times the model's load-balancing loss."""
    tx = optax.sgd(0.1)
    unrolled, scanned = reference(name, scan=False, optimizer=tx), reference(name, scan=True, optimizer=tx)
    cfg, batch = unrolled.config, unrolled.batch(4)
    params = unrolled.init(jax.random.key(0))["params"]
    stacked = jax.eval_shape(scanned.init, jax.random.key(0))["params"]     # the scanned layout
    nnx.replace_by_pure_dict(stacked, _stacked(params, cfg.n_layers))

    new_u, metrics_u = jax.jit(unrolled.train_step)({"params": params, "opt_state": tx.init(params)}, batch)
    new_s, metrics_s = jax.jit(scanned.train_step)({"params": stacked, "opt_state": tx.init(stacked)}, batch)
    loss_u, loss_s = float(metrics_u["loss"]), float(metrics_s["loss"])
    assert math.isfinite(loss_u) and math.isfinite(loss_s)
    assert loss_s == pytest.approx(loss_u, rel=1e-5)
    got, want = nnx.to_pure_dict(new_s["params"]), _stacked(new_u["params"], cfg.n_layers)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        assert bool(jnp.all(jnp.isfinite(a))), jax.tree_util.keystr(path)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))

    graphdef = nnx.graphdef(nnx.eval_shape(lambda: moe.MoEDecoder(cfg, rngs=nnx.Rngs(0))))
    logits, balance = jax.jit(lambda p, tokens: nnx.merge(graphdef, p)(tokens))(params, batch["inputs"])
    cross_entropy = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
    assert math.isfinite(float(balance)) and float(balance) > 0
    assert loss_u == pytest.approx(float(cross_entropy + cfg.aux_loss_coef * balance), rel=1e-5)


def _layer_and_input(cfg: moe.MoEConfig, batch: int = 2):
    layer = moe.MoEMLP(cfg, nnx.Rngs(3))
    x = jax.random.normal(jax.random.key(4), (batch, cfg.seq_len, cfg.d_model))
    return layer, x


def _top_k(layer, x):
    probs = jax.nn.softmax(layer.gate(x).astype(jnp.float32), axis=-1)
    weights, index = jax.lax.top_k(probs, layer.cfg.top_k)
    if layer.cfg.norm_topk:
        weights = weights / weights.sum(-1, keepdims=True)
    return weights, index


def _per_token(layer, x, keep=None):
    """Each token through each of its top-k experts, one choice at a time (gathered weights, no
    dispatch), weighted and summed; choices where ``keep`` is False left out."""
    weights, index = _top_k(layer, x)
    if keep is not None:
        weights = weights * keep
    wi_0, wi_1, wo = (layer.wi_0[...][index], layer.wi_1[...][index], layer.wo[...][index])   # [b, s, k, ...]
    h = jax.nn.silu(jnp.einsum("bsd,bskdf->bskf", x, wi_0)) * jnp.einsum("bsd,bskdf->bskf", x, wi_1)
    y = jnp.einsum("bskf,bskfd,bsk->bsd", h, wo, weights)
    if layer.shared is not None:
        s = layer.shared
        y = y + jax.nn.silu(x @ s.wi_0.kernel[...]) * (x @ s.wi_1.kernel[...]) @ s.wo.kernel[...]
    return y


def _kept(index: np.ndarray, n_experts: int, capacity: int) -> np.ndarray:
    """GShard's priority, one choice at a time: all first choices in sequence order, then all
    second choices, ...; a choice is kept while its expert has taken fewer than ``capacity``."""
    b, s, k = index.shape
    keep = np.zeros(index.shape, bool)
    for i in range(b):
        load = np.zeros(n_experts, int)
        for j in range(k):
            for t in range(s):
                e = index[i, t, j]
                if load[e] < capacity:
                    keep[i, t, j], load[e] = True, load[e] + 1
    return keep


@pytest.mark.parametrize("name", ["mixtral-tiny-dropless", "deepseek-tiny"])
def test_dropless_routing_computes_every_routed_token(name):
    cfg = dataclasses.replace(moe.CONFIGS[name], capacity_factor=None)
    layer, x = _layer_and_input(cfg)
    dispatch, combine, _ = layer.route(x)
    assert dispatch.shape == (2, cfg.seq_len, cfg.n_experts, cfg.seq_len)
    assert float(dispatch.sum()) == 2 * cfg.seq_len * cfg.top_k
    y, _ = layer(x)
    np.testing.assert_allclose(y, _per_token(layer, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name, capacity_factor", [("mixtral-tiny", 0.25), ("mixtral-tiny", 1.25),
                                                   ("deepseek-tiny", 0.5)])
def test_capacity_routing_drops_what_does_not_fit(name, capacity_factor):
    cfg = dataclasses.replace(moe.CONFIGS[name], capacity_factor=capacity_factor)
    capacity = math.ceil(capacity_factor * cfg.seq_len * cfg.top_k / cfg.n_experts)
    assert moe.expert_capacity(cfg, cfg.seq_len) == capacity
    layer, x = _layer_and_input(cfg)
    dispatch, combine, _ = layer.route(x)
    assert dispatch.shape == (2, cfg.seq_len, cfg.n_experts, capacity)
    assert float(dispatch.sum(axis=1).max()) <= 1                # one token per slot
    keep = _kept(np.asarray(_top_k(layer, x)[1]), cfg.n_experts, capacity)
    assert float(dispatch.sum()) == keep.sum()
    y, _ = layer(x)
    np.testing.assert_allclose(y, _per_token(layer, x, keep), rtol=1e-5, atol=1e-6)
    if capacity_factor < 1:
        assert not keep.all()
        assert not np.allclose(y, _per_token(layer, x), rtol=1e-3, atol=1e-4)   # the drops changed it


def test_load_balancing_loss_is_one_when_balanced_and_experts_when_collapsed():
    e, s = 8, 16
    uniform = jnp.full((1, s, e), 1.0 / e)
    assert float(moe.route(uniform, 2, s)[2][0]) == pytest.approx(1.0)
    collapsed = jax.nn.softmax(jnp.zeros((1, s, e)).at[..., :2].set(30.0), axis=-1)   # all to experts 0, 1
    assert float(moe.route(collapsed, 2, s)[2][0]) == pytest.approx(e / 2, rel=1e-6)
    grad = jax.grad(lambda p: moe.route(p, 2, s)[2].sum())(collapsed)
    assert float(jnp.abs(grad).sum()) > 0                        # it trains the router


def _formula(cfg: moe.MoEConfig) -> int:
    """Embedding and head; per layer q/k/v/o, two RMSNorm scales, router, routed and shared SwiGLU
    experts (three matrices each); the final RMSNorm."""
    d, heads, kv, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_model // cfg.n_heads
    per_layer = (2 * d * heads * hd + 2 * d * kv * hd + 2 * d + d * cfg.n_experts
                 + 3 * d * cfg.d_ff * (cfg.n_experts + cfg.shared_experts))
    return cfg.vocab * d * 2 + cfg.n_layers * per_layer + d


@pytest.mark.parametrize("name, published", [("mixtral-8x7b", 46.7e9), ("deepseek-v2-lite", None)])
def test_full_size_shapes_and_parameter_count(name, published):
    ref = reference(name, scan=True)
    cfg = ref.config
    params = jax.eval_shape(ref.init, jax.random.key(0))["params"]
    count = sum(x.size for x in jax.tree.leaves(params))
    assert count == _formula(cfg) == moe.parameter_count(cfg)
    experts = params["layers"]["blocks"]["moe"]
    assert experts["wi_0"].shape == experts["wi_1"].shape == (cfg.n_layers, cfg.n_experts, cfg.d_model, cfg.d_ff)
    assert experts["wo"].shape == (cfg.n_layers, cfg.n_experts, cfg.d_ff, cfg.d_model)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    if published is not None:
        assert count == pytest.approx(published, rel=0.005)


FALLBACK = "Involuntary full rematerialization"


PLANNED = [("mixtral-tiny", {"data": 2, "model": 4}, True),
           ("mixtral-tiny", {"expert": 8}, True),                       # expert parallelism alone
           ("mixtral-tiny", {"data": 2, "expert": 4}, True),            # with data parallelism
           ("mixtral-tiny", {"data": 2, "expert": 4}, False),
           ("mixtral-tiny", {"expert": 4, "model": 2}, True),           # with tensor parallelism
           ("deepseek-tiny", {"data": 2, "expert": 4}, False)]          # fine-grained, a shared expert


@pytest.mark.parametrize("name, axes, scan", PLANNED,
                         ids=[f"{n}-{'x'.join(f'{a}{k}' for a, k in ax.items())}-{'scan' if s else 'unrolled'}"
                              for n, ax, s in PLANNED])
def test_planned_moe_matches_the_plain_step(name, axes, scan, capfd):
    # 3 AdamW steps' losses within 1e-5 of jax.jit's; on a mesh with an `expert` axis every
    # expert weight is split over it, and the compiled all-to-all bytes are the predicted ones.
    from shardplan.compiler.hlo import collectives
    ref = reference(name, scan=scan)
    state, batch = ref.init(jax.random.key(0)), ref.batch(8)
    planned = shardplan.auto(ref.train_step, mesh=shardplan.load_mesh("cpu-8", axes=axes), time_limit=2)
    expected, got = [], []
    for step, losses in ((jax.jit(ref.train_step), expected), (planned, got)):
        s = state
        for _ in range(3):
            s, metrics = step(s, batch)
            losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert not planned.plan.warnings
    assert FALLBACK not in capfd.readouterr().err
    if "expert" in axes:
        experts = [r for r in planned.plan.inputs if "['params']" in r.name and "['moe']['w" in r.name]
        assert experts and all(any("expert" in ax for ax in r.spec) for r in experts), \
            [(r.name, r.spec) for r in experts]
        text = planned.lower(state, batch).compile().as_text()
        compiled = sum(c.nbytes * c.count for c in collectives(text, planned.plan.jax_mesh()) if c.kind == "all-to-all")
        assert compiled == pytest.approx(planned.plan.cost.comm_bytes_by_kind.get("all-to-all", 0), rel=1e-4)


@pytest.mark.parametrize("bad, match", [
    (dict(top_k=9), r"top_k=9: .*between 1 and 8"),
    (dict(top_k=0), r"top_k=0"),
    (dict(capacity_factor=0.0), r"capacity_factor=0.0: give a positive factor"),
    (dict(shared_experts=-1), r"shared_experts=-1"),
])
def test_bad_moe_configs_are_refused_naming_the_field(bad, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(moe.CONFIGS["mixtral-tiny"], **bad)


def test_experts_split_within_pipeline_stages_train_like_the_plain_step():
    # Expert parallelism with pipeline, data and FSDP-style splits at once: the layers' stacked
    # experts over `stage` and `expert` (and their embedding dimension over `data`), GPipe over 2
    # stages x 4 microbatches; the balance loss rides in the pipeline's carry.
    from shardplan.parallel.pipeline import PipelineConfig
    ref = reference("mixtral-tiny", scan=True, n_layers=4)
    state, batch = ref.init(jax.random.key(0)), ref.batch(16)
    f = shardplan.auto(ref.train_step, mesh=shardplan.load_mesh("cpu-8", axes={"stage": 2, "data": 2, "expert": 2}),
                       time_limit=3, pipeline=PipelineConfig(2, 4))
    got, want = state, state
    for _ in range(3):
        got, got_metrics = f(got, batch)
        want, want_metrics = jax.jit(ref.train_step)(want, batch)
        np.testing.assert_allclose(got_metrics["loss"], want_metrics["loss"], rtol=1e-5)
    assert not f.plan.warnings


@pytest.mark.xfail(strict=True, reason=(
    "mispriced since the reduce-scatter order rule (compiler/cost.py _reduction): the planner now puts the "
    "layers' stacked experts over ('data', 'expert') with the stage dimension over 'expert', and there XLA "
    "gathers each layer's weight gradient whole inside the microbatch loop before writing it into the stacked "
    "gradient (31.5 MiB of collectives compiled against 9.4 MiB predicted on cpu-8; the plan below, 7.5 MiB). "
    "The stacked write's reshard is not priced as XLA runs it"))
def test_experts_split_within_pipeline_stages_keep_their_stage_and_expert_axes():
    from shardplan.parallel.pipeline import PipelineConfig
    ref = reference("mixtral-tiny", scan=True, n_layers=4)
    state, batch = jax.eval_shape(ref.init, jax.random.key(0)), ref.batch(16, abstract=True)
    plan = shardplan.plan(ref.train_step, state, batch, mesh=shardplan.load_mesh(
        "cpu-8", axes={"stage": 2, "data": 2, "expert": 2}), time_limit=3, pipeline=PipelineConfig(2, 4), cache=False)
    experts = [r for r in plan.inputs if "['params']" in r.name and "['moe']['w" in r.name]
    assert experts and all(r.spec[:2] == (("stage",), ("expert",))
                           for r in experts), [(r.name, r.spec) for r in experts]
