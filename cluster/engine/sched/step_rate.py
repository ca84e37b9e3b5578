"""StepRate: what one more token costs an engine's step, measured online from its steps.

A step of n tokens (decode rows plus prompt tokens) takes about base + per_token x n
seconds. StepRate fits that line by least squares over the steps seen, each step's
weight decaying by `decay` per later step (a memory of about 1 / (1 - decay) steps), and
reports the slope: what a prompt token added to a step costs this engine, on this
hardware, under its present load. The worker reports it in its stats, and the router
prices a prefill with it (router/prefill_cost.py).
"""

from __future__ import annotations


class StepRate:
    def __init__(self, decay: float = 0.99, min_spread: float = 1.0) -> None:
        """`min_spread`: the least standard deviation of step sizes, in tokens, below which
        the steps say nothing about the slope (all alike) and `per_token` is None."""
        self.decay = decay
        self.min_spread = min_spread
        self._w = self._x = self._xx = self._y = self._xy = 0.0

    def observe(self, seconds: float, tokens: int) -> None:
        """One step of `tokens` tokens took `seconds`."""
        d = self.decay
        self._w = self._w * d + 1.0
        self._x = self._x * d + tokens
        self._xx = self._xx * d + tokens * tokens
        self._y = self._y * d + seconds
        self._xy = self._xy * d + tokens * seconds

    @property
    def per_token(self) -> float | None:
        """Seconds one more token adds to a step (>= 0); None until the steps seen differ
        in size by at least `min_spread` tokens."""
        if self._w == 0.0:
            return None
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var < self.min_spread**2:
            return None
        return max((self._xy / self._w - mx * my) / var, 0.0)
