"""Suite ``peers``: us against the anchors a researcher would try instead, side by side in one
run on whatever machine it runs on.

- Exact attention: ``flash_attention`` (lifted with ``multihead``) against PyTorch's
  ``torch.nn.functional.scaled_dot_product_attention`` (its CPU flash kernel) and
  ``jax.nn.dot_product_attention`` (XLA's own, materialising the scores; up to 4K), fp32,
  B=1, H=4, D=64, fwd and fwd+bwd (the gradient of the output's sum), causal and not.
- A training step of an LRA-Text-sized classifier (vocab 256 + CLS, dim 256, 4 heads, MLP
  1024, 2 pre-norm GELU layers, CLS pooling, B=2, AdamW, fp32, no dropout): ours is
  ``models.EncoderClassifier`` with ``flash`` attention and its layers unrolled (also measured
  with the default scan over layers) stepped by the trainer's
  ``train.make_train_step`` (state donated, fed back every call); PyTorch's is
  ``nn.TransformerEncoder(norm_first=True, activation="gelu")`` with the same embedding,
  positions, pooling and head, ``torch.optim.AdamW``.
- The float32 matmul rate of both frameworks on 2048 x 2048.
- A bound (the "(why)" rows): flash's forward with everything but its two tile matmuls taken
  out (``tile_matmuls``), at flash's tile and at 1024. Where PyTorch's whole SDPA forward takes
  less time than these matmuls alone, no flash forward built from XLA's matmul kernels can
  match it on this machine, however cheap its softmax.

PyTorch is a benchmark-only extra (``pip install -e '.[bench]'``); without it the PyTorch cases
record an import error and their figures read n/a. Both frameworks use every core (PyTorch's
default intra-op threads). The header names the CPU model and its vector extensions: the
figures depend on them (AVX-512 and AMX change both frameworks' matmul kernels).
"""

from __future__ import annotations

import os

from xformers_jax_experiments.bench_lib import Case, Results, Workload, ratio_check, value_check
from xformers_jax_experiments.suites.attention import attention_flops, qkv

TITLE = ("Peers: flash attention and a training step against PyTorch and jax.nn "
         "(fp32, B=1, H=4, D=64)")
_BUILD = "xformers_jax_experiments.suites.peers:build"
_STEP = "xformers_jax_experiments.suites.peers:build_step"
_MATMUL = "xformers_jax_experiments.suites.peers:build_matmul"
# PEERS_LENGTHS (comma-separated) and PEERS_LONG=0 shrink a run on a busy machine; the
# defaults are the full table.
LENGTHS = tuple(int(x) for x in os.environ.get("PEERS_LENGTHS", "1024,2048,4096,8192").split(","))
LONG = 16384          # forward only: fwd+bwd at 16K would take minutes per case here
WITH_LONG = os.environ.get("PEERS_LONG", "1") != "0"
JAX_NN_MAX = 4096     # jax.nn.dot_product_attention holds [H, L, L] scores
# The forward's tile matmuls alone (``tile_matmuls``) at flash's own tile (0: the machine's,
# ``kernels.default_block``) and at 1024, the larger tile that ran as fast on the Sapphire Rapids;
# larger ones ran slower (2048: 89 against 81 ms at L=4096, timed once in one process).
TILE_BOUND_BLOCKS, TILE_BOUND_BLOCKS_QUICK = (0, 1024), (32, 64)
STEP_LENGTHS = (2048, 4096)
_VECTOR_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl",
                 "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8", "sve", "asimd")


def cpu_description() -> str:
    """``"<model name>, <n> cores; vector extensions: ..."`` from /proc/cpuinfo (Linux)."""
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model == "unknown CPU":
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    have = [x for x in _VECTOR_FLAGS if x in flags]
    return f"{model}, {os.cpu_count()} cores; vector extensions: {' '.join(have) or 'unknown'}"


def _torch_version() -> str:
    try:
        import torch
    except ImportError:
        return "PyTorch not installed (pip install -e '.[bench]')"
    cap = torch.backends.cpu.get_cpu_capability()
    return f"PyTorch {torch.__version__} (CPU kernels: {cap}, {torch.get_num_threads()} threads)"


def machine_note() -> str:
    """What this suite's figures depend on beyond the machine line: the CPU's vector
    extensions and PyTorch's build, recorded with each run (``benchmark.py`` stores it as the
    run's ``machine_note``; the suite's ``NOTE`` is documentation and is re-read at render)."""
    return f"CPU: {cpu_description()}. {_torch_version()}."


NOTE = ("Ratios are 'x' = PyTorch's (or "
        "jax.nn's) time over ours: above 1 we are faster. Each case runs in its own process "
        "one after another; the machine may be shared, so only ratios within this run count. "
        "Checks marked (cpu time) compare the process's CPU time per call (all threads), which "
        "other jobs' load stretches far less than wall time. 'tile matmuls' is flash's forward "
        "with only its two tile matmuls left (block 0: flash's own tile on this machine), a "
        "floor for any flash forward built from XLA's matmul kernels.")


# -- builders (worker processes) ---------------------------------------------------------------

def _torch_qkv(L: int, B: int, H: int, D: int, requires_grad: bool):
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, L, D, generator=g, requires_grad=requires_grad) for _ in range(3)]


def build(variant: str, L: int, causal: bool = False, B: int = 1, H: int = 4, D: int = 64,
          block: int = 0):
    flops = attention_flops(L, B, H, D, causal)
    if variant == "torch":
        import torch
        import torch.nn.functional as F

        def native(mode):
            q, k, v = _torch_qkv(L, B, H, D, requires_grad=mode == "fwdbwd")
            if mode == "fwd":
                def fwd():
                    with torch.no_grad():
                        F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                return fwd

            def fwdbwd():
                for x in (q, k, v):
                    x.grad = None
                F.scaled_dot_product_attention(q, k, v, is_causal=causal).sum().backward()
            return fwdbwd

        return Workload(None, (), flops=flops, native=native)
    import jax

    if variant == "flash":
        from xformers_jax.attention import flash_attention, multihead

        lifted = multihead(flash_attention)
        fn = lambda q, k, v: lifted(q, k, v, causal=causal)  # noqa: E731
    elif variant == "jax.nn":
        fn = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
            q, k, v, is_causal=causal, implementation="xla")
    elif variant == "tile matmuls":
        if causal:
            raise ValueError("the 'tile matmuls' bound is measured for full attention only")
        fn = lambda q, k, v: tile_matmuls(q, k, v, block or None)  # noqa: E731
    else:
        raise ValueError(f"unknown variant {variant!r}")
    return Workload(fn, qkv(L, B, H, D), flops=flops)


def tile_matmuls(q, k, v, block: int | None = None):
    """Flash attention's forward with everything but its two tile matmuls taken out: per
    head, for each ``block``-row query tile, ``acc += (q_t k_t^T) v_t`` over the key tiles
    (no scale, no running max, no exponential, no normaliser). ``q, k, v [B, L, H, D]``,
    ``L`` a multiple of ``block`` (the machine's flash tile, ``kernels.default_block``, by
    default). Its time is what XLA's matmul kernels alone need for the forward's FLOPs at
    flash's tiles: a floor for any flash forward built from them. Not attention: the suite
    times it, nothing else calls it."""
    import jax
    import jax.numpy as jnp

    from xformers_jax import kernels

    b = block or kernels.default_block()
    B, L, H, D = q.shape
    if L % b:
        raise ValueError(f"tile_matmuls: L = {L} must be a multiple of the tile {b}")

    def one_head(q, k, v):  # [L, D] each
        kt, vt = k.reshape(L // b, b, D), v.reshape(L // b, b, D)

        def q_tile(qt):
            def step(acc, kv):
                return acc + (qt @ kv[0].T) @ kv[1], None
            return jax.lax.scan(step, jnp.zeros((b, D), q.dtype), (kt, vt))[0]

        return jax.lax.map(q_tile, q.reshape(L // b, b, D)).reshape(L, D)

    # Over B and H on head-major copies, as ``multihead`` runs flash (each tile a contiguous
    # slice).
    hm = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
    return hm(jax.vmap(jax.vmap(one_head))(hm(q), hm(k), hm(v)))


def build_matmul(framework: str, n: int = 2048):
    flops = 2.0 * n**3
    if framework == "torch":
        import torch

        a, b = (torch.randn(n, n, generator=torch.Generator().manual_seed(i)) for i in range(2))
        return Workload(None, (), flops=flops, native=lambda mode: (lambda: a @ b))
    from xformers_jax_experiments.bench_lib import matmul_workload

    return matmul_workload(n)


VOCAB, DIM, HEADS, HIDDEN, LAYERS, CLASSES = 256, 256, 4, 1024, 2, 2


def _torch_step(L: int, B: int):
    import torch
    from torch import nn as tnn

    torch.manual_seed(0)

    class Classifier(tnn.Module):
        def __init__(self):
            super().__init__()
            self.embed = tnn.Embedding(VOCAB + 1, DIM)   # + the CLS token
            self.pos = tnn.Parameter(torch.randn(L + 1, DIM) * 0.02)
            layer = tnn.TransformerEncoderLayer(DIM, HEADS, HIDDEN, dropout=0.0,
                                                activation="gelu", batch_first=True,
                                                norm_first=True)
            self.encoder = tnn.TransformerEncoder(layer, LAYERS, norm=tnn.LayerNorm(DIM),
                                                  enable_nested_tensor=False)
            self.head = tnn.Linear(DIM, CLASSES)

        def forward(self, tokens):
            cls = torch.full((tokens.shape[0], 1), VOCAB, dtype=tokens.dtype)
            h = self.embed(torch.cat([cls, tokens], 1)) + self.pos
            return self.head(self.encoder(h)[:, 0])

    model = Classifier()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, VOCAB, (B, L), generator=g)
    labels = torch.arange(B) % CLASSES

    def step():
        opt.zero_grad(set_to_none=True)
        loss = tnn.functional.cross_entropy(model(tokens), labels)
        loss.backward()
        opt.step()
        return loss.item()

    return step


def _jax_step(L: int, B: int, scan: bool = False):
    import jax
    import jax.numpy as jnp
    import optax

    from xformers_jax import models, nn, train

    model = models.EncoderClassifier(CLASSES, DIM, LAYERS, HEADS, HIDDEN, pooling="cls",
                                 vocab_size=VOCAB + 1, max_len=L + 1,
                                 block=dict(spec=nn.AttentionSpec("flash", {})),
                                 stack=dict(scan=scan), key=jax.random.PRNGKey(0))
    optimizer = optax.adamw(1e-4)

    def loss_fn(m, batch, key):
        logits = m(batch["tokens"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()
        return loss, {}

    run = train.make_train_step(loss_fn, optimizer)
    holder = [train.create_train_state(model, optimizer, jax.random.PRNGKey(2))]
    batch = dict(tokens=jax.random.randint(jax.random.PRNGKey(1), (B, L), 1, VOCAB),
                 labels=jnp.arange(B) % CLASSES)

    def step():
        holder[0], metrics = run(holder[0], batch)
        return float(metrics["loss"])   # waits for the step

    return step


def build_step(framework: str, L: int, B: int = 2, scan: bool = False):
    """One training step (forward, backward, AdamW update) of the classifier above.

    Ours runs its two layers unrolled (``LayerStack(scan=False)``) unless ``scan``: under a
    ``lax.scan`` over layers XLA:CPU stacks every layer's saved activations into ``[layers,
    ...]`` buffers with dynamic-update-slices and reads them back with dynamic slices (see
    BUILD.md, "Performance on CPU"); the scanned case is measured beside it and the suite's
    "(why)" check reports the ratio.
    """
    if framework == "torch":
        return Workload(None, (), native=lambda mode: _torch_step(L, B))
    return Workload(None, (), native=lambda mode: _jax_step(L, B, scan))


# -- cases and checks ----------------------------------------------------------------------

def cases(quick: bool) -> list[Case]:
    lengths = (128, 256) if quick else LENGTHS
    out = [Case("matmul", _MATMUL, dict(framework=f, n=256 if quick else 2048), ("fwd",))
           for f in ("xla", "torch")]
    for L in lengths:
        for causal in (False, True):
            for variant in ("flash", "torch", "jax.nn"):
                if variant == "jax.nn" and L > JAX_NN_MAX:
                    continue
                out.append(Case(f"{variant} attention", _BUILD,
                                dict(variant=variant, L=L, causal=causal)))
    for L in [x for x in lengths if quick or x >= 2048]:
        for block in TILE_BOUND_BLOCKS_QUICK if quick else TILE_BOUND_BLOCKS:
            out.append(Case("tile matmuls", _BUILD, dict(variant="tile matmuls", L=L,
                                                         block=block), ("fwd",)))
    if not quick and WITH_LONG:
        for causal in (False, True):
            for variant in ("flash", "torch"):
                out.append(Case(f"{variant} attention", _BUILD,
                                dict(variant=variant, L=LONG, causal=causal), ("fwd",)))
    for L in (128,) if quick else STEP_LENGTHS:
        for f in ("ours", "torch"):
            out.append(Case(f"train step ({f})", _STEP, dict(framework=f, L=L), ("step",)))
        out.append(Case("train step (ours, scanned layers)", _STEP,
                        dict(framework="ours", L=L, scan=True), ("step",)))
    return out


def _lengths(r: Results):
    return LENGTHS if r.find("flash attention", "fwd", L=LENGTHS[-1]) else (128, 256)


def checks(r: Results):
    out = []
    lengths = _lengths(r)
    for L in [x for x in lengths if x >= 2048]:
        for causal in (False, True):
            for mode in ("fwd", "fwdbwd"):
                out.append(ratio_check(
                    f"flash {mode} vs PyTorch SDPA at L={L}{' causal' if causal else ''} "
                    "(torch time / ours)",
                    r.time("torch attention", mode, L=L, causal=causal),
                    r.time("flash attention", mode, L=L, causal=causal), at_least=1.0))
    for L in (STEP_LENGTHS if lengths == LENGTHS else (128,)):
        out.append(ratio_check(f"training step vs PyTorch at L={L} (torch time / ours)",
                               r.time("train step (torch)", "step", L=L),
                               r.time("train step (ours)", "step", L=L), at_least=1.0))
    xla = r.value("gflops", "matmul", "fwd", framework="xla")
    for L in [x for x in (*lengths, LONG) if x >= 4096 and (x != LONG or WITH_LONG)]:
        rate = r.value("gflops", "flash attention", "fwd", L=L, causal=False)
        out.append(value_check(f"flash fwd fraction of the XLA matmul rate at L={L}",
                               None if rate is None or not xla else rate / xla,
                               at_least=0.6, fmt="{:.2f}"))
    # The same ratios in CPU time (process time of all threads per call): on a machine shared
    # with other jobs, wall time is stretched by their load at whatever moment each case ran.
    for L in [x for x in lengths if x >= 2048]:
        for causal in (False, True):
            for mode in ("fwd", "fwdbwd"):
                out.append(ratio_check(
                    f"(cpu time) flash {mode} vs PyTorch SDPA at L={L}"
                    f"{' causal' if causal else ''}",
                    r.value("cpu_s", "torch attention", mode, L=L, causal=causal),
                    r.value("cpu_s", "flash attention", mode, L=L, causal=causal),
                    at_least=1.0))
    for L in (STEP_LENGTHS if lengths == LENGTHS else (128,)):
        out.append(ratio_check(f"(cpu time) training step vs PyTorch at L={L}",
                               r.value("cpu_s", "train step (torch)", "step", L=L),
                               r.value("cpu_s", "train step (ours)", "step", L=L),
                               at_least=1.0))
    for L in (STEP_LENGTHS if lengths == LENGTHS else (128,)):
        out.append(ratio_check(f"(why) our training step with scanned / unrolled layers at L={L}",
                               r.time("train step (ours, scanned layers)", "step", L=L),
                               r.time("train step (ours)", "step", L=L), at_least=0.0))
    out.append(ratio_check("(why) PyTorch matmul rate / XLA matmul rate (2048^2 fp32)",
                           r.value("gflops", "matmul", "fwd", framework="torch"), xla,
                           at_least=0.0))
    for L in [x for x in lengths if x >= 2048] or lengths[-1:]:
        floor = [t for t in (r.time("tile matmuls", "fwd", L=L, block=b) for b in
                             (TILE_BOUND_BLOCKS if lengths == LENGTHS else TILE_BOUND_BLOCKS_QUICK))
                 if t is not None]
        floor = min(floor) if floor else None
        out.append(ratio_check(f"(why) PyTorch SDPA fwd time / our forward's tile matmuls alone "
                               f"(no softmax) at L={L}",
                               r.time("torch attention", "fwd", L=L, causal=False), floor,
                               at_least=0.0))
        out.append(ratio_check(f"(why) flash fwd time / its tile matmuls alone at L={L}",
                               r.time("flash attention", "fwd", L=L, causal=False), floor,
                               at_least=0.0))
    L = min(JAX_NN_MAX, lengths[-1])
    out.append(ratio_check(f"(why) jax.nn.dot_product_attention fwd+bwd time / flash at L={L}",
                           r.time("jax.nn attention", "fwdbwd", L=L, causal=False),
                           r.time("flash attention", "fwdbwd", L=L, causal=False),
                           at_least=0.0))
    return out
