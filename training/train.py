"""Training, evaluation and saving of the distilled draft (stages 2-4 of training.distill)."""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec import models
from training.common import SEED, log

ARCH = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
)  # --init-from pca: a fresh draft of this shape
CALIBRATION_ANSWERS = 96  # --init-from slice: answers the target's stream statistics are gathered on
COVERAGE = 0.995  # the output layer keeps the most frequent tokens covering this share of the answers
MAX_KEPT = 16384
VAL_CHECK = 512  # validation answers read at each check during training


def kept_vocabulary(records) -> list[int]:
    counts = Counter(t for r in records for t in r["completion"])
    total, run, kept = sum(counts.values()), 0, []
    for tok, c in counts.most_common():
        if run / total >= COVERAGE or len(kept) >= MAX_KEPT:
            break
        kept.append(tok)
        run += c
    return sorted(kept)


def build_draft(target, kept: list[int]):
    from transformers import LlamaConfig, LlamaForCausalLM

    tc = target.config
    # transformers 5 keeps rope_theta in rope_parameters; reading only the old attribute gave 10,000
    theta = (getattr(tc, "rope_parameters", None) or {}).get("rope_theta") or getattr(tc, "rope_theta", 10000.0)
    cfg = LlamaConfig(
        vocab_size=tc.vocab_size,
        max_position_embeddings=tc.max_position_embeddings,
        rope_theta=theta,
        rms_norm_eps=tc.rms_norm_eps,
        tie_word_embeddings=True,
        bos_token_id=tc.bos_token_id,
        eos_token_id=tc.eos_token_id,
        pad_token_id=getattr(tc, "pad_token_id", None),
        **ARCH,
    )
    cfg.specdec_output_token_ids = kept
    torch.manual_seed(SEED)
    draft = LlamaForCausalLM(cfg)
    # embedding: the target's, projected on its top principal directions
    emb = target.get_input_embeddings().weight.detach().float()  # [vocab, 576]
    centered = emb - emb.mean(0)
    _, _, v = torch.pca_lowrank(centered, q=ARCH["hidden_size"], center=False, niter=4)
    proj = centered @ v  # [vocab, hidden]
    # the standard init scale: the tied output layer starts with small logits
    draft.get_input_embeddings().weight.data.copy_(proj * (draft.config.initializer_range / proj.std()))
    return draft


def build_sliced_draft(target, kept: list[int], records, layers: int, intermediate: int):
    """The target cut to at most ARCH's width: its most influential layers, rotated and cut (training.slice).
    The width is a multiple of the target's head count, which the draft keeps (252 for SmolLM2's 9 heads)."""
    from training.slice import calibrate, choose_layers, slice_target

    heads = target.config.num_attention_heads
    hidden = ARCH["hidden_size"] - ARCH["hidden_size"] % heads

    rng = random.Random(SEED)
    sample = rng.sample(records, min(CALIBRATION_ANSWERS, len(records)))
    cal = calibrate(target, [r["prompt"] + r["completion"] for r in sample])
    chosen = choose_layers(cal.influence, layers)
    energy = (cal.eigenvalues[:hidden].sum() / cal.eigenvalues.sum()).item()
    log(
        f"slice: {cal.tokens} calibration tokens; layers {chosen} of {len(cal.influence)} by influence "
        f"({', '.join(f'{v:.2f}' for v in cal.influence.tolist())}); top {hidden} directions "
        f"hold {energy:.1%} of the stream's energy; {intermediate} MLP neurons per layer"
    )
    return slice_target(target, cal, chosen, hidden, intermediate, kept)


def batches(records, batch_tokens: int, rng: random.Random, length=lambda r: len(r["prompt"]) + len(r["completion"])):
    """Lists of record indices of similar length (length(record) tokens), about batch_tokens tokens each, in random
    order."""
    order = sorted(range(len(records)), key=lambda i: length(records[i]))
    groups, cur, cur_max = [], [], 0
    for i in order:
        n = length(records[i])
        if cur and max(cur_max, n) * (len(cur) + 1) > batch_tokens:
            groups.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, n)
    if cur:
        groups.append(cur)
    rng.shuffle(groups)
    return groups


def loss_on(draft, kept_t, slot, recs, hard_weight=0.2):
    """Soft KL to the target's renormalised top-20 on the kept tokens, plus hard-label CE (the target's token:
    its answer's for its own answers, its top choice for the draft's). Agreement is against the hard label.
    The records' tensors are moved to the device of kept_t and slot (the draft's)."""
    dev = kept_t.device
    lens = [len(r["prompt"]) + len(r["completion"]) for r in recs]
    T = max(lens)
    ids = torch.zeros(len(recs), T, dtype=torch.long)
    mask = torch.zeros(len(recs), T, dtype=torch.long)
    for b, r in enumerate(recs):
        seq = r["prompt"] + r["completion"]
        ids[b, : len(seq)] = torch.tensor(seq)
        mask[b, : len(seq)] = 1
    hidden = draft.model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).last_hidden_state  # [B, T, h]
    rows, top_ids, top_logp, hard = [], [], [], []
    for b, r in enumerate(recs):
        p = len(r["prompt"])
        m = len(r["completion"])
        rows.append(hidden[b, p - 1 : p - 1 + m])  # positions predicting each completion token
        top_ids.append(r["top_ids"].long())
        top_logp.append(r["top_logp"].float())
        hard.append(torch.tensor(r.get("hard", r["completion"])))  # on-policy answers: the target's top token
    h = torch.cat(rows)  # [N, hidden]
    logits = h @ draft.get_input_embeddings().weight[kept_t].T  # [N, kept]
    logq = torch.log_softmax(logits.float(), dim=-1)
    ti = slot[torch.cat(top_ids).to(dev)]  # [N, 20] index into kept, -1 outside
    tp = torch.cat(top_logp).to(dev).exp() * (ti >= 0)
    tp = tp / tp.sum(-1, keepdim=True).clamp_min(1e-9)
    soft = -(tp * logq.gather(1, ti.clamp_min(0))).sum(-1).mean()
    hs = slot[torch.cat(hard).to(dev)]
    hard_loss = F.nll_loss(logq[hs >= 0], hs[hs >= 0])
    agree = (logits.argmax(-1) == hs).float().mean()
    return soft + hard_weight * hard_loss, agree


def split(records, rng: random.Random) -> tuple[list, list]:
    """(validation, training): each part keeps its own 2.5% slice, so adding a part never
    moves an answer a checkpoint trained on into validation."""
    records = list(records)
    rng.shuffle(records)
    n_val = max(20, len(records) // 40)
    return records[:n_val], records[n_val:]


def stage_train(args, tokenizer, data_paths: list[Path]) -> None:
    val, train = [], []
    for path in data_paths:
        v, t = split(torch.load(path, weights_only=False), random.Random(SEED))
        val += v
        train += t
    draft, kept = initial_draft(args, train)
    log(
        f"train: {len(train)} answers ({sum(len(r['completion']) for r in train)} tokens), "
        f"output layer keeps {len(kept)} tokens ({COVERAGE:.1%} of answer tokens)"
    )
    dev = torch.device(args.device)
    draft.to(dev)
    kept_t = torch.tensor(kept, device=dev)
    slot = torch.full((draft.config.vocab_size,), -1, dtype=torch.long, device=dev)
    slot[kept_t] = torch.arange(len(kept), device=dev)
    c = draft.config
    log(
        f"train: draft {sum(p.numel() for p in draft.parameters()) / 1e6:.1f}M parameters, {c.num_hidden_layers} "
        f"layers x {c.hidden_size} wide, MLP {c.intermediate_size}, {c.num_attention_heads} heads "
        f"({c.num_key_value_heads} KV) of {c.head_dim}, on {dev}"
    )
    # bf16 products on a GPU; on a CPU only where they are in hardware (emulated bf16 is slower than fp32)
    bf16 = dev.type == "cuda" or models.cpu_has_native_bf16()
    validate = validator(draft, kept_t, slot, dev, bf16)
    log(f"train: before training, {validate(val)[0]}")
    step, epoch = train_steps(args, draft, kept_t, slot, train, validate, val[:VAL_CHECK], bf16)
    log(f"train: after {step} steps, {validate(val)[0]}")
    draft.eval()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    draft.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    log(f"saved {out} after {step} steps, {epoch} epochs")


def initial_draft(args, train) -> tuple[torch.nn.Module, list[int]]:
    """(draft, its output vocabulary): the checkpoint --init continues, or a new draft built from the target."""
    if args.init:  # continue: the checkpoint's architecture and output vocabulary
        from transformers import LlamaForCausalLM

        draft = LlamaForCausalLM.from_pretrained(args.init, dtype=torch.float32)
        log(f"train: continuing {args.init}")
        return draft, sorted(draft.config.specdec_output_token_ids)
    kept = kept_vocabulary(train)
    target = models.load_model(models.DEFAULT_TARGET)
    if args.init_from == "slice":
        return build_sliced_draft(target, kept, train, args.layers, args.intermediate).float(), kept
    return build_draft(target, kept), kept


def validator(draft, kept_t, slot, dev: torch.device, bf16: bool):
    """validate(records) -> (summary text, agreement): the draft's loss and top-1 agreement on records."""
    val_rows = 8 if dev.type == "cpu" else 64

    def validate(records) -> tuple[str, float]:
        draft.eval()
        with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            vl, va = zip(
                *(loss_on(draft, kept_t, slot, records[i : i + val_rows]) for i in range(0, len(records), val_rows))
            )
        draft.train()
        agree = float(sum(va) / len(va))
        return f"val loss {sum(vl) / len(vl):.3f} agree {agree:.3f}", agree

    return validate


def train_steps(args, draft, kept_t, slot, train, validate, check, bf16: bool) -> tuple[int, int]:
    """Train for args.train_minutes (warm-up, then a cosine learning rate); (steps, epochs) run.

    The checks during training read `check`, at most VAL_CHECK answers (a GPU run's slice is thousands); the
    best checkpoint by them is kept, so a run that starts to overfit late does not lose its best weights."""
    dev = next(draft.parameters()).device
    rng = random.Random(SEED)
    opt = torch.optim.AdamW(draft.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    budget = 60 * args.train_minutes
    t0, step, epoch = time.monotonic(), 0, 0
    best, best_state, best_step = -1.0, None, 0
    draft.train()
    done = False
    while not done:
        epoch += 1
        for group in batches(train, args.batch_tokens, rng):
            frac = (time.monotonic() - t0) / budget
            if frac >= 1:
                done = True
                break
            lr = args.lr * min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * frac))  # warm-up, cosine
            for g in opt.param_groups:
                g["lr"] = lr
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
                loss, agree = loss_on(draft, kept_t, slot, [train[i] for i in group])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
            opt.step()
            step += 1
            if step % 100 == 0:
                text, got = validate(check)
                if got > best:
                    best, best_step = got, step
                    best_state = {k: v.detach().to("cpu", copy=True) for k, v in draft.state_dict().items()}
                log(
                    f"train: step {step} epoch {epoch} {frac:.0%} lr {lr:.2e} loss {loss.item():.3f} "
                    f"agree {agree.item():.3f} | {text}"
                )
    text, last = validate(check)
    if best_state is not None and best > last:
        draft.load_state_dict(best_state)
        log(f"train: the end ({last:.3f}) checks worse than step {best_step} ({best:.3f}): keeping step {best_step}")
    return step, epoch
