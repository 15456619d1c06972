"""Reading the orchestrator's Prometheus metrics around a run, and Leviathan et al.'s figures from them."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str) -> dict:
    """Every sample of the specdec metrics, keyed by (name, sorted labels)."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples if s.name.startswith("specdec_")}


def delta(before: dict, after: dict) -> dict:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def value(d: dict, name: str, **labels) -> float:
    return d.get((name, tuple(sorted(labels.items()))), 0.0)


def histogram_median(d: dict, name: str) -> float | None:
    """The upper edge of the bucket holding the median observation (None without observations)."""
    buckets = sorted((float(dict(k[1])["le"]), v) for k, v in d.items() if k[0] == name + "_bucket")
    if not buckets or buckets[-1][1] <= 0:
        return None
    half = buckets[-1][1] / 2
    return next(le for le, count in buckets if count >= half)


def leviathan_alpha(accepted: int, rejected_rounds: int) -> float:
    """Per-position acceptance probability: accepted / (accepted + rounds that ended in a rejection).
    Both are 0 only when nothing was drafted."""
    return accepted / (accepted + rejected_rounds) if accepted + rejected_rounds else 0.0


def expected_tokens_per_round(alpha: float, k: int) -> float:
    """tau = (1 - alpha^(K+1)) / (1 - alpha): accepted drafts plus the one token the target adds."""
    return k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def leviathan_bound(alpha: float, k: int, c: float) -> float:
    """Expected speedup (1 - alpha^(K+1)) / ((1 - alpha)(Kc + 1)): tokens per round over a round's cost."""
    return expected_tokens_per_round(alpha, k) / (k * c + 1)
