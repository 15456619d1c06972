"""Reading the orchestrator's Prometheus metrics around a run, and Leviathan et al.'s figures from them."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str, job: str | None = None) -> dict:
    """Every sample of the specdec metrics, keyed by (name, sorted labels); job, when given, is added to the
    labels, as Prometheus labels each target's samples, so that several servers' samples fit one dict."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    extra = {"job": job} if job else {}
    return {
        (s.name, tuple(sorted({**s.labels, **extra}.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("specdec_")
    }


def scrape_all(urls: dict) -> dict:
    """scrape() of several servers into one dict: {job: url}, the job None for the orchestrator."""
    out = {}
    for job, url in urls.items():
        out.update(scrape(url, job))
    return out


def mean_step_s(d: dict, job: str) -> float:
    """A model server's mean time of a one-token forward pass (its specdec_forward_seconds{tokens="1"}): one
    decoding step, without the prefills and verify passes of the other buckets. 0 without observations."""
    n = value(d, "specdec_forward_seconds_count", job=job, tokens="1")
    return value(d, "specdec_forward_seconds_sum", job=job, tokens="1") / n if n else 0.0


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
