"""What the draft's training stages share: the seed and the log line."""

from __future__ import annotations

import time

SEED = 20261121


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)
