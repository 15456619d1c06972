"""specdec bench --production: c, the verify cost against K, and the projected speedup at production sizes.

    specdec bench --production [--device cuda] [--dtype bfloat16] [--context 512] [--overhead-ms 2.5]

Builds Llama-3.2-1B (the draft) and Llama-3.2-3B (the target) from their published
configurations with random weights: the real weights cannot be downloaded here, and
random weights take exactly as long. Times, with the runner the model servers use
(the lean Llama forward), after a prefill of --context tokens:
- one draft step and one target step: c = draft step / target step; the same for a
  one-layer head that reads the 3B's features (specdec/head.py, random weights too);
- one target pass over n = 1..9 new tokens: the verify cost of K = n - 1 drafts,
  relative to one step (about 1 while the pass is bound by reading the weights).
Then projects, for acceptance rates that Llama 3.2 1B/3B pairs are reported to reach
(alpha 0.6 to 0.9), the speedup at each K:

    tau(alpha, K) * target_step / (K * draft_step + verify(K) + overhead)

with the measured costs and the per-round orchestration and RPC overhead
(--overhead-ms; the main bench measures it on loopback, and it does not depend on the
models' size: a round's messages are a few KB), next to Leviathan's bound
(1 - alpha^(K+1)) / ((1 - alpha)(Kc + 1)). The speedups are projected, not measured,
and the report says so. Writes production.json and production.md under --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.metrics import expected_tokens_per_round, leviathan_bound
from specdec.head import head_weights, random_head
from specdec.runners.cuda_graphs import CudaGraphs

_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
}
_COMMON = dict(
    vocab_size=128256,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    hidden_act="silu",
    rope_parameters=_ROPE,
    bos_token_id=128000,
    eos_token_id=128009,
)
# the published config.json of meta-llama/Llama-3.2-{1B,3B}-Instruct
CONFIGS = {
    "Llama-3.2-1B": dict(
        _COMMON,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
    ),
    "Llama-3.2-3B": dict(
        _COMMON,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
    ),
}
PUBLISHED_ALPHAS = (0.6, 0.7, 0.8, 0.9)
# tokens a head scores: a quarter of Llama 3's 128,256, about the share the embedded head's 8,192 are of 49,152
HEAD_SCORED = 32768
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def shrink(cfg: dict, factor: int) -> dict:
    """The same architecture, every width divided by factor (a smoke check of the profile itself)."""
    small = dict(cfg)
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        small[key] = max(1, cfg[key] // factor)
    small["num_hidden_layers"] = max(1, cfg["num_hidden_layers"] // factor)
    small["head_dim"] = small["hidden_size"] // small["num_attention_heads"]
    small["num_key_value_heads"] = min(small["num_key_value_heads"], small["num_attention_heads"])
    small["bos_token_id"] = small["eos_token_id"] = 0
    return small


def build(cfg: dict, dtype: torch.dtype, device: str):
    """A LlamaForCausalLM with random weights, made directly in dtype on device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return LlamaForCausalLM(LlamaConfig(**cfg)).eval().requires_grad_(False)
    finally:
        torch.set_default_dtype(default)


def pass_ms(runner, n_new: int, context: int, reps: int, sync=lambda: None, warmup: int = 2) -> float:
    """Median time of one pass over n_new tokens after a prefill of context tokens (all n_new logits)."""
    cache = runner.new_cache()
    runner.forward(cache, [i % 1000 + 1 for i in range(context)], 1)
    times = []
    for r in range(reps + warmup):
        tokens = [(r * 7 + i) % 1000 + 1 for i in range(n_new)]
        sync()
        t = time.perf_counter()
        runner.forward(cache, tokens, n_new)
        sync()
        if r >= warmup:
            times.append(time.perf_counter() - t)
        runner.crop(cache, context)
    return 1000 * statistics.median(times)


def graph_pass_ms(runner, n_new: int, context: int, reps: int) -> float:
    """pass_ms as the model servers run one session's passes on a GPU: replayed as CUDA graphs
    (specdec.runners.cuda_graphs, captured on the first pass), so what is left is the GPU's own time and a replay's
    few launches. A pass that could not be captured raises, rather than timing the eager pass under this name."""
    runner.graphs = CudaGraphs(runner)
    try:
        ms = pass_ms(runner, n_new, context, reps, torch.cuda.synchronize)
        if runner.graphs.failed:
            raise RuntimeError(runner.graphs.failed)
        return ms
    finally:
        runner.graphs = None


def projected_speedup(alpha: float, k: int, draft_ms: float, verify_ms: dict[int, float], overhead_ms: float) -> float:
    """Tokens per round over a round's measured cost, against the target alone (one step per token)."""
    if k == 0:
        return 1.0
    return expected_tokens_per_round(alpha, k) * verify_ms[0] / (k * draft_ms + verify_ms[k] + overhead_ms)


def summarize(timings: dict, overhead_ms: float, max_k: int) -> dict:
    """c, the verify cost against K, and the projection at published alphas, from {role: {K: ms}}."""
    draft_ms, verify_ms = timings["draft"][0], timings["target"]
    c = draft_ms / verify_ms[0]
    projection = {}
    for alpha in PUBLISHED_ALPHAS:
        rows = {
            k: {
                "projected": projected_speedup(alpha, k, draft_ms, verify_ms, overhead_ms),
                "leviathan_bound": leviathan_bound(alpha, k, c),
            }
            for k in range(1, max_k + 1)
        }
        best = max(rows, key=lambda k: rows[k]["projected"])
        projection[str(alpha)] = {
            "per_k": {str(k): v for k, v in rows.items()},
            "best_k": best,
            "best_projected": rows[best]["projected"],
        }
    return dict(
        draft_step_ms=draft_ms,
        target_step_ms=verify_ms[0],
        c=c,
        verify_ms={str(k): v for k, v in verify_ms.items()},
        verify_over_step={str(k): v / verify_ms[0] for k, v in verify_ms.items()},
        projection=projection,
    )


def profile(
    device: str, dtype: str, context: int, reps: int, overhead_ms: float, max_k: int = 8, shrink_by: int = 1
) -> dict:
    from specdec.runners import make_runner

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    cfgs = {name: (shrink(cfg, shrink_by) if shrink_by > 1 else cfg) for name, cfg in CONFIGS.items()}
    result = {
        "device": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
        "dtype": dtype,
        "context": context,
        "reps": reps,
        "overhead_ms": overhead_ms,
        "shrunk_by": shrink_by,
        "models": {
            name: {k: cfg[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size")}
            for name, cfg in cfgs.items()
        },
    }
    timings, graphs = {}, {}
    for role, name in (("draft", "Llama-3.2-1B"), ("target", "Llama-3.2-3B")):
        model = build(cfgs[name], DTYPES[dtype], device)
        result["models"][name]["parameters"] = sum(p.numel() for p in model.parameters())
        runners = {role: make_runner(model, cfgs[name]["vocab_size"], context + 64, "auto")}
        if role == "target":  # the draft issue 41 builds for it: one layer that reads its features
            drafter = head_for(model)
            result["models"]["head"] = {"parameters": head_parameters(drafter), "scored": len(head_scored(model))}
            runners["head"] = make_runner(drafter, cfgs[name]["vocab_size"], context + 64, "auto", device=device)
        for each, runner in runners.items():
            ks = range(max_k + 1) if each == "target" else (0,)
            timings[each] = {k: pass_ms(runner, k + 1, context, reps, sync) for k in ks}  # K drafts: K + 1 tokens
            if device.startswith("cuda") and graphs is not None:
                try:
                    graphs[each] = {k: graph_pass_ms(runner, k + 1, context, reps) for k in ks}
                except Exception as e:  # the eager profile stands on its own; say why the graphs are missing
                    result["graphs_error"] = f"{type(e).__name__}: {e}"
                    graphs = None
        del runners, model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    result.update(summarize(timings, overhead_ms, max_k))
    result["head"] = summarize({"draft": timings["head"], "target": timings["target"]}, overhead_ms, max_k)
    if graphs:
        result["graphs"] = summarize(graphs, overhead_ms, max_k)
        result["head_graphs"] = summarize({"draft": graphs["head"], "target": graphs["target"]}, overhead_ms, max_k)
    return result


def head_scored(target) -> range:
    """The tokens a head for target scores: HEAD_SCORED of them (the first ids here; a trained head keeps the most
    frequent, training.head --scored-tokens), as the embedded head scores 8,192 of 49,152."""
    return range(min(HEAD_SCORED, target.config.vocab_size))


def head_for(target):
    """A one-layer head (specdec/head.py, EAGLE-1 style) for target with random weights: the target's attention
    layout and MLP width, fc over [embedding ; feature], the target's output rows over head_scored."""
    return random_head(target, "Llama-3.2-3B", output_token_ids=head_scored(target))


def head_parameters(drafter) -> int:
    """A head's own parameters: fc, its layer and norm (the embedding and the output rows are the target's)."""
    return sum(t.numel() for t in head_weights(drafter).values())


def _section(r: dict, overhead_ms: float) -> list[str]:
    ks = list(r["verify_ms"])
    lines = [
        f"Draft step {r['draft_step_ms']:.2f} ms, target step {r['target_step_ms']:.2f} ms: **c = {r['c']:.3f}**.",
        "",
        "| K (tokens in the verify pass) | " + " | ".join(f"{k} ({int(k) + 1})" for k in ks) + " |",
        "|---|" + "---|" * len(ks),
        "| verify ms | " + " | ".join(f"{r['verify_ms'][k]:.2f}" for k in ks) + " |",
        "| verify / one step | " + " | ".join(f"{r['verify_over_step'][k]:.2f}" for k in ks) + " |",
        "",
        f"**Projected** speedup (not measured): measured costs, {overhead_ms} ms of RPC overhead per round, "
        "and published acceptance rates; Leviathan's bound in brackets.",
        "",
        "| alpha | " + " | ".join(f"K = {k}" for k in ks[1:]) + " | best |",
        "|---|" + "---|" * len(ks),
    ]
    for alpha, p in r["projection"].items():
        cells = [f"{v['projected']:.2f}x [{v['leviathan_bound']:.2f}]" for v in p["per_k"].values()]
        lines.append(f"| {alpha} | " + " | ".join(cells) + f" | {p['best_projected']:.2f}x (K = {p['best_k']}) |")
    return lines


def markdown(r: dict) -> str:
    lines = [
        f"# specdec production-size profile ({time.strftime('%Y-%m-%d')})",
        "",
        "Llama-3.2-1B drafting for Llama-3.2-3B, built from their published configurations with random weights"
        + (f" shrunk {r['shrunk_by']}x (a smoke check, not production sizes)" if r["shrunk_by"] > 1 else "")
        + f"; {r['dtype']} on {r['device']}; lean forward; context {r['context']} tokens; medians of {r['reps']}.",
        "",
        "## Eager (how specdec's model servers run today: one Python call per kernel)",
        "",
    ]
    lines += _section(r, r["overhead_ms"])
    if "graphs" in r:
        lines += ["", "## Each pass replayed as a CUDA graph (how vLLM and TGI run decode steps)", ""]
        lines += _section(r["graphs"], r["overhead_ms"])
    elif "graphs_error" in r:
        lines += ["", f"CUDA graphs: not measured ({r['graphs_error']})."]
    head = r["models"]["head"]
    lines += [
        "",
        f"## A one-layer head drafting for the 3B (specdec/head.py: {head['parameters'] / 1e6:.1f} M parameters of its"
        f" own, the target's output rows over {head['scored']} tokens; the target's verify without its features)",
        "",
        "Eager:",
        "",
        *_section(r["head"], r["overhead_ms"]),
    ]
    if "head_graphs" in r:
        lines += ["", "As CUDA graphs:", "", *_section(r["head_graphs"], r["overhead_ms"])]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="specdec bench --production", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--context", type=int, default=512, help="tokens already in the cache when timing")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--max-k", type=int, default=8)
    ap.add_argument(
        "--overhead-ms",
        type=float,
        default=2.5,
        help="orchestration + RPC per round (default: the CPU bench's median, loopback)",
    )
    ap.add_argument("--shrink", type=int, default=1, help="divide every width by this (a smoke check)")
    ap.add_argument("--out", default=None, help="results folder (default results/production-DATE)")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    out = Path(args.out or f"results/production-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    r = profile(args.device, args.dtype, args.context, args.reps, args.overhead_ms, args.max_k, args.shrink)
    (out / "production.json").write_text(json.dumps(r, indent=2))
    (out / "production.md").write_text(markdown(r))
    print(markdown(r))
    print(f"wrote {out}/production.json, production.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
