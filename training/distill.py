"""Distil a small draft from the embedded target, end to end and reproducibly.

    python -m training.distill [--gen-minutes 50] [--train-minutes 45] [--out models/smollm2-draft]

The defaults are the recipe of the shipped draft: about 96 minutes on a 2-core CPU.

Stages (each cached under ~/.cache/specdec/distill, so a rerun resumes):
1. data: the target answers generated instruction prompts (60% greedy, 40% at
   T = 0.7, top_p 0.9) with a batched forward, bf16 where the CPU multiplies it in
   hardware and fp32 elsewhere; its top-20 log-probs at every generated position
   are kept as soft labels. With --data-from draft --init DRAFT the data is on-policy
   instead: DRAFT answers the prompts and the target labels each answer in one
   teacher-forced pass (4-5x the labelled tokens per minute of generating them).
2. train: a small Llama with the target's tokenizer, cut from the target itself
   (training/slice.py: its 6 most influential layers, rotated onto the 252 main
   directions of its residual stream, 1024 MLP neurons each), learns the target's
   soft labels (KL on the top-20, renormalised) plus a little hard-label loss; its
   output layer covers only the most frequent tokens of the target's answers
   (q = 0 elsewhere: sampling stays exact).
3. eval: agreement on held-out prompts (subjects and code tasks the training never saw).
4. save: safetensors (bf16) and config in --out, loadable with from_pretrained.
Fixed seeds throughout; uses CUDA when available (--device auto): data and training there, slicing on the CPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import torch

from specdec import models
from specdec.runners import gated_activations, resolve_kv_cache
from specdec.runners.lean_llama import LeanLlamaRunner
from training import batched
from training.common import SEED, log
from training.prompts import VERSION as PROMPTS_VERSION, make_prompts


def work_dir() -> Path:
    d = models.cache_dir() / "distill"
    d.mkdir(parents=True, exist_ok=True)
    return d


def compute_dtype(device: str) -> str:
    """On CPU, bf16 where it is in hardware (AMX: batched generation at 475 tokens/s), else fp32 (an
    AVX2-only CPU emulates bf16: 22 tokens/s against 190 in fp32). On a GPU fp32, the precision the target
    is served in here: a 135M model at batch 512 is bound by launches, not by its arithmetic."""
    return "bfloat16" if device == "cpu" and models.cpu_has_native_bf16() else "float32"


def pick_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def chat_prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    """make_prompts(n, seed), each once (a large n repeats prompts: 60,000 hold about 32,000 distinct),
    in the template's token ids."""
    seen, out = set(), []
    for m in make_prompts(n, seed):
        key = json.dumps(m)
        if key not in seen:
            seen.add(key)
            out.append(tokenizer.apply_chat_template(m, add_generation_prompt=True, return_dict=True)["input_ids"])
    return out


def add_activations_argument(ap) -> None:
    """--activations: the target's numbers for its answers on a CPU (training.distill and training.head)."""
    ap.add_argument(
        "--activations",
        default="auto",
        choices=["auto", "float32", "int8", "int16"],
        help="the target's numbers for the data on a CPU: auto, as a target server takes them here (int16 where the "
        "CPU has AVX-512 VNNI and the file passed the quality gate, else float32); int8, its answers agreeing with "
        "float32's on about 97%% of tokens (docs/performance.md, items 16 and 22)",
    )


def stage_data(args, tokenizer) -> list[Path]:
    """One cached file per part; part i answers its own prompts (seed SEED + i). With --data-from draft,
    the parts are the draft's own answers labelled by the target (seeds SEED + ON_POLICY_SEED + i)."""
    make = _draft_part if args.data_from == "draft" else _data_part
    return [make(args, tokenizer, part) for part in range(args.data_parts)]


def _data_part(args, tokenizer, part: int) -> Path:
    seed = SEED + part
    features = getattr(args, "features", False)  # training/head.py: the target's features at every position too
    spec = getattr(args, "target", models.DEFAULT_TARGET)  # training/head.py --target: another target's answers
    # on a CPU the target answers in the forms it is served in (its GGUF blocks and specdec's kernels, the step's
    # rows in one pass: 3.1x the padded float32 forward, 4.9x with 16-bit activations, bench/datagen.py), and a
    # head reads the features it is served; the padded forward serves a GPU
    served = args.device == "cpu"
    activations = getattr(args, "activations", "auto") if served else "float32"
    gguf = models.gguf_file(spec) if served else None
    if activations == "auto":  # as a target server takes it here
        activations = gated_activations(gguf)
    kv_cache = resolve_kv_cache("auto", "target", activations, gguf)  # and its KV cache
    tags = ["distinct", "features"] if features else ["distinct"]
    tags += [spec] if spec != models.DEFAULT_TARGET else []
    tags += [f"served-{activations}"] if served else []
    tags += [f"kv-{kv_cache}"] if kv_cache != "model" else []
    key = hashlib.sha256(json.dumps([args.num_prompts, args.max_new, seed, PROMPTS_VERSION, *tags]).encode())
    key = key.hexdigest()[:10]
    path = work_dir() / f"data-{key}.pt"
    if path.exists():
        log(f"data: cached {path}")
        return path
    target = models.load_model(spec, dtype="float32" if served else compute_dtype(args.device), device=args.device)
    runner = LeanLlamaRunner(target, len(tokenizer), 4096, gguf=gguf, activations=activations, kv_cache=kv_cache)
    prompts = chat_prompts(tokenizer, args.num_prompts, seed)
    eos = set(models.eos_token_ids(target, tokenizer))
    deadline = time.monotonic() + 60 * args.gen_minutes
    n_greedy = int(0.6 * len(prompts))
    records = []
    for mode, (lo, hi), temperature in (("greedy", (0, n_greedy), 0.0), ("sampled", (n_greedy, len(prompts)), 0.7)):
        # each mode gets its share of the time budget
        share = deadline if mode == "sampled" else time.monotonic() + 0.6 * (deadline - time.monotonic())
        log(f"data: {mode} answers for {hi - lo} prompts")
        got = batched.generate_all(
            runner,
            prompts[lo:hi],
            args.max_new,
            temperature,
            0.9,
            eos,
            seed + lo,
            args.batch_size,
            deadline=share,
            log=log,
            features=features,
            served=served,
        )
        for i, (ids, top_i, top_v, *feats) in got.items():
            rec = {"prompt": prompts[lo + i], "completion": ids, "top_ids": top_i, "top_logp": top_v, "mode": mode}
            records.append(rec | ({"feats": feats[0]} if features else {}))
    torch.save(records, path)
    log(f"data: {len(records)} answers, {sum(len(r['completion']) for r in records)} tokens -> {path}")
    return path


ON_POLICY_SEED = 1000  # on-policy parts answer prompts no target part answers
ON_POLICY_GREEDY = 0.2  # share of the draft's answers that are greedy (the rest at T = 0.7, top_p 0.9)
SCORE_ROWS = 16  # answers per labelling pass of the target (the fastest batch measured here)


def _draft_part(args, tokenizer, part: int) -> Path:
    """On-policy data: the draft answers fresh prompts itself (about 1,400-2,100 tokens/s batched here) and
    the target labels every answer token in one teacher-forced pass (about 560 tokens/s, against 190-250
    for generating with the target). The contexts are the draft's, as in DistillSpec (Zhou et al., 2023):
    the target's top-20 at each of them is the soft label, and its top token the hard label (the draft's
    own token would teach it its own guesses)."""
    if not args.init:
        raise SystemExit("--data-from draft needs --init: the draft whose answers are labelled")
    weights = Path(args.init) / "model.safetensors"
    draft_key = hashlib.sha256(weights.read_bytes()).hexdigest()[:10]
    seed = SEED + ON_POLICY_SEED + part
    key = hashlib.sha256(
        json.dumps([args.num_prompts, args.max_new, seed, PROMPTS_VERSION, draft_key, "distinct"]).encode()
    )
    path = work_dir() / f"onpolicy-{key.hexdigest()[:10]}.pt"
    if path.exists():
        log(f"data: cached {path}")
        return path
    draft_model = models.load_model(args.init, dtype="float32", device=args.device)
    draft = LeanLlamaRunner(draft_model, len(tokenizer), 4096)
    target = models.load_model(models.DEFAULT_TARGET, dtype=compute_dtype(args.device), device=args.device)
    target = LeanLlamaRunner(target, len(tokenizer), 4096)
    eos = set(models.eos_token_ids(draft_model, tokenizer))
    prompts = chat_prompts(tokenizer, args.num_prompts, seed)
    prompts = [prompts[i] for i in batched.budget_order([len(p) for p in prompts], args.batch_size, seed)]
    deadline = time.monotonic() + 60 * args.gen_minutes
    records, t0, tokens = [], time.monotonic(), 0
    for s in range(0, len(prompts), args.batch_size):
        if time.monotonic() > deadline:
            log(f"  time budget reached after {len(records)} of {len(prompts)} prompts")
            break
        labelled = _answer_and_label(draft, target, prompts[s : s + args.batch_size], args.max_new, eos, seed + s)
        records += labelled
        tokens += sum(len(r["completion"]) for r in labelled)
        log(
            f"  {len(records)}/{len(prompts)} prompts, {tokens} tokens, "
            f"{tokens / (time.monotonic() - t0):.0f} labelled tokens/s"
        )
    torch.save(records, path)
    log(f"data: {len(records)} on-policy answers, {tokens} tokens -> {path}")
    return path


def _answer_and_label(draft, target, batch: list, max_new: int, eos: set[int], seed: int) -> list[dict]:
    """One batch of on-policy records: the draft answers the prompts (ON_POLICY_GREEDY of them greedily, the
    rest sampled), then the target labels the answers, SCORE_ROWS a pass, shortest first."""
    greedy = [int((j + 1) * ON_POLICY_GREEDY) > int(j * ON_POLICY_GREEDY) for j in range(len(batch))]
    answers = []
    for mode, rows, temperature in (
        ("draft-greedy", [p for p, g in zip(batch, greedy) if g], 0.0),
        ("draft-sampled", [p for p, g in zip(batch, greedy) if not g], 0.7),
    ):
        got = batched.generate(draft, rows, max_new, temperature, 0.9, eos, seed, top_k_labels=0)
        answers += [(mode, p, ids) for p, (ids, _, _) in zip(rows, got) if ids]
    answers.sort(key=lambda a: len(a[1]) + len(a[2]))
    records = []
    for i in range(0, len(answers), SCORE_ROWS):
        group = answers[i : i + SCORE_ROWS]
        for (mode, p, ids), (top_i, top_v) in zip(group, batched.score(target, [(p, ids) for _, p, ids in group])):
            records.append(
                {
                    "prompt": p,
                    "completion": ids,
                    "top_ids": top_i,
                    "top_logp": top_v,
                    "mode": mode,
                    "hard": top_i[:, 0].tolist(),
                }
            )
    return records


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", default="all", choices=["data", "train", "all"])
    ap.add_argument("--num-prompts", type=int, default=12000)
    ap.add_argument("--max-new", type=int, default=192)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--data-parts", type=int, default=1, help="parts of --gen-minutes each, on fresh prompts")
    ap.add_argument(
        "--data-from",
        default="target",
        choices=["target", "draft"],
        help="who answers the prompts: the target (its own samples, labelled as it generates) or "
        "the --init draft (on-policy: its answers, labelled by the target in one pass each)",
    )
    add_activations_argument(ap)
    ap.add_argument("--gen-minutes", type=float, default=50, help="time budget of one data part")
    ap.add_argument("--train-minutes", type=float, default=45)
    ap.add_argument("--lr", type=float, help="peak learning rate (default: 2e-3 for slice, 3e-3 for pca)")
    ap.add_argument("--init", help="continue training this draft (a folder) instead of a fresh one")
    ap.add_argument(
        "--init-from",
        default="slice",
        choices=["slice", "pca"],
        help="a fresh draft's start: random layers and a PCA of the target's embedding (pca), "
        "or the target itself, rotated and cut (slice: training/slice.py)",
    )
    ap.add_argument("--layers", type=int, default=6, help="--init-from slice: layers kept")
    ap.add_argument("--intermediate", type=int, default=1024, help="--init-from slice: MLP neurons kept per layer")
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--device", default="auto", help="cpu, cuda, or auto: cuda where there is one")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "models" / "smollm2-draft"))
    args = ap.parse_args(argv)
    args.device = pick_device(args.device)
    if args.lr is None:
        args.lr = 2e-3 if args.init_from == "slice" else 3e-3
    torch.manual_seed(SEED)
    tokenizer = models.load_tokenizer(models.DEFAULT_TARGET)
    data = stage_data(args, tokenizer)
    if args.stage == "data":
        return
    from training.train import stage_train

    stage_train(args, tokenizer, data)


if __name__ == "__main__":
    main()
