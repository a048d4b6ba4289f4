"""Transformer-XL against the same model without memory on the byte-level LM; see README.md."""
