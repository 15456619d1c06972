"""What the benchmarks share: the committed prompts, the machine's description, and the services they start.

`specdec bench` (bench/run.py), its load mode (bench/load.py) and the draft's evaluation (training/evaluate.py)
all run on these.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import grpc

from specdec.health import health_status
from specdec.server import free_ports, up_environment

PROMPTS = Path(__file__).resolve().parent / "prompts.json"


def load_prompts(n: int | None) -> list[dict]:
    prompts = json.loads(PROMPTS.read_text())["prompts"]
    if n is None or n >= len(prompts):
        return prompts
    by_cat: dict[str, list] = {}
    for p in prompts:
        by_cat.setdefault(p["category"], []).append(p)
    picked = []
    while len(picked) < n:  # round-robin over categories
        for cat in list(by_cat):
            if by_cat[cat] and len(picked) < n:
                picked.append(by_cat[cat].pop(0))
    return picked


def save(report: dict, out: Path, name: str) -> dict:
    """A bench's report written to out/NAME.json (the folder made if need be) and printed; the report."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return report


def machine() -> dict:
    import torch
    import transformers

    cpu = ""
    with contextlib.suppress(OSError, StopIteration):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    return {
        "cpu": cpu or platform.processor(),
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def start_services(draft: str, target: str, log_path: Path, tree: Path | None = None, env: dict | None = None):
    """`specdec up` and a second orchestrator (adaptive speculation) on free ports; tree: another checkout of specdec
    to run them from (bench/versions.py), else this one; env: more settings for them (SPECDEC_...), which win over
    the ones set here."""
    ports = free_ports(8)
    o, d, t, om, dm, tm, _, oh2 = ports
    env = {
        **os.environ,
        **({"PYTHONPATH": str(tree)} if tree is not None else {}),
        **up_environment(ports[:7]),
        "SPECDEC_DRAFT_MODEL": draft,
        "SPECDEC_TARGET_MODEL": target,
        "SPECDEC_ORCHESTRATOR_TOKENIZER": target,
        "SPECDEC_ORCHESTRATOR_MAX_SPECULATIVE_TOKENS": "8",
        **(env or {}),
    }
    log = open(log_path, "w")  # noqa: SIM115 - the services write to it while they run
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "cli.main", "up"], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tree
        )
    ]
    # The "auto" arm's orchestrator, on the same model servers: adaptive speculation learns its costs and alpha
    # from the rounds it runs, as it would in service, and not from the fixed-K arms' runs of the same prompt.
    o2, om2 = free_ports(2)
    env2 = dict(
        env,
        SPECDEC_ORCHESTRATOR_PORT=str(o2),
        SPECDEC_ORCHESTRATOR_METRICS_PORT=str(om2),
        SPECDEC_ORCHESTRATOR_HTTP_PORT=str(oh2),
        SPECDEC_ORCHESTRATOR_ADAPTIVE_SPECULATION="true",
    )
    procs.append(
        subprocess.Popen(
            [sys.executable, "-m", "cli.main", "orchestrator"], env=env2, stdout=log, stderr=subprocess.STDOUT, cwd=tree
        )
    )
    deadline = time.monotonic() + 600
    while any(health_status(f"127.0.0.1:{port}", timeout=1) != "SERVING" for port in (o, o2)):
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            for p in procs:
                p.terminate()
            raise SystemExit(f"specdec bench: the services did not start; see {log_path}")
        time.sleep(1)
    urls = {
        None: f"http://127.0.0.1:{om}/metrics",
        "draft": f"http://127.0.0.1:{dm}/metrics",
        "target": f"http://127.0.0.1:{tm}/metrics",
    }
    auto = (f"127.0.0.1:{o2}", {**urls, None: f"http://127.0.0.1:{om2}/metrics"})
    return procs, f"127.0.0.1:{o}", urls, auto, forwards(f"127.0.0.1:{d}", f"127.0.0.1:{t}")


def forwards(draft_address: str, target_address: str) -> dict:
    """How each model server runs its passes (ModelInfo.forward): the product forms its start-up chose."""
    from specdec.v1 import draft_pb2_grpc, model_server_pb2, target_pb2_grpc

    out = {}
    for role, address, stub_class in (
        ("draft", draft_address, draft_pb2_grpc.DraftServiceStub),
        ("target", target_address, target_pb2_grpc.TargetServiceStub),
    ):
        with grpc.insecure_channel(address) as channel:
            out[role] = stub_class(channel).GetModelInfo(model_server_pb2.GetModelInfoRequest(), timeout=30).forward
    return out


def stop_services(procs) -> None:
    """SIGTERM to every process start_services started, then wait for each (a minute at most)."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait(60)
