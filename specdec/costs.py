"""A forward pass's cost by its width, as a piecewise-linear curve through measured points; moving averages.

The model servers measure it (specdec/engine.py) and publish it (ModelInfo.pass_costs); the orchestrator prices
speculation with it (orchestrator/speculation.py). Pure functions, no torch.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field


def at(points: list[tuple[float, float]], rows: float) -> tuple[float, float]:
    """(seconds of a pass of `rows` rows, seconds one more row adds there) on the line through the measured
    (rows, seconds) points around it, ascending by rows; past either end, the nearest segment's line.
    (0, 0) without points; one point: its seconds, no slope."""
    if not points:
        return 0.0, 0.0
    if len(points) == 1:
        return points[0][1], 0.0
    i = min(max(bisect.bisect_left([r for r, _ in points], rows), 1), len(points) - 1)
    (r0, s0), (r1, s1) = points[i - 1], points[i]
    slope = max((s1 - s0) / (r1 - r0), 0.0) if r1 > r0 else 0.0
    return max(s0 + slope * (rows - r0), 0.0), slope


def nondecreasing(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(rows, seconds) points ascending by rows, each pass priced at most as a wider one: a narrow pass never costs
    more rows' worth than a wide one, and where a measure says it does, the narrow passes were timed while the
    cores did other work."""
    out, cheapest = [], float("inf")
    for rows, seconds in sorted(points, reverse=True):
        cheapest = min(cheapest, seconds)
        out.append((rows, cheapest))
    return out[::-1]


def ewma(old: float | None, x: float, rate: float) -> float:
    """A moving average's next value: x itself when there is none yet, else old moved `rate` of the way to x."""
    return x if old is None else old + rate * (x - old)


# Pass widths the cost table keeps apart; a pass counts in the first at or above its rows.
WIDTHS = (
    1,
    2,
    3,
    4,
    5,
    6,
    8,
    10,
    12,
    16,
    20,
    24,
    32,
    48,
    64,
    96,
    128,
    192,
    256,
    384,
    512,
    768,
    1024,
    1536,
    2048,
    3072,
    4096,
    6144,
    8192,
)
COST_RATE = 0.1  # each width's estimate weighs its last ~10 passes most


def width_of(rows: int) -> int:
    """The width a pass of `rows` rows counts in: the first of WIDTHS at or above it (the last past them)."""
    return WIDTHS[min(bisect.bisect_left(WIDTHS, rows), len(WIDTHS) - 1)]


@dataclass
class PassCosts:
    """Seconds of a pass by its width, learned from the passes the server runs (a moving average per width).

    What a row costs depends on the width: a few rows cost little more than one while the weights' bytes
    bound the pass, and each costs its arithmetic once the cores' (or the GPU's) multiply-adds do. ``at(rows)``
    gives the pass's seconds at a width and what one more row adds there, the slope between the measured
    widths around it; the orchestrator prices a drafted token from it (orchestrator/speculation.py)."""

    rate: float = COST_RATE
    seconds: dict = field(default_factory=dict)  # width bucket -> (mean rows, mean seconds)

    def observe(self, rows: int, seconds: float) -> None:
        old = self.seconds.get(key := width_of(rows))
        self.seconds[key] = (
            (rows, seconds) if old is None else (ewma(old[0], rows, self.rate), ewma(old[1], seconds, self.rate))
        )

    def curve(self) -> list[tuple[float, float]]:
        """(mean rows, mean seconds) of each width measured, ascending."""
        return sorted(self.seconds.values())

    def at(self, rows: int) -> tuple[float, float]:
        """(seconds of a pass of `rows` rows, seconds one more row adds there); (0, 0) before any pass."""
        return at(self.curve(), rows)
