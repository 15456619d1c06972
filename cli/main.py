"""The ``specdec`` command.

  specdec up                  the three services on this machine (Ctrl-C stops all)
  specdec draft|target|orchestrator   one service
  specdec generate "PROMPT"   stream a completion from a running orchestrator
  specdec health ADDRESS      exit 0 when a server reports SERVING (for container health checks)
  specdec fetch MODEL...      download hub models into the Hugging Face cache (compose runs it before the servers)
  specdec bench [--quick]     speedup measured side by side (see bench/run.py)
  specdec bench --production  c, verify cost and projected speedup at Llama 3.2 1B/3B sizes (bench/production.py)

Importing this module imports neither torch nor transformers: a container health check runs `specdec health`
every few seconds, and it loads grpc alone. Each subcommand imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import subprocess
import sys
import time

# Read by libgomp when torch loads, so set before the imports below. After a parallel region its idle
# threads spin 300,000 times by default before they sleep, milliseconds on a CPU, and take a core that the
# other two services need between the target's passes; 30,000 spins still cover the gaps inside a forward
# pass (docs/performance.md, "Behind the defaults").
os.environ.setdefault("GOMP_SPINCOUNT", "30000")


def _logging() -> None:
    logging.basicConfig(
        level=os.environ.get("SPECDEC_LOG_LEVEL", "INFO"), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def _serve_model(role: str, args) -> int:
    from cli.hub import require_access
    from specdec.config import ROLE_DEFAULTS, ModelServerConfig, from_args

    cfg = from_args(ModelServerConfig, args, role=role, defaults=ROLE_DEFAULTS[role])
    require_access(cfg.model)
    from specdec.model_server import run_model_server

    if role == "draft":
        from draft_service.app import services
    else:
        from target_service.app import services
    asyncio.run(run_model_server(cfg, services))
    return 0


def _serve_orchestrator(args) -> int:
    from cli.hub import require_access
    from specdec.config import OrchestratorConfig, from_args

    cfg = from_args(OrchestratorConfig, args)
    require_access(cfg.tokenizer)
    from orchestrator.app import run_orchestrator

    asyncio.run(run_orchestrator(cfg))
    return 0


def _up_arguments(up: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from specdec.config import DEFAULT_DRAFT

    up.add_argument("--draft-model", help=f"draft model (default {DEFAULT_DRAFT})")
    up.add_argument("--target-model", help="target model (default the embedded SmolLM2-135M-Instruct)")
    up.add_argument(
        "--dtype", help="auto (the default: float32 on CPU, bfloat16 or float16 on a GPU), float32, bfloat16 or float16"
    )
    up.add_argument("--device", help="cpu, cuda...")
    up.add_argument("--threads", type=int, default=0, help="torch threads per model server")
    up.add_argument(
        "--with-prometheus", action="store_true", help="also start Prometheus (the binary must be installed)"
    )
    up.add_argument("--prometheus-port", type=int, default=9090, help="with --with-prometheus (default %(default)s)")
    return up


def _up(args) -> int:
    """Start the three services as child processes; stop all when one exits or on a signal."""
    from specdec.config import ModelServerConfig, OrchestratorConfig, env_prefix

    env = dict(os.environ)
    for flag, var in (
        (args.draft_model, "SPECDEC_DRAFT_MODEL"),
        (args.target_model, "SPECDEC_TARGET_MODEL"),
        (args.dtype, "SPECDEC_DRAFT_DTYPE"),
        (args.dtype, "SPECDEC_TARGET_DTYPE"),
        (args.device, "SPECDEC_DRAFT_DEVICE"),
        (args.device, "SPECDEC_TARGET_DEVICE"),
        (args.target_model, "SPECDEC_ORCHESTRATOR_TOKENIZER"),
    ):
        if flag:
            env[var] = flag
    if args.target_model is None and "SPECDEC_TARGET_MODEL" in env:
        env.setdefault("SPECDEC_ORCHESTRATOR_TOKENIZER", env["SPECDEC_TARGET_MODEL"])
    if args.threads:
        env.setdefault("SPECDEC_DRAFT_THREADS", str(args.threads))
        env.setdefault("SPECDEC_TARGET_THREADS", str(args.threads))
    cmd = [sys.executable, "-m", "cli.main"]
    children = [_child([*cmd, role], env=env) for role in ("target", "draft", "orchestrator")]
    if args.with_prometheus:
        children.append(_start_prometheus(env, args.prometheus_port))
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    code = 0
    while not stopping:
        done = [c for c in children if c.poll() is not None]
        if done:
            code = done[0].returncode or 1
            print(
                f"specdec up: a service exited with status {done[0].returncode}; stopping the others", file=sys.stderr
            )
            break
        time.sleep(0.2)

    # The orchestrator first, so that the generations in flight finish on model servers that are still up
    # (a model server that stops ends its streams at once, for a client that would reconnect elsewhere);
    # then the model servers and Prometheus. Each gets its grace period and a margin before SIGKILL.
    def grace(role: str, default: float) -> float:
        try:
            return float(env.get(env_prefix(role) + "GRACE_S", default))
        except ValueError:
            return default

    orchestrator, rest = children[2], children[:2] + children[3:]
    _stop([orchestrator], grace("orchestrator", OrchestratorConfig.grace_s) + 10)
    _stop(rest, max(grace(role, ModelServerConfig.grace_s) for role in ("draft", "target")) + 10)
    return code


def _child(argv: list[str], **kwargs) -> subprocess.Popen:
    """A service in its own process group, so that a terminal's Ctrl-C reaches `specdec up` alone, which stops
    the services in order; on Linux the service gets SIGTERM should `specdec up` die without stopping it.

    A group, not a session: Linux schedules each session as one group of its own (autogroup), and three
    services in three groups wait longer for each other's cores (docs/performance.md, "Behind the defaults")."""
    return subprocess.Popen(argv, preexec_fn=_own_group_terminated_with_parent, **kwargs)


def _own_group_terminated_with_parent() -> None:
    os.setpgid(0, 0)
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # not Linux: the child outlives a killed parent, as without this
        pass


def _stop(processes: list[subprocess.Popen], timeout_s: float) -> None:
    for p in processes:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in processes:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def prometheus_config(targets: dict[str, str], rules: str | None, interval: str = "5s") -> str:
    """A scrape configuration for the three services: {job: host:port}."""
    jobs = "\n".join(
        f'  - job_name: {job}\n    static_configs: [{{targets: ["{addr}"]}}]' for job, addr in targets.items()
    )
    rule_files = f"rule_files:\n  - {rules}\n" if rules else ""
    return (
        f"global:\n  scrape_interval: {interval}\n  evaluation_interval: {interval}\n"
        f"{rule_files}scrape_configs:\n{jobs}\n"
    )


def _start_prometheus(env: dict, port: int) -> subprocess.Popen:
    """Prometheus beside `specdec up`, scraping the local metrics ports, with the project's alert rules."""
    import shutil
    from pathlib import Path

    from specdec.config import ROLE_DEFAULTS, ConfigError, OrchestratorConfig, env_prefix
    from specdec.models import cache_dir

    binary = shutil.which("prometheus")
    if binary is None:
        raise ConfigError("--with-prometheus needs the prometheus binary on PATH (Debian: apt-get install prometheus)")
    defaults = {
        "orchestrator": OrchestratorConfig.metrics_port,
        **{role: d["metrics_port"] for role, d in ROLE_DEFAULTS.items()},
    }
    ports = {role: env.get(env_prefix(role) + "METRICS_PORT", str(port)) for role, port in defaults.items()}
    rules = Path(__file__).resolve().parent.parent / "deploy" / "prometheus" / "alerts.yml"
    folder = cache_dir() / "prometheus"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "prometheus.yml").write_text(
        prometheus_config({role: f"localhost:{p}" for role, p in ports.items()}, str(rules) if rules.exists() else None)
    )
    print(f"specdec up: Prometheus on http://localhost:{port} (data in {folder})", file=sys.stderr)
    return _child(
        [
            binary,
            f"--config.file={folder / 'prometheus.yml'}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address=:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _generate_arguments(g: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g.add_argument("prompt", help="raw text to continue, or with --chat the user's message")
    g.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    g.add_argument(
        "--address",
        default=os.environ.get("SPECDEC_ADDRESS", "localhost:50051"),
        help="the orchestrator's host:port (default %(default)s; env SPECDEC_ADDRESS)",
    )
    unset = "; unset: the orchestrator's default"
    g.add_argument("--max-tokens", type=int, help="most tokens to generate" + unset)
    g.add_argument("--temperature", type=float, help="0 is greedy" + unset)
    g.add_argument("--top-p", type=float, help="nucleus sampling, in (0, 1]" + unset)
    g.add_argument("--top-k", type=int, help="sample among the k likeliest tokens, 0 for all" + unset)
    g.add_argument("--seed", type=int, help="makes a sampled completion reproducible; unset: a random one, printed")
    g.add_argument("--stop", action="append", default=[], help="a string that ends the completion (repeatable)")
    g.add_argument(
        "-k",
        "--num-speculative-tokens",
        dest="k",
        type=int,
        help="tokens the draft proposes a round, 0 for the target alone" + unset,
    )
    g.add_argument(
        "--prompt-lookup-min",
        type=int,
        help="propose tokens copied from earlier in the sequence when its last n >= this tokens repeat (0: off)",
    )
    g.add_argument("--timeout", type=float, default=600.0, help="seconds before giving up (default %(default)s)")
    g.add_argument(
        "--api-key",
        default=os.environ.get("SPECDEC_API_KEY", ""),
        help="the orchestrator's --api-key, where it has one (env SPECDEC_API_KEY)",
    )
    g.add_argument(
        "--tls-ca",
        default=os.environ.get("SPECDEC_TLS_CA", ""),
        help="PEM CA file: connect over TLS, trusting the certificates it signed (env SPECDEC_TLS_CA)",
    )
    return g


def _generate(args) -> int:
    import grpc

    from specdec.v1 import generation_pb2 as pb, generation_pb2_grpc

    req = pb.GenerateRequest(stop=args.stop)
    if args.chat:
        req.messages.add(role="user", content=args.prompt)
    else:
        req.prompt = args.prompt
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        if getattr(args, name) is not None:
            setattr(req, name, getattr(args, name))
    if args.k is not None:
        req.num_speculative_tokens = args.k
    if args.prompt_lookup_min is not None:
        req.prompt_lookup_min = args.prompt_lookup_min
    metadata = [("authorization", f"Bearer {args.api_key}")] if args.api_key else None
    if args.tls_ca:
        from specdec.server import channel_credentials

        channel = grpc.secure_channel(args.address, channel_credentials(args.tls_ca))
    else:
        channel = grpc.insecure_channel(args.address)
    with channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            for msg in stub.Generate(req, timeout=args.timeout, metadata=metadata):
                sys.stdout.write(msg.text)
                sys.stdout.flush()
                if msg.HasField("stats"):
                    s = msg.stats
                    alpha = (
                        s.accepted_tokens / (s.accepted_tokens + s.rejected_rounds)
                        if s.accepted_tokens + s.rejected_rounds
                        else 0.0
                    )
                    print(
                        f"\n\n[{pb.FinishReason.Name(s.finish_reason)}] {s.completion_tokens} tokens in "
                        f"{s.total_seconds:.2f} s ({s.completion_tokens / max(s.total_seconds, 1e-9):.1f} tokens/s), "
                        f"first token {1000 * s.time_to_first_token_seconds:.0f} ms | {s.rounds} rounds, "
                        f"{s.mean_tokens_per_round:.2f} tokens/round, acceptance {s.accepted_tokens}/{s.draft_tokens} "
                        f"= {s.acceptance_rate:.2f}, alpha {alpha:.2f}"
                        + (
                            f", prompt lookup {s.lookup_accepted_tokens}/{s.lookup_tokens} in {s.lookup_rounds} rounds"
                            if s.lookup_rounds
                            else ""
                        )
                        + f" | seed {s.seed}",
                        file=sys.stderr,
                    )
        except grpc.RpcError as e:
            hint = (
                f" (is an orchestrator running at {args.address}? `specdec up` starts one)"
                if e.code() == grpc.StatusCode.UNAVAILABLE and "failed to connect" in (e.details() or "")
                else ""
            )
            print(f"\nspecdec generate: {e.code().name}: {e.details()}{hint}", file=sys.stderr)
            return 1
    return 0


def _health(args) -> int:
    from specdec.health import health_status

    status = health_status(args.address, args.service, args.timeout)
    print(f"{args.address}: {status}", file=sys.stdout if status == "SERVING" else sys.stderr)
    return 0 if status == "SERVING" else 1


def _health_arguments(h: argparse.ArgumentParser) -> argparse.ArgumentParser:
    h.add_argument("address", nargs="?", default="localhost:50051")
    h.add_argument("--service", default="", help="service name; empty for the whole server")
    h.add_argument("--timeout", type=float, default=3.0, help="seconds (default %(default)s)")
    return h


def _fetch_arguments(f: argparse.ArgumentParser) -> argparse.ArgumentParser:
    f.add_argument("models", nargs="+", help="hub ids; local folders and embedded models are skipped")
    return f


def _fetch(args) -> int:
    from cli.hub import fetch

    return fetch(args.models)


# Subcommands parsed and run without the services' configuration: `health` runs every few seconds in a container,
# `fetch` before the servers start. Neither imports torch.
_LIGHT = {"health": (_health_arguments, _health), "fetch": (_fetch_arguments, _fetch)}


def parser() -> argparse.ArgumentParser:
    from specdec.config import ROLE_DEFAULTS, ModelServerConfig, OrchestratorConfig, add_arguments

    p = argparse.ArgumentParser(prog="specdec", description="Speculative decoding as three gRPC services.")
    sub = p.add_subparsers(dest="command", required=True)
    _up_arguments(sub.add_parser("up", help="start draft, target and orchestrator here (foreground)"))
    for role in ("draft", "target"):
        s = sub.add_parser(role, help=f"start the {role} service")
        add_arguments(s, ModelServerConfig, ROLE_DEFAULTS[role])
    o = sub.add_parser("orchestrator", help="start the orchestrator")
    add_arguments(o, OrchestratorConfig)
    _generate_arguments(sub.add_parser("generate", help="stream a completion from a running orchestrator"))
    sub.add_parser("bench", help="measure the speedup side by side (specdec bench --help)", add_help=False)
    sub.add_parser(
        "gate",
        help="measure a target's quantized activations and float16 KV cache against float32, record the verdict",
        add_help=False,
    )
    _health_arguments(sub.add_parser("health", help="check a server's gRPC health service"))
    _fetch_arguments(sub.add_parser("fetch", help="download hub models into the Hugging Face cache"))
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the benchmark parses its own flags
        from bench.run import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["gate"]:  # bench.quality's flags, and its verdicts recorded
        from bench.quality import main as quality_main

        quality_main([*argv[1:], "--record"])
        return 0
    if argv[:1] and argv[0] in _LIGHT:  # without the services' configuration, which imports torch
        arguments, run = _LIGHT[argv[0]]
        return run(arguments(argparse.ArgumentParser(prog=f"specdec {argv[0]}")).parse_args(argv[1:]))
    from cli.hub import HubAccessError
    from specdec.config import ConfigError

    args = parser().parse_args(argv)
    try:
        if args.command in ("draft", "target"):
            _logging()
            return _serve_model(args.command, args)
        if args.command == "orchestrator":
            _logging()
            return _serve_orchestrator(args)
        if args.command == "up":
            return _up(args)
        return _generate(args)
    except (ConfigError, HubAccessError) as e:
        print(f"specdec {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
