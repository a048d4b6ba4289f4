"""Suite ``parallel``: memory per device under FSDP and ring attention.

Simulated CPU devices share one memory, so these figures are not RSS. They are computed in a
subprocess started with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (the harness's
workers have one device):

- FSDP: the bytes of parameters + Adam state that device 0 holds, summed over the sharded
  arrays' ``addressable_shards`` sizes, against the unsharded total (a 4-layer model, E=256
  or 32 quick).
- Ring attention: XLA's compiled memory analysis of the per-device SPMD program
  (``jax.jit(f).lower(...).compile().memory_analysis()``: arguments + outputs + temporaries),
  ring attention over 8 ``sequence`` shards against exact attention (``dot_product_attention``)
  compiled for one device, same total length (one head, D=64), forward and forward+backward.

The timed cases (one device) are the unsharded baselines, for scale.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from xformers_jax_experiments.bench_lib import Case, Results, Workload, ratio_check

TITLE = "Sharding: FSDP and ring-attention memory per device (8 simulated CPU devices)"
_BUILD = "xformers_jax_experiments.suites.parallel:build"
_LAST_QUICK = {"value": False}


def _model(embed: int, layers: int = 4):
    import equinox as eqx
    import jax

    from xformers_jax import axes as X

    class Block(eqx.Module):  # parameters declare their logical axes (xformers_jax.axes)
        wq: jax.Array = X.param(X.EMBED, X.HEADS)
        wo: jax.Array = X.param(X.HEADS, X.EMBED)
        w1: jax.Array = X.param(X.EMBED, X.MLP)
        w2: jax.Array = X.param(X.MLP, X.EMBED)

    keys = jax.random.split(jax.random.PRNGKey(0), 4 * layers)
    n = lambda k, s: jax.random.normal(k, s) / s[0] ** 0.5  # noqa: E731
    return [Block(n(keys[4 * i], (embed, embed)), n(keys[4 * i + 1], (embed, embed)),
                  n(keys[4 * i + 2], (embed, 4 * embed)), n(keys[4 * i + 3], (4 * embed, embed)))
            for i in range(layers)]


def build(variant: str, L: int = 0, embed: int = 0):
    import jax
    import jax.numpy as jnp

    from xformers_jax.attention import dot_product_attention

    if variant == "mlp_step":
        params = _model(embed)
        x = jax.random.normal(jax.random.PRNGKey(1), (8, 16, embed))

        def loss(params, x):
            for p in params:
                x = x + jax.nn.gelu(x @ p.wq @ p.wo @ p.w1) @ p.w2
            return jnp.mean(x ** 2)

        return Workload(loss, (params, x))
    q, k, v = jax.random.normal(jax.random.PRNGKey(0), (3, L, 64))
    return Workload(lambda q, k, v: dot_product_attention(q, k, v, causal=True), (q, k, v),
                    flops=2.0 * L * L * 64)


def cases(quick: bool) -> list[Case]:
    _LAST_QUICK["value"] = quick
    return [Case("unsharded MLP step", _BUILD, dict(variant="mlp_step", embed=32 if quick else 256)),
            Case("exact attention 1 device", _BUILD, dict(variant="dense", L=256 if quick else 4096))]


def _nbytes(x):
    return x.size * x.dtype.itemsize


def measure_memory(quick: bool) -> dict:
    """The figures; runs in a process that has 8 devices."""
    import jax
    import optax

    from xformers_jax import parallel as par
    from xformers_jax.attention import dot_product_attention

    out = {}
    params = _model(32 if quick else 256)
    mesh = par.make_mesh({"fsdp": 8})
    shard = par.param_shardings(params, par.DEFAULT_PARAM_RULES, mesh)
    opt = optax.adam(1e-3)
    sharded = jax.device_put(params, shard)
    state = jax.device_put(opt.init(params), par.optimizer_shardings(opt, opt.init(params), shard, mesh))
    leaves = jax.tree_util.tree_leaves((sharded, state))
    dev0 = jax.devices()[0]
    out["fsdp_device0_bytes"] = sum(_nbytes(s.data) for x in leaves for s in x.addressable_shards
                                    if s.device == dev0)
    out["unsharded_bytes"] = sum(_nbytes(x) for x in leaves)

    L = 512 if quick else 8192
    q, k, v = jax.random.normal(jax.random.PRNGKey(0), (3, L, 64))
    seq = par.make_mesh({"sequence": 8})

    def peak(f, *args):
        m = jax.jit(f).lower(*args).compile().memory_analysis()
        return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes

    ring = lambda q, k, v: par.ring_attention(q, k, v, causal=True, mesh=seq)  # noqa: E731
    exact = lambda q, k, v: dot_product_attention(q, k, v, causal=True)  # noqa: E731
    grad = lambda f: jax.grad(lambda q, k, v: f(q, k, v).sum(), argnums=(0, 1, 2))  # noqa: E731
    one = jax.sharding.SingleDeviceSharding(dev0)
    q1, k1, v1 = (jax.device_put(x, one) for x in (q, k, v))
    out["L"] = L
    out["ring_fwd_bytes"] = peak(ring, q, k, v)
    out["exact_fwd_bytes"] = peak(exact, q1, k1, v1)
    out["ring_fwdbwd_bytes"] = peak(grad(ring), q, k, v)
    out["exact_fwdbwd_bytes"] = peak(grad(exact), q1, k1, v1)
    out.update(measure_lm_step(4096 if quick else 65536))
    return out


def measure_lm_step(L: int, repeats: int = 2) -> dict:
    """A causal LM's train step (loss and gradients) at ``L`` tokens: per-device compiled
    memory under ``sequence=8`` (every attention layer runs as zig-zag ring attention) against
    the same step compiled for one device, and the sharded step's time."""
    import time

    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from xformers_jax import models, nn
    from xformers_jax import parallel as par

    model = models.CausalLM(256, 64, 2, 2, 128, max_len=L, block=dict(spec=nn.AttentionSpec("flash")),
                        key=jax.random.PRNGKey(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (1, L + 1), 0, 256)

    def loss(p, x):
        logits = eqx.combine(p, static)(x[:, :-1])
        return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(
            logits, x[:, 1:, None], -1)[..., 0])

    step = jax.value_and_grad(loss)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def total(compiled):
        m = compiled.memory_analysis()
        return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes

    single = jax.jit(step).lower(jax.device_put(params, one), jax.device_put(tokens, one)).compile()
    mesh = par.strategy("sequence", {"sequence": 8}).mesh()
    with par.use_mesh(mesh):
        placed = jax.device_put(params, par.param_shardings(params, par.DEFAULT_PARAM_RULES, mesh))
        sharded = jax.jit(step).lower(placed, tokens).compile()
        jax.block_until_ready(sharded(placed, tokens))
        start = time.perf_counter()
        for _ in range(repeats):
            jax.block_until_ready(sharded(placed, tokens))
        seconds = (time.perf_counter() - start) / repeats
    return {"lm_L": L, "lm_sequence_bytes": total(sharded), "lm_single_bytes": total(single),
            "lm_sequence_step_s": seconds}


def _figures(quick: bool) -> dict | None:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")
    cmd = [sys.executable, "-m", "xformers_jax_experiments.suites.parallel"] + (
        ["--quick"] if quick else [])
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root, timeout=1800)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("FIGURES ")]
    return json.loads(lines[-1][len("FIGURES "):]) if lines else None


def checks(r: Results):
    f = _figures(_LAST_QUICK["value"]) or {}
    L = f.get("L", "?")
    return [
        ratio_check("FSDP over 8 devices: parameter+Adam bytes on device 0 / unsharded",
                    f.get("fsdp_device0_bytes"), f.get("unsharded_bytes"), at_most=round(1 / 6, 3),
                    fmt="{:.3f}"),
        ratio_check(f"ring attention, 8 sequence shards, L={L}: per-device compiled memory / "
                    "exact attention on one device (fwd)",
                    f.get("ring_fwd_bytes"), f.get("exact_fwd_bytes"), at_most=0.2, fmt="{:.3f}"),
        ratio_check(f"same, forward+backward (L={L})", f.get("ring_fwdbwd_bytes"),
                    f.get("exact_fwdbwd_bytes"), at_most=0.2, fmt="{:.3f}"),
        ratio_check(f"causal LM train step (2 layers, flash attention), {f.get('lm_L', '?')} "
                    "tokens, sequence=8: per-device compiled memory / the one-device step's "
                    f"(the 8-device step took {f.get('lm_sequence_step_s', float('nan')):.1f} s "
                    "on the simulated devices)",
                    f.get("lm_sequence_bytes"), f.get("lm_single_bytes"), at_most=0.2,
                    fmt="{:.3f}"),
    ]


if __name__ == "__main__":
    print("FIGURES " + json.dumps(measure_memory("--quick" in sys.argv)))
