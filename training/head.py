"""Train an EAGLE-style head for the embedded target: a draft that reads the target's own features.

    python -m training.head [--gen-minutes 40] [--data-parts 1] [--train-minutes 30] [--out models/smollm2-head]

The head's entry at position p reads the token t_p and the target's feature f_{p-1} (its final-norm output at
p - 1, the vector its output layer multiplies; zeros at p = 0): x = W_fc [E t_p ; f_{p-1}], then one Llama
decoder layer with the target's attention layout, then its own RMSNorm, g_p = norm(layer(x)). g_p predicts f_p,
and the head's logits are the target's output rows over the scored tokens times g_p. Drafting K tokens, step
j > 1 feeds the head's own g of the step before in place of the target's feature (EAGLE, Li et al. 2024).

Stages, each cached under ~/.cache/specdec/head:
1. data: the target's answers to the training prompts (training.distill's data parts, generated the same way:
   on a CPU in the forms the target is served in), with its features at every position it fed, recorded as it
   generated them.
2. train: cross-entropy to the target's distribution over the scored tokens (softmax of its output rows times
   f_p) plus a regression of f_p (smooth L1), at every answer position. A second pass per batch feeds the head
   its own g_{p-1} where serving does (training-time test, EAGLE-3): its queries see the first pass's keys
   before p and their own at p, exactly what a second draft step sees.
3. save: the head's format (specdec/runners/head.py): fc, one layer and a norm; the embedding and the output
   rows come from the target at load.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
import types
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdec import models
from specdec.features import fingerprint
from specdec.head import head_config, rescore, save_head
from specdec.runners.lean_llama import LeanLlamaRunner, rope, rotary_tables
from training import distill
from training.common import SEED, log
from training.train import batches as train_batches, kept_vocabulary

REGRESSION_WEIGHT = 1.0  # EAGLE weighs the feature regression above the tokens' cross-entropy
SECOND_PASS_WEIGHT = 0.5  # the loss of the pass that reads the head's own features
NOISE = 0.1  # uniform noise added to the target's features in training (EAGLE-1's robustness to its own errors)


def target_parts(model, max_len: int = 4096) -> types.SimpleNamespace:
    """What a head reads of its target, as a LeanLlamaRunner holds it (Head takes either): the embedding, the output
    rows, the rotary tables and the attention layout; none of the runner's fused copies of every layer."""
    cfg = model.config
    cos, sin = rotary_tables(model, max_len, torch.float32, lambda t: t)
    return types.SimpleNamespace(
        embed=model.model.embed_tokens.weight,
        lm_head=model.get_output_embeddings().weight,
        cos=cos,
        sin=sin,
        n_heads=cfg.num_attention_heads,
        n_kv=cfg.num_key_value_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        eps=cfg.rms_norm_eps,
    )


class Head(nn.Module):
    """The head in training: fc, one pre-norm Llama layer (fused QKV and gate/up, as the lean runner holds
    them), a final norm; the target's embedding, output rows and rotary tables held frozen beside it."""

    def __init__(self, r: LeanLlamaRunner, intermediate: int):
        super().__init__()
        H = r.embed.shape[1]
        self.n_heads, self.n_kv, self.d, self.eps = r.n_heads, r.n_kv, r.head_dim, r.eps
        qkv = (self.n_heads + 2 * self.n_kv) * self.d
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.wqkv = nn.Linear(H, qkv, bias=False)
        self.wo = nn.Linear(self.n_heads * self.d, H, bias=False)
        self.wgu = nn.Linear(H, 2 * intermediate, bias=False)
        self.wd = nn.Linear(intermediate, H, bias=False)
        self.ln1, self.ln2, self.norm = (nn.Parameter(torch.ones(H)) for _ in range(3))
        for lin in (self.fc, self.wqkv, self.wo, self.wgu, self.wd):
            nn.init.normal_(lin.weight, std=0.02)
        self.register_buffer("embed", r.embed.float(), persistent=False)
        self.register_buffer("cos", r.cos.float(), persistent=False)
        self.register_buffer("sin", r.sin.float(), persistent=False)

    def _rms(self, x, w):
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)

    def qkv(self, ids: torch.Tensor, fprev: torch.Tensor):
        """x [B, T, H] entering the layer, and its rotated q [B, h, T, d], k, v [B, kv, T, d]."""
        B, T = ids.shape
        x = self.fc(torch.cat([self.embed[ids], fprev], dim=-1))
        qkv = self.wqkv(self._rms(x, self.ln1))
        h, kv, d = self.n_heads, self.n_kv, self.d
        q = qkv[..., : h * d].view(B, T, h, d).transpose(1, 2)
        k = qkv[..., h * d : (h + kv) * d].view(B, T, kv, d).transpose(1, 2)
        v = qkv[..., (h + kv) * d :].view(B, T, kv, d).transpose(1, 2)
        cos, sin = self.cos[:T], self.sin[:T]
        return x, rope(q, cos, sin), rope(k, cos, sin), v

    def finish(self, x, q, k, v, mask):
        """The rest of the layer after attention over keys k, v under mask [B, 1, T, keys]: g [B, T, H]."""
        B, _, T, _ = q.shape
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        x = x + self.wo(att.transpose(1, 2).reshape(B, T, -1))
        gate, up = self.wgu(self._rms(x, self.ln2)).chunk(2, dim=-1)
        return self._rms(x + self.wd(F.silu(gate) * up), self.norm)

    def forward(self, ids, fprev, valid, second: bool):
        """g of the first pass (the target's features in), and with `second` also of the pass that reads the
        first pass's g_{p-1} at every p, attending to the first pass's keys before p and its own at p."""
        T = ids.shape[1]
        x, q, k, v = self.qkv(ids, fprev)
        causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
        mask = (causal[None] & valid[:, None, :])[:, None]  # [B, 1, T, T]
        g1 = self.finish(x, q, k, v, mask)
        if not second:
            return g1, None
        f2 = torch.cat([torch.zeros_like(g1[:, :1]), g1[:, :-1]], dim=1)
        x2, q2, k2, v2 = self.qkv(ids, f2)
        before = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril(-1)
        own = torch.eye(T, dtype=torch.bool, device=ids.device)
        mask2 = torch.cat([before[None] & valid[:, None, :], own[None].expand(len(ids), T, T)], dim=-1)[:, None]
        return g1, self.finish(x2, q2, torch.cat([k, k2], 2), torch.cat([v, v2], 2), mask2)


def batch_of(recs: list[dict], dev) -> tuple:
    """Right-padded ids [B, T]; the features each position reads (f_{p-1}, zeros at p = 0) and the ones it
    predicts (f_p) [B, T, H] float32; the valid positions [B, T]; and the positions that predict an answer token
    [B, T]: from the prompt's last to the answer's last but one (a record's features stop there: f_0 .. f_{n-2})."""
    T = max(len(r["ids"]) for r in recs)
    H = recs[0]["feats"].shape[1]
    ids = torch.zeros(len(recs), T, dtype=torch.long)
    f = torch.zeros(len(recs), T + 1, H)
    valid = torch.zeros(len(recs), T, dtype=torch.bool)
    scored = torch.zeros(len(recs), T, dtype=torch.bool)
    for b, r in enumerate(recs):
        n, m = len(r["ids"]), len(r["feats"])
        ids[b, :n] = r["ids"].long()
        f[b, 1 : m + 1] = r["feats"].float()
        valid[b, :n] = True
        scored[b, r["prompt_len"] - 1 : m] = True
    return ids.to(dev), f[:, :T].to(dev), f[:, 1:].to(dev), valid.to(dev), scored.to(dev)


def as_records(data: list[dict]) -> list[dict]:
    """training.distill's records (with features) as the head trains on them."""
    return [
        {
            "ids": torch.tensor(d["prompt"] + d["completion"], dtype=torch.int32),
            "prompt_len": len(d["prompt"]),
            "feats": d["feats"],
        }
        for d in data
        if d["completion"]
    ]


def loss_on(head: Head, rows: torch.Tensor, recs: list[dict], second: bool, noise: float = 0.0):
    """(loss, greedy agreement of the first pass, of the second pass or None). rows: the target's output rows
    of the scored tokens [scored, H]; the target's distribution over them is softmax(rows f_p)."""
    ids, fprev, fnext, valid, scored = batch_of(recs, rows.device)
    if noise:
        fprev = fprev + (torch.rand_like(fprev) - 0.5) * (2 * noise)
    g1, g2 = head(ids, fprev, valid, second)
    target = F.softmax(fnext[scored] @ rows.T, dim=-1)
    loss, agree = 0.0, []
    for g, w in ((g1, 1.0), (g2, SECOND_PASS_WEIGHT)):
        if g is None:
            continue
        logits = g[scored] @ rows.T
        ce = -(target * F.log_softmax(logits, dim=-1)).sum(-1).mean()
        loss = loss + w * (ce + REGRESSION_WEIGHT * F.smooth_l1_loss(g[scored], fnext[scored]))
        agree.append((logits.argmax(-1) == target.argmax(-1)).float().mean().item())
    return loss, agree[0], agree[1] if second else None


def batches(records: list[dict], batch_tokens: int, rng: random.Random) -> list[list[dict]]:
    """Records of similar length, about batch_tokens tokens a batch, in random order (training.train's grouping)."""
    return [[records[i] for i in group] for group in train_batches(records, batch_tokens, rng, lambda r: len(r["ids"]))]


@torch.no_grad()
def validate(head: Head, rows, val: list[dict], batch_tokens: int) -> tuple[float, float, float]:
    """Mean loss, first-step and second-step greedy agreement over the validation records."""
    head.eval()
    n, loss, a1, a2 = 0, 0.0, 0.0, 0.0
    for group in batches(val, batch_tokens, random.Random(0)):
        lo, g1, g2 = loss_on(head, rows, group, second=True)
        w = sum(len(r["feats"]) - r["prompt_len"] + 1 for r in group)
        n, loss, a1, a2 = n + w, loss + w * float(lo), a1 + w * g1, a2 + w * g2
    head.train()
    return loss / n, a1 / n, a2 / n


def train(head: Head, rows, train_recs, val, args, on_best=lambda head: None) -> Head:
    """AdamW, warm-up then cosine decay over the time budget; the best validation checkpoint is kept, and given to
    on_best as it is found (saved then, a run cut short, on a lent GPU say, keeps its best)."""
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    rng, t0, step = random.Random(SEED), time.monotonic(), 0
    budget = 60 * args.train_minutes
    best, best_state = -1.0, None
    while time.monotonic() - t0 < budget:
        for group in batches(train_recs, args.batch_tokens, rng):
            frac = (time.monotonic() - t0) / budget
            if frac >= 1:
                break
            lr = args.lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * frac))
            for pg in opt.param_groups:
                pg["lr"] = lr
            with torch.autocast(rows.device.type, dtype=torch.bfloat16, enabled=args.bf16):
                loss, a1, _ = loss_on(head, rows, group, second=args.second_pass, noise=NOISE)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            if step % args.check_every == 0:
                vl, v1, v2 = validate(head, rows, val, args.batch_tokens)
                log(
                    f"step {step}: train loss {float(loss):.3f} agree {a1:.3f}; val loss {vl:.3f} agree {v1:.3f} / {v2:.3f}"
                )
                if v1 + v2 > best:
                    best, best_state = v1 + v2, {k: v.clone() for k, v in head.state_dict().items()}
                    on_best(head)
    if best_state is not None:
        head.load_state_dict(best_state)
    return head


def save(head: Head, target, kept: list[int], out: Path, spec: str = models.DEFAULT_TARGET) -> None:
    """The head's folder (specdec/head.py's format): its fc, layer and norm, named as transformers names a
    LlamaForCausalLM's, with the target's spec and feature fingerprint."""
    d = head.d
    q, k, v = head.wqkv.weight.split([head.n_heads * d, head.n_kv * d, head.n_kv * d])
    gate, up = head.wgu.weight.chunk(2)
    layer = {
        "self_attn.q_proj.weight": q,
        "self_attn.k_proj.weight": k,
        "self_attn.v_proj.weight": v,
        "self_attn.o_proj.weight": head.wo.weight,
        "mlp.gate_proj.weight": gate,
        "mlp.up_proj.weight": up,
        "mlp.down_proj.weight": head.wd.weight,
        "input_layernorm.weight": head.ln1,
        "post_attention_layernorm.weight": head.ln2,
    }
    weights = {"fc.weight": head.fc.weight, "model.norm.weight": head.norm}
    weights |= {f"model.layers.0.{n}": w for n, w in layer.items()}
    save_head(
        out,
        config=head_config(target, head.wd.weight.shape[1], kept),
        weights=weights,
        target=spec,
        feature_fingerprint=fingerprint(target.get_output_embeddings().weight),
    )


def most_frequent(tokens: list[int], answers: list[list[int]], n: int) -> list[int]:
    """The n of `tokens` the answers hold most often (ties to the lower id), in id order: the head's output layer
    is most of its step (13,146 rows of 576 against 4.2 M multiply-adds in the rest), and the rarest rows add the
    least acceptance."""
    counts = Counter(t for a in answers for t in a)
    return sorted(sorted(tokens, key=lambda t: (-counts[t], t))[:n])


def stage_data(args, tokenizer) -> tuple[list[dict], list[int]]:
    """The target's answers with their features (training.distill's data part, cached there), and the tokens the
    head scores: the embedded draft's list for the embedded target (chosen on 7.9 M answer tokens), else the most
    frequent tokens of these answers; with --scored-tokens, the most frequent of those in these answers."""
    args.data_from, args.features = "target", True
    data = [r for part in distill.stage_data(args, tokenizer) for r in torch.load(part, weights_only=False)]
    if args.target == models.DEFAULT_TARGET:
        draft_config = models.REPO_MODELS["smollm2-135m-draft"] / "config.json"
        kept = json.loads(draft_config.read_text())["specdec_output_token_ids"]
    else:
        kept = kept_vocabulary(data)
    if args.scored_tokens:
        kept = most_frequent(kept, [d["completion"] for d in data], args.scored_tokens)
    return as_records(data), kept


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--stage",
        default="all",
        choices=["data", "all", "rows"],
        help="rows: only --out's scored tokens, from the data",
    )
    ap.add_argument("--num-prompts", type=int, default=12000)
    ap.add_argument("--max-new", type=int, default=192)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--gen-minutes", type=float, default=40, help="time budget of each part of the target's answers")
    ap.add_argument("--data-parts", type=int, default=1, help="parts of answers, each to its own prompts")
    ap.add_argument("--train-minutes", type=float, default=30)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--check-every", type=int, default=100)
    distill.add_activations_argument(ap)
    ap.add_argument("--scored-tokens", type=int, default=0, help="score only the N most frequent (default: all)")
    ap.add_argument("--intermediate", type=int, help="the head's MLP width (default: the target's layers')")
    ap.add_argument("--no-second-pass", dest="second_pass", action="store_false")
    ap.add_argument("--target", default=models.DEFAULT_TARGET, help="the target whose features the head reads")
    ap.add_argument("--device", default="cpu", help="cpu or cuda: the target's answers and the training")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "models" / "smollm2-head"))
    args = ap.parse_args(argv)
    torch.manual_seed(SEED)
    tokenizer = models.load_tokenizer(args.target)
    records, kept = stage_data(args, tokenizer)
    if args.stage == "data":
        return
    if args.stage == "rows":
        rescore(Path(args.out), kept)
        log(f"{args.out} scores {len(kept)} tokens")
        return
    random.Random(SEED).shuffle(records)
    val, train_recs = records[: max(20, len(records) // 40)], records[max(20, len(records) // 40) :]
    target = models.load_model(args.target, dtype="float32")
    # The target stays on the host: a card trains the head beside the target's embedding and scored rows only
    # (Llama-3.2-3B's 13 GB of float32 would not fit the 16 GB card that serves it).
    parts, device = target_parts(target), torch.device(args.device)
    rows = parts.lm_head[torch.tensor(kept)].float().to(device)
    head = Head(parts, args.intermediate or target.config.intermediate_size).to(device)
    del parts
    # bf16 products on a GPU, and on a CPU where they are in hardware (emulated bf16 is slower), as training.train
    args.bf16 = device.type == "cuda" or models.cpu_has_native_bf16()
    n_train = sum(len(r["feats"]) - r["prompt_len"] + 1 for r in train_recs)
    log(f"train: {len(train_recs)} answers ({n_train} answer positions), {len(val)} for validation")
    head = train(head, rows, train_recs, val, args, lambda best: save(best, target, kept, Path(args.out), args.target))
    vl, v1, v2 = validate(head, rows, val, args.batch_tokens)
    log(f"final: val loss {vl:.3f}, agreement first step {v1:.3f}, second {v2:.3f}")
    save(head.cpu(), target, kept, Path(args.out), args.target)
    log(f"saved {args.out}")


if __name__ == "__main__":
    main()
