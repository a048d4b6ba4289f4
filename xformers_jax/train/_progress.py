"""A one-line progress bar on stderr: steps, steps/s, ETA and the latest metrics.

Plain carriage-return redraws (no dependency); ``message`` prints a permanent line above the
bar (evaluations). Redraws are throttled so the bar costs nothing next to a step.
"""

from __future__ import annotations

import sys
import time


def format_duration(seconds: float) -> str:
    """``1h02m03s``-style duration."""
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m{seconds % 60:02d}s"


class ProgressBar:
    """``update(step, **metrics)`` after each step; ``close()`` at the end.

    Steps/s is measured from this process's first update on (so neither compilation in the
    first step nor the steps a resumed run restored count); ``enabled=False`` makes every
    call a no-op (other hosts).
    """

    def __init__(self, total: int, *, start: int = 0, width: int = 24, stream=None,
                 min_interval_s: float = 0.25, enabled: bool = True):
        self.total, self.start, self.width = total, start, width
        self.stream = sys.stderr if stream is None else stream
        self.min_interval_s, self.enabled = min_interval_s, enabled
        self._t0, self._first = None, None
        self._last_draw = -float("inf")
        self._line = ""
        self.step = start

    def rate(self) -> float:
        if self._t0 is None:
            return 0.0
        elapsed = time.perf_counter() - self._t0
        return (self.step - self._first) / elapsed if elapsed > 0 else 0.0

    def line(self, metrics: dict[str, float]) -> str:
        frac = self.step / self.total if self.total else 1.0
        filled = int(round(self.width * frac))
        rate = self.rate()
        eta = format_duration((self.total - self.step) / rate) if rate > 0 else "?"
        shown = " ".join(f"{k} {v:.4g}" for k, v in metrics.items())
        return (f"[{'#' * filled}{'.' * (self.width - filled)}] {self.step}/{self.total} "
                f"{100 * frac:3.0f}% {rate:.2f} steps/s ETA {eta} {shown}").rstrip()

    def update(self, step: int, force: bool = False, **metrics: float) -> None:
        self.step = step
        now = time.perf_counter()
        if self._t0 is None:
            self._t0, self._first = now, step
        if not self.enabled or (not force and step < self.total
                                and now - self._last_draw < self.min_interval_s):
            return
        self._last_draw = now
        line = self.line(metrics)
        # Pad over the previous line's tail: \r returns the cursor but erases nothing.
        self.stream.write("\r" + line + " " * max(0, len(self._line) - len(line)))
        self.stream.flush()
        self._line = line

    def message(self, text: str) -> None:
        """A permanent line (the bar is redrawn under it on the next update)."""
        if not self.enabled:
            return
        self.stream.write("\r" + text + " " * max(0, len(self._line) - len(text)) + "\n")
        self.stream.flush()
        self._line = ""
        self._last_draw = -float("inf")

    def close(self) -> None:
        if self.enabled and self._line:
            self.stream.write("\n")
            self.stream.flush()
            self._line = ""
