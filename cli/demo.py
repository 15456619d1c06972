"""`make demo`: the three services on the embedded pair, one streamed completion, then serve until Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

PROMPT = "Explain in a few sentences why the sky is blue."


def _wait_serving(address: str, timeout_s: float, up: subprocess.Popen) -> bool:
    from specdec.health import health_status

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if up.poll() is not None:
            return False
        if health_status(address, timeout=1) == "SERVING":
            return True
        time.sleep(1)
    return False


def main() -> int:
    from cli.main import main as cli

    print("Starting draft, target and orchestrator (the first run converts the embedded model, ~20 s)...", flush=True)
    up = subprocess.Popen([sys.executable, "-m", "cli.main", "up"])
    try:
        if not _wait_serving("localhost:50051", 300, up):
            print("specdec demo: the services did not come up; see the log above", file=sys.stderr)
            return 1
        print(f"\n>>> specdec generate --chat {PROMPT!r} --temperature 0\n", flush=True)
        cli(["generate", PROMPT, "--chat", "--temperature", "0", "--max-tokens", "128"])
        print(
            "\nThe services keep serving on localhost:50051 (metrics on :8001, :8002, :8003). "
            'Try: .venv/bin/specdec generate --chat "Write a haiku about the sea."\nCtrl-C stops them.',
            flush=True,
        )
        signal.signal(signal.SIGINT, lambda *_: up.send_signal(signal.SIGTERM))
        return up.wait()
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
            up.wait(timeout=60)


if __name__ == "__main__":
    sys.exit(main())
