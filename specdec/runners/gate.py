"""The quality gate of quantized activations for a target.

A target's numbers are its output, so ``--activations auto`` gives a target 8- or 16-bit activations only where they
were measured to keep its output: teacher-forced on held-out text against the same file's float32 products
(bench/quality.py), top-1 agreement at least TOP1_GOAL and perplexity within PERPLEXITY_GOAL on every text. The
verdicts live in ``activation_gates.json`` beside this file, keyed by the sha256 of the model's GGUF file, so a
record holds for those exact weights and no others; ``specdec gate`` measures a file and writes its record. A file
without a record runs float32 until then. A form with a float16 KV cache (``form_name``) is gated the same way, against
the same float32 products with a float32 cache: ``--kv-cache-dtype auto`` takes it where it passed.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

TOP1_GOAL = 0.99
PERPLEXITY_GOAL = 0.005  # |perplexity_quantized / perplexity_float32 - 1|
RECORDS = Path(__file__).with_name("activation_gates.json")
TEXTS = ("answers", "passages")


def file_sha256(path: str) -> str:
    stat = os.stat(path)
    return _sha256(os.path.realpath(path), stat.st_size, stat.st_mtime_ns)


@functools.cache
def _sha256(path: str, size: int, mtime_ns: int) -> str:  # size and mtime: a rewritten file is hashed again
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def form_name(activations: str, kv_cache: str = "model") -> str:
    """The name a numerics form is measured and recorded under: its activations, and its KV cache where that is
    not the model's dtype ("int16", "int16 + float16 KV cache")."""
    return activations if kv_cache == "model" else f"{activations} + {kv_cache} KV cache"


def verdict(measured: dict) -> bool:
    """Whether one activations form's measurements (bench.quality's report for it) pass the gate."""
    return all(
        measured[text]["top1_agreement"] >= TOP1_GOAL and abs(measured[text]["perplexity_change"]) <= PERPLEXITY_GOAL
        for text in TEXTS
    )


def _read(records: Path) -> dict:
    return json.loads(records.read_text()) if records.exists() else {}


def passed(gguf: str | None, records: Path | None = None) -> tuple[str, ...]:
    """The forms (``form_name``: int8, int16, with a float16 KV cache) whose record for this GGUF file passed the gate;
    () without one."""
    if gguf is None:
        return ()
    entry = _read(records or RECORDS).get(file_sha256(gguf), {})
    return tuple(form for form, measured in entry.get("activations", {}).items() if measured["passed"])


def record(gguf: str, report: dict, records: Path | None = None) -> dict:
    """Write bench.quality's report for this GGUF file as its record (replacing an older one); the record."""
    forms = {
        form: {
            **{
                text: {k: measured[text][k] for k in ("positions", "top1_agreement", "perplexity_change")}
                for text in TEXTS
            },
            "mean_kl": {text: measured[text]["mean_kl"] for text in TEXTS},
            "passed": verdict(measured),
        }
        for form, measured in report.items()
        if isinstance(measured, dict) and all(text in measured for text in TEXTS)  # a form measured
    }
    machine = report.get("machine", {})
    entry = {
        "file": os.path.basename(gguf),
        "measured_on": f"{report.get('date', '')} {machine.get('cpu', '')}, {machine.get('cores', '')} cores".strip(),
        "goals": {"top1_agreement": TOP1_GOAL, "perplexity_change": PERPLEXITY_GOAL},
        "activations": forms,
    }
    records = records or RECORDS
    everything = _read(records)
    everything[file_sha256(gguf)] = entry
    records.write_text(json.dumps(everything, indent=1, sort_keys=True) + "\n")
    return entry
