"""Kill a target replica and a draft replica under load, and count what it cost.

Two target replicas, two draft replicas and two orchestrators sharing them, each a real process on loopback
(the embedded pair). 16 greedy streams, 8 through each orchestrator; once every stream has its first tokens,
SIGKILL one target and one draft replica. Reported: requests that failed, outputs that differ from the target
alone's (each prompt run at K = 0 before), how long each stream whose target died waited for its next
message, and how the generations spread over the replicas. Then the killed target restarts on its port and
must take new generations again.

    python tools/failover_drill.py [--streams 16] [--max-tokens 48]

tests/test_replicas.py runs it and asserts 0 failed and 0 wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specdec.health import health_status  # noqa: E402
from specdec.server import free_ports  # noqa: E402
from specdec.v1 import generation_pb2 as gen_pb, generation_pb2_grpc  # noqa: E402

PROMPTS = [
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
    "What is 17 times 23?",
    "Explain a hash map in two sentences.",
    "Name four planets.",
    "Write a short story opening.",
    "Give a JSON object describing a cat.",
    "Say hello in French and Spanish.",
]


class Cluster:
    """The drill's processes: model servers by (role, index), orchestrators by index."""

    def __init__(self, log_dir: Path, replicas: int = 2, orchestrators: int = 2, extra_env: dict | None = None):
        self.log_dir = log_dir
        self.env = dict(os.environ, **(extra_env or {}))
        self.ports = {(role, i): free_ports(2) for role in ("draft", "target") for i in range(replicas)}
        self.procs: dict = {}
        for role, i in self.ports:
            self.start_server(role, i)
        self.orch_ports = [free_ports(2) for _ in range(orchestrators)]
        addresses = {
            role: ",".join(f"127.0.0.1:{p[0]}" for (r, _), p in self.ports.items() if r == role)
            for role in ("draft", "target")
        }
        for j, (port, metrics) in enumerate(self.orch_ports):
            env = dict(
                self.env,
                SPECDEC_ORCHESTRATOR_PORT=str(port),
                SPECDEC_ORCHESTRATOR_METRICS_PORT=str(metrics),
                SPECDEC_ORCHESTRATOR_HTTP_PORT="0",
                SPECDEC_ORCHESTRATOR_DRAFT_ADDRESS=addresses["draft"],
                SPECDEC_ORCHESTRATOR_TARGET_ADDRESS=addresses["target"],
            )
            self.procs[("orchestrator", j)] = self._spawn("orchestrator", f"orchestrator-{j}", env)
        self.wait_serving([f"127.0.0.1:{p}" for p, _ in self.orch_ports])

    def _spawn(self, command: str, name: str, env: dict) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "a")  # noqa: SIM115 - the process writes to it while it runs
        return subprocess.Popen(
            [sys.executable, "-m", "cli.main", command], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )

    def start_server(self, role: str, i: int) -> None:
        port, metrics = self.ports[(role, i)]
        prefix = f"SPECDEC_{role.upper()}_"
        env = dict(
            self.env,
            **{prefix + "PORT": str(port), prefix + "METRICS_PORT": str(metrics), prefix + "HOST": "127.0.0.1"},
        )
        self.procs[(role, i)] = self._spawn(role, f"{role}-{i}", env)

    def address(self, role: str, i: int) -> str:
        return f"127.0.0.1:{self.ports[(role, i)][0]}"

    def wait_serving(self, addresses: list[str], timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while any(health_status(a, timeout=1) != "SERVING" for a in addresses):
            dead = [k for k, p in self.procs.items() if p.poll() is not None and k[0] == "orchestrator"]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"the cluster did not start ({dead or 'timeout'}); see the logs in {self.log_dir}")
            time.sleep(0.5)

    def kill(self, role: str, i: int) -> None:
        p = self.procs[(role, i)]
        p.send_signal(signal.SIGKILL)
        p.wait()

    def metrics(self, j: int) -> str:
        return _scrape(self.orch_ports[j][1])

    def server_sessions(self, role: str) -> dict[str, float]:
        """The KV sessions each live replica of role holds, from its own metrics."""
        out = {}
        for (r, i), (_, metrics) in self.ports.items():
            if r == role and self.procs[(r, i)].poll() is None:
                lines = [line for line in _scrape(metrics).splitlines() if line.startswith("specdec_kv_sessions ")]
                out[self.address(r, i)] = float(lines[0].split()[1])
        return out

    def placed(self, role: str) -> dict[str, float]:
        """Generations placed on each replica of role, summed over the orchestrators."""
        out: dict[str, float] = {}
        for j in range(len(self.orch_ports)):
            for line in self.metrics(j).splitlines():
                if line.startswith("specdec_replica_generations_total{") and f'role="{role}"' in line:
                    replica = line.split('replica="')[1].split('"')[0]
                    out[replica] = out.get(replica, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def generate(address: str, prompt: str, max_tokens: int, k: int | None, on_message=None):
    """(token ids, error code name or None)."""
    req = gen_pb.GenerateRequest(
        messages=[gen_pb.ChatMessage(role="user", content=prompt)], max_tokens=max_tokens, temperature=0.0
    )
    if k is not None:
        req.num_speculative_tokens = k
    ids = []
    try:
        with grpc.insecure_channel(address) as channel:
            for msg in generation_pb2_grpc.GenerationStub(channel).Generate(req, timeout=300):
                ids.extend(msg.token_ids)
                if on_message is not None:
                    on_message()
    except grpc.RpcError as e:
        return ids, e.code().name
    return ids, None


def run_drill(streams: int = 16, max_tokens: int = 48, log_dir: Path | None = None) -> dict:
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="specdec-drill-"))
    cluster = Cluster(log_dir)
    try:
        orchestrators = [f"127.0.0.1:{p}" for p, _ in cluster.orch_ports]
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(streams)]
        expected = {p: generate(orchestrators[0], p, max_tokens, 0)[0] for p in set(prompts)}  # the target alone
        report = {"streams": streams, "max_tokens": max_tokens}
        report |= kill_mid_stream(cluster, orchestrators, prompts, max_tokens, expected)
        report |= after_restart(cluster, orchestrators, prompts, max_tokens, expected)
        return report | {"logs": str(log_dir)}
    finally:
        cluster.stop()


def kill_mid_stream(
    cluster: Cluster, orchestrators: list[str], prompts: list[str], max_tokens: int, expected: dict
) -> dict:
    """Kill the first target and draft once every stream has its first messages; what the streams saw."""
    streams = len(prompts)
    placed_at_start = cluster.placed("target")
    arrivals: list[list[float]] = [[] for _ in range(streams)]
    results: list = [None] * streams

    def stream(i: int) -> None:
        results[i] = generate(
            orchestrators[i % 2], prompts[i], max_tokens, 3, on_message=lambda: arrivals[i].append(time.monotonic())
        )

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 300
    while min(len(a) for a in arrivals) < 2 and time.monotonic() < deadline and any(t.is_alive() for t in threads):
        time.sleep(0.01)
    placed_before = {r: n - placed_at_start.get(r, 0.0) for r, n in cluster.placed("target").items()}
    sessions_before = cluster.server_sessions("target")
    killed_at = time.monotonic()
    cluster.kill("target", 0)
    cluster.kill("draft", 0)
    for t in threads:
        t.join()

    failed = [r[1] for r in results if r[1] is not None]
    wrong = sum(1 for i, r in enumerate(results) if r[1] is None and r[0] != expected[prompts[i]])
    # The wait of each stream still running at the kill, from the kill to its next message: the streams on
    # the killed target rebuild on the other (their longest waits), the others wait for its larger batches.
    waits = [min(t for t in a if t > killed_at) - killed_at for a in arrivals if a and a[-1] > killed_at]
    moved = sum(
        float(line.rsplit(" ", 1)[1])
        for j in range(2)
        for line in cluster.metrics(j).splitlines()
        if line.startswith("specdec_replica_failovers_total{") and 'role="target"' in line
    )
    return {
        "failed_requests": len(failed),
        "failure_codes": failed,
        "wrong_outputs": wrong,
        "moved_generations": moved,
        "recovery_seconds": {
            "max": max(waits, default=0.0),
            "median": sorted(waits)[len(waits) // 2] if waits else 0.0,
            "streams": len(waits),
        },
        "placement_before_kill": placed_before,
        "target_sessions_before_kill": sessions_before,
    }


def after_restart(
    cluster: Cluster, orchestrators: list[str], prompts: list[str], max_tokens: int, expected: dict
) -> dict:
    """The killed target comes back on its port and takes new generations again."""
    cluster.start_server("target", 0)
    cluster.wait_serving([cluster.address("target", 0)])
    time.sleep(2.5)  # the orchestrators' next reports see it up
    back = cluster.address("target", 0)
    before = cluster.placed("target").get(back, 0.0)
    after_results = [None] * 8

    def again(i: int) -> None:
        after_results[i] = generate(orchestrators[i % 2], prompts[i], max_tokens, 3)

    threads = [threading.Thread(target=again, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {
        "restarted_replica_took": cluster.placed("target").get(back, 0.0) - before,
        "after_restart_failed": sum(1 for r in after_results if r[1] is not None),
        "after_restart_wrong": sum(
            1 for i, r in enumerate(after_results) if r[1] is None and r[0] != expected[prompts[i]]
        ),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=48)
    args = p.parse_args()
    print(json.dumps(run_drill(args.streams, args.max_tokens), indent=2))


if __name__ == "__main__":
    main()
