"""ListOps (Nangia & Bowman 2018) as used by Long Range Arena, generated offline.

An expression is a tree of operators over digits, written in prefix form with brackets:
``[MAX 2 9 [MIN 4 7 ] 0 ]``. The label is the expression's value, a digit (10 classes). The tree
generator follows the LRA script (``lra_benchmarks/data/listops.py``): a node below the maximum
depth is a digit with probability 0.75, otherwise an operator with 2..max_args arguments; trees
are drawn until their token count lies in [min_length, max_length] (rejection sampling).
LRA's task: depth 10, 10 arguments, 500-2000 tokens (Tay et al. 2021, "Long Range Arena").

Tokens are whole symbols: each operator with its opening bracket (``[MAX``) is one token, ``]``
is one token, each digit is one token; id 0 is padding. Parentheses in LRA's TSV files are only
the generator's tuple nesting, not symbols, and are dropped when tokenising.
"""

from __future__ import annotations

import numpy as np

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
CLOSE = "]"
PAD_ID = 0
# Digits first so that a digit's id minus one is its value.
VOCAB = ("<pad>",) + tuple(str(d) for d in range(10)) + OPERATORS + (CLOSE,)
VOCAB_SIZE = len(VOCAB)
NUM_CLASSES = 10
_TOKEN_ID = {symbol: i for i, symbol in enumerate(VOCAB)}
# Probability that a node above the depth limit is a digit (LRA: r > VALUE_P=0.25 -> digit).
_DIGIT_PROBABILITY = 0.75


def _tree_tokens(rng: np.random.Generator, depth: int, max_depth: int, max_args: int,
                 out: list[str], budget: int) -> bool:
    """Appends one random subtree's tokens to ``out``; False once it exceeds ``budget``."""
    if len(out) > budget:
        return False
    if depth >= max_depth or rng.random() < _DIGIT_PROBABILITY:
        out.append(str(int(rng.integers(10))))
        return True
    out.append(OPERATORS[int(rng.integers(len(OPERATORS)))])
    for _ in range(int(rng.integers(2, max_args + 1))):
        if not _tree_tokens(rng, depth + 1, max_depth, max_args, out, budget):
            return False
    out.append(CLOSE)
    return True


def random_expression(rng: np.random.Generator, *, min_length: int = 500,
                      max_length: int = 2000, max_depth: int = 10, max_args: int = 10,
                      max_tries: int = 100_000) -> list[str]:
    """One ListOps expression as a token list with ``min_length <= len <= max_length``.

    The root is always an operator (a bare digit is no task). Trees that outgrow
    ``max_length`` are abandoned early, so rejection stays cheap.
    """
    if not 1 <= min_length <= max_length:
        raise ValueError(f"need 1 <= min_length <= max_length, got {min_length}, {max_length}")
    if max_depth < 1 or max_args < 2:
        raise ValueError(f"need max_depth >= 1 and max_args >= 2, got {max_depth}, {max_args}")
    for _ in range(max_tries):
        tokens = [OPERATORS[int(rng.integers(len(OPERATORS)))]]
        ok = all(_tree_tokens(rng, 1, max_depth, max_args, tokens, max_length)
                 for _ in range(int(rng.integers(2, max_args + 1))))
        tokens.append(CLOSE)
        if ok and min_length <= len(tokens) <= max_length:
            return tokens
    raise RuntimeError(f"no ListOps tree of {min_length}..{max_length} tokens in {max_tries} "
                       f"tries with max_depth={max_depth}, max_args={max_args}")


def _apply(operator: str, values: list[int]) -> int:
    if operator == "[MIN":
        return min(values)
    if operator == "[MAX":
        return max(values)
    if operator == "[MED":
        # LRA computes int(np.median(values)): the mean of the middle pair, truncated.
        ordered = sorted(values)
        middle = len(ordered) // 2
        if len(ordered) % 2:
            return ordered[middle]
        return (ordered[middle - 1] + ordered[middle]) // 2
    if operator == "[SM":
        return sum(values) % 10
    raise ValueError(f"unknown ListOps operator {operator!r}")


def evaluate(tokens: list[str]) -> int:
    """The value (0-9) of a ListOps expression given as tokens (stack machine, no recursion)."""
    stack: list[list] = []
    result = None
    for token in tokens:
        if token in OPERATORS:
            stack.append([token, []])
        elif token == CLOSE:
            operator, values = stack.pop()
            value = _apply(operator, values)
            if stack:
                stack[-1][1].append(value)
            else:
                result = value
        else:
            stack[-1][1].append(int(token))
    if stack or result is None:
        raise ValueError("unbalanced ListOps expression")
    return result


def tokenize(text: str) -> list[str]:
    """Splits an expression string (LRA TSV form, parentheses allowed) into symbols."""
    return [t for t in text.replace("(", " ").replace(")", " ").split()]


def encode(tokens: list[str], length: int) -> np.ndarray:
    """Token ids ``int32[length]``, padded with ``PAD_ID``; ValueError when too long."""
    if len(tokens) > length:
        raise ValueError(f"expression has {len(tokens)} tokens, more than length={length}")
    ids = np.full((length,), PAD_ID, np.int32)
    try:
        ids[: len(tokens)] = [_TOKEN_ID[t] for t in tokens]
    except KeyError as e:
        raise ValueError(f"unknown ListOps symbol {e.args[0]!r}") from None
    return ids


class ListOps:
    """A deterministic ListOps split: example ``i`` depends only on ``(seed, i)``.

    ``source[i]`` is ``{"inputs": int32[max_length], "targets": int32[]}``; inputs are padded
    with 0. Use distinct seeds for train / validation / test.
    """

    def __init__(self, num_examples: int, *, seed: int, min_length: int = 500,
                 max_length: int = 2000, max_depth: int = 10, max_args: int = 10):
        self.num_examples = num_examples
        self.seed = seed
        self.min_length, self.max_length = min_length, max_length
        self.max_depth, self.max_args = max_depth, max_args

    def __len__(self) -> int:
        return self.num_examples

    def expression(self, index: int) -> list[str]:
        """The token list of example ``index``."""
        if not 0 <= index < self.num_examples:
            raise IndexError(f"index {index} out of range for {self.num_examples} examples")
        rng = np.random.default_rng([self.seed, index])
        return random_expression(rng, min_length=self.min_length, max_length=self.max_length,
                                 max_depth=self.max_depth, max_args=self.max_args)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        tokens = self.expression(index)
        return {"inputs": encode(tokens, self.max_length),
                "targets": np.asarray(evaluate(tokens), np.int32)}
