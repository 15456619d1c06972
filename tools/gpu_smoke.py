"""The first run on a GPU: the three services on CUDA, checked end to end through the orchestrator.

  python tools/gpu_smoke.py                              the embedded pair, cuda, bfloat16
  python tools/gpu_smoke.py --target meta-llama/Llama-3.2-3B-Instruct --draft meta-llama/Llama-3.2-1B-Instruct
  python tools/gpu_smoke.py --lanes 1                    several sessions' graphs replayed one after another
  python tools/gpu_smoke.py --device cpu --dtype float32 --max-tokens 8     the same checks on CPU (its test)

It prints torch, CUDA and the card, and the models in the local caches; starts `specdec up` on the device, with
--strict-attention on CUDA so that the model servers hold attention to the fused SDPA kernels (flash or
memory-efficient) and a fall back to the math kernel raises; sends greedy and seeded sampled requests alone, then
--concurrency of them at once; checks that greedy output equals the target alone's (K = 0) token for token where the
kernels are batch-invariant (float32 on a CPU; elsewhere it counts the outputs that differ), and that a seed
reproduces its sample; prints each server's pass costs and the rounds' costs. Exit status 0 when every check
passed, 1 when one failed, 2 when the services could not start.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from specdec.server import up_environment  # noqa: E402

PROMPTS = ["Write a haiku about the sea.", "List three uses of a paperclip, one line each."]
SAMPLED = dict(temperature=0.7, top_p=0.9)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_smoke", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", help="target model: hub id, folder or embedded:NAME (default: the embedded target)")
    p.add_argument("--draft", help="draft model (default: the embedded draft)")
    p.add_argument("--device", default="cuda", help="default %(default)s")
    p.add_argument("--dtype", default="bfloat16", help="default %(default)s")
    p.add_argument(
        "-k",
        "--num-speculative-tokens",
        dest="k",
        type=int,
        default=4,
        help="K of the speculative requests (default %(default)s, the GPU profile's)",
    )
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default %(default)s)")
    p.add_argument("--concurrency", type=int, default=8, help="requests sent at once (default %(default)s)")
    p.add_argument(
        "--sdpa-strict",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the model servers with --strict-attention (default: on a CUDA device)",
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=1800.0,
        help="seconds for the services to start, downloads included (default %(default)s)",
    )
    p.add_argument("--lanes", type=int, help="both servers' --cuda-graph-lanes (default: the servers')")
    p.add_argument("--log", type=Path, help="the services' log (default: a temporary file, printed)")
    args = p.parse_args(argv)
    if args.sdpa_strict is None:
        args.sdpa_strict = args.device.startswith("cuda")
    if min(args.k, args.max_tokens, args.concurrency, 1 if args.lanes is None else args.lanes) < 1:
        p.error("-k, --max-tokens, --concurrency and --lanes must be >= 1")
    return args


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where two token sequences differ (the shorter one's end counts), None when equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ---- 1) the machine ---------------------------------------------------------------------------------------------


def describe_machine(device: str) -> str | None:
    """Print torch, CUDA, the card and the cached models; the reason the device cannot run, else None."""
    import torch

    print(
        f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"cuDNN {torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}"
    )
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            print(
                f"cuda:{i} {props.name}, compute capability {props.major}.{props.minor}, "
                f"{props.total_memory / 2**30:.1f} GiB, bf16 {torch.cuda.is_bf16_supported()}, "
                f"flash SDPA {torch.backends.cuda.flash_sdp_enabled()}"
            )
    else:
        print("no CUDA device")
    print("models in the Hugging Face cache:")
    from huggingface_hub import constants, scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        repos = sorted(scan_cache_dir().repos, key=lambda r: r.repo_id)
    except CacheNotFound:
        repos = []
    for repo in repos:
        print(f"  {repo.repo_id} ({repo.repo_type}, {repo.size_on_disk / 2**30:.2f} GiB)")
    if not repos:
        print(f"  none in {constants.HF_HUB_CACHE}")
    from specdec.models import cache_dir

    converted = sorted(p.name for p in (cache_dir() / "models").glob("*") if (p / "config.json").exists())
    print(f"embedded models converted in {cache_dir() / 'models'}: {', '.join(converted) or 'none'}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        return f"--device {device}, but torch {torch.__version__} sees no CUDA device"
    return None


# ---- 2) the services ---------------------------------------------------------------------------------------------


def launch(args: argparse.Namespace, ports: list[int], environ: dict) -> tuple[list[str], dict]:
    """The command line and environment of `specdec up` on ports (orchestrator, draft, target, their three metrics
    ports, the HTTP API)."""
    env = dict(environ, **up_environment(ports), SPECDEC_ORCHESTRATOR_MAX_SPECULATIVE_TOKENS=str(max(8, args.k)))
    if args.sdpa_strict:
        env["SPECDEC_TARGET_STRICT_ATTENTION"] = env["SPECDEC_DRAFT_STRICT_ATTENTION"] = "true"
    if args.lanes is not None:
        env["SPECDEC_TARGET_CUDA_GRAPH_LANES"] = env["SPECDEC_DRAFT_CUDA_GRAPH_LANES"] = str(args.lanes)
    argv = [sys.executable, "-m", "cli.main", "up", "--device", args.device, "--dtype", args.dtype]
    argv += ["--target-model", args.target] if args.target else []
    argv += ["--draft-model", args.draft] if args.draft else []
    return argv, env


class Services:
    """`specdec up` on free loopback ports, as a user starts it."""

    def __init__(self, args: argparse.Namespace, log_path: Path):
        from specdec.server import free_ports

        ports = free_ports(7)
        argv, env = launch(args, ports, os.environ)
        o, d, t, om, dm, tm, _ = ports
        self.address, self.draft, self.target = f"127.0.0.1:{o}", f"127.0.0.1:{d}", f"127.0.0.1:{t}"
        self.metrics = {
            None: f"http://127.0.0.1:{om}/metrics",
            "draft": f"http://127.0.0.1:{dm}/metrics",
            "target": f"http://127.0.0.1:{tm}/metrics",
        }
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop(), once the services have exited
        self.proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_serving(self, timeout_s: float) -> str | None:
        """None once the orchestrator serves; else why not."""
        from specdec.health import health_status

        deadline = time.monotonic() + timeout_s
        while health_status(self.address, timeout=1) != "SERVING":
            if self.proc.poll() is not None:
                return f"specdec up exited with status {self.proc.returncode}"
            if time.monotonic() > deadline:
                return f"the services did not serve within {timeout_s:.0f} s"
            time.sleep(1)
        return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


# ---- 3) the requests ----------------------------------------------------------------------------------------------


def generate(address: str, prompt: str, **fields) -> tuple[list[int], str, object]:
    """One chat request through the orchestrator's Generate: (token ids, text, stats)."""
    from specdec.v1 import generation_pb2 as pb, generation_pb2_grpc

    request = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=prompt)], **fields)
    ids, text, stats = [], "", None
    with grpc.insecure_channel(address) as channel:
        for msg in generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=600):
            ids.extend(msg.token_ids)
            text += msg.text
            if msg.HasField("stats"):
                stats = msg.stats
    return ids, text, stats


class Checks:
    """exact: whether greedy output must equal K = 0's token for token (the batch-invariant float32 CPU kernels);
    elsewhere a near-tie between the two best tokens can break either way, and the outputs that differ are
    counted (python -m bench.exactness measures the rate)."""

    def __init__(self, exact: bool = True):
        self.failed: list[str] = []
        self.exact = exact
        self.greedy = self.differ = 0

    def __call__(self, name: str, ok: bool, detail: str = "") -> bool:
        print(f"{'ok  ' if ok else 'FAIL'} {name}" + (f": {detail}" if detail else ""))
        if not ok:
            self.failed.append(name)
        return ok


def tokens_per_s(stats) -> float:
    return stats.completion_tokens / max(stats.total_seconds, 1e-9)


def compare_greedy(check: Checks, name: str, got: list[int], ref: list[int], texts: tuple[str, str]) -> None:
    at = first_divergence(got, ref)
    detail = "" if at is None else f"differs from K = 0 at token {at}: {texts[0]!r} vs {texts[1]!r}"
    check.greedy += 1
    check.differ += at is not None
    if at is None or check.exact:
        check(name, at is None and len(got) > 0, detail)
    else:
        check(name, len(got) > 0, f"{detail} (a near-tie off the batch-invariant kernels: counted, not failed)")


def run_requests(services: Services, args: argparse.Namespace, check: Checks) -> None:
    address, n, k = services.address, args.max_tokens, args.k
    greedy = dict(max_tokens=n, temperature=0.0, prompt_lookup_min=0)
    # what a first user waits for once the services serve; the requests after it are timed warm
    t = time.perf_counter()
    first = generate(address, PROMPTS[1], **dict(greedy, max_tokens=8), num_speculative_tokens=k)
    print(f"     the first request after start-up: {len(first[0])} tokens in {time.perf_counter() - t:.2f} s")
    # the target alone, the reference of every greedy request
    ref = {p: generate(address, p, num_speculative_tokens=0, **greedy) for p in PROMPTS}
    for p, (ids, _, stats) in ref.items():
        check(
            f"K = 0 greedy {p[:24]!r}",
            len(ids) > 0 and stats is not None and stats.draft_tokens == 0,
            f"{len(ids)} tokens in {stats.total_seconds:.2f} s",
        )
    # alone
    speculative = dict(greedy, num_speculative_tokens=k)
    for p in PROMPTS:
        ids, text, stats = generate(address, p, **speculative)
        compare_greedy(check, f"K = {k} greedy alone {p[:24]!r}", ids, ref[p][0], (text, ref[p][1]))
        ratio = tokens_per_s(stats) / max(tokens_per_s(ref[p][2]), 1e-9)
        print(
            f"     {stats.completion_tokens} tokens in {stats.total_seconds:.2f} s, {ratio:.2f}x K = 0's tokens/s; "
            f"{stats.mean_tokens_per_round:.2f} tokens/round, acceptance {stats.acceptance_rate:.2f}"
        )
    sampled = dict(max_tokens=n, num_speculative_tokens=k, prompt_lookup_min=0, seed=7, **SAMPLED)
    first, second = (generate(address, PROMPTS[0], **sampled) for _ in range(2))
    check(
        f"K = {k} sampled alone, seed 7",
        len(first[0]) > 0 and first[2].draft_tokens > 0,
        f"{len(first[0])} tokens, acceptance {first[2].acceptance_rate:.2f}",
    )
    check(
        "the same seed samples the same tokens",
        first[0] == second[0],
        "" if first[0] == second[0] else f"differ at token {first_divergence(first[0], second[0])}",
    )
    check_structured(address, k, n, check)
    # at once: greedy and sampled alternate, each greedy one checked against K = 0 alone
    jobs = [
        (PROMPTS[i // 2 % len(PROMPTS)], speculative if i % 2 == 0 else dict(sampled, seed=100 + i))
        for i in range(args.concurrency)
    ]
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(generate, address, p, **f) for p, f in jobs]
        results = []
        for future in futures:
            try:
                results.append(future.result())
            except grpc.RpcError as e:
                results.append(e)
    for i, ((p, f), result) in enumerate(zip(jobs, results)):
        name = f"{args.concurrency} at once, #{i} {'greedy' if f is speculative else 'sampled'}"
        if isinstance(result, grpc.RpcError):
            check(name, False, f"{result.code().name}: {result.details()}")
        elif f is speculative:
            compare_greedy(check, name, result[0], ref[p][0], (result[1], ref[p][1]))
        else:
            check(name, len(result[0]) > 0)


SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}


def check_structured(address: str, k: int, n: int, check: Checks) -> None:
    """A JSON schema as the grammar, with speculation, greedy and sampled: the output rules run on the device's rows
    (masks on the host, the rows crossing once): greedy equals K = 0 under the same grammar, and both parse."""
    import importlib.util

    from specdec.v1 import generation_pb2 as pb, model_server_pb2 as ms_pb

    if importlib.util.find_spec("llguidance") is None:  # requirements/gpu.txt has it; a bare machine may not
        print("  skip structured output: llguidance is not installed (pip install llguidance==1.9.1)")
        return
    prompt = "The weather in Oslo for the next days, as JSON."
    # room for the whole answer (about 15 tokens), whatever --tokens the other checks run
    rules = dict(grammar=ms_pb.Grammar(json_schema=json.dumps(SCHEMA)), prompt_lookup_min=0, max_tokens=max(n, 48))
    try:
        ref = generate(address, prompt, num_speculative_tokens=0, temperature=0.0, **rules)
        got = generate(address, prompt, num_speculative_tokens=k, temperature=0.0, **rules)
        sampled = generate(address, prompt, num_speculative_tokens=k, seed=3, **SAMPLED, **rules)
    except grpc.RpcError as e:  # a grammar refused or failed fails this check; the checks after it still run
        check("structured output", False, f"{e.code().name}: {e.details()[:300]}")
        return
    compare_greedy(check, f"K = {k} greedy under a JSON schema", got[0], ref[0], (got[1], ref[1]))
    for name, (_, text, stats) in (("greedy", got), ("sampled", sampled)):
        try:
            valid = set(json.loads(text)) == {"city", "days"}
        except ValueError:
            valid = False
        ended = stats.finish_reason == pb.FINISH_REASON_EOS_TOKEN  # the grammar ended it
        check(f"the {name} answer under a JSON schema ends and parses", valid and ended, repr(text[:80]))


# ---- 4) the costs -------------------------------------------------------------------------------------------------


PASSES = "specdec_forward_passes_total"  # by way: eager, graphed, in_turn, captured


def print_costs(services: Services) -> None:
    """Each model server's pass costs by width (GetModelInfo), and the rounds' split from the metrics."""
    from bench.metrics import mean_step_s, scrape_all, value
    from specdec.v1 import draft_pb2_grpc, model_server_pb2, target_pb2_grpc

    for role, address, stub in (
        ("draft", services.draft, draft_pb2_grpc.DraftServiceStub),
        ("target", services.target, target_pb2_grpc.TargetServiceStub),
    ):
        with grpc.insecure_channel(address) as channel:
            info = stub(channel).GetModelInfo(model_server_pb2.GetModelInfoRequest(), timeout=30)
        costs = ", ".join(f"{c.rows}: {1000 * c.seconds:.2f}" for c in info.pass_costs)
        print(f"{role}: {info.model} on {info.device} in {info.dtype}; {info.forward}")
        print(f"  pass ms by rows: {costs or 'none yet'}")
    graphs = [line for line in services.log_path.read_text().splitlines() if "CUDA graph" in line]
    print("\n".join(graphs) or "no CUDA graph captured")
    m = scrape_all(services.metrics)
    draft_step, target_step = mean_step_s(m, "draft"), mean_step_s(m, "target")
    rounds = value(m, "specdec_round_phase_seconds_count", phase="verify") or 1.0
    phases = {
        ph: 1000 * value(m, "specdec_round_phase_seconds_sum", phase=ph) / rounds
        for ph in ("draft", "verify", "queue", "accept", "rpc")
    }
    print(
        f"step ms: draft {1000 * draft_step:.2f}, target {1000 * target_step:.2f}; "
        f"c = {draft_step / target_step if target_step else 0:.3f}"
    )
    ways = sorted((dict(k[1]).get("job", ""), dict(k[1])["way"], n) for k, n in m.items() if k[0] == PASSES)
    print("passes by way: " + (", ".join(f"{job} {way} {n:.0f}" for job, way, n in ways) or "none counted"))
    whole = 1000 * value(m, "specdec_round_seconds_sum") / max(value(m, "specdec_round_seconds_count"), 1)
    print(
        f"round ms ({rounds:.0f} decoding rounds): "
        + ", ".join(f"{ph} {ms:.2f}" for ph, ms in phases.items())
        + f"; whole round {whole:.2f}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reason = describe_machine(args.device)
    if reason:
        print(f"gpu_smoke: {reason}", file=sys.stderr)
        return 2
    log_path = args.log or Path(tempfile.mkstemp(prefix="gpu_smoke-", suffix=".log")[1])
    print(f"services' log: {log_path}")
    services = Services(args, log_path)
    check = Checks(exact=args.device == "cpu" and args.dtype == "float32")
    try:
        reason = services.wait_serving(args.startup_timeout)
        if reason:
            print(f"gpu_smoke: {reason}; the log's end:\n{log_path.read_text()[-4000:]}", file=sys.stderr)
            return 2
        run_requests(services, args, check)
        print_costs(services)
    except grpc.RpcError as e:
        check("requests", False, f"{e.code().name}: {e.details()}")
    finally:
        services.stop()
    print(f"greedy outputs that differ from K = 0's: {check.differ} of {check.greedy}")
    check("services stopped cleanly", services.proc.returncode == 0, f"specdec up exited {services.proc.returncode}")
    print(f"gpu_smoke: {'all checks passed' if not check.failed else 'FAILED: ' + ', '.join(check.failed)}")
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
