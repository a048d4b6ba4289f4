"""Suite ``decode``: the decoding atlas. Per kind, time per decoding step and cache/state bytes
per sequence against the context length, at batch 1 and 16; continuous against lockstep
batching on requests of mixed lengths; a paged cache's memory against the tokens it holds.

- The atlas model: ``CausalLM``, 2 layers, dim 256 (4 heads of 64), FFN 1024, vocab 256,
  float32, with the kind in every layer. A case times ``steps`` decoding steps of the whole
  batch (one ``lax.scan``, so the cache is updated in place; 8 for exact attention, 64 for
  the others, whose steps are short) from a cache holding ``L`` tokens
  (its positions set, its contents zeros: the work does not depend on them), donated and
  rewound to ``L`` after each call, compiled with ``models.decode_compiler_options()``, the
  model laid out for decoding (``CausalLM.for_decoding``: no layer's parameters sliced per step);
  ``state_kib`` is one sequence's cache (``models.sequence_cache_bytes``).
- ``read``: the time to sum a 256 MiB float32 array, the machine's memory bandwidth for the
  figure "exact attention's step within 2x of reading its cache once".
- Serving: 96 requests, prompts log-uniform in 64..2048 tokens and outputs log-uniform in
  16..512 (seeded; serving traces are heavy-tailed), on 16 slots of ``models.Server`` (prompts
  fed in chunks of up to 64 tokens a step, generating slots decoding on through such a step),
  a one-layer RetNet model at dim 64 (the figure is the scheduler's); ``continuous`` admits a
  request into any free slot, ``lockstep`` a new batch of 16 only when the last has finished;
  same tokens, same compiled step. Lockstep's batches prefill together and then generate one
  token a step until their longest request is done; continuous batching keeps admitting
  prompts, whose chunks lengthen the steps the generating slots decode through.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from xformers_jax import models, nn
from xformers_jax_experiments.bench_lib import Case, Workload, ratio_check, value_check

TITLE = "Decoding: time per step and cache bytes per sequence against context, per kind"
NOTE = ("`time (ms)` of an atlas row is for `steps` decoding steps of the whole batch (B "
        "sequences advance `steps` tokens); `state_kib` is one sequence's cache or state. "
        "Exact attention at "
        "batch 16 stops at 16K tokens (a 64K cache for 16 sequences is 4 GiB on a shared "
        "machine). Serving rows time a whole run of 96 requests (`generated` tokens). "
        "The machine is shared with other jobs while this runs: ratios within the run are what "
        "count.")
_BUILD = "xformers_jax_experiments.suites.decode:"
STEPS = {"dot_product": 8}  # decoding steps timed per call; 64 for the other kinds
DIM, LAYERS, HEADS, HIDDEN, VOCAB = 256, 2, 4, 1024, 256
KINDS = {  # name -> (slot, hyperparameters)
    "dot_product": ("attention", {}),
    "local": ("attention", {"left": 256}),
    "linear": ("attention", {}),
    "retnet": ("mixer", {}),
    "mamba": ("mixer", {}),
}
RECURRENT_OR_WINDOW = ("local", "linear", "retnet", "mamba")
CONTEXTS, QUICK_CONTEXTS = (1024, 4096, 16384, 65536), (128, 512)
EXACT_B16_MAX = 16384
READ_MIB = 256
SERVE = dict(requests=96, slots=16, prompt=(64, 2048), output=(16, 512), dim=64, seed=0)
QUICK_SERVE = dict(requests=8, slots=4, prompt=(4, 64), output=(2, 16), dim=32, seed=0)


def steps_of(kind: str) -> int:
    return STEPS.get(kind, 64)


def _model(kind: str, dim: int = DIM, layers: int = LAYERS, max_len: int = 1024):
    slot, hp = KINDS[kind]
    field, spec = {"attention": ("spec", nn.AttentionSpec),
                   "mixer": ("mixer", nn.MixerSpec)}[slot]
    return models.CausalLM(VOCAB, dim, layers, HEADS, 4 * dim, max_len=max_len,
                           block={field: spec(kind, hp)}, key=jax.random.PRNGKey(0))


def _at_context(cache, length: int):
    """``cache`` as if it held ``length`` tokens: key/value positions filled (a ring buffer's
    last ``C``), every index ``length``."""
    def fix(c):
        if isinstance(c, nn.KVCache):
            cap = c.pos.shape[-1]
            slots = jnp.arange(cap)
            pos = (jnp.where(slots < length, slots, -1) if not c.ring else
                   length - cap + (slots - (length - cap)) % cap)
            return nn.KVCache(c.k, c.v, jnp.broadcast_to(pos, c.pos.shape).astype(jnp.int32),
                              jnp.full_like(c.index, length), c.ring)
        if isinstance(c, nn.RecurrentCache):
            return nn.RecurrentCache(c.state, jnp.full_like(c.index, length))
        return c

    return jax.tree_util.tree_map(
        fix, cache, is_leaf=lambda x: isinstance(x, (nn.KVCache, nn.RecurrentCache)))


@functools.cache
def state_kib(kind: str, length: int) -> float:
    """One sequence's cache at ``length`` tokens, in KiB (nothing allocated)."""
    model = jax.eval_shape(lambda: _model(kind))
    return models.sequence_cache_bytes(model, length + steps_of(kind)) / 1024


def build(kind: str, L: int, B: int):
    model = _model(kind).for_decoding()  # as generate and Server step: no parameter slices
    n = steps_of(kind)
    caches = _at_context(model.init_cache(B, L + n), L)
    token = jnp.zeros((B,), jnp.int32)

    def steps(model, caches, token):
        def step(carry, t):
            caches, token = carry
            logits, caches = model.decode_step(token, caches, t)
            return (caches, jnp.argmax(logits, -1).astype(jnp.int32)), None

        (caches, token), _ = jax.lax.scan(step, (caches, token), L + jnp.arange(n))
        return _at_context(caches, L), token  # rewound: the next call decodes from L again

    # The cache is donated and fed back, as a server holds it: passed in without donation, each
    # call would first copy it whole; compiled as models.Server compiles its step.
    run_steps = jax.jit(steps, donate_argnums=1,
                        compiler_options=models.decode_compiler_options())
    state = [caches, token]

    def run():
        state[0], state[1] = run_steps(model, state[0], state[1])
        return jax.block_until_ready(state[1])

    return Workload(None, (), native=lambda mode: run,
                    figures=dict(steps=n, state_kib=round(state_kib(kind, L), 1)))


def build_read(mib: int):
    x = jnp.ones((mib * 2**20 // 4,), jnp.float32)
    return Workload(jnp.sum, (x,), figures=dict(read_mib=mib))


def serving_requests(requests, prompt, output, seed, **_):
    """The mixed workload: prompt and output lengths log-uniform in the given ranges."""
    rng = np.random.default_rng(seed)

    def lengths(lo, hi):
        return np.exp(rng.uniform(np.log(lo), np.log(hi), requests)).astype(int)

    return [models.Request(rng.integers(0, VOCAB, p).astype(np.int32), int(n))
            for p, n in zip(lengths(*prompt), lengths(*output))]


def build_serving(policy: str, quick: bool = False):
    cfg = QUICK_SERVE if quick else SERVE
    requests = serving_requests(**cfg)
    max_len = max(len(r.prompt) + r.max_new_tokens for r in requests)
    server = models.Server(_model("retnet", dim=cfg["dim"], layers=1, max_len=max_len),
                           num_slots=cfg["slots"], max_len=max_len)

    def run():
        return server.run(requests, policy=policy)[1].steps

    generated = sum(r.max_new_tokens for r in requests)
    return Workload(None, (), native=lambda mode: run,
                    figures=dict(generated=generated, slots=cfg["slots"]))


def page_fill(quick: bool = False, page_size: int = 16) -> float:
    """Pages in use times the page size over the tokens they hold, over the serving
    workload, with a paged exact-attention cache (a small model: the figure is the
    allocator's, not the model's)."""
    cfg = QUICK_SERVE if quick else SERVE
    requests = serving_requests(**cfg)
    max_len = max(len(r.prompt) + r.max_new_tokens for r in requests)
    model = models.CausalLM(VOCAB, 16, 1, 2, 32, max_len=max_len, key=jax.random.PRNGKey(0))
    server = models.Server(model, num_slots=cfg["slots"], max_len=max_len,
                           page_size=page_size)
    return server.run(requests)[1].page_fill


def cases(quick: bool) -> list[Case]:
    contexts = QUICK_CONTEXTS if quick else CONTEXTS
    out = [Case("read", _BUILD + "build_read", dict(mib=16 if quick else READ_MIB), ("fwd",))]
    for kind in KINDS:
        for b in (1, 16):
            for n in contexts:
                if kind == "dot_product" and b == 16 and n > EXACT_B16_MAX:
                    continue
                out.append(Case(kind, _BUILD + "build", dict(kind=kind, L=n, B=b), ("fwd",)))
    for policy in ("continuous", "lockstep"):
        out.append(Case(f"serve {policy}", _BUILD + "build_serving",
                        dict(policy=policy, quick=quick), ("fwd",)))
    return out


def checks(r):
    # The read case's size says which run this is (an --only run may lack the atlas's L=1K).
    read_case = r.find("read", "fwd")
    quick = read_case is not None and read_case["params"].get("mib") != READ_MIB
    short, long = (QUICK_CONTEXTS if quick else CONTEXTS)[0], (QUICK_CONTEXTS if quick
                                                                else CONTEXTS)[-1]
    mid = short if quick else 16384
    out = []
    for kind in RECURRENT_OR_WINDOW:
        for b in (1, 16):  # CPU time: a shared machine's load stretches it less than wall
            out.append(ratio_check(
                f"{kind}: CPU time per token at L={long} / at L={short} (B={b})",
                r.value("cpu_s", kind, "fwd", L=long, B=b),
                r.value("cpu_s", kind, "fwd", L=short, B=b), at_most=1.2))
        out.append(ratio_check(f"{kind}: state bytes per sequence at L={long} / at L={short}",
                               state_kib(kind, long), state_kib(kind, short), at_most=1.0))
    read = r.time("read", "fwd")
    read_mib = 16 if quick else READ_MIB
    exact = r.time("dot_product", "fwd", L=mid, B=1)
    if read and exact:
        seconds_to_read = state_kib("dot_product", mid) / 1024 / read_mib * read
        out.append(ratio_check(f"dot_product at L={mid}, B=1: time per token / reading its "
                               f"cache once at the measured bandwidth "
                               f"({read_mib / read / 1024:.1f} GiB/s)",
                               exact / steps_of("dot_product"), seconds_to_read, at_most=2.0))
    # CPU time, as for the atlas: under other jobs' load the wall time of these runs of a few
    # seconds swung from 1.0x to 5.0x between two runs of the same code.
    out.append(ratio_check("continuous / lockstep batching, tokens per CPU second (mixed "
                           "lengths)", r.value("cpu_s", "serve lockstep", "fwd"),
                           r.value("cpu_s", "serve continuous", "fwd"), at_least=2.0))
    out.append(value_check("paged cache: memory held / tokens held (pages of 16)",
                           page_fill(quick), at_most=1.1, fmt="{:.3f}x"))
    return out
