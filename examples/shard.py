"""Shard a model over a device mesh: data, FSDP and tensor parallelism from one strategy name.

Parameters declare their logical axes where they are defined (``xformers_jax.axes``); a
strategy maps logical axes to mesh axes, ``param_shardings`` turns a model into the
``NamedSharding`` of each array, and ``use_mesh`` activates the rules the models' activation
constraints read while a step is traced. JAX's partitioner does the rest. On a CPU, XLA can
pretend to have several devices, which is how this script (and the test suite) runs:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/shard.py

The trainer does the same from its config: ``--config.mesh='{"strategy": "fsdp+tensor",
"tensor": 2}'``.
"""

import os

# Before JAX starts: 8 CPU devices unless the caller chose otherwise.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from xformers_jax import models, nn, parallel  # noqa: E402


def loss_fn(model, tokens, labels):
    logits = model(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def step(model, opt_state, tokens, labels, optimizer):
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, tokens, labels)
    updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss


def main(strategy: str = "fsdp+tensor", tensor: int = 2) -> dict:
    model = models.EncoderClassifier(
        10, 64, 2, 4, 128, pooling="mean", vocab_size=256, max_len=32,
        block=dict(spec=nn.AttentionSpec("flash", {"block_q": 16, "block_k": 16})),
        key=jax.random.PRNGKey(0))
    optimizer = optax.adamw(1e-3)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (8, 32), 0, 256)
    labels = jax.random.randint(jax.random.PRNGKey(2), (8,), 0, 10)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    run = jax.jit(step, static_argnums=4)
    _, _, single_loss = run(model, opt_state, tokens, labels, optimizer)

    st = parallel.strategy(strategy, {"tensor": tensor} if "tensor" in strategy else None)
    mesh = st.mesh()
    params = parallel.param_shardings(model, st.param_rules, mesh)
    batch = NamedSharding(mesh, P(("data", "fsdp")))
    sharded = jax.device_put(model, params)
    opt_state = optimizer.init(eqx.filter(sharded, eqx.is_array))  # follows the parameters
    with parallel.use_mesh(mesh, st.compute_rules, st.param_rules):
        new, _, loss = run(sharded, opt_state, jax.device_put(tokens, batch),
                           jax.device_put(labels, batch), optimizer)

    wq = new.encoder.layers.layers.attn.wq  # [layers, dim, dim], the layers stacked for scan
    shape = {name: size for name, size in mesh.shape.items() if size > 1}
    print(f"{jax.device_count()} devices, mesh {shape}, strategy {strategy!r}")
    print(f"the query projections {tuple(wq.shape)} are laid out as {wq.sharding.spec}; "
          f"one device holds {wq.addressable_shards[0].data.shape}")
    print(f"loss on one device {float(single_loss):.6f}, sharded {float(loss):.6f}")
    return dict(single_loss=float(single_loss), sharded_loss=float(loss),
                devices=jax.device_count(), wq_spec=wq.sharding.spec,
                wq_shard=wq.addressable_shards[0].data.shape, wq_shape=wq.shape)


if __name__ == "__main__":
    main()
