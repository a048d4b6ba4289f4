"""What the LRA configs share: the attention variants and the ``VARIANT[,size]`` argument.

Attention hyperparameters follow the Long Range Arena code base where its paper (Tay et al.
2021, appendix) gives them: Performer 256 random features, Linformer projection length 256,
Sinkhorn blocks of 64 (hard sorting off), Reformer 2 hash rounds, BigBird blocks of 64 with 3
window, 2 global and 3 random blocks (tiled at 64). Two settings come from the LRA code's
configs and modules rather than the paper: Local attention is non-overlapping blocks of 50 (its
``LocalTransformer`` default ``block_size=50``: each query attends within its own block), run
here as block-sparse attention with 50 x 50 tiles; Synthesizer is factorized random with
rank 32 and no dot-product term (``synthesizer_mode="factorized_random"``, ``k=32``,
``ignore_dot_product=True``). Nyström (64 landmarks) and Luna (256 packed tokens) follow their
own papers' LRA settings.
"""

from __future__ import annotations

from xformers_jax.attention import patterns as P

VARIANTS = {
    "transformer": dict(kind="dot_product"),
    "flash": dict(kind="flash"),
    "local": dict(kind="block_sparse", pattern=P.BlockLocal(50), block_q=50, block_k=50),
    "performer": dict(kind="performer", num_features=256),
    "linear": dict(kind="linear", feature_map="elu"),
    "linformer": dict(kind="linformer", proj_len=256),
    "sinkhorn": dict(kind="sinkhorn", block_size=64),
    "reformer": dict(kind="lsh", num_buckets=8, num_rounds=2, chunk_size=64),
    # Tiled at its own block size (the default, pattern_tile, picks it too; at 512 x 512 tiles
    # almost every tile holds some kept block and the computation is as dense as flash's).
    "bigbird": dict(kind="block_sparse", pattern=P.BigBird(64), block_q=64, block_k=64),
    "nystrom": dict(kind="nystrom", num_landmarks=64),
    "luna": dict(kind="luna", length=256),
    "synthesizer": dict(kind="synthesizer", forms=("factorized_random",), rank=32),
    # Scores passed between layers (dense residual scores; Predictive attention's alpha and
    # Lazyformer's k as in their papers' defaults).
    "realformer": dict(kind="realformer"),
    "predictive": dict(kind="predictive", alpha=0.5),
    "lazy": dict(kind="lazy", every=2),
}

# Attention settings for short runlocal sequences (tens to hundreds of tokens).
SMALL = {
    "local": dict(pattern=P.BlockLocal(16), block_q=16, block_k=16),
    "performer": dict(num_features=32),
    "linformer": dict(proj_len=16),
    "sinkhorn": dict(block_size=8),
    "reformer": dict(num_buckets=4, chunk_size=16),
    "bigbird": dict(pattern=P.BigBird(8), block_q=8, block_k=8),
    "nystrom": dict(num_landmarks=8),
    "luna": dict(length=16),
}


# Token mixers replacing attention (``model.mixer``, nn.MixerSpec). S4D and S5 follow the S4
# papers' LRA recipe where it is a mixer setting (N = 64 states, dt in [1e-3, 1e-1], the SSM
# parameters at learning rate 1e-3 without weight decay: MIXER_OPTIM); Mamba / Mamba-2 use
# their papers' defaults; lambda layers use the local-context form (a global position lambda
# at 1K-4K tokens is an [L, L, k] tensor per sequence).
MIXERS = {
    "s4d": dict(kind="s4d", state_size=64, dt_min=1e-3, dt_max=1e-1),
    "s5": dict(kind="s5", state_size=64, dt_min=1e-3, dt_max=1e-1),
    "mamba": dict(kind="mamba", state_size=16),
    "mamba2": dict(kind="mamba2", state_size=64, chunk_size=64),
    "retnet": dict(kind="retnet", chunk_size=64),
    "gla": dict(kind="gla", chunk_size=16),
    "gated_deltanet": dict(kind="gated_deltanet", chunk_size=64),
    # The recurrences since the surveys, at their default chunk sizes.
    "mlstm": dict(kind="mlstm", chunk_size=64),
    "hgrn2": dict(kind="hgrn2", chunk_size=16),
    "kda": dict(kind="kda", chunk_size=16),
    "rwkv7": dict(kind="rwkv7", chunk_size=16),
    "delta_product": dict(kind="delta_product", householder_steps=2, chunk_size=64),
    "mlp_mixer": dict(kind="mlp_mixer", token_hidden=256),
    "gmlp": dict(kind="gmlp", expansion=2),
    "amlp": dict(kind="amlp", expansion=2, attention_dim=64),
    "fnet": dict(kind="fnet"),
    "poolformer": dict(kind="poolformer", pool_size=3),
    "lambda": dict(kind="lambda", key_dim=16, window=64),
    # Lite Transformer's long-short range attention (attention and convolution branches).
    "lsra": dict(kind="lsra", kernel_size=7),
}
MIXER_OPTIM = {"s4d": dict(ssm_learning_rate=1e-3), "s5": dict(ssm_learning_rate=1e-3)}
SMALL_MIXERS = {
    "s4d": dict(state_size=16), "s5": dict(state_size=16), "mamba2": dict(state_size=16,
                                                                           chunk_size=16),
    "retnet": dict(chunk_size=16), "gated_deltanet": dict(chunk_size=16),
    "mlstm": dict(chunk_size=16), "delta_product": dict(chunk_size=16),
    "mlp_mixer": dict(token_hidden=32), "amlp": dict(attention_dim=16),
    "lambda": dict(key_dim=8, window=8), "lsra": dict(kernel_size=3),
}


def parse(arg: str | None, sizes=("runlocal",), default: str = "transformer"):
    """``"VARIANT[,SIZE]"`` -> ``(variant, size or None)``; VARIANT from ``VARIANTS`` or
    ``MIXERS``."""
    parts = [p for p in (arg or "").split(",") if p]
    size = [p for p in parts if p in sizes]
    names = [p for p in parts if p not in sizes]
    known = {**VARIANTS, **MIXERS}
    if len(size) > 1 or len(names) > 1 or (names and names[0] not in known):
        raise ValueError(f"config arg must be 'VARIANT[,{'|'.join(sizes)}]' with VARIANT in "
                         f"{sorted(known)}, got {arg!r}")
    return (names[0] if names else default), (size[0] if size else None)


def set_attention(config, variant: str, small: bool = False) -> None:
    """Replaces ``config.model.attention`` with ``variant``'s settings (``small``: runlocal),
    or, for a token mixer (``MIXERS``), sets ``config.model.mixer`` (and the SSM learning
    rate of ``MIXER_OPTIM``) and leaves the attention at its default."""
    if variant in MIXERS:
        settings = dict(MIXERS[variant])
        if small:
            settings.update(SMALL_MIXERS.get(variant, {}))
        config.model.mixer = type(config.model.mixer)(settings)
        config.optim.update(MIXER_OPTIM.get(variant, {}))
        return
    settings = dict(VARIANTS[variant])
    if small:
        settings.update(SMALL.get(variant, {}))
    config.model.attention = type(config.model.attention)(settings)
