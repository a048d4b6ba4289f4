"""Token mixers (Transformer, S4D, Mamba-2, gMLP, FNet) on LRA ListOps and Pathfinder; see
README.md."""
