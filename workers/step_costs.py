"""What a row of a decode step costs on this machine, learnt from the engine's own steps, for the scheduler's
choice of drafts beside other requests (`Scheduler._earned`).

A draft is a row of the step: it is worth computing when the chance that it is kept is at least what the row
costs in tokens. A step of `n` requests takes `T(n)` and makes about `n` tokens; one row more takes `b`
(the slope of `T` at `n`) and makes a token with the draft's chance `p`: throughput grows when
`(n + p) / (T + b) > n / T`, that is when `p > b * n / T`, the rows' share of the step's time. Where the
weights dominate a step (one GPU, a CPU's bfloat16 GEMV over a few rows) that share is small and drafts pay
at low odds; where each row costs nearly as much as the weights (a CPU's float32 steps of tens of rows) it
nears 1 and only drafts almost sure to be kept pay.

`T` is fitted by least squares to the latest decode-only steps (seconds against rows, each sample's weight
decaying by `DECAY` a step, so the fit follows the batch as it grows and shrinks); the rows vary from step to
step with the drafts themselves and with requests arriving and ending.
"""

from __future__ import annotations

DECAY = 0.95  # a step's weight in the fit after each later step (about the last 20 steps count)
MIN_WEIGHT = 8.0  # the fit's total weight before it is used (about 8 steps)
MIN_SPREAD = 0.5  # rows: the fit's weighted standard deviation of rows before its slope is used


class StepCosts:
    """An online weighted least-squares line through (rows, seconds) of decode-only steps."""

    __slots__ = ("_w", "_x", "_y", "_xx", "_xy", "_share_slope")

    def __init__(self) -> None:
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self._share_slope: float | None = None  # the last slope fitted over rows that spread enough

    def observe(self, rows: int, seconds: float) -> None:
        """A decode-only step of `rows` rows took `seconds`."""
        if rows < 1 or not seconds > 0:
            return
        d = DECAY
        self._w = d * self._w + 1.0
        self._x = d * self._x + rows
        self._y = d * self._y + seconds
        self._xx = d * self._xx + rows * rows
        self._xy = d * self._xy + rows * seconds
        if self._w >= MIN_WEIGHT:
            mean_x = self._x / self._w
            var_x = self._xx / self._w - mean_x * mean_x
            if var_x >= MIN_SPREAD * MIN_SPREAD:
                cov = self._xy / self._w - mean_x * self._y / self._w
                self._share_slope = max(0.0, cov / var_x)

    def row_share(self, rows: int) -> float | None:
        """`b * rows / T(rows)`: the share of a step of `rows` rows that its rows cost, by the fit (the step's
        time there, the slope from the last steps whose rows spread enough); None until the fit has both."""
        b = self._share_slope
        if b is None or self._w < MIN_WEIGHT or rows < 1:
            return None
        t = self._y / self._w + b * (rows - self._x / self._w)
        if t <= 0:
            return None
        return min(1.0, b * rows / t)
