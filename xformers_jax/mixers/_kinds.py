"""The token mixers as :class:`~xformers_jax.kinds.Kind` records (family ``"mixers"``).
``decoding="recurrent"``: an O(1) state per step; ``"kv"``: a cache growing with the sequence
(gMLP's past gate inputs, aMLP's keys and values); None: cannot decode. ``fixed_length``:
weights sized by ``max_len``. ``causal``: a causal form exists. Each mixer's layer (the
record's adapter) is the ``xformers_jax.nn`` module that declares it with ``nn.implements``."""

from __future__ import annotations

from ..attention import KINDS as ATTENTION_KINDS
from ..kinds import Kind, Paper
from ._conv import lightweight_conv
from ._mixing import (fourier_mixing, lambda_mixing, pool_mixing, spatial_gating,
                      token_mixing_mlp)
from ._delta_rules import DELTA_PRODUCT_CHUNK, DPLR_CHUNK, delta_product, kda, rwkv7
from ._longconv import h3, hyena
from ._loglinear import LOGLINEAR_CHUNK, loglinear_linear, loglinear_ssd
from ._mlstm import mlstm
from ._recurrences import GLA_CHUNK, gated_delta, gla, hgrn2, retention, ssd
from ._ssm import s4d, s5, selective_scan

_CHUNK = {"chunk_size": 8}


def _scan(chunk_size, forms):
    return {"chunk_size": (chunk_size, "positions per chunk of the chunked scan"),
            "implementation": ("chunked", f"the form: {forms}")}


def _ssm(state_size, implementation, forms):
    return {
        "state_size": (state_size, "states per system"),
        "dt_min": (1e-3, "smallest initial step size (log-uniform in [dt_min, dt_max])"),
        "dt_max": (1e-1, "largest initial step size"),
        "implementation": (implementation, f"the form: {forms}"),
    }


def _short_conv(paper_width):
    said = (f"the paper's layer uses {paper_width}" if paper_width
            else "the paper's layer has none")
    return {"short_conv": (0, (f"taps W of a short causal convolution on q, k and v (0: none; "
                               f"{said}); decoding then also keeps the last W - 1 inputs, "
                               "(W - 1) D per sequence"))}

_SELECTIVE = {
    "expand": (2, "inner width expand * dim"),
    "conv_width": (4, "taps of the short causal convolution"),
}

# Why these mixers do not pack (Kind.segments as a reason: each document's outputs would differ
# from the document alone).
_LOGLINEAR_ABSOLUTE = (
    "its Fenwick-tree buckets (and so the level weight lambda each key gets) are by absolute "
    "position in the row, so a document at an offset is split into other buckets than alone")
_GATING_ABSOLUTE = (
    "the spatial gating unit's weights W[i, j] are per absolute position pair of the row, so a "
    "document at an offset meets other weights than alone")
_MIXER_ABSOLUTE = (
    "the token-mixing MLP's weights are per absolute position of the row (and mix every "
    "position of it, other documents included)")
_FOURIER_ROW = ("the Fourier transform over positions mixes every position of the row, "
                "other documents included")
_LAMBDA_ROW = (
    "the content lambda normalises the keys of every position of the row (a softmax over "
    "positions, other documents included) and the global position lambdas reach across it")
_POOL_UNTESTED = (
    "its centred pool averages across a document's edges (a pool kept inside documents is not "
    "written: packing is tested in causal language models, and it has no causal form)")


def _lsra_segments(hp):
    """LSRA packs exactly when its attention branch's kind does (its convolution's taps stay
    inside a document)."""
    spec = hp["spec"]
    # A kind's name (configs), or an nn.AttentionSpec (its kind and hyperparameters).
    name, params = (spec, {}) if isinstance(spec, str) else (spec.kind, dict(spec.params))
    kind = next((k for k in ATTENTION_KINDS if k.name == name), None)
    if kind is None:
        return f"its attention branch names no registered attention kind ({name!r})"
    problem = kind.segment_problem(kind.resolve(params))
    return None if problem is None else f"its attention branch: {problem}"


KINDS = (
    Kind("retnet", retention, "mixers",
         Paper("Sun et al.", 2023, "Retentive Network: A Successor to Transformer for Large "
               "Language Models"),
         time="O(L c D + L D^2)", memory="O(L D + (L/c) D^2)", causal=True, segments=True,
         decoding="recurrent",
         state_size="H D_k D_v", test_hyperparameters=_CHUNK,
         hyperparameters={**_scan(64, "'chunked', 'parallel' or 'recurrent'"),
                          **_short_conv(0)}),
    Kind("gla", gla, "mixers",
         Paper("Yang et al.", 2024, "Gated Linear Attention Transformers with "
               "Hardware-Efficient Training"),
         time="O(L c D_k + L D^2)", memory="O(L D + (L/c) D^2 + c^2 D_k)",
         causal=True, segments=True,
         decoding="recurrent",
         state_size="H D_k D_v", test_hyperparameters=_CHUNK,
         hyperparameters={**_scan(GLA_CHUNK, "'chunked', 'parallel' or 'recurrent'"),
                          **_short_conv(0)}),
    Kind("mamba2", ssd, "mixers",
         Paper("Dao and Gu", 2024, "Transformers are SSMs: Generalized Models and Efficient "
               "Algorithms Through Structured State Space Duality"),
         time="O(L c N + L N P)", memory="O(L D + (L/c) N D)", causal=True, segments=True,
         decoding="recurrent",
         state_size="H N P + (W - 1)(E + 2 N)", test_hyperparameters={**_CHUNK, "state_size": 8},
         hyperparameters={**_ssm(64, "chunked", "'chunked', 'parallel' or 'recurrent'"),
                          **_SELECTIVE,
                          "chunk_size": (64, "positions per chunk of the chunked scan")}),
    Kind("loglinear_mamba2", loglinear_ssd, "mixers",
         Paper("Guo et al.", 2025, "Log-Linear Attention"),
         time="O(L c N + L N P log(L/c))", memory="O(L D + (L/c) N D log(L/c))", causal=True,
         decoding="recurrent", fixed_length=True,
         segments=_LOGLINEAR_ABSOLUTE,
         state_size="O(log L) H N P: bit_length(L) H N P + (W - 1)(E + 2 N)",
         test_hyperparameters={**_CHUNK, "state_size": 8},
         hyperparameters={**_ssm(64, "chunked", "'chunked', 'parallel' or 'recurrent'"),
                          **_SELECTIVE,
                          "chunk_size": (LOGLINEAR_CHUNK, ("positions per chunk of the chunked "
                                                           "form (a power of two)"))}),
    Kind("loglinear_linear", loglinear_linear, "mixers",
         Paper("Guo et al.", 2025, "Log-Linear Attention"),
         time="O(L c D + L D^2 log(L/c) / H)", memory="O(L D + (L/c) D^2 log(L/c) / H)",
         causal=True, decoding="recurrent", fixed_length=True,
         segments=_LOGLINEAR_ABSOLUTE,
         state_size="O(log L) H D_k D_v: bit_length(L) H D_k D_v",
         test_hyperparameters=_CHUNK,
         hyperparameters=_scan(LOGLINEAR_CHUNK, "'chunked', 'parallel' or 'recurrent' "
                                                "(chunks: a power of two)")),
    Kind("mamba", selective_scan, "mixers",
         Paper("Gu and Dao", 2023, "Mamba: Linear-Time Sequence Modeling with Selective State "
               "Spaces"),
         time="O(L D N)", memory="O(L D + G D N)", causal=True, decoding="recurrent",
         segments=True,
         test_hyperparameters={"state_size": 4},
         hyperparameters={**_ssm(16, "auto", "'auto' (a loop with its own backward on a "
                                              "CPU, the associative scan elsewhere), 'loop', "
                                              "'associative' or 'sequential'"),
                          **_SELECTIVE}),
    Kind("gated_deltanet", gated_delta, "mixers",
         Paper("Yang, Kautz and Hatamizadeh", 2025, "Gated Delta Networks: Improving Mamba2 "
               "with Delta Rule"),
         time="O(L c D + L D^2)", memory="O(L D + (L/c) D^2)", causal=True,
         decoding="recurrent", segments=True,
         state_size="H D_k D_v", test_hyperparameters=_CHUNK,
         hyperparameters={**_scan(64, "'chunked', 'recurrent' or 'parallel'"),
                          "dt_min": (1e-3, "smallest initial decay step (log-uniform)"),
                          "dt_max": (1e-1, "largest initial decay step"),
                          **_short_conv(4)}),
    Kind("mlstm", mlstm, "mixers",
         Paper("Beck et al.", 2024, "xLSTM: Extended Long Short-Term Memory"),
         time="O(L c D + L D^2)", memory="O(L D + (L/c) D^2)", causal=True, segments=True,
         decoding="recurrent",
         state_size="H (D_k D_v + D_k + 1)", test_hyperparameters=_CHUNK,
         hyperparameters={**_scan(64, "'chunked', 'parallel' or 'recurrent'"),
                          **_short_conv(4)}),
    Kind("hgrn2", hgrn2, "mixers",
         Paper("Qin et al.", 2024, "HGRN2: Gated Linear RNNs with State Expansion"),
         time="O(L c D_k + L D^2)", memory="O(L D + (L/c) D^2 + c^2 D_k)",
         causal=True, segments=True,
         decoding="recurrent",
         state_size="H D_k D_v", test_hyperparameters=_CHUNK,
         hyperparameters={"lower_bound": (0.0, "the forget gates' lower bound in [0, 1)"),
                          **_scan(GLA_CHUNK, "'chunked', 'parallel' or 'recurrent'")}),
    Kind("kda", kda, "mixers",
         Paper("Kimi Team", 2025, "Kimi Linear: An Expressive, Efficient Attention "
               "Architecture"),
         time="O(L c D_k + L D^2)", memory="O(L D + (L/c) D^2 + c^2 D_k)", causal=True,
         decoding="recurrent", segments=True,
         state_size="H D_k D_v", test_hyperparameters=_CHUNK,
         hyperparameters={**_scan(DPLR_CHUNK, "'chunked', 'recurrent' or 'parallel'"),
                          "dt_min": (1e-3, "smallest initial decay step (log-uniform)"),
                          "dt_max": (1e-1, "largest initial decay step"),
                          **_short_conv(4)}),
    Kind("rwkv7", rwkv7, "mixers",
         Paper("Peng et al.", 2025, "RWKV-7 \"Goose\" with Expressive Dynamic State "
               "Evolution"),
         time="O(L c D_k + L D^2)", memory="O(L D + (L/c) D^2 + c^2 D_k)", causal=True,
         decoding="recurrent", segments=True,
         state_size="H D_k D_v", test_hyperparameters=_CHUNK,
         hyperparameters=_scan(DPLR_CHUNK, "'chunked', 'recurrent' or 'parallel'")),
    Kind("delta_product", delta_product, "mixers",
         Paper("Siems et al.", 2025, "DeltaProduct: Improving State-Tracking in Linear RNNs "
               "via Householder Products"),
         time="O(L n_h (c D + D^2))", memory="O(L n_h D + (L n_h/c) D^2)", causal=True,
         decoding="recurrent", segments=True,
         state_size="H D_k D_v", test_hyperparameters=_CHUNK,
         hyperparameters={"householder_steps": (2, "delta (Householder) steps n_h per token"),
                          **_scan(DELTA_PRODUCT_CHUNK, "'chunked', 'recurrent' or 'parallel' "
                                                       "(chunks count the n_h sub-steps of each "
                                                       "token)"),
                          "dt_min": (1e-3, "smallest initial decay step (log-uniform)"),
                          "dt_max": (1e-1, "largest initial decay step"),
                          **_short_conv(4)}),
    Kind("s4d", s4d, "mixers",
         Paper("Gu, Gupta, Goel and Re", 2022, "On the Parameterization and Initialization of "
               "Diagonal State Space Models"),
         time="O(H N L + H L log L)", memory="O(H N L)", causal=True, decoding="recurrent",
         segments=True,
         test_hyperparameters={"state_size": 8},
         hyperparameters=_ssm(64, "fft", "'fft' (convolution kernel) or 'recurrent'")),
    Kind("s5", s5, "mixers",
         Paper("Smith, Warrington and Linderman", 2023, "Simplified State Space Layers for "
               "Sequence Modeling"),
         time="O(L P H)", memory="O(L P)", causal=True, decoding="recurrent",
         segments=True, test_hyperparameters={"state_size": 8},
         hyperparameters=_ssm(64, "associative", "'associative' or 'sequential'")),
    Kind("h3", h3, "mixers",
         Paper("Fu et al.", 2023, "Hungry Hungry Hippos: Towards Language Modeling with State "
               "Space Models"),
         time="O(D P L log L + H N L)", memory="O(L D P + H N L)", causal=True,
         segments=True,
         decoding="recurrent", state_size="(S - 1) D + D P N",
         test_hyperparameters={"state_size": 4, "shift_size": 3, "head_dim": 2},
         hyperparameters={
             "state_size": (64, "states N of each head's diagonal SSM (N/2 conjugate pairs)"),
             "shift_size": (64, "taps S of the shift SSM on the keys (its state size)"),
             "head_dim": (1, "channels P per head: P^2 outer-product channels share a kernel"),
             "dt_min": (1e-3, "smallest initial step size (log-uniform in [dt_min, dt_max])"),
             "dt_max": (1e-1, "largest initial step size"),
             "implementation": ("fft", "the form: 'fft' (kernels and FFT convolutions) or "
                                       "'recurrent'")}),
    Kind("hyena", hyena, "mixers",
         Paper("Poli et al.", 2023, "Hyena Hierarchy: Towards Larger Convolutional Language "
               "Models"),
         time="O(N D L log L + L F (F + N D))", memory="O(N D L + L F)", causal=True,
         segments=True,
         decoding="kv", state_size="N D per token + (W - 1)(N + 1) D",
         test_hyperparameters={"filter_width": 8, "emb_dim": 5},
         hyperparameters={
             "order": (2, "the operator's order N (N + 1 projections, N long filters)"),
             "filter_width": (64, "hidden width F of the implicit filters' FFN"),
             "emb_dim": (33, "positional features of the filters: t and (emb_dim - 1) / 2 "
                             "sine bands (odd)"),
             "sine_freq": (1.0, "initial frequency omega of the FFN's sin activations"),
             "short_width": (3, "taps W of the short causal convolution of every stream")}),
    Kind("mlp_mixer", token_mixing_mlp, "mixers",
         Paper("Tolstikhin et al.", 2021, "MLP-Mixer: An all-MLP Architecture for Vision"),
         time="O(L T D)", memory="O(L D + T L)", causal=False, fixed_length=True,
         segments=_MIXER_ABSOLUTE,
         test_hyperparameters={"token_hidden": 8},
         hyperparameters={"token_hidden": (256, "hidden units T of the token-mixing MLP")}),
    Kind("gmlp", spatial_gating, "mixers",
         Paper("Liu, Dai, So and Le", 2021, "Pay Attention to MLPs"),
         time="O(L^2 E)", memory="O(L^2 + L E)", causal=True, fixed_length=True,
         decoding="kv",
         segments=_GATING_ABSOLUTE, test_hyperparameters={"expansion": 2},
         hyperparameters={"expansion": (6, "d_ffn = expansion * dim")}),
    Kind("amlp", spatial_gating, "mixers",
         Paper("Liu, Dai, So and Le", 2021, "Pay Attention to MLPs (aMLP: gMLP with a tiny "
               "single-head attention)"),
         time="O(L^2 (E + d_attn))", memory="O(L^2 + L E)", causal=True, fixed_length=True,
         decoding="kv",
         segments=_GATING_ABSOLUTE, test_hyperparameters={"expansion": 2, "attention_dim": 8},
         hyperparameters={"expansion": (6, "d_ffn = expansion * dim"),
                          "attention_dim": (64, "width of the tiny single-head attention")}),
    Kind("fnet", fourier_mixing, "mixers",
         Paper("Lee-Thorp, Ainslie, Eckstein and Ontanon", 2022, "FNet: Mixing Tokens with "
               "Fourier Transforms"),
         time="O(L D log(L D))", memory="O(L D)", causal=False, fixed_length=True,
         segments=_FOURIER_ROW),
    Kind("poolformer", pool_mixing, "mixers",
         Paper("Yu et al.", 2022, "MetaFormer Is Actually What You Need for Vision"),
         time="O(L D p)", memory="O(L D)", causal=False,
         segments=_POOL_UNTESTED,
         test_hyperparameters={"pool_size": 3},
         hyperparameters={"pool_size": (3, "positions p per average pool")}),
    Kind("lambda", lambda_mixing, "mixers",
         Paper("Bello", 2021, "LambdaNetworks: Modeling Long-Range Interactions Without "
               "Attention"),
         time="O(L^2 K V) global, O(L r K V) local", memory="O(L^2 K) global", causal=False,
         segments=_LAMBDA_ROW,
         fixed_length=True, test_hyperparameters={"key_dim": 4},
         hyperparameters={
             "key_dim": (16, "query and key width K"),
             "window": (None, "local-context radius r of the position lambdas (None: global)")}),
    Kind("lsra", lightweight_conv, "mixers",
         Paper("Wu et al.", 2020, "Lite Transformer with Long-Short Range Attention"),
         time="O(L^2 D / 2 + L K D / 2)", memory="O(L D) with flash, O(L^2) dense",
         causal=True, segments=_lsra_segments, test_hyperparameters={"kernel_size": 3},
         hyperparameters={
             "kernel_size": (3, "taps K of the lightweight convolution branch"),
             "spec": ("dot_product", "the attention branch's kind: a name or an "
                                     "nn.AttentionSpec")}),
)
