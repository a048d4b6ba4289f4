"""Lite Transformer's long-short range attention (a token mixer); the other architecture-level
variants are whole models in ``xformers_jax.models``."""

from ._lite import LSRA as LSRA
