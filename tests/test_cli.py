"""The `specdec` command as a user runs it: real processes, real ports, SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from specdec.server import free_ports


def specdec(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.fixture(scope="module")
def services():
    o, d, t, om, dm, tm, oh = free_ports(7)
    env = dict(os.environ, SPECDEC_ORCHESTRATOR_PORT=str(o), SPECDEC_DRAFT_PORT=str(d), SPECDEC_TARGET_PORT=str(t),
               SPECDEC_ORCHESTRATOR_HTTP_PORT=str(oh),
               SPECDEC_ORCHESTRATOR_METRICS_PORT=str(om), SPECDEC_DRAFT_METRICS_PORT=str(dm),
               SPECDEC_TARGET_METRICS_PORT=str(tm), SPECDEC_ORCHESTRATOR_DRAFT_ADDRESS=f"localhost:{d}",
               SPECDEC_ORCHESTRATOR_TARGET_ADDRESS=f"localhost:{t}", SPECDEC_DRAFT_THREADS="1", SPECDEC_TARGET_THREADS="1")
    up = subprocess.Popen([sys.executable, "-m", "cli.main", "up"], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    address = f"localhost:{o}"
    deadline = time.monotonic() + 180
    while specdec("health", address, env=env).returncode != 0:
        assert up.poll() is None, up.stdout.read()
        assert time.monotonic() < deadline, "services did not become healthy"
        time.sleep(1)
    yield up, address, env, (om, dm, tm)
    if up.poll() is None:
        up.kill()


def test_generate_streams_text_and_prints_stats(services):
    _, address, env, _ = services
    out = specdec("generate", "Name three colors.", "--chat", "--address", address, "--max-tokens", "16",
                  "--temperature", "0", env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
    assert "tokens/round" in out.stderr and "acceptance" in out.stderr


def test_bad_request_prints_the_status(services):
    _, address, env, _ = services
    out = specdec("generate", "hi", "--address", address, "--top-p", "2", env=env)
    assert out.returncode == 1 and "INVALID_ARGUMENT" in out.stderr and "top_p" in out.stderr


def test_generate_without_an_orchestrator_says_how_to_start_one():
    (port,) = free_ports(1)
    out = specdec("generate", "hi", "--address", f"localhost:{port}", "--timeout", "5")
    assert out.returncode == 1 and "UNAVAILABLE" in out.stderr and "specdec up" in out.stderr, out.stderr


def test_each_service_exports_its_metrics(services):
    _, _, _, (om, dm, tm) = services
    body = {p: urllib.request.urlopen(f"http://127.0.0.1:{p}/metrics", timeout=5).read().decode() for p in (om, dm, tm)}
    assert "specdec_rounds_total" in body[om] and "specdec_accepted_tokens_per_position_total" in body[om]
    for p in (dm, tm):
        assert "specdec_kv_sessions_capacity" in body[p] and "specdec_forward_seconds" in body[p]


def test_sigterm_finishes_the_generation_in_flight_and_stops_all_three_cleanly(services):
    up, address, env, _ = services
    gen = subprocess.Popen([sys.executable, "-m", "cli.main", "generate", "Once upon a time", "--address", address,
                            "--max-tokens", "300", "--temperature", "0"],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    gen.stdout.read(8)  # streaming has begun
    assert gen.poll() is None
    up.send_signal(signal.SIGTERM)
    out, err = gen.communicate(timeout=60)
    assert gen.returncode == 0, err
    assert "tokens/round" in err and "specdec generate:" not in err, err  # it ended with its stats, not an error
    assert up.wait(timeout=60) == 0
    assert specdec("health", address, "--timeout", "1", env=env).returncode != 0
    log = up.stdout.read()
    assert log.count("shutting down: NOT_SERVING") == 3, log
