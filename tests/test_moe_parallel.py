"""Expert parallelism and GPipe pipeline parallelism on the 8 simulated CPU devices equal the
one-device computation (outputs and gradients)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.tolerances import EXACT_GRAD, assert_close
from xformers_jax import experts as M
from xformers_jax import parallel

T, D, H, E = 64, 8, 16, 8
_O0 = dict(compiler_options={"xla_backend_optimization_level": 0})


def _setup():
    k = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(k[0], (T, D))
    wr = jax.random.normal(k[1], (D, E))
    w = M.init_expert_weights(k[2], E, D, H)
    mask = jax.random.uniform(k[3], (T,)) < 0.9
    return x, wr, w, mask


def _loss(fn, x, wr, w, mask):
    y, aux = fn(x, wr, w, mask=mask)
    return (jnp.sin(y) * jnp.arange(D)).sum() + aux["load_balancing"] + aux["router_z"], (y, aux)


_ONE = {}


def _one_device(one):
    # The one-device reference is the same for every mesh: computed once.
    if not _ONE:
        x, wr, w, mask = _setup()
        _ONE["r"] = jax.jit(jax.value_and_grad(functools.partial(_loss, one), argnums=(0, 1, 2),
                                               has_aux=True), **_O0)(x, wr, w, mask)
    return _ONE["r"]


@pytest.mark.parametrize("sizes", [{"data": 2, "expert": 4}, {"fsdp": 2, "expert": 4},
                                   {"expert": 8}])
def test_expert_parallel_equals_one_device(sizes):
    x, wr, w, mask = _setup()
    mesh = parallel.make_mesh(sizes)
    kw = dict(k=2, capacity_factor=1.0)
    ep = functools.partial(M.expert_parallel_moe, mesh=mesh, **kw)
    one = functools.partial(M.grouped_moe, groups=8, **kw)
    g = lambda fn: jax.jit(jax.value_and_grad(  # noqa: E731
        functools.partial(_loss, fn), argnums=(0, 1, 2), has_aux=True), **_O0)(x, wr, w, mask)
    (l1, (y1, a1)), g1 = g(ep)
    (l0, (y0, a0)), g0 = _one_device(one)
    assert_close(y1, y0)
    assert_close(l1, l0)
    for k in a0:
        assert_close(a1[k], a0[k])
    assert float(a0["dropped_fraction"]) > 0  # capacity 1.0 drops something: a real test
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        assert_close(a, b, EXACT_GRAD)


def test_expert_parallel_sequence_capacity_equals_one_device_routing():
    # "sequence" capacity routes each row on its own: the expert-parallel form (rows of 8 over
    # 8 devices) equals the one-device layer's dispatch over all T tokens, whatever the mesh.
    x, wr, w, mask = _setup()
    mesh = parallel.make_mesh({"data": 2, "expert": 4})
    ep = jax.jit(functools.partial(M.expert_parallel_moe, mesh=mesh, k=2, capacity_factor=1.0,
                                   priority="token", length=8), **_O0)
    y1, a1 = ep(x, wr, w, mask=mask)
    r = M.top_k_route(M.router_logits(x, wr), 2, mask=mask)
    y0, kept, _ = M.moe_capacity(x, r, w, capacity_factor=1.0, mask=mask, group="sequence",
                                 length=8)
    assert_close(y1, y0)
    assert float(a1["dropped_fraction"]) > 0 and not bool(kept[mask].all())
    with pytest.raises(ValueError, match="whole rows of 16"):
        M.expert_parallel_moe(x, wr, w, mesh=mesh, length=16)


def test_no_drops_equal_dropless_and_errors():
    x, wr, w, mask = _setup()
    y, aux = jax.jit(functools.partial(M.grouped_moe, groups=8, k=2, capacity_factor=8.0))(
        x, wr, w, mask=mask)
    r = M.top_k_route(M.router_logits(x, wr), 2, mask=mask)
    assert float(aux["dropped_fraction"]) == 0
    assert_close(y, M.moe_dropless(x, r, w, mask=mask))
    mesh = parallel.make_mesh({"expert": 8})
    with pytest.raises(ValueError, match="do not split over the expert axis"):
        M.expert_parallel_moe(x, wr[:, :6], w, mesh=mesh)


def test_gpipe_layer_stack_equals_unpipelined():
    import xformers_jax.nn as nn
    from jax.sharding import Mesh

    stack = nn.LayerStack(lambda k: nn.TransformerBlock(8, 2, 16, key=k), 4,
                          key=jax.random.key(1))
    x = jax.random.normal(jax.random.key(2), (4, 6, 8))
    mask = jnp.arange(6)[None] < jnp.array([[6], [5], [4], [6]])
    mesh = Mesh(np.array(jax.devices()[:4]), (parallel.STAGE,))
    run = lambda s, x: parallel.pipeline_layers(s, x, mesh=mesh, num_microbatches=2,  # noqa
                                                kv_mask=mask)
    loss = lambda f: lambda s, x: (jnp.sin(f(s, x)) * jnp.arange(8)).sum()  # noqa: E731
    ref = lambda s, x: s(x, kv_mask=mask)  # noqa: E731
    both = lambda f: jax.jit(  # noqa: E731
        lambda s, x: (f(s, x), jax.grad(loss(f), argnums=(0, 1))(s, x)), **_O0)
    y1, g1 = both(run)(stack, x)
    y0, g0 = both(ref)(stack, x)
    assert_close(y1, y0)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        assert_close(a, b, EXACT_GRAD)
    assert parallel.bubble_fraction(4, 2) == pytest.approx(3 / 5)
    with pytest.raises(ValueError, match="do not split into 4 stages"):
        parallel.pipeline_layers(nn.LayerStack(lambda k: nn.TransformerBlock(8, 2, 16, key=k),
                                               6, key=jax.random.key(1)), x, mesh=mesh,
                                 num_microbatches=2)


def test_gpipe_runs_the_stacks_own_step_with_layerdrop_and_timesteps():
    """The pipeline runs each layer through the stack's one step body, so LayerDrop (the same
    per-layer keys decide which layers are skipped) and the Universal Transformer's timestep
    embedding give the unpipelined stack's outputs."""
    import xformers_jax.nn as nn
    from jax.sharding import Mesh

    x = jax.random.normal(jax.random.key(2), (4, 6, 8))
    mask = jnp.arange(6)[None] < jnp.array([[6], [5], [4], [6]])
    mesh = Mesh(np.array(jax.devices()[:4]), (parallel.STAGE,))
    key = jax.random.key(3)
    for setting in (dict(layerdrop=0.5), dict(universal=True)):
        stack = nn.LayerStack(lambda k: nn.TransformerBlock(8, 2, 16, key=k), 4,
                              key=jax.random.key(1), **setting)
        run = jax.jit(lambda s, x: parallel.pipeline_layers(
            s, x, mesh=mesh, num_microbatches=2, kv_mask=mask, key=key), **_O0)
        ref = jax.jit(lambda s, x: s(x, kv_mask=mask, key=key), **_O0)
        assert_close(run(stack, x), ref(stack, x))
        if "layerdrop" in setting:  # some layers skipped, some run: the test means something
            dropped = stack.dropped_layers(key)
            assert 0 < int(dropped.sum()) < 4


def test_gpipe_moe_aux_is_the_mean_over_microbatches():
    """A pipelined MoE stack (capacity dispatch, so each micro-batch's capacity decides what is
    dropped) equals the unpipelined stack run on each micro-batch: outputs, every layer's aux
    outputs averaged over the micro-batches, and gradients of a loss that uses both."""
    import xformers_jax.nn as nn
    from jax.sharding import Mesh

    spec = nn.FFNSpec("switch", dict(num_experts=4, mode="capacity", capacity_factor=1.0,
                                     jitter=0.0))
    stack = nn.LayerStack(lambda k: nn.TransformerBlock(8, 2, 16, ffn=spec, key=k), 4,
                          key=jax.random.key(7))
    x = jax.random.normal(jax.random.key(8), (4, 6, 8))
    mask = jnp.arange(6)[None] < jnp.array([[6], [5], [4], [6]])
    mesh = Mesh(np.array(jax.devices()[:4]), (parallel.STAGE,))

    def run(s, x):
        y, carry = parallel.pipeline_layers(s, x, nn.Carry(), mesh=mesh, num_microbatches=2,
                                            kv_mask=mask)
        return y, carry.aux

    def ref(s, x):
        parts = [s(x[i : i + 2], nn.Carry(), kv_mask=mask[i : i + 2]) for i in (0, 2)]
        y = jnp.concatenate([p[0] for p in parts])
        return y, jax.tree.map(lambda a, b: (a + b) / 2, parts[0][1].aux, parts[1][1].aux)

    def loss(f):
        def fn(s, x):
            y, aux = f(s, x)
            return (jnp.sin(y) * jnp.arange(8)).mean() + 0.1 * nn.aux_losses(aux)[
                "load_balancing"]
        return fn

    both = lambda f: jax.jit(  # noqa: E731
        lambda s, x: (f(s, x), jax.grad(loss(f), argnums=(0, 1))(s, x)), **_O0)
    (y1, aux1), g1 = both(run)(stack, x)
    (y0, aux0), g0 = both(ref)(stack, x)
    assert_close(y1, y0)
    assert set(aux1) == set(aux0) and aux1["expert_load"].shape[0] == 4
    assert float(aux0["dropped_fraction"].max()) > 0  # capacity 1.0 drops some tokens here
    for name in aux0:
        assert_close(aux1[name], aux0[name])
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        assert_close(a, b, EXACT_GRAD)


def test_moe_model_under_an_expert_mesh_equals_one_device():
    """A causal LM with an MoE FFN under parallel.use_mesh (expert=4, fsdp=2) runs the
    expert-parallel form, its parameters placed by the default rules (expert weights split
    over 'expert' on the expert axis and over 'fsdp' on the model width: FSDP); with a capacity
    that drops nothing its logits and gradients equal the one-device model's."""
    import equinox as eqx
    import xformers_jax.models as models
    import xformers_jax.nn as nn

    spec = nn.FFNSpec("switch", dict(num_experts=8, mode="capacity", capacity_factor=8.0,
                                     jitter=0.0))
    model = models.CausalLM(32, 8, 1, 2, 16, max_len=8, block=dict(ffn=spec),
                        key=jax.random.key(3))
    tokens = jax.random.randint(jax.random.key(4), (8, 8), 0, 32)

    def loss(m):
        return (jnp.sin(m(tokens)) * jnp.arange(32)).sum()

    f = jax.jit(jax.value_and_grad(loss), **_O0)
    l0, g0 = f(model)
    mesh = parallel.make_mesh({"fsdp": 2, "expert": 4})
    shardings = parallel.param_shardings(model, parallel.DEFAULT_PARAM_RULES, mesh)
    for w in (shardings.layers.layers.ffn.w1, shardings.layers.layers.ffn.w2):
        # [layers, experts, ...]: experts over 'expert', the model width over 'fsdp'.
        assert w.spec[1] == "expert" and "fsdp" in tuple(w.spec[2:]), w.spec
    arrays, rest = eqx.partition(model, eqx.is_array)
    placed = eqx.combine(jax.device_put(arrays, shardings), rest)
    assert placed.layers.layers.ffn.w1.sharding.spec == shardings.layers.layers.ffn.w1.spec
    with parallel.use_mesh(mesh):
        l1, g1 = jax.jit(jax.value_and_grad(loss), **_O0)(placed)
    assert_close(l1, l0)
    for a, b in zip(jax.tree.leaves(eqx.filter(g1, eqx.is_inexact_array)),
                    jax.tree.leaves(eqx.filter(g0, eqx.is_inexact_array))):
        assert_close(a, b, EXACT_GRAD)


def test_stage_mesh_pipelines_the_model():
    """A 'stage' axis in parallel.make_mesh (what a trainer's mesh config names) makes the
    models' LayerStack run as a GPipe pipeline; loss and gradients equal one device's."""
    import equinox as eqx
    import xformers_jax.models as models

    model = models.CausalLM(32, 8, 4, 2, 16, max_len=6, key=jax.random.key(5))
    tokens = jax.random.randint(jax.random.key(6), (8, 6), 0, 32)
    mask = jnp.arange(6)[None] < jnp.array([[6], [5], [4], [6]] * 2)

    def loss(m):
        # A mean, so that float32's summation order (micro-batches) stays below the tolerance.
        return (jnp.sin(m(tokens, mask=mask)) * jnp.arange(32)).mean()

    l0, g0 = jax.jit(jax.value_and_grad(loss), **_O0)(model)
    mesh = parallel.make_mesh({"stage": 4, "data": 2})
    assert dict(mesh.shape)["stage"] == 4 and parallel.STAGE == "stage"
    with parallel.use_mesh(mesh):
        l1, g1 = jax.jit(jax.value_and_grad(loss), **_O0)(model)
    assert_close(l1, l0)
    for a, b in zip(jax.tree.leaves(eqx.filter(g1, eqx.is_inexact_array)),
                    jax.tree.leaves(eqx.filter(g0, eqx.is_inexact_array))):
        assert_close(a, b, EXACT_GRAD)
