"""The kind records (``xformers_jax.kinds.Kind``) and the one slot registry over them: every
registered kind declares every hyperparameter it accepts with a one-line doc and the default
its function, adapter or layer actually has (so the documentation cannot drift), its test
hyperparameters resolve, and specs of every slot check names the same way."""

import functools
import inspect

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.fast_jit import jit0
from tests.tolerances import EXACT_GRAD, assert_close
from xformers_jax import models, nn
from xformers_jax.kinds import (
    REQUIRED,
    SLOTS,
    AttentionAdapter,
    Hyperparameter,
    Kind,
    KVDecoding,
    Paper,
)

ALL = [(slot, name) for slot in SLOTS for name in nn.registered_kinds(slot)
       if nn.get_kind(slot, name).missing() == ()]

# Kinds sharing one layer that give a hyperparameter a default of their own (the layer's
# keyword default is another kind's): GShard's top-2 with a random second expert, Switch's
# jitter, expert choice's capacity, prototyping's groups, aMLP's tiny attention on gMLP.
OWN_DEFAULTS = {("ffn", "switch", "jitter"), ("ffn", "gshard", "k"),
                ("ffn", "gshard", "second_policy"), ("ffn", "st_moe", "k"),
                ("ffn", "expert_choice", "capacity_factor"), ("ffn", "prototype", "groups"),
                ("mixer", "amlp", "attention_dim")}


def _callables(kind):
    """``(callable, is_the_layer)`` for the kind's function and everything of its adapter that
    receives hyperparameters, each with the functions it wraps (``lifted``'s ``__wrapped__``)."""
    found = [(kind.function, False)]
    a = kind.adapter
    if isinstance(a, AttentionAdapter):
        found += [(f, False) for f in (a.attend, a.init, a.state, a.layer_carry) if f]
        if a.decoding is not None:
            found += [(f, False) for f in vars(a.decoding).values() if callable(f)]
        if a.sequence is not None:
            found.append((a.sequence.attend, False))
    elif a is not None:
        found.append((a, True))
    out = []
    for f, is_layer in found:
        while f is not None:
            out.append((f, is_layer))
            f = getattr(f, "__wrapped__", None)
    return out


def _keyword_defaults(f):
    try:
        params = inspect.signature(f, follow_wrapped=False).parameters.values()
    except (TypeError, ValueError):
        return {}
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


@pytest.mark.parametrize("slot,name", ALL)
def test_declared_defaults_are_the_signatures_defaults(slot, name):
    kind = nn.get_kind(slot, name)
    assert kind.adapter is not None, f"{slot} kind {name!r} has no adapter or layer"
    for hp_name, h in kind.hyperparameters.items():
        assert isinstance(h, Hyperparameter) and h.doc, (name, hp_name)
    own = set()
    for f, is_layer in _callables(kind):
        for hp_name, default in _keyword_defaults(f).items():
            if hp_name not in kind.hyperparameters:
                continue
            declared = kind.hyperparameters[hp_name].default
            if is_layer and (slot, name, hp_name) in OWN_DEFAULTS:
                assert declared != default, (f"{name}.{hp_name} is declared in OWN_DEFAULTS but "
                                             f"equals {getattr(f, '__name__', f)}'s default")
                own.add(hp_name)
                continue
            assert declared is not REQUIRED and declared == default, (
                f"{slot} kind {name!r}: {hp_name} is declared with default {declared!r} but "
                f"{getattr(f, '__qualname__', f)} has {default!r}")
    assert own == {n for s, k, n in OWN_DEFAULTS if (s, k) == (slot, name)}


@pytest.mark.parametrize("slot,name", ALL)
def test_test_hyperparameters_resolve(slot, name):
    kind = nn.get_kind(slot, name)
    resolved = kind.resolve(kind.test_hyperparameters)
    assert set(resolved) == set(kind.hyperparameters)
    assert resolved == {**{n: h.default for n, h in kind.hyperparameters.items()},
                        **dict(kind.test_hyperparameters)}


def test_resolve_fills_defaults_and_names_what_is_wrong():
    nystrom = nn.get_kind("attention", "nystrom")
    assert nystrom.resolve({"num_landmarks": 8}) == {"num_landmarks": 8, "kernel_size": 33,
                                                     "pinv_iterations": 6}
    with pytest.raises(ValueError, match=r"attention kind 'nystrom': missing required "
                                         r"hyperparameters: 'num_landmarks' \(landmarks m"):
        nystrom.resolve({})
    with pytest.raises(ValueError, match=r"unknown hyperparameters \['num_landmark'\]; it "
                                         r"accepts \['kernel_size', 'num_landmarks', "
                                         r"'pinv_iterations'\] \(did you mean "
                                         r"'num_landmarks' for 'num_landmark'\?\)"):
        nystrom.resolve({"num_landmark": 8})
    # A spec checks names when it is made, the required ones when a layer is built from it.
    spec = nn.AttentionSpec("nystrom", {})
    with pytest.raises(ValueError, match="missing required hyperparameters: 'num_landmarks'"):
        nn.MultiHeadAttention(16, 2, spec=spec, key=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match=r"FFN kind 'switch': unknown hyperparameters "
                                         r"\['num_expert'\].*did you mean 'num_experts'"):
        nn.FFNSpec("switch", {"num_expert": 4})
    with pytest.raises(ValueError, match=r"mixer 'mamba': unknown hyperparameters \['state'\]"):
        nn.MixerSpec("mamba", {"state": 4})


def test_the_declared_defaults_are_the_ones_in_effect():
    # The MoE kinds' own defaults reach the shared layer through the spec.
    gshard = nn.FFNSpec("gshard", {"num_experts": 4}).build(8, 16, key=jax.random.PRNGKey(0))
    switch = nn.FFNSpec("switch", {"num_experts": 4}).build(8, 16, key=jax.random.PRNGKey(0))
    assert (gshard.router, gshard.k, gshard.second_policy) == ("top_k", 2, "random")
    assert (switch.k, switch.jitter) == (1, 1e-2)
    hashed = nn.FFNSpec("hash", {"num_experts": 4}).build(8, 16, key=jax.random.PRNGKey(0))
    assert hashed.router == "hash"
    with pytest.raises(ValueError, match=r"unknown hyperparameters \['router'\]"):
        nn.FFNSpec("hash", {"router": "top_k"})
    # aMLP is gMLP with its declared attention width; the block's chunk_size reaches the
    # dense FFN unless its spec gives one.
    amlp = nn.MixerSpec("amlp").build(16, 2, causal=False, max_len=8, key=jax.random.PRNGKey(0))
    assert amlp.w_attn is not None and amlp.w_attn.shape[-1] == 3 * 64
    dense = nn.FFNSpec().build(8, 16, chunk_size=4, key=jax.random.PRNGKey(0))
    assert dense.chunk_size == 4
    assert nn.FFNSpec("dense", {"chunk_size": 2}).build(
        8, 16, chunk_size=4, key=jax.random.PRNGKey(0)).chunk_size == 2


def _kind(**fields):
    base = dict(name="toy", function=len, family="exact", paper=Paper("A", 2020, "T"),
                time="O(1)", memory="O(1)", causal=True)
    return Kind(**{**base, **fields})


def test_a_record_checks_itself():
    toy = _kind(hyperparameters={"width": (REQUIRED, "the width"), "depth": (2, "the depth")})
    assert toy.slot == "attention" and toy.missing() == ()
    assert toy.hyperparameters["width"].required and not toy.hyperparameters["depth"].required
    assert _kind(family="experts").slot == "ffn" and _kind(family="mixers").slot == "mixer"
    with pytest.raises(ValueError, match="family must be one of"):
        _kind(family="nope")
    with pytest.raises(ValueError, match="decoding must be one of"):
        _kind(family="experts", decoding="kv")
    with pytest.raises(ValueError, match="needs a one-line doc"):
        _kind(hyperparameters={"width": (1, "")})
    with pytest.raises(ValueError, match="its adapter decodes with 'kv' but the record declares"):
        _kind(adapter=AttentionAdapter(len, decoding=KVDecoding()))
    with pytest.raises(ValueError, match=r"init_only \['width'\] must be among"):
        _kind(adapter=AttentionAdapter(len, init_only={"width"}))
    with pytest.raises(ValueError, match="not both"):
        AttentionAdapter(len, state=len, layer_carry=len)
    with pytest.raises(ValueError, match=r"\['router'\] are fixed layer_arguments"):
        _kind(family="experts", hyperparameters={"router": ("a", "b")},
              layer_arguments={"router": "top_k"})
    assert _kind(paper=None).missing() == ("paper",)


def test_one_registry_for_every_slot():
    assert {"dot_product", "flash"} <= set(nn.registered_kinds("attention"))
    assert {"mamba2", "lsra"} <= set(nn.registered_kinds("mixer"))
    assert {"dense", "switch", "none"} <= set(nn.registered_kinds("ffn"))
    assert nn.get_kind("ffn", "switch").adapter is nn.MoEFeedForward
    assert nn.get_kind("mixer", "lsra").adapter is nn.LSRA
    assert nn.get_kind("ffn", "dense").adapter is nn.FeedForward
    with pytest.raises(ValueError, match="unknown slot 'nope'"):
        nn.registered_kinds("nope")
    with pytest.raises(ValueError, match="unknown FFN kind 'nope'"):
        nn.get_kind("ffn", "nope")
    with pytest.raises(ValueError, match="'switch' is already registered"):
        nn.register_kind(nn.get_kind("ffn", "switch"))
    with pytest.raises(ValueError, match="must be one registered mixer or FFN kind"):
        nn.implements("dot_product")(nn.FeedForward)
    with pytest.raises(TypeError, match="Spec names no slot"):
        nn.Spec("dense")


# -- the records against behaviour --------------------------------------------------------------
#
# A record that claims causal support must give the logits of a prefix equal to those positions
# of a longer run; one that claims decoding, ``prefill`` + ``decode_step`` equal to one forward
# call; every kind, outputs of one batch row independent of the others (a kind that couples the
# rows says so with ``Kind.mixes_rows``, and no such kind may claim causal support); and
# padding content, NaN and infinities included, in keys or values, changes no real output and
# no gradient at a real position. Each kind is one compiled program per check family, at the
# test hyperparameters' size (L = max_len = 16), at XLA's backend optimisation level 0.

B, L, PREFIX, DIM, HEADS, HIDDEN, VOCAB = 2, 16, 11, 16, 2, 32, 20
REAL = (11, 13)  # real tokens of the two batch rows in the padding checks
_SPECS = {"attention": ("spec", nn.AttentionSpec), "mixer": ("mixer", nn.MixerSpec),
          "ffn": ("ffn", nn.FFNSpec)}
# Beside each kind at its test hyperparameters, the configurations of shared layers that claim
# more than the kind's defaults: capacity dispatch with token priority, which the library
# recommends for causal MoE. A case is (slot, name, hyperparameters over the test ones).
CASES = [(s, n, ()) for s, n in ALL] + [
    ("ffn", "switch", (("capacity_factor", 1.0), ("mode", "capacity"))),
    ("ffn", "st_moe", (("mode", "capacity"), ("priority", "token")))]
CAUSAL = [c for c in CASES if nn.get_kind(*c[:2]).causal]
DECODES = [c for c in CAUSAL if nn.get_kind(*c[:2]).decoding is not None]
# The capacity FFN kinds route every token of a batch as one group in row-major order, so a
# token's drops depend on other rows and on later tokens. Hash routing reads token ids, which
# decoding does not pass. Both are fixed on branch moe-causal.
_CAPACITY = pytest.mark.xfail(strict=True,
                              reason="capacity routing across the batch; fixed on branch moe-causal")
_HASH = pytest.mark.xfail(strict=True, reason="hash routing needs the token ids; fixed on branch "
                                               "moe-causal")
_CAPACITY_CASES = CASES[-2:]
# (At these sizes Switch's drops in row 1 happen not to move when row 0 changes.)
KNOWN = {"rows": {_CAPACITY_CASES[1]: _CAPACITY},
         "prefix": dict.fromkeys(_CAPACITY_CASES, _CAPACITY),
         "decode": {**dict.fromkeys(_CAPACITY_CASES, _CAPACITY), ("ffn", "hash", ()): _HASH}}


def _cases(cases, check):
    return [pytest.param(*c, marks=KNOWN[check].get(c, ()),
                         id="-".join([c[0], c[1]] + [f"{k}={v}" for k, v in c[2]]))
            for c in cases]


def _model(cls, slot, name, hp, *args, **kw):
    """``(model, state)``: a one-layer ``cls`` with ``name`` in ``slot`` at its test
    hyperparameters updated by ``hp`` (state is None unless the kind keeps ``eqx.nn.State``),
    initialised as one compiled program."""
    field, spec = _SPECS[slot]
    block = {field: spec(name, {**dict(nn.get_kind(slot, name).test_hyperparameters), **dict(hp)})}

    def make(key):
        m = functools.partial(cls, *args, DIM, 1, HEADS, HIDDEN, max_len=L, block=block,
                              key=key, **kw)
        if slot == "attention" and nn.get_kind(slot, name).adapter.state is not None:
            return eqx.nn.make_with_state(m)()
        return m(), None

    return jit0(make)(jax.random.PRNGKey(1))


def _call(model, state, tokens, mask=None):
    if state is None:
        return model(tokens, mask=mask)
    leaves, tree = jax.tree_util.tree_flatten(state)  # each call from its own copy
    return model(tokens, mask=mask, state=jax.tree_util.tree_unflatten(tree, leaves))[0]


_TOKENS = jax.random.randint(jax.random.PRNGKey(2), (B, L), 0, VOCAB)
# Row 0 replaced by other tokens: row 1's outputs must not move.
_OTHER_ROWS = _TOKENS.at[0].set(jax.random.randint(jax.random.PRNGKey(3), (L,), 0, VOCAB))


@functools.cache
def _causal_runs(slot, name, hp):
    """One compiled program per causal kind, in ``models.CausalLM``: ``{"full", "rows",
    "prefix", "decode"}`` logits (``decode``: the exception, if decoding cannot be traced)."""
    record = nn.get_kind(slot, name)
    model, state = _model(models.CausalLM, slot, name, hp, VOCAB)

    def forward(m, s):
        out = {"full": _call(m, s, _TOKENS), "rows": _call(m, s, _OTHER_ROWS)}
        if record.fixed_length:  # parameters sized by max_len: the prefix padded to it
            mask = jnp.broadcast_to(jnp.arange(L) < PREFIX, (B, L))
            out["prefix"] = _call(m, s, _TOKENS, mask)[:, :PREFIX]
        else:
            out["prefix"] = _call(m, s, _TOKENS[:, :PREFIX])
        return out

    def decode(m):  # prefill a prompt, then one decoding step per token
        logits, caches = m.prefill(_TOKENS[:, :PREFIX], m.init_cache(B, L))

        def step(caches, t):
            out, caches = m.decode_step(_TOKENS[:, t], caches, t)
            return caches, out

        _, rest = jax.lax.scan(step, caches, jnp.arange(PREFIX, L))
        return jnp.concatenate([logits, jnp.moveaxis(rest, 0, 1)], axis=1)

    if record.decoding is None:
        return jax.tree.map(np.asarray, jit0(forward)(model, state))
    try:
        out = jit0(lambda m, s: {**forward(m, s), "decode": decode(m)})(model, state)
    except Exception as e:  # noqa: BLE001  reported by the decoding check alone
        return {**jax.tree.map(np.asarray, jit0(forward)(model, state)), "decode": e}
    return jax.tree.map(np.asarray, out)


@functools.cache
def _encoder_runs(slot, name, hp):
    model, state = _model(models.EncoderClassifier, slot, name, hp, 3, pooling="mean",
                          vocab_size=VOCAB)
    return jax.tree.map(np.asarray, jit0(lambda m, s: {
        "full": _call(m, s, _TOKENS), "rows": _call(m, s, _OTHER_ROWS)})(model, state))


def test_no_kind_that_mixes_rows_claims_causal_support():
    for slot, name in ALL:
        kind = nn.get_kind(slot, name)
        assert not (kind.mixes_rows and kind.causal), (slot, name)
    with pytest.raises(ValueError, match="mixes batch rows, so it cannot claim causal"):
        _kind(family="experts", mixes_rows=True)


@pytest.mark.parametrize("slot,name,hp", _cases(CASES, "rows"))
def test_rows_are_independent(slot, name, hp):
    kind = nn.get_kind(slot, name)
    if kind.mixes_rows:
        pytest.skip(f"{name} mixes batch rows by design (Kind.mixes_rows; refused in causal "
                    "models)")
    runs = _causal_runs(slot, name, hp) if kind.causal else _encoder_runs(slot, name, hp)
    assert not np.allclose(runs["rows"][0], runs["full"][0])
    assert_close(runs["rows"][1], runs["full"][1],
                 err_msg=f"{slot} kind {name!r}: changing batch row 0 changed row 1")


@pytest.mark.parametrize("slot,name,hp", _cases(CAUSAL, "prefix"))
def test_prefix_logits_equal_the_longer_run(slot, name, hp):
    runs = _causal_runs(slot, name, hp)
    assert_close(runs["prefix"], runs["full"][:, :PREFIX],
                 err_msg=f"{slot} kind {name!r}: the logits of a {PREFIX}-token prefix differ "
                         f"from those positions of a {L}-token run")


@pytest.mark.parametrize("slot,name,hp", _cases(DECODES, "decode"))
def test_decoding_equals_the_forward_pass(slot, name, hp):
    runs = _causal_runs(slot, name, hp)
    if isinstance(runs["decode"], Exception):
        raise runs["decode"]
    assert_close(runs["decode"], runs["full"],
                 err_msg=f"{slot} kind {name!r}: prefill + decode_step differ from the forward "
                         "pass")


# Padding content: each case puts one value in the padded positions of the keys, the values or
# both (for a mixer or an FFN kind, of its input); the reference has finite junk there.
POISONS = [("keys", np.nan), ("values", np.nan), ("values", np.inf), ("keys", -np.inf),
           ("values", 1e38), ("both", np.nan), ("both", np.inf)]
_MASK = jnp.arange(L)[None] < jnp.asarray(REAL)[:, None]


def _attend(mha, q, k, v, x, params):
    """The kind's ``attend`` as ``nn.MultiHeadAttention`` calls it (non-causal self attention
    over ``_MASK``) on heads ``q, k, v [B, L, H, D]`` and the block input ``x [B, L, DIM]``
    (for the kinds that take it)."""
    extra = {}
    if mha.carries_between_layers:
        extra["carry"] = mha.init_layer_carry(B, L, 1)
    if mha.adapter.takes_input:
        extra["inputs"] = x
    if mha.state_index is not None:
        extra.update(state=mha.adapter.state(jax.random.PRNGKey(7), mha.spec.resolved,
                                             num_heads=HEADS, head_dim=DIM // HEADS),
                     inference=True)
    out = mha.adapter.attend(q, k, v, params, causal=False, kv_mask=_MASK, q_mask=_MASK,
                             bias=None, key=jax.random.PRNGKey(5), **extra,
                             **mha._call_hyperparameters())
    return out[0] if mha.state_index is not None or mha.carries_between_layers else out


@functools.cache
def _padding_program(slot, name):
    """``(inputs, run)``: the kind's inputs with finite junk at padded positions, and
    ``run(inputs) -> (outputs, gradients)`` compiled once: the outputs zeroed at padded
    positions (and an FFN kind's aux outputs), and the gradients of a fixed projection of the
    real outputs with respect to every input and the kind's own parameters."""
    rng = np.random.default_rng(6)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    key = jax.random.PRNGKey(4)
    if slot == "attention":
        spec = nn.AttentionSpec(name, nn.get_kind(slot, name).test_hyperparameters)
        layer = jit0(lambda k: nn.MultiHeadAttention(DIM, HEADS, spec=spec, max_len=L, key=k))(
            key)
        inputs = [normal(B, L, HEADS, DIM // HEADS) for _ in range(3)] + [normal(B, L, DIM)]
        own = layer.variant_params

        def apply(inputs, own):
            q, k, v, x = inputs
            return _attend(layer, q, k, v, x, own), {}
    else:
        make = _SPECS[slot][1]
        spec = make(name, nn.get_kind(slot, name).test_hyperparameters)
        if slot == "mixer":
            layer = jit0(lambda k: nn._mixer.make_mixer(spec, DIM, HEADS, causal=False,
                                                        max_len=L, key=k))(key)
        else:
            layer = jit0(lambda k: spec.build(DIM, HIDDEN, key=k))(key)
        inputs = [normal(B, L, DIM)]
        tokens = jax.random.randint(key, (B, L), 1, VOCAB)
        own = layer

        def apply(inputs, own):
            if slot == "mixer":
                return own(inputs[0], kv_mask=_MASK), {}
            return nn._ffns.call_ffn(own, inputs[0], mask=_MASK, tokens=tokens, inference=True)

    params, static = eqx.partition(own, eqx.is_inexact_array)
    cotangent = normal(B, L, DIM)

    def loss(inputs, params):
        out, aux = apply(inputs, eqx.combine(params, static))
        real = jnp.where(_MASK.reshape(B, L, *[1] * (out.ndim - 2)), out, 0)
        return jnp.sum(real.reshape(B, L, -1) * cotangent[..., : real[0, 0].size]), (real, aux)

    grad = jax.grad(loss, argnums=(0, 1), has_aux=True)
    junk = [jnp.where(_MASK.reshape(B, L, *[1] * (x.ndim - 2)), x, 30 * normal(*x.shape))
            for x in inputs]
    run = jit0(lambda inputs, params: grad(inputs, params)[::-1])
    return junk, functools.partial(run, params=params)


def _poison(slot, inputs, where, value):
    """``inputs`` with ``value`` at the padded positions of the keys, values or both."""
    names = {"keys": (1,), "values": (2,), "both": (1, 2, 3)}[where] if slot == "attention" \
        else (0,)
    return [jnp.where(_MASK.reshape(B, L, *[1] * (x.ndim - 2)), x, jnp.asarray(value, x.dtype))
            if i in names else x for i, x in enumerate(inputs)]


# Kinds where a NaN or infinity in the padding still reaches a real output or gradient (a product
# of a masked entry by zero in their recurrences, routers or score carries): not fixed yet.
_NON_FINITE = pytest.mark.xfail(strict=True, reason="non-finite padding reaches real positions")
NON_FINITE_LEAKS = {
    ("ffn", n) for n in ("expert_choice", "gshard", "prototype", "st_moe", "switch")}


@pytest.mark.parametrize("slot,name", [pytest.param(*c, marks=_NON_FINITE)
                                       if c in NON_FINITE_LEAKS else c for c in ALL])
def test_padding_content_changes_nothing_nan_and_inf_included(slot, name):
    junk, run = _padding_program(slot, name)
    (ref, ref_aux), ref_grads = run(junk)
    for where, value in POISONS if slot == "attention" else POISONS[::2]:
        what = f"{slot} kind {name!r}: {value} in the padded {where}"
        (out, aux), grads = run(_poison(slot, junk, where, value))
        assert_close(out, ref, err_msg=f"{what} changed a real output")
        assert_close(aux, ref_aux, err_msg=f"{what} changed an auxiliary output")
        (g_in, g_own), (r_in, r_own) = grads, ref_grads
        for g, r in zip(g_in, r_in):
            m = _MASK.reshape(B, L, *[1] * (g.ndim - 2))
            assert_close(jnp.where(m, g, 0), jnp.where(m, r, 0), EXACT_GRAD,
                         err_msg=f"{what} changed a gradient at a real position")
        if slot == "attention":  # a layer's input projections see its padded input itself
            assert_close(g_own, r_own, EXACT_GRAD,
                         err_msg=f"{what} changed a parameter's gradient")
