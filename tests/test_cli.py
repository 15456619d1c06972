"""The `specdec` command as a user runs it: real processes, real ports, SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest

from cli import hub
from specdec.server import free_ports, up_environment


def specdec(*args, env=None, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


@pytest.fixture(scope="module")
def services():
    ports = free_ports(7)
    o, _, _, om, dm, tm, _ = ports
    env = dict(os.environ, **up_environment(ports, "localhost"), SPECDEC_DRAFT_THREADS="1", SPECDEC_TARGET_THREADS="1")
    up = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "up"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
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
    out = specdec(
        "generate",
        "Name three colors.",
        "--chat",
        "--address",
        address,
        "--max-tokens",
        "16",
        "--temperature",
        "0",
        env=env,
    )
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
    gen = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cli.main",
            "generate",
            "Once upon a time",
            "--address",
            address,
            "--max-tokens",
            "300",
            "--temperature",
            "0",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    gen.stdout.read(8)  # streaming has begun
    assert gen.poll() is None
    up.send_signal(signal.SIGTERM)
    _, err = gen.communicate(timeout=60)
    assert gen.returncode == 0, err
    assert "tokens/round" in err and "specdec generate:" not in err, err  # it ended with its stats, not an error
    assert up.wait(timeout=60) == 0
    assert specdec("health", address, "--timeout", "1", env=env).returncode != 0
    log = up.stdout.read()
    assert log.count("shutting down: NOT_SERVING") == 3, log


@pytest.fixture
def health_server():
    """A bare grpc.health.v1 server on loopback: (its servicer, its address)."""
    from concurrent import futures

    from grpc_health.v1 import health, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)


def imported(stderr: str) -> set[str]:
    """The modules a `python -X importtime` run imported, from its report on stderr."""
    return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


def test_health_check_imports_neither_torch_nor_transformers(health_server):
    """Compose runs `specdec health` every 10 s in each container: importing torch there costs seconds of CPU."""
    from grpc_health.v1 import health_pb2

    servicer, address = health_server
    for status, code in ((health_pb2.HealthCheckResponse.SERVING, 0), (health_pb2.HealthCheckResponse.NOT_SERVING, 1)):
        servicer.set("", status)
        out = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "cli.main", "health", address],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == code, out.stdout + out.stderr[-2000:]
        heavy = {m for m in imported(out.stderr) if m.split(".")[0] in ("torch", "transformers")}
        assert "specdec.health" in imported(out.stderr) and not heavy, sorted(heavy)[:10]


@pytest.fixture
def no_hub_access(monkeypatch, tmp_path):
    """No token in the environment or on disk, and an empty Hugging Face cache."""
    from huggingface_hub import constants

    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "token"))
    return tmp_path


def test_a_gated_model_needs_a_token_or_a_cached_copy(no_hub_access, monkeypatch):
    gated = "meta-llama/Llama-3.2-3B-Instruct"
    with pytest.raises(hub.HubAccessError, match="set HF_TOKEN"):
        hub.require_access(gated)
    snapshot = no_hub_access / "hub" / "models--meta-llama--Llama-3.2-3B-Instruct" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("abc123")
    hub.require_access(gated)  # cached
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    hub.require_access("meta-llama/Llama-3.2-1B-Instruct")  # not cached, but a token


def test_only_gated_hub_models_are_checked(no_hub_access):
    for spec in ("HuggingFaceTB/SmolLM2-135M-Instruct", "embedded:smollm2-135m-instruct", str(no_hub_access)):
        hub.require_access(spec)


def test_a_server_of_a_gated_model_without_access_exits_2_at_once_with_one_line(tmp_path):
    """A restart policy shows this line each time instead of a traceback from from_pretrained."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    env.update(HF_HOME=str(tmp_path), HF_HUB_OFFLINE="1", SPECDEC_TARGET_PORT="0", SPECDEC_TARGET_METRICS_PORT="0")
    for argv in (
        ["target", "--model", "meta-llama/Llama-3.2-3B-Instruct"],
        ["fetch", "meta-llama/Llama-3.2-3B-Instruct", "meta-llama/Llama-3.2-1B-Instruct"],
    ):
        out = specdec(*argv, env=env, timeout=60)
        assert out.returncode == 2, out.stderr[-2000:]
        assert out.stderr.count("\n") == 1 and "set HF_TOKEN" in out.stderr, out.stderr[-2000:]
