"""The exact softmax kinds (:mod:`._dense`, :mod:`._exact`) as :class:`~xformers_jax.kinds.Kind`
records, with their adapters: the only kinds that take additive position biases and decode over
a key/value cache. They honour segment ids (packed rows): the dense reference masks the scores
and the tiled kernel each tile by ``segment_ids``, which ``attend`` passes through."""

from __future__ import annotations

import jax.numpy as jnp

from ..kinds import AttentionAdapter, Kind, KVDecoding, Paper, REQUIRED, SequenceParallel
from ..kinds import WindowDecoding
from ._adapters import IMPLEMENTATION, TILES, lifted
from ._dense import dot_product_attention
from ._exact import block_sparse_attention, flash_attention
from ._halo import halo_local_attention
from ._ring import ring_attention
from ._flex import flex_attention, soft_cap_score, streaming_documents, streaming_mask
from .patterns import Local

_VASWANI = Paper("Vaswani et al.", 2017, "Attention Is All You Need")
_CHILD = Paper("Child et al.", 2019, "Generating Long Sequences with Sparse Transformers")

_TILES = {**TILES, **IMPLEMENTATION}


def _block_sparse(q, k, v, *, pattern, **kw):
    return block_sparse_attention(q, k, v, pattern, **kw)


def _local(q, k, v, *, left, right=0, **kw):
    return block_sparse_attention(q, k, v, Local(left, right), **kw)


# Sequence parallelism: ring attention (Liu et al., 2023) for the full and causal patterns, a
# halo exchange for the sliding window. The Pallas implementations are single-device kernels:
# under a sequence split the ring runs the XLA tiles.
def _ring(q, k, v, *, causal=False, kv_mask=None, key=None, block_q=None, block_k=None,
          pattern=None, implementation=None):
    return ring_attention(q, k, v, causal=causal, kv_mask=kv_mask, block_q=block_q,
                          block_k=block_k)


def _halo(q, k, v, *, left, right=0, causal=False, kv_mask=None, key=None, block_q=None,
          block_k=None, implementation=None):
    return halo_local_attention(q, k, v, left=left, right=right, causal=causal,
                                kv_mask=kv_mask, block_q=block_q, block_k=block_k)


def _no_pattern(hp, causal):
    if hp.get("pattern") is not None:
        return ("ring attention runs the full or causal pattern, not pattern="
                f"{hp['pattern']!r}; use kind 'local' for a sliding window")
    return None


def _softcap(q, k, v, *, cap=50.0, **kw):
    return flex_attention(q, k, v, score_mod=soft_cap_score(cap), **kw)


def _streaming(q, k, v, *, window, sinks=4, segment_ids=None, **kw):
    if segment_ids is not None:  # sinks per document, still O(L (w + n) D)
        return streaming_documents(q, k, v, window=window, sinks=sinks,
                                   segment_ids=segment_ids, **kw)
    return flex_attention(q, k, v, mask_mod=streaming_mask(window, sinks), **kw)


def _learned_sinks(q, k, v, sink, *, window=None, **kw):
    return flex_attention(q, k, v, sink=sink, mask_mod=None if window is None else Local(
        window, 0 if kw.get("causal") else window), **kw)


def _init_sinks(key, hp, *, num_heads, head_dim, max_len):
    return jnp.zeros((num_heads,), jnp.float32)


_RING = SequenceParallel(lifted(_ring), _no_pattern)
_PATTERN_DECODING = KVDecoding(pattern=lambda hp: hp["pattern"])

def _pattern_segments(hp):
    """Packed rows need a pattern of offsets ``i - j`` only (``Pattern.offsets_only``): one of
    absolute positions puts a document packed at an offset under another pattern than alone."""
    pattern = hp.get("pattern")
    if pattern is None or pattern.offsets_only:
        return None
    return (f"its pattern {type(pattern).__name__} depends on absolute positions of the row "
            "(not only on offsets i - j), so a packed document would not see its own pattern; "
            "use a pattern of offsets (Local, Strided, Dilated, Causal and their unions) or "
            "unpacked rows (data.pack=False)")


KINDS = (
    Kind("dot_product", dot_product_attention, "exact", _VASWANI,
         time="O(L^2 D)", memory="O(L^2)", causal=True, decoding="kv", bias=True,
         segments=_pattern_segments, test_hyperparameters={},
         hyperparameters={"pattern": (None, "a static sparsity pattern (attention.patterns) "
                                            "applied to the dense scores; None: all keys")},
         adapter=AttentionAdapter(lifted(dot_product_attention), decoding=_PATTERN_DECODING,
                                  sequence=_RING)),
    Kind("flash", flash_attention, "exact",
         Paper("Dao et al.", 2022,
               "FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness"),
         time="O(L^2 D)", memory="O(L D)", causal=True, decoding="kv", bias=True,
         segments=_pattern_segments, test_hyperparameters={"block_q": 8, "block_k": 8},
         hyperparameters={"pattern": (None, "a static sparsity pattern (attention.patterns) "
                                            "whose empty tiles are skipped; None: all keys"),
                          **_TILES},
         adapter=AttentionAdapter(lifted(flash_attention), decoding=_PATTERN_DECODING,
                                  sequence=_RING)),
    Kind("block_sparse", block_sparse_attention, "exact", _CHILD,
         time="O(L n D), n kept keys per query", memory="O(L D)", causal=True, decoding="kv",
         bias=True, segments=_pattern_segments,
         test_hyperparameters={"pattern": Local(4, 4), "block_q": 8, "block_k": 8},
         hyperparameters={"pattern": (REQUIRED, "the static sparsity pattern "
                                                "(attention.patterns), e.g. Local(16, 0)"),
                          **_TILES},
         adapter=AttentionAdapter(lifted(_block_sparse), decoding=_PATTERN_DECODING)),
    Kind("local", block_sparse_attention, "exact",
         Paper("Parmar et al.", 2018, "Image Transformer"),
         time="O(L w D), w the window", memory="O(L D)", causal=True, decoding="window",
         bias=True, segments=True, test_hyperparameters={"left": 3},
         hyperparameters={"left": (REQUIRED, "keys before the query inside its window"),
                          "right": (0, "keys after the query inside its window"),
                          **_TILES},
         adapter=AttentionAdapter(lifted(_local),
                                  decoding=WindowDecoding(left=lambda hp: hp["left"]),
                                  sequence=SequenceParallel(lifted(_halo)))),
    # Flex attention's score and mask functions (attention._flex) as kinds.
    Kind("softcap", flex_attention, "exact",
         Paper("Gemma Team", 2024, "Gemma 2: Improving Open Language Models at a Practical Size"),
         time="O(L^2 D)", memory="O(L D)", causal=True, decoding=None, segments=True,
         test_hyperparameters={"cap": 1.0, "block_q": 8, "block_k": 8},
         hyperparameters={"cap": (50.0, "soft cap of the scaled logits: cap * tanh(s / cap)"),
                          **TILES},
         adapter=AttentionAdapter(lifted(_softcap))),
    Kind("streaming", flex_attention, "exact",
         Paper("Xiao et al.", 2024, "Efficient Streaming Language Models with Attention Sinks"),
         time="O(L (w + n) D)", memory="O(L D)", causal=True, decoding="kv", segments=True,
         test_hyperparameters={"window": 3, "sinks": 2, "block_q": 8, "block_k": 8},
         hyperparameters={"window": (REQUIRED, "keys before the query inside its window"),
                          "sinks": (4, "first keys every query sees (the attention sinks)"),
                          **TILES},
         adapter=AttentionAdapter(
             lifted(_streaming),
             decoding=KVDecoding(pattern=lambda hp: streaming_mask(hp["window"], hp["sinks"])))),
    Kind("learned_sinks", flex_attention, "exact",
         Paper("OpenAI", 2025, "gpt-oss-120b & gpt-oss-20b Model Card"),
         time="O(L^2 D) (O(L w D) windowed)", memory="O(L D)", causal=True, decoding=None,
         segments=True,
         test_hyperparameters={"block_q": 8, "block_k": 8},
         hyperparameters={"window": (None, "sliding window (keys back; both sides when not "
                                           "causal); None: all keys"),
                          **TILES},
         adapter=AttentionAdapter(lifted(_learned_sinks, ("heads",)), init=_init_sinks)),
)
