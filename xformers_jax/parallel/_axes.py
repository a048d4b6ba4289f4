"""Logical axis names (what a dimension means) and mesh axis names (where it can be split).

Parameters and activations are annotated with logical names; ordered rules (``_rules``) map
them onto the mesh axes, so one model runs unchanged under any parallelism (MaxText's
``logical_axis_rules``, Levanter/Haliax's axis mappings).
"""

# Logical axes.
BATCH = "batch"
LENGTH = "length"
EMBED = "embed"
HEADS = "heads"
KV = "kv"  # the per-head feature dimension
MLP = "mlp"
VOCAB = "vocab"
EXPERTS = "experts"
LOGICAL_AXES = (BATCH, LENGTH, EMBED, HEADS, KV, MLP, VOCAB, EXPERTS)

# Mesh axes, in the order devices are laid out: the last axis is the one whose devices are
# closest (same host / ICI neighbours), so it carries the most traffic (tensor, sequence).
DATA = "data"
FSDP = "fsdp"
EXPERT = "expert"
SEQUENCE = "sequence"
TENSOR = "tensor"
MESH_AXES = (DATA, FSDP, EXPERT, SEQUENCE, TENSOR)
