"""Pathfinder (Linsley et al. 2018) as used by Long Range Arena, drawn offline in numpy.

An image holds curved contours made of short straight paddles separated by one-pixel gaps, and
two endpoint markers. Label 1: both markers sit on the two ends of the same contour; label 0:
they sit on ends of two different contours. Distractor contours fill the rest of the image.
Difficulty is the contour length in paddles, as in LRA's three sets: easy 6
(``curv_baseline``), intermediate 9, hard 14. LRA uses 32x32 images (Pathfinder, 1024 tokens)
and 128x128 (Path-X, 16384 tokens); any size from 32 to 128 works here.

Labels are true to the drawing by construction: inside a contour every drawn pixel is within
Chebyshev distance 2 of the next one, and pixels of different contours (markers included) are
always at Chebyshev distance >= 3. So linking pixels at distance <= 2 recovers exactly the
contours, which is what the tests check independently.
"""

from __future__ import annotations

import numpy as np

DIFFICULTIES = {"easy": 6, "intermediate": 9, "hard": 14}
NUM_CLASSES = 2
PATHX_SIZE = 128
# Pixels of different contours stay farther apart than this (Chebyshev distance).
_LINK = 2
_INK = 255


class _Canvas:
    """Owner map (-1 free, else contour id) that refuses pixels too close to other contours."""

    def __init__(self, size: int):
        self.size = size
        self.owner = np.full((size, size), -1, np.int32)
        self.padded = np.full((size + 2 * _LINK, size + 2 * _LINK), -1, np.int32)
        r = np.arange(-_LINK, _LINK + 1)
        self.window = np.stack(np.meshgrid(r, r, indexing="ij"), -1).reshape(-1, 2)

    def fits(self, pixels: np.ndarray, contour: int) -> bool:
        if pixels.min() < 0 or pixels.max() >= self.size:
            return False
        near = self.padded[tuple((pixels[:, None, :] + self.window[None] + _LINK).T)]
        return bool(np.all((near == -1) | (near == contour)))

    def draw(self, pixels: np.ndarray, contour: int) -> None:
        self.owner[tuple(pixels.T)] = contour
        self.padded[tuple((pixels + _LINK).T)] = contour


def _segment(start: np.ndarray, direction: np.ndarray, length: int) -> np.ndarray:
    """Integer pixels of a straight paddle from ``start``: 8-connected, ``length`` steps."""
    steps = np.arange(length + 1)[:, None] * direction[None]
    return np.unique(np.rint(start[None] + steps).astype(np.int64), axis=0)


def _contour(rng, canvas: _Canvas, contour: int, num_paddles: int, paddle_length: int,
             max_turn: float, tries: int = 20):
    """Draws one contour; returns its two end pixels, or None when it does not fit."""
    for _ in range(tries):
        position = rng.integers(0, canvas.size, 2).astype(np.float64)
        angle = rng.uniform(0, 2 * np.pi)
        paddles = []
        end = position
        for _ in range(num_paddles):
            for attempt in range(8):
                # Near walls and other contours, sharper turns are allowed to get free.
                bend = max_turn * (1 + attempt / 2)
                turn = angle + rng.uniform(-bend, bend)
                direction = np.array([np.sin(turn), np.cos(turn)])
                pixels = _segment(end, direction, paddle_length)
                # The gap: the next paddle starts two steps on from this one's last pixel, so
                # its first pixel is within Chebyshev distance 2 of it (module docstring).
                following = np.rint(end + paddle_length * direction) + np.rint(2 * direction)
                if canvas.fits(np.vstack([pixels, following[None].astype(np.int64)]), contour):
                    break
            else:
                break
            canvas.draw(pixels, contour)
            paddles.append((np.rint(end).astype(np.int64), pixels))
            angle = turn
            end = following
        if len(paddles) == num_paddles:
            first = paddles[0][0]
            last_pixels = paddles[-1][1]
            tail = last_pixels[np.argmax(np.abs(last_pixels - paddles[-1][0]).sum(-1))]
            return first, tail
        for _, pixels in paddles:  # undo a contour that could not be finished
            canvas.owner[tuple(pixels.T)] = -1
            canvas.padded[tuple((pixels + _LINK).T)] = -1
    return None


def _marker(centre: np.ndarray, radius: int) -> np.ndarray:
    r = np.arange(-radius, radius + 1)
    offsets = np.stack(np.meshgrid(r, r, indexing="ij"), -1).reshape(-1, 2)
    offsets = offsets[(offsets ** 2).sum(-1) <= radius * radius + radius]
    return centre[None] + offsets


def draw_pathfinder(rng: np.random.Generator, *, size: int = 32, difficulty: str = "easy",
                    label: int | None = None, num_distractors: int | None = None,
                    max_tries: int = 1000):
    """One Pathfinder image.

    Args:
      rng: numpy Generator (the only source of randomness).
      size: image side in pixels, 32..128 (LRA: 32; Path-X: 128).
      difficulty: "easy", "intermediate" or "hard" (6, 9 or 14 paddles per contour).
      label: 1 (markers connected) or 0; None draws it at random.
      num_distractors: extra contours; default grows with the image area.

    Returns:
      (image uint8[size, size], label int, markers int[2, 2]): the marker centres (row, col).
    """
    if not 32 <= size <= PATHX_SIZE:
        raise ValueError(f"size must be in 32..{PATHX_SIZE}, got {size}")
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"difficulty must be one of {sorted(DIFFICULTIES)}, got {difficulty!r}")
    if label is None:
        label = int(rng.integers(2))
    if label not in (0, 1):
        raise ValueError(f"label must be 0 or 1, got {label}")
    num_paddles = DIFFICULTIES[difficulty]
    scale = size / 32
    paddle_length = max(2, round(2 * scale))
    marker_radius = max(1, round(scale))
    if num_distractors is None:
        num_distractors = round(2 * scale * scale)
    for _ in range(max_tries):
        canvas = _Canvas(size)
        ends = [_contour(rng, canvas, c, num_paddles, paddle_length, np.pi / 5) for c in (0, 1)]
        if any(e is None for e in ends):
            continue
        markers = [ends[0][0], ends[0][1]] if label else [ends[0][0], ends[1][0]]
        owners = [0, 0] if label else [0, 1]
        marker_pixels = [_marker(m, marker_radius) for m in markers]
        if not all(canvas.fits(p, o) for p, o in zip(marker_pixels, owners)):
            continue
        for p, o in zip(marker_pixels, owners):
            canvas.draw(p, o)
        for c in range(num_distractors):
            _contour(rng, canvas, 2 + c, num_paddles, paddle_length, np.pi / 5, tries=5)
        image = np.where(canvas.owner >= 0, _INK, 0).astype(np.uint8)
        return image, label, np.stack(markers).astype(np.int64)
    raise RuntimeError(f"could not draw a {size}px {difficulty} Pathfinder image")


class Pathfinder:
    """A deterministic Pathfinder split: example ``i`` depends only on ``(seed, i)``.

    ``source[i]`` is ``{"inputs": int32[size * size] (pixel values 0..255, raster order),
    "targets": int32[]}``; labels are balanced in expectation. Path-X: ``size=128``.
    """

    def __init__(self, num_examples: int, *, seed: int, size: int = 32,
                 difficulty: str = "hard"):
        self.num_examples, self.seed = num_examples, seed
        self.size, self.difficulty = size, difficulty

    def __len__(self) -> int:
        return self.num_examples

    def draw(self, index: int):
        """``draw_pathfinder``'s (image, label, markers) for example ``index``."""
        if not 0 <= index < self.num_examples:
            raise IndexError(f"index {index} out of range for {self.num_examples} examples")
        rng = np.random.default_rng([self.seed, index])
        return draw_pathfinder(rng, size=self.size, difficulty=self.difficulty)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        image, label, _ = self.draw(index)
        return {"inputs": image.reshape(-1).astype(np.int32),
                "targets": np.asarray(label, np.int32)}
