"""A forward pass's cost by its width, as a piecewise-linear curve through measured points; moving averages.

The model servers measure it (specdec/engine.py) and publish it (ModelInfo.pass_costs); the orchestrator prices
speculation with it (orchestrator/speculation.py). Pure functions, no torch.
"""

from __future__ import annotations

import bisect


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


def ewma(old: float | None, x: float, rate: float) -> float:
    """A moving average's next value: x itself when there is none yet, else old moved `rate` of the way to x."""
    return x if old is None else old + rate * (x - old)
