"""Swin against the plain Transformer on LRA's image tasks; see README.md."""
