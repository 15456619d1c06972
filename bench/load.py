"""specdec bench --concurrency 1,4,8,16: throughput and latency under load, side by side.

    specdec bench --concurrency 1,4,8,16 [--load-prompts 8] [--load-tokens 96] [--reps 3]
                  [--llama-server PATH/llama-server]

Starts the three services (and the adaptive orchestrator beside them, as `specdec bench` does) and, for
each concurrency N, runs the same list of chat requests (the prompts in turn, at least as many requests as
the largest N), greedy, N at a time: each of N clients sends its next request as soon as one ends, so N = 1
is one by one. Aggregate tokens/s is the tokens of the whole run over its wall time, per request tokens/s
each request's tokens over its own time; time to first token and inter-token latency come from the
streamed messages (a message of n tokens counts n gaps of its wait / n, so a speculative round's tokens
share its wait). Each N runs `reps` times per arm after one uncounted run of each, the arms alternating, each rep
starting from the next arm, so that the machine's drift hits all of them and no arm always follows the same one;
the report gives medians and the spread (min, max) over the runs, and the scaling over the same arm's N = 1 in
the same run.

Arms: K = 0 (the target alone) and `auto` (K left unset on the adaptive orchestrator: the K the system
chooses, which fades out where rows are dear). Greedy output must not change with load: every output is
compared with the same request's output at N = 1, and the report counts those that differ.

Given a llama.cpp `llama-server` binary, the same runs go to it on the same GGUF file as the embedded
target (`-np` parallel slots, continuous batching), through its /completion endpoint with the same token ids,
as the peer; both reuse the prompt prefixes they hold (llama-server's cache_prompt, its default; specdec's
prefix cache, --prefix-cache-tokens). It is optional and never needed by the tests.
"""

from __future__ import annotations

import http.client
import json
import os
import statistics
import subprocess
import threading
import time
from pathlib import Path

import grpc

from bench.metrics import scrape_all
from specdec.v1 import generation_pb2 as pb, generation_pb2_grpc

PEER = "llama-server"


def percentile(xs: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation; None for no data."""
    if not xs:
        return None
    xs = sorted(xs)
    i = (len(xs) - 1) * q / 100
    lo = int(i)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (i - lo)


def request_times(start: float, messages: list[tuple[float, int]], end: float) -> dict:
    """One request's figures from its streamed messages (arrival time, tokens carried)."""
    tokens = sum(n for _, n in messages)
    firsts = [t for t, n in messages if n]
    gaps, last = [], None
    for t, n in messages:
        if not n:
            continue
        if last is not None:
            gaps += [(t - last) / n] * n
        last = t
    return {"tokens": tokens, "seconds": end - start, "ttft": firsts[0] - start if firsts else None, "gaps": gaps}


def run_summary(requests: list[dict], wall_s: float) -> dict:
    """A run's figures: aggregate and per-request tokens/s, TTFT and inter-token latency percentiles."""
    tokens = sum(r["tokens"] for r in requests)
    gaps = [g for r in requests for g in r["gaps"]]
    ttfts = [r["ttft"] for r in requests if r["ttft"] is not None]
    return {
        "aggregate_tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "tokens": tokens,
        "wall_s": wall_s,
        "request_tokens_per_s": statistics.median(r["tokens"] / r["seconds"] for r in requests),
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p99": percentile(ttfts, 99),
        "itl_p50": percentile(gaps, 50),
        "itl_p99": percentile(gaps, 99),
    }


def run_jobs(send, jobs: list, workers: int) -> tuple[list[dict], float]:
    """send(job) for every job, `workers` at a time (each takes the next job as it finishes one); each job's
    result, and the wall time of them all."""
    results: list = [None] * len(jobs)
    errors: list = []
    lock, nxt = threading.Lock(), [0]

    def worker():
        while True:
            with lock:
                i, nxt[0] = nxt[0], nxt[0] + 1
            if i >= len(jobs):
                return
            try:
                results[i] = send(jobs[i])
            except Exception as e:  # reported below with the job
                errors.append((jobs[i], e))

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(workers)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(jobs)} requests failed; the first: {errors[0][1]!r}")
    return results, wall


def grpc_sender(
    address: str, k: int | None, max_tokens: int, temperature: float = 0.0, top_p: float = 1.0, ignore_eos=False
):
    """send(prompt) for run_jobs: one streamed Generate on a shared channel; returns its figures and ids.
    ignore_eos: every answer runs to max_tokens (a context that grows as long as asked)."""
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(address))

    def send(prompt: str) -> dict:
        req = pb.GenerateRequest(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=0, ignore_eos=ignore_eos
        )
        req.messages.add(role="user", content=prompt)
        if k is not None:
            req.num_speculative_tokens = k
        start, messages, ids = time.perf_counter(), [], []
        for msg in stub.Generate(req, timeout=900):
            messages.append((time.perf_counter(), len(msg.token_ids)))
            ids += msg.token_ids
        return {**request_times(start, messages, time.perf_counter()), "ids": ids}

    return send


class LlamaServer:
    """A llama.cpp llama-server on the target's GGUF file, with `slots` parallel slots (continuous batching)."""

    def __init__(self, binary: str, gguf: str, slots: int, threads: int, log_path: Path, context: int = 8192):
        from specdec.server import free_ports

        self.port = free_ports(1)[0]
        self.proc = subprocess.Popen(
            [
                binary,
                "-m",
                gguf,
                "-t",
                str(threads),
                "-np",
                str(slots),
                "-c",
                str(context),
                "--port",
                str(self.port),
                "--host",
                "127.0.0.1",
                "--no-webui",
            ],
            stdout=open(log_path, "w"),  # noqa: SIM115 - the server writes to it while it runs
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 300
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"llama-server did not start; see {log_path}")
            time.sleep(0.5)

    def _healthy(self) -> bool:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        except OSError:
            return False

    def sender(self, max_tokens: int):
        """send(token ids) for run_jobs: a streamed /completion of the same prompt tokens, greedy."""

        def send(ids: list[int]) -> dict:
            body = json.dumps(
                {
                    "prompt": ids,
                    "n_predict": max_tokens,
                    "temperature": 0.0,
                    "top_k": 1,
                    "stream": True,
                    "cache_prompt": True,
                    "return_tokens": True,
                }
            )
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=900)
            start, messages, out = time.perf_counter(), [], []
            conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            for line in resp:
                if not line.startswith(b"data: "):
                    continue
                chunk = json.loads(line[6:])
                tokens = chunk.get("tokens") or []
                messages.append((time.perf_counter(), len(tokens)))
                out += tokens
                if chunk.get("stop"):
                    break
            conn.close()
            return {**request_times(start, messages, time.perf_counter()), "ids": out}

        return send

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def chat_ids(tokenizer, prompt: str) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
    )


def run_load(arms: dict, prompts: list[str], concurrency: list[int], reps: int, progress=print) -> dict:
    """arms: name -> (send, job for a prompt). Every run sends the same jobs (the prompts in turn, at least as
    many as the largest N) through N workers at a time; N = 1 is one by one. `reps` runs per N and arm, the
    arms alternating, after one uncounted run of each arm at that N (an arm's first run at a new N ran up to 16%
    slower than its next, 2026-11-26). Each rep starts from the next arm in turn, so that no arm always runs after
    the same one (a run warms or loads the machine for the next). Outputs are compared with the same prompt's at
    N = 1."""
    jobs = [prompts[i % len(prompts)] for i in range(max(len(prompts), max(concurrency)))]
    out = {name: {} for name in arms}
    alone: dict[str, dict] = {name: {} for name in arms}
    for n in sorted(concurrency):
        runs = {name: [] for name in arms}
        for send, job in arms.values():
            run_jobs(send, [job(p) for p in jobs], n)
        names = list(arms)
        for rep in range(reps):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                send, job = arms[name]
                results, wall = run_jobs(send, [job(p) for p in jobs], n)
                summary = run_summary(results, wall)
                if n == min(concurrency):
                    for p, r in zip(jobs, results):
                        alone[name].setdefault(p, r["ids"])
                summary["differ_from_alone"] = sum(
                    r["ids"] != alone[name].get(p, r["ids"]) for p, r in zip(jobs, results)
                )
                runs[name].append(summary)
                progress(
                    f"  N = {n:2d} {name:>12}: {summary['aggregate_tokens_per_s']:7.1f} tokens/s aggregate, "
                    f"ITL p50 {1e3 * (summary['itl_p50'] or 0):.1f} ms, p99 {1e3 * (summary['itl_p99'] or 0):.1f} ms, "
                    f"{summary['differ_from_alone']} of {len(jobs)} outputs differ from alone"
                )
        for name in arms:
            out[name][n] = summarize(runs[name])
            out[name][n]["requests"] = len(jobs) * reps
    for name in arms:
        base = out[name][min(concurrency)]["aggregate_tokens_per_s"]["median"]
        for n in concurrency:
            agg = out[name][n]["aggregate_tokens_per_s"]
            out[name][n]["scaling"] = {key: agg[key] / base for key in ("median", "min", "max")} if base else None
    return out


def summarize(runs: list[dict]) -> dict:
    """Median and spread (min, max) of each figure over the runs; outputs that differ, summed."""
    out = {}
    for key in runs[0]:
        xs = [r[key] for r in runs if r[key] is not None]
        if key == "differ_from_alone" or key == "tokens":
            out[key] = sum(xs)
        elif xs:
            out[key] = {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}
    return out


def main(args, progress=print) -> dict:
    """Run the load benchmark as `specdec bench --concurrency ...` asked; writes load.json, load.md, load.png."""
    from bench.services import load_prompts, machine, start_services, stop_services
    from specdec import models

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    concurrency = sorted({int(c) for c in args.concurrency.split(",")})
    prompts = [p["prompt"] for p in load_prompts(args.load_prompts)]
    procs, address, urls, (auto_address, _), forward = start_services(
        args.draft_model, args.target_model, out_dir / "services.log"
    )
    peer = None
    try:
        arms = {
            "0": (grpc_sender(address, 0, args.load_tokens), lambda p: p),
            "auto": (grpc_sender(auto_address, None, args.load_tokens), lambda p: p),
        }
        if args.llama_server:
            gguf = models.gguf_file(args.target_model)
            if gguf is None:
                raise SystemExit("--llama-server needs an embedded target: it serves the same GGUF file")
            tokenizer = models.load_tokenizer(args.target_model)
            peer = LlamaServer(
                args.llama_server,
                gguf,
                slots=max(concurrency),
                threads=os.cpu_count() or 1,
                log_path=out_dir / "llama-server.log",
            )
            ids = {p: chat_ids(tokenizer, p) for p in prompts}
            arms[PEER] = (peer.sender(args.load_tokens), lambda p: ids[p])
        for send, job in arms.values():  # warm-up: the first run is not a cold start
            run_jobs(send, [job(prompts[0])], 1)
        results = run_load(arms, prompts, concurrency, args.reps, progress)
        passes = passes_by_way(scrape_all({job: urls[job] for job in ("draft", "target")}))
    finally:
        if peer is not None:
            peer.stop()
        stop_services(procs)
    report = {
        "machine": machine(),
        "forward": forward,
        "concurrency": concurrency,
        "prompts": len(prompts),
        "max_tokens": args.load_tokens,
        "reps": args.reps,
        "arms": results,
        "passes": passes,
    }
    (out_dir / "load.json").write_text(json.dumps(report, indent=1))
    (out_dir / "load.md").write_text(markdown(report))
    plot(report, out_dir / "load.png")
    return report


def _ms(x) -> str:
    return "" if x is None else f"{1e3 * x['median']:.1f}"


def passes_by_way(metrics: dict) -> dict:
    """Each model server's forward passes by how they ran (specdec_forward_passes_total: eager, or on a GPU graphed,
    in_turn, captured), the ways that ran."""
    out: dict = {}
    for (name, labels), n in metrics.items():
        if name == "specdec_forward_passes_total" and n:
            out.setdefault(dict(labels).get("job"), {})[dict(labels)["way"]] = n
    return out


def markdown(report: dict) -> str:
    m = report["machine"]
    where = f"{m['gpu']} (host: {m['cpu']}, {m['cores']} cores)" if m.get("gpu") else f"{m['cpu']} ({m['cores']} cores)"
    lines = [
        f"# specdec bench --concurrency: {where}, {m['date']}",
        "",
        f"{report['prompts']} chat prompts, greedy, up to {report['max_tokens']} tokens each, N requests at a "
        f"time; {report['reps']} runs per N and arm, median [min, max] over the runs.",
        "",
        "| arm | N | aggregate tokens/s | over N = 1 | per request tokens/s | TTFT p50 / p99 ms | "
        "ITL p50 / p99 ms | outputs that differ from alone |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, by_n in report["arms"].items():
        for n in report["concurrency"]:
            r = by_n[n]
            agg, sc = r["aggregate_tokens_per_s"], r.get("scaling")
            lines.append(
                f"| {name} | {n} | {agg['median']:.1f} [{agg['min']:.1f}, {agg['max']:.1f}] | "
                + (f"{sc['median']:.2f}x [{sc['min']:.2f}, {sc['max']:.2f}]" if sc else "")
                + " | "
                f"{r['request_tokens_per_s']['median']:.1f} | {_ms(r.get('ttft_p50'))} / {_ms(r.get('ttft_p99'))} | "
                f"{_ms(r.get('itl_p50'))} / {_ms(r.get('itl_p99'))} | {r['differ_from_alone']} of "
                f"{r['requests']} |"
            )
    if PEER in report["arms"]:
        lines += ["", "specdec over llama-server, aggregate tokens/s, same N:", ""]
        for name in report["arms"]:
            if name == PEER:
                continue
            ratios = [
                report["arms"][name][n]["aggregate_tokens_per_s"]["median"]
                / report["arms"][PEER][n]["aggregate_tokens_per_s"]["median"]
                for n in report["concurrency"]
            ]
            lines.append(
                f"- K = {name}: " + ", ".join(f"N = {n}: {r:.2f}x" for n, r in zip(report["concurrency"], ratios))
            )
    lines += ["", "Forward passes: " + "; ".join(f"{k}: {v}" for k, v in report["forward"].items())]
    if report.get("passes"):
        ran = "; ".join(
            f"{job}: " + ", ".join(f"{n:.0f} {way}" for way, n in ways.items())
            for job, ways in report["passes"].items()
        )
        lines += ["", f"How they ran over the whole benchmark: {ran}."]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, by_n in report["arms"].items():
        ns = report["concurrency"]
        agg = [by_n[n]["aggregate_tokens_per_s"] for n in ns]
        label = name if name == PEER else f"specdec, K = {name}"
        ax.errorbar(
            ns,
            [a["median"] for a in agg],
            yerr=[[a["median"] - a["min"] for a in agg], [a["max"] - a["median"] for a in agg]],
            marker="o",
            label=label,
        )
        ax2.plot(ns, [1e3 * by_n[n]["itl_p99"]["median"] for n in ns], marker="o", label=label)
    ax.set(xlabel="concurrent requests", ylabel="aggregate tokens/s", title="Throughput under load")
    ax2.set(xlabel="concurrent requests", ylabel="ms", title="Inter-token latency, p99")
    for a in (ax, ax2):
        a.set_xticks(report["concurrency"])
        a.grid(alpha=0.3)
        a.legend()
    fig.suptitle(f"{report['machine']['cpu']}, {report['machine']['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
