"""Synthetic recall and copying tasks that separate sub-quadratic sequence models.

Three tasks, each a Grain random-access source whose example ``i`` depends only on
``(seed, i)``; ``source[i]`` is ``{"inputs": int32[L], "targets": int32[L], "scored":
bool[L]}``: a causal language model reads ``inputs`` and is scored only where ``scored`` is
True, against ``targets`` there (the other targets are 0 and never scored).

- :class:`MultiQueryAR`: multi-query associative recall (Arora et al. 2023, "Zoology",
  section 3 and appendix; the generator of ``zoology/data/multiquery_ar.py``): keys from
  ``[1, V/2)``, values from ``[V/2, V)``; the sequence opens with ``kv`` key-value pairs; each
  key is queried once, the queries at gaps drawn without replacement from the power law
  ``p(i) proportional to a * i^(a - 1)`` over the ``(L - 2 kv) / 2`` even slots after the
  pairs; every other position holds a token drawn from the whole vocabulary; only the token
  after each query is scored: its value.
- :class:`SelectiveCopying`: Gu & Dao 2023 ("Mamba", section 4.1.1 and appendix E.1): ``n``
  data tokens at random positions of a context of noise tokens, then ``n`` marker tokens,
  at which the data tokens are to be produced in order. Scored: the ``n`` marker positions.
- :class:`InductionHeads`: Gu & Dao 2023 (section 4.1.2; Olsson et al. 2022): random tokens; a
  special token appears once followed by a token ``x``; the sequence ends with the special
  token again, where ``x`` is to be produced. Scored: the last position. Trained at one length
  and evaluated at longer ones (extrapolation).
"""

from __future__ import annotations

import numpy as np


def _check(name: str, ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")


def power_law_probs(space: int, a: float) -> np.ndarray:
    """``p(i) proportional to a * i^(a - 1)`` for ``i = 1 .. space`` (Zoology's query gaps),
    normalised; index ``g`` holds the probability of gap ``g`` (slot ``g + 1``)."""
    p = a * np.arange(1, space + 1, dtype=np.float64) ** (a - 1)
    return p / p.sum()


class _Source:
    seq_len: int

    def __init__(self, num_examples: int, seed: int):
        self.num_examples, self.seed = int(num_examples), int(seed)

    def __len__(self) -> int:
        return self.num_examples

    def _rng(self, index: int) -> np.random.Generator:
        if not 0 <= index < self.num_examples:
            raise IndexError(f"index {index} out of range for {self.num_examples} examples")
        return np.random.default_rng([self.seed, index])

    def _example(self, inputs, positions, answers):
        targets = np.zeros(self.seq_len, np.int32)
        scored = np.zeros(self.seq_len, bool)
        targets[positions] = answers
        scored[positions] = True
        return {"inputs": inputs.astype(np.int32), "targets": targets, "scored": scored}


class MultiQueryAR(_Source):
    """Zoology's multi-query associative recall (module docstring).

    Args:
      num_examples, seed: the split's size and seed (distinct seeds per split).
      seq_len: ``L``, even, less than ``vocab_size``, at least ``4 * num_kv_pairs``.
      num_kv_pairs: ``kv``, the pairs at the start (each queried once).
      vocab_size: ``V`` (Zoology: 8192).
      power_a: the gap distribution's exponent parameter ``a`` (Zoology: 0.01).
      random_non_queries: fill the positions holding neither a pair nor a query with tokens
        drawn from the whole vocabulary (Zoology's default), else 0.
    """

    def __init__(self, num_examples: int, *, seed: int, seq_len: int, num_kv_pairs: int,
                 vocab_size: int = 8192, power_a: float = 0.01,
                 random_non_queries: bool = True):
        super().__init__(num_examples, seed)
        name = "MultiQueryAR"
        _check(name, seq_len % 2 == 0, f"seq_len must be even, got {seq_len}")
        _check(name, vocab_size > seq_len, f"vocab_size ({vocab_size}) must exceed seq_len "
               f"({seq_len})")
        _check(name, 4 * num_kv_pairs <= seq_len, f"4 * num_kv_pairs ({4 * num_kv_pairs}) must "
               f"be at most seq_len ({seq_len})")
        _check(name, num_kv_pairs >= 1 and num_kv_pairs < vocab_size // 2,
               f"num_kv_pairs must be in [1, vocab_size / 2), got {num_kv_pairs}")
        _check(name, 0 < power_a <= 1, f"power_a must be in (0, 1], got {power_a}")
        self.seq_len, self.num_kv_pairs, self.vocab_size = seq_len, num_kv_pairs, vocab_size
        self.power_a, self.random_non_queries = power_a, random_non_queries
        self.context = 2 * num_kv_pairs
        self.probs = power_law_probs((seq_len - self.context) // 2, power_a)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        rng = self._rng(index)
        kv, half = self.num_kv_pairs, self.vocab_size // 2
        keys = rng.choice(np.arange(1, half), kv, replace=False)
        values = rng.choice(np.arange(half, self.vocab_size), kv, replace=False)
        gaps = rng.choice(len(self.probs), kv, replace=False, p=self.probs)
        inputs = np.zeros(self.seq_len, np.int64)
        inputs[0:self.context:2], inputs[1:self.context:2] = keys, values
        queries = self.context + 2 * gaps
        inputs[queries] = keys
        if self.random_non_queries:
            filler = rng.integers(0, self.vocab_size, self.seq_len)
            free = np.ones(self.seq_len, bool)
            free[: self.context] = False
            free[queries] = False
            inputs[free] = filler[free]
        return self._example(inputs, queries, values)


class SelectiveCopying(_Source):
    """Mamba's selective copying (module docstring): id 0 is the noise token, ids
    ``1 .. vocab`` the data tokens and ``vocab + 1`` the marker (``vocab_size = vocab + 2``).

    Args:
      num_examples, seed: the split's size and seed.
      seq_len: ``L``, the context (``L - num_tokens``) plus the ``num_tokens`` markers.
      num_tokens: the data tokens to copy (Mamba: 16).
      vocab: the data tokens' vocabulary (Mamba: 16).
    """

    def __init__(self, num_examples: int, *, seed: int, seq_len: int, num_tokens: int = 16,
                 vocab: int = 16):
        super().__init__(num_examples, seed)
        _check("SelectiveCopying", seq_len >= 2 * num_tokens >= 2,
               f"seq_len ({seq_len}) must be at least 2 * num_tokens ({2 * num_tokens})")
        _check("SelectiveCopying", vocab >= 1, f"vocab must be positive, got {vocab}")
        self.seq_len, self.num_tokens, self.vocab = seq_len, num_tokens, vocab
        self.marker = vocab + 1
        self.vocab_size = vocab + 2

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        rng = self._rng(index)
        n, context = self.num_tokens, self.seq_len - self.num_tokens
        tokens = rng.integers(1, self.vocab + 1, n)
        where = np.sort(rng.choice(context, n, replace=False))
        inputs = np.zeros(self.seq_len, np.int64)
        inputs[where] = tokens
        inputs[context:] = self.marker
        return self._example(inputs, np.arange(context, self.seq_len), tokens)


class InductionHeads(_Source):
    """Mamba's induction heads (module docstring): ids ``0 .. vocab - 1`` are ordinary tokens
    and ``vocab`` the special token (``vocab_size = vocab + 1``).

    Args:
      num_examples, seed: the split's size and seed.
      seq_len: ``L`` (Mamba trains at 256 and tests up to 2^20).
      vocab: the ordinary tokens' vocabulary (Mamba: 16).
    """

    def __init__(self, num_examples: int, *, seed: int, seq_len: int, vocab: int = 16):
        super().__init__(num_examples, seed)
        _check("InductionHeads", seq_len >= 4, f"seq_len must be at least 4, got {seq_len}")
        _check("InductionHeads", vocab >= 2, f"vocab must be at least 2, got {vocab}")
        self.seq_len, self.vocab = seq_len, vocab
        self.special = vocab
        self.vocab_size = vocab + 1

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        rng = self._rng(index)
        inputs = rng.integers(0, self.vocab, self.seq_len)
        first = int(rng.integers(0, self.seq_len - 2))  # the special token and x before the end
        inputs[first] = self.special
        answer = inputs[first + 1]
        inputs[-1] = self.special
        return self._example(inputs, np.array([self.seq_len - 1]), np.array([answer]))
