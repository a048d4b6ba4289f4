"""The public API: every name README.md shows is exported where it says, and the exported names
of ``xformers_jax.attention`` and ``.patterns`` are pinned (a rename or a lost re-export fails
here, not in a user's code)."""

import importlib
import pathlib
import re

import pytest

README_PATH = pathlib.Path(__file__).resolve().parents[1] / "README.md"
README = README_PATH.read_text()

# The attention functions and patterns of the first wave: moving a module inside the package
# must never change these.
ATTENTION_NAMES = {
    "LinearAttentionState", "RoutingAux", "RoutingState", "SinkhornSortNet",
    "adaptive_span_attention", "adaptive_span_penalty", "axial_attention", "axial_shift",
    "block_sparse_attention", "clustered_attention", "dam_attention", "dam_mask", "dam_penalty",
    "delta_rule_attention", "delta_rule_init_state", "delta_rule_step", "dot_product_attention",
    "dpfp_features", "elu_features", "entmax15", "entmax_alpha", "entmax_attention",
    "entmax_bisect", "etc_attention", "favor_positive_features", "favor_trig_features",
    "flash_attention", "funnel_attention", "funnel_pool", "funnel_upsample",
    "halo_local_attention", "hyperbolic_features", "improved_clustered_attention", "init_dam_logits",
    "init_linformer_projections", "init_long_short_projection", "init_lowrank_band",
    "init_lsh_rotations", "init_luna_sequence", "init_memory_compression", "init_nystrom_conv",
    "init_random_projection", "init_rfa_projection", "init_routing_state",
    "init_sinkhorn_sort_net", "init_synthesizer", "init_token_learner", "linear_attention",
    "linear_attention_init_state", "linear_attention_step", "linformer_attention",
    "long_short_attention", "longformer_attention", "lowrank_band_attention", "lsh_attention",
    "luna_attention", "memory_compressed_attention", "multihead", "nystrom_attention",
    "pattern_tile", "patterns", "per_head_block_sparse_attention", "performer_attention",
    "poolingformer_attention", "probsparse_attention", "relu_features", "rfa_features",
    "ring_attention", "routing_attention", "sequence_parallel_linear_attention",
    "sinkhorn_attention", "sparsemax", "synthesizer_attention",
    # The one chunked causal scan and the delta rule's forms, which every recurrence runs on.
    "causal_chunked", "causal_parallel", "causal_recurrent", "causal_step",
    "gated_delta_chunked", "gated_delta_recurrent", "gated_delta_step",
    "dplr_chunked", "dplr_recurrent", "dplr_step", "taylor_features",
    # Log-linear attention's Fenwick-tree hierarchy of states over the same recurrence.
    "fenwick_levels", "loglinear_chunked", "loglinear_parallel", "loglinear_recurrent",
    "loglinear_step", "num_levels",
    "token_learner", "topk_attention",
    # Attention with priors and multi-head variants.
    "AverageGate", "AverageState", "Disagreement", "attention_weights", "average_attention",
    "average_attention_init_state", "average_attention_step", "collaborative_attention",
    "collaborative_mixing_from_heads", "disagreement", "distance_prior_attention",
    "gaussian_prior_attention", "hardcoded_gaussian_attention", "init_average_gate",
    "init_gaussian_window", "init_predictive_conv", "lazy_attention", "multiscale_attention",
    "multiscale_patterns", "predict_gaussian_window", "predictive_attention", "predictive_conv",
    "realformer_attention", "realformer_flash_attention", "talking_heads_attention",
    "init_routing_votes", "routing_aggregation", "squash",
    # Softmax attention changed since the surveys (attention.modern).
    "deepseek_sparse_attention", "deepseek_sparse_tiled", "differential_attention",
    "differential_lambda",
    "forgetting_attention", "indexer_alignment_loss", "lambda_init_for", "lightning_indexer",
    "mha_cache_bytes_per_token",
    "mla_cache_bytes_per_token", "moba_attention", "multi_head_latent_attention",
    "native_sparse_attention", "path_attention", "path_update_keys",
    # Cluster-Former's attention (its layer is models.ClusterformerAttention).
    "assign_clusters", "cluster_chunk_attention", "kmeans_centroids",
    # Every attention kind's record (xformers_jax.kinds.Kind), family by family.
    "KINDS",
    # Flex attention and the score and mask functions of the catalogue's methods.
    "flex_attention", "alibi_score", "prefix_lm_mask", "relative_bias_score", "soft_cap_score",
    "streaming_mask", "document_offsets",
}
PATTERN_NAMES = {
    "BPTree", "BigBird", "BlockBERT", "BlockLayout", "BlockLocal", "Cascade", "Causal", "Dilated",
    "EMPTY", "FULL", "Fixed", "Full", "Global", "ImageLocal1D", "ImageLocal2D", "Intersection",
    "KeyPadding", "Local", "LogSparse", "Longformer", "PARTIAL", "Pattern", "PerHead", "Random",
    "Segments", "Star", "Strided", "Union", "MaskMod", "document_mask",
}
FAMILIES = ("sparse", "linear", "lowrank", "learned", "priors", "modern")


def _public(module):
    return {n for n in dir(module) if not n.startswith("_")}


def test_attention_and_patterns_names_are_pinned():
    attention = importlib.import_module("xformers_jax.attention")
    patterns = importlib.import_module("xformers_jax.attention.patterns")
    assert ATTENTION_NAMES <= _public(attention), sorted(ATTENTION_NAMES - _public(attention))
    # Besides the pinned names, the top level only adds the family subpackages.
    assert _public(attention) - ATTENTION_NAMES == set(FAMILIES)
    assert _public(patterns) == PATTERN_NAMES


def test_every_family_name_is_exported_at_the_top():
    attention = importlib.import_module("xformers_jax.attention")
    seen = set()
    for family in FAMILIES:
        names = _public(importlib.import_module(f"xformers_jax.attention.{family}"))
        assert names, family
        for name in names:
            assert getattr(attention, name) is getattr(attention, family).__dict__[name], name
        assert not names & seen, f"{family} re-exports names of another family: {names & seen}"
        seen |= names


def _readme_table_names():
    """``(module, name)`` for every backticked identifier in the 'What is here' table."""
    rows, module = [], None
    for line in README.splitlines():
        if not line.startswith("| "):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0].startswith("`"):
            module = cells[0].strip("`")
        elif cells[0] not in ("",):
            continue
        if module is None or not module.startswith(("xformers_jax", "pallas_kernels")):
            continue
        for name in re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", " ".join(cells[1:])):
            rows.append((module, name))
    return rows


def _readme_import_names():
    return [(m, n.strip()) for m, names in re.findall(r"^from (\S+) import (.+)$", README, re.M)
            for n in names.split(",")]


@pytest.mark.parametrize("module,name", _readme_table_names() + _readme_import_names())
def test_readme_names_exist(module, name):
    assert hasattr(importlib.import_module(module), name), f"README names {module}.{name}"


def test_readme_table_is_read():
    names = _readme_table_names()
    assert ("xformers_jax.attention", "flash_attention") in names
    assert ("xformers_jax.attention.patterns", "BigBird") in names
    # Every package has its row (the table says what is where).
    packages = {f"xformers_jax.{p.parent.name}"
                for p in (README_PATH.parent / "xformers_jax").glob("*/__init__.py")}
    rows = {m for m, _ in names}
    assert packages <= rows, f"README's table has no row for {sorted(packages - rows)}"


# Lighter models: quantization, pruning, distillation.
COMPRESS_NAMES = {
    "FakeQuantWeight", "Int4Weight", "MATMUL_WEIGHTS", "PruneState", "QuantizedWeight",
    "TinyBertProjections", "absmax_scale", "apply_masks", "attention_map_loss", "calibrate",
    "cosine_hidden_loss", "dequantize", "dequantize_model", "distilbert_init", "drop_layers",
    "fake_quant", "gradual_sparsity", "head_importance", "head_masks", "hidden_mse_loss",
    "hidden_states", "int8_matmul", "kd_loss", "layer_map", "lottery_ticket", "magnitude_masks",
    "masks_of", "model_bytes", "ones_masks", "prune_transform", "quantize", "quantize_model",
    "rewind", "sparsity_report", "tinybert_loss", "with_layerdrop",
}


def test_compress_names_are_pinned():
    assert _public(importlib.import_module("xformers_jax.compress")) == COMPRESS_NAMES
    assert hasattr(importlib.import_module("xformers_jax.models"), "Electra")


EXPERTS_NAMES = {
    "ACTIVATIONS", "ExpertChoice", "ExpertWeights", "LOAD_BALANCING_COEF", "Routing",
    "Z_LOSS_COEF", "balanced_assignment", "balanced_hash_table", "base_route", "capacity",
    "capacity_slots", "default_backend", "module_conv", "multiplicative_dense", "sparse_qkv",
    "expert_choice_capacity", "expert_choice_ffn", "expert_choice_route", "expert_load",
    "expert_parallel_moe", "grouped_matmul", "grouped_matmul_backends", "grouped_moe",
    "hash_route", "init_expert_weights", "load_balancing_loss", "moe_capacity", "moe_dropless",
    "moe_ffn", "moe_reference", "product_key_lookup", "product_key_topk", "prototype_route",
    "register_grouped_matmul", "router_logits", "router_z_loss", "top_k_route",
    # The dense, sparse and empty FFNs, and every FFN kind's record.
    "KINDS", "feed_forward", "no_feed_forward", "sparse_feed_forward",
    "DISPATCH_MODES", "FFN_ACTIVATIONS", "GATED", "sparse_controller", "sparse_masked",
    # Capacity over each sequence (causal), with its decoding state.
    "CAPACITY_GROUPS", "CapacityState", "sequence_capacity_slots",
}


def test_experts_names_are_pinned():
    assert _public(importlib.import_module("xformers_jax.experts")) == EXPERTS_NAMES
    nn = importlib.import_module("xformers_jax.nn")
    for name in ("FFNSpec", "Spec", "register_kind", "get_kind", "registered_kinds", "implements",
                 "MoEFeedForward", "ProductKeyMemory", "SparseFeedForward", "aux_losses",
                 "aux_terms", "SparseQKVAttention", "BlockCycle", "BlockCache", "init_ffn_cache",
                 "decode_ffn", "CLS_TOKEN_ID"):
        assert hasattr(nn, name), name
    parallel = importlib.import_module("xformers_jax.parallel")
    for name in ("expert_parallel_moe", "gpipe", "pipeline_layers", "bubble_fraction"):
        assert hasattr(parallel, name), name


# Token mixers that are not attention (the one-sequence functions; modules are in nn).
MIXERS_NAMES = {
    "causal_convolve", "fourier_mixing", "gated_delta", "gla", "lambda_mixing",
    "linear_recurrence", "pool_mixing", "retention", "s4d", "s4d_kernel", "s4d_step", "s5",
    "s5_step", "selective_scan", "selective_step", "spatial_gating", "ssd", "token_mixing_mlp",
    "zoh", "lightweight_conv", "GLA_CHUNK",
    # The recurrences since the surveys, with their decoding steps.
    "DPLR_CHUNK", "DELTA_PRODUCT_CHUNK", "LOGLINEAR_CHUNK", "delta_product",
    "delta_product_step", "hgrn2", "kda", "kda_step", "mlstm",
    "loglinear_linear", "loglinear_ssd",
    "mlstm_init_state", "mlstm_step", "rwkv7", "rwkv7_step",
    # The long convolutions (H3, Hyena) and the short causal convolution they and Mamba share.
    "causal_depthwise_conv", "causal_depthwise_step", "h3", "h3_init_state", "h3_step", "hyena",
    "hyena_step",
    # Every mixer's record (xformers_jax.kinds.Kind).
    "KINDS",
}


def test_mixers_names_are_pinned():
    assert _public(importlib.import_module("xformers_jax.mixers")) == MIXERS_NAMES
    nn = importlib.import_module("xformers_jax.nn")
    for name in ("MixerSpec", "MixerModule", "register_kind", "get_kind", "registered_kinds",
                 "SSM_PARAMETERS", "ssm_parameters"):
        assert hasattr(nn, name), name


# Serving: rows of different lengths, continuous batching, the paged cache, prefix reuse.
SERVING_NAMES = ("PagePool", "Prefix", "Request", "ServeStats", "Server", "cache_bytes",
                 "decode_compiler_options", "init_rows", "prefill_rows", "sequence_cache_bytes", "step_rows")


def test_serving_names_are_exported():
    models = importlib.import_module("xformers_jax.models")
    for name in SERVING_NAMES:
        assert hasattr(models, name), name
    nn = importlib.import_module("xformers_jax.nn")
    for name in ("PagedKVCache", "pick_token", "KVCache", "RecurrentCache", "sample_tokens"):
        assert hasattr(nn, name), name
