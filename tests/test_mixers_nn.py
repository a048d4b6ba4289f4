"""The mixer slot of the models (nn.MixerSpec): every registered mixer in a block, causal
no-leak, decoding step by step equals the parallel form, padding changes no real output, bf16,
the registry's errors, configs and the SSM parameter groups of the optimizer."""

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from tests.tolerances import EXACT, assert_close
from xformers_jax import models, nn, train
from xformers_jax.train._optim import make_optimizer

B, L, DIM, HEADS, MAX_LEN = 2, 12, 16, 2, 16
MIXERS = nn.registered_kinds("mixer")
CAUSAL = [m for m in MIXERS if nn.get_kind("mixer", m).causal]
RECURRENT = [m for m in MIXERS if nn.get_kind("mixer", m).decoding == "recurrent"]
DECODES = [m for m in MIXERS if nn.get_kind("mixer", m).decoding is not None]


def _jit(f):
    return jax.jit(f, compiler_options={"xla_backend_optimization_level": 0})


def _module(name, causal):
    spec = nn.MixerSpec(name, nn.get_kind("mixer", name).test_hyperparameters)
    return nn._mixer.make_mixer(spec, DIM, HEADS, causal=causal, max_len=MAX_LEN,
                                key=jax.random.PRNGKey(1))


def _x(key, length=L, batch=B):
    return jax.random.normal(key, (batch, length, DIM))


def test_registry_lists_every_mixer_with_complete_metadata():
    assert set(MIXERS) >= {"s4d", "s5", "retnet", "gla", "mamba2", "mamba", "gated_deltanet",
                           "mlp_mixer", "gmlp", "amlp", "fnet", "poolformer", "lambda"}
    for name in MIXERS:
        kind = nn.get_kind("mixer", name)
        assert kind.family == "mixers" and kind.missing() == (), name
    assert set(RECURRENT) == {"s4d", "s5", "retnet", "gla", "mamba2", "mamba",
                              "gated_deltanet", "mlstm", "hgrn2", "kda", "rwkv7",
                              "delta_product", "h3", "loglinear_mamba2", "loglinear_linear"}
    assert set(DECODES) - set(RECURRENT) == {"gmlp", "amlp", "hyena"}  # a cache growing with L


def test_registry_errors():
    with pytest.raises(ValueError, match="unknown mixer 'nope'"):
        nn.MixerSpec("nope")
    with pytest.raises(ValueError, match=r"unknown hyperparameters \['heads'\]"):
        _ = nn.TransformerBlock(DIM, HEADS, 32, mixer=nn.MixerSpec("fnet", {"heads": 2}),
                                key=jax.random.PRNGKey(0))
    with pytest.raises(NotImplementedError, match="mixer 'fnet' has no causal form"):
        nn.TransformerBlock(DIM, HEADS, 32, causal=True, mixer=nn.MixerSpec("fnet"),
                            key=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="a mixer replaces the self-attention"):
        nn.TransformerBlock(DIM, HEADS, 32, spec=nn.AttentionSpec("flash"),
                            mixer=nn.MixerSpec("fnet"), key=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="already registered"):
        nn.register_kind(nn.get_kind("mixer", "fnet"))
    with pytest.raises(ValueError, match=r"kv_mask must be bool\[B, L\]"):
        _module("poolformer", False)(_x(jax.random.PRNGKey(0)), kv_mask=jnp.ones((B, 3), bool))
    with pytest.raises(ValueError, match="exceeds the 16 positions"):
        _module("fnet", False)(_x(jax.random.PRNGKey(0), length=20))
    block = nn.TransformerBlock(DIM, HEADS, 32, mixer=nn.MixerSpec("s4d", {"state_size": 4}),
                               max_len=MAX_LEN, key=jax.random.PRNGKey(0))
    nn.check_sequence_parallel(block, 1)
    with pytest.raises(ValueError, match="mixer S4D has no sequence-parallel form"):
        nn.check_sequence_parallel(block, 2)
    with pytest.raises(ValueError, match="only the causal form"):
        _module("gmlp", False).init_cache(B, L)
    with pytest.raises(ValueError, match="max_len=20 exceeds the 16 positions"):
        _module("amlp", True).init_cache(B, 20)
    assert nn.MixerSpec.from_config({"kind": "s4d", "dt_min": 1e-4}) == nn.MixerSpec(
        "s4d", {"dt_min": 1e-4})


@pytest.mark.parametrize("name", MIXERS)
def test_padding_changes_no_real_output(key, name):
    # Bidirectional form (causal=False): the padding sits at the end of the forward pass and at
    # the start of the backward one. Junk content and another padded length.
    m = _module(name, causal=False)
    f = _jit(lambda m, x, mask: m(x, kv_mask=mask))
    real = jnp.array([8, 12])
    x = _x(key)
    mask = jnp.arange(L)[None] < real[:, None]
    junk = jnp.where(mask[..., None], x, 9.0)
    out = f(m, junk, mask)
    assert out.shape == x.shape and bool(jnp.isfinite(out).all())
    assert_close(jnp.where(mask[..., None], out, 0), out, EXACT)  # padded rows are zero
    assert_close(f(m, x, mask) * mask[..., None], out * mask[..., None], EXACT)
    short = f(m, junk[:1, :10], mask[:1, :10])
    assert_close(short[0, :8], out[0, :8], EXACT, err_msg="padded length changed outputs")


@pytest.mark.parametrize("name", CAUSAL)
def test_causal_no_leak_and_decoding_equals_parallel(key, name):
    m = _module(name, causal=True)
    x = _x(key)
    mid = L // 2
    x2 = x.at[:, mid].add(3.0)
    f = _jit(lambda m, x: m(x))
    y, y2 = f(m, x), f(m, x2)
    assert_close(y2[:, :mid], y[:, :mid], EXACT, err_msg="a later token changed an output")
    assert not np.allclose(np.asarray(y2[:, mid:]), np.asarray(y[:, mid:]))
    if name not in DECODES:
        return

    @_jit
    def decode_all(m, x):
        def step(cache, x_t):
            out, cache = m.decode(x_t[:, None], cache)
            return cache, out[:, 0]

        return jnp.moveaxis(jax.lax.scan(step, m.init_cache(B, L), jnp.moveaxis(x, 1, 0))[1],
                            0, 1)

    assert_close(decode_all(m, x), y, EXACT, err_msg="decoding != parallel form")


@pytest.mark.parametrize("name", ["mamba2", "s4d", "gmlp", "fnet", "h3", "hyena"])
def test_bf16_inputs_and_gradients(key, name):
    m = _module(name, causal=False)
    x = _x(key).astype(jnp.bfloat16)
    # The float32 run on the same (rounded) inputs: what bf16 compute should approximate.
    y32 = _jit(lambda m, x: m(x))(m, x.astype(jnp.float32))
    y16 = _jit(lambda m, x: m(x))(m, x)
    assert y16.dtype == jnp.bfloat16
    assert_close(y16, y32, EXACT, dtype=jnp.bfloat16)
    g = _jit(lambda m, x: jax.grad(lambda mx: jnp.sum(mx[0](mx[1]) ** 2))((m, x)))(
        m, x.astype(jnp.float32))
    assert all(bool(jnp.isfinite(a).all()) for a in jax.tree.leaves(g))


def test_causal_lm_with_a_mixer_generates_like_its_forward(key):
    model = models.CausalLM(32, DIM, 1, HEADS, 32, max_len=MAX_LEN,
                        block=dict(mixer=nn.MixerSpec("mamba2", {"state_size": 8,
                                                                 "chunk_size": 4})), key=key)
    tokens = jax.random.randint(jax.random.PRNGKey(2), (B, L), 1, 32)
    full = _jit(lambda m, t: m(t))(model, tokens)
    cached = _jit(lambda m, t: m.prefill(t, m.init_cache(B, L))[0])(model, tokens)
    assert_close(cached, full, EXACT)


def test_config_builds_a_mixer_model_and_ssm_parameters_get_their_own_rate():
    c = train.base_config("listops")
    c.model.update(dict(dim=DIM, num_layers=1, num_heads=HEADS, hidden=32, pooling="mean"))
    c.model.mixer = ml_collections.ConfigDict(dict(kind="s4d", state_size=4, dt_min=1e-3,
                                                   dt_max=1e-2))
    c.optim.ssm_learning_rate = 1e-3
    train.validate_config(c)
    task = train.Task(None, None, None, vocab_size=20, num_classes=3, seq_len=10, padded=True)
    model = train.build_model(c.model, task, jax.random.PRNGKey(0))
    layer = model.encoder.layers.layers.attn
    assert isinstance(layer, nn._mixer.S4D)
    dt = np.exp(np.asarray(layer.log_dt))
    assert dt.min() >= 1e-3 * (1 - 1e-5) and dt.max() <= 1e-2 * (1 + 1e-5)
    params = eqx.filter(model, eqx.is_array)
    opt = make_optimizer(lambda s: 1.0, weight_decay=0.5, grad_clip_norm=0.0,
                         ssm_schedule=lambda s: 0.01)
    ones = jax.tree.map(jnp.ones_like, params)
    upd = _jit(lambda p: opt.update(ones, opt.init(p), p)[0])(params).encoder.layers.layers.attn
    # Adam's first step is -lr * sign: the SSM group moves by its own rate, no decay...
    np.testing.assert_allclose(np.asarray(upd.log_dt), -0.01, rtol=1e-3)
    np.testing.assert_allclose(np.asarray(upd.b_re), -0.01, rtol=1e-3)
    # ...and the output matrix by the main rate plus weight decay (AdamW: -lr (1 + wd p)).
    w = np.asarray(layer.w_out)
    np.testing.assert_allclose(np.asarray(upd.w_out), -(1 + 0.5 * w), rtol=1e-3, atol=1e-5)


def test_lra_and_lm_configs_take_every_mixer():
    from xformers_jax_experiments.configs.lm import mixer_bytes
    from xformers_jax_experiments.configs.lra import _common, listops

    for name in _common.MIXERS:
        c = listops.get_config(f"{name},runlocal")
        train.validate_config(c)
        assert nn.MixerSpec.from_config(c.model.mixer.to_dict()).kind == name
    for name in mixer_bytes.CAUSAL_MIXERS:
        train.validate_config(mixer_bytes.get_config(f"{name},runlocal"))
    assert listops.get_config("s4d").optim.ssm_learning_rate == 1e-3


def test_mixer_table_sweep_lists_every_task_and_variant(tmp_path):
    from xformers_jax_experiments import sweep
    from xformers_jax_experiments.configs.lra import listops
    from xformers_jax_experiments.studies.mixers_lra import mixer_table

    path = mixer_table.__file__
    variants = ("transformer", "s4d", "mamba2", "gmlp", "fnet")
    runs = sweep.load_hyper(path)
    assert [r[sweep.ARG] for r in runs] == [f"{t},{v}" for t in ("listops", "pathfinder")
                                           for v in variants]
    # LRA Image joins when the sweep's argument is a directory with the CIFAR-10 batches.
    data = tmp_path / "data"
    with pytest.raises(FileNotFoundError, match="cifar-10-batches-py"):
        sweep.load_hyper(f"{path}:{data}")
    (data / "cifar-10-batches-py").mkdir(parents=True)
    (data / "cifar-10-batches-py" / "data_batch_1").write_bytes(b"")
    with_image = sweep.load_hyper(f"{path}:{data}")
    assert with_image[:len(runs)] == runs and with_image[len(runs):] == [
        {sweep.ARG: f"image,{v}", "config.data.data_dir": str(data)} for v in variants]
    runs = with_image
    args = sweep.run_args(path, "/tmp/x", runs[1], ["num_train_steps=5"], python="py")
    assert args[3] == f"--config={path}:listops,s4d" and args[-1] == "--config.num_train_steps=5"
    steps = {}
    for run in runs:
        c = mixer_table.get_config(run[sweep.ARG])
        train.validate_config(c)
        task, variant = run[sweep.ARG].split(",")
        steps.setdefault(task, set()).add((c.num_train_steps, c.batch_size))
        assert c.model.mixer.kind == ("none" if variant == "transformer" else variant)
        if task == "listops":  # the README main job's data and steps
            main = listops.get_config(f"{variant},main")
            assert (c.data, c.num_train_steps) == (main.data, main.num_train_steps)
    assert all(len(s) == 1 for s in steps.values()), steps  # the same steps within a task
    with pytest.raises(ValueError, match="TASK"):
        mixer_table.get_config("text,s4d")
