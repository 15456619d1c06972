"""Batched generation with the target's lean forward, recording its top-k log-probs.

Data generation is the slow part of distillation: the stock ``generate`` runs
at about 100 tokens/s here, while a bf16 forward over 100+ rows uses the CPU's
matrix units. Rows are left-padded; each row's RoPE positions start after its
padding, and padded keys are masked out.
"""

from __future__ import annotations

import random
import time

import torch
import torch.nn.functional as F

from specdec.runners.lean_llama import LeanLlamaRunner, TorchLayerOps, rope
from specdec.sampling import logits_to_probs


def _rms(r: LeanLlamaRunner, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """RMS norm with the runner's epsilon, in torch: batched [B, n, hidden] rows, any device."""
    return TorchLayerOps.rms_norm(x, w, r.eps)


def _forward(r: LeanLlamaRunner, ids, pos, k_cache, v_cache, start: int, key_valid):
    """ids, pos: [B, n]; caches [L, B, kv, T, d]; key_valid [B, T]. Returns the logits of the last position
    [B, vocab], or [B, scored] for a draft that scores only some tokens (r.scored_ids), and the features of every
    position [B, n, hidden]: the final norm's output, which the output layer multiplies."""
    feats = _rms(r, _hidden(r, ids, pos, k_cache, v_cache, start, key_valid), r.norm)
    return F.linear(feats[:, -1], r.lm_head).float(), feats


def _hidden(r: LeanLlamaRunner, ids, pos, k_cache, v_cache, start: int, key_valid):
    """The final residual stream, before the last norm: [B, n, hidden]."""
    B, n = ids.shape
    h, kv, d = r.n_heads, r.n_kv, r.head_dim
    end = start + n
    x = r.embed[ids]  # [B, n, hidden]
    cos, sin = r.cos[pos][:, None], r.sin[pos][:, None]  # [B, 1, n, d]
    causal = torch.ones(n, end, dtype=torch.bool, device=ids.device).tril(start)  # [n, end]
    mask = causal[None, None] & key_valid[:, None, None, :end]  # [B, 1, n, end]
    for i, (ln1, wqkv, wo, ln2, wgu, wd) in enumerate(r.layers):
        qkv = F.linear(_rms(r, x, ln1), wqkv)  # [B, n, (h + 2 kv) d]
        q = qkv[..., : h * d].view(B, n, h, d).transpose(1, 2)  # [B, h, n, d]
        k = qkv[..., h * d : (h + kv) * d].view(B, n, kv, d).transpose(1, 2)
        v = qkv[..., (h + kv) * d :].view(B, n, kv, d).transpose(1, 2)
        k_cache[i, :, :, start:end] = rope(k, cos, sin)
        v_cache[i, :, :, start:end] = v
        att = F.scaled_dot_product_attention(
            rope(q, cos, sin), k_cache[i, :, :, :end], v_cache[i, :, :, :end], attn_mask=mask, enable_gqa=True
        )  # [B, h, n, d]
        x = x + F.linear(att.transpose(1, 2).reshape(B, n, h * d), wo)
        x = x + F.linear(TorchLayerOps.silu_mul(F.linear(_rms(r, x, ln2), wgu)), wd)
    return x


def _left_padded(r: LeanLlamaRunner, seqs: list[list[int]], capacity: int):
    """A batch of token sequences, left-padded to the longest, on the runner's device: ids and RoPE positions
    [B, P] (each row's positions start after its padding), padding [B], key_valid [B, capacity] (the keys a
    row may attend to), and empty K/V caches of `capacity` positions [L, B, kv, capacity, d]."""
    dev = r.device
    B, P = len(seqs), max(len(s) for s in seqs)
    pad = torch.tensor([P - len(s) for s in seqs])
    ids = torch.zeros(B, P, dtype=torch.long)
    key_valid = torch.zeros(B, capacity, dtype=torch.bool)
    for b, s in enumerate(seqs):
        ids[b, P - len(s) :] = torch.tensor(s)
        key_valid[b, P - len(s) :] = True
    pad, ids, key_valid = pad.to(dev), ids.to(dev), key_valid.to(dev)
    k_cache = torch.empty(len(r.layers), B, r.n_kv, capacity, r.head_dim, dtype=r.dtype, device=dev)
    pos = (torch.arange(P, device=dev)[None] - pad[:, None]).clamp(min=0)
    return ids, pos, pad, key_valid, k_cache, torch.empty_like(k_cache)


def _choose(logits, temperature: float, top_p: float, g: torch.Generator, token_of) -> torch.Tensor:
    """Each row's next token: the argmax, or a draw at the temperature and top-p; token ids even where the
    logits index a draft's scored tokens (token_of)."""
    if temperature == 0:
        nxt = logits.argmax(-1)
    else:
        nxt = torch.multinomial(logits_to_probs(logits, temperature, 0, top_p), 1, generator=g)[:, 0]
    return nxt if token_of is None else token_of[nxt]


class _FeatureLog:
    """The features a generating batch fed, per original row: the prompt's (after its left padding), then the
    last position of each step for the rows still answering."""

    def __init__(self, feats: torch.Tensor, pad: torch.Tensor):
        self.parts = [[feats[b, int(pad[b]) :].to(torch.bfloat16).cpu()] for b in range(len(feats))]

    def step(self, last: torch.Tensor, rows: torch.Tensor, done: torch.Tensor) -> None:
        last = last.to(torch.bfloat16).cpu()
        for j in torch.nonzero(~done).flatten().tolist():
            self.parts[int(rows[j])].append(last[j : j + 1])

    def rows(self) -> list[torch.Tensor]:
        return [torch.cat(parts) for parts in self.parts]


@torch.inference_mode()
def generate(
    r: LeanLlamaRunner,
    prompts: list[list[int]],
    max_new: int,
    temperature: float,
    top_p: float,
    eos_ids: set[int],
    seed: int,
    top_k_labels: int = 20,
    features: list | None = None,
):
    """One batch. Returns per row: (completion ids, top-k ids [m, k] int32, top-k log-probs [m, k] fp16);
    with top_k_labels=0, (completion ids, None, None). A list `features` gets per row the features (bf16) of every
    position fed, [prompt + m - 1, hidden] (training/head.py). A draft that scores only its kept tokens samples
    among them (its own q), and its labels would index the kept list: use top_k_labels=0 for drafts.

    Rows that finished are dropped from the batch (and its caches) once they are a quarter of it,
    so a batch's long answers do not drag its short ones' share of the compute along."""
    dev = r.device
    g = torch.Generator(device=dev).manual_seed(seed)
    B, P = len(prompts), max(len(p) for p in prompts)
    ids, pos, pad, key_valid, k_cache, v_cache = _left_padded(r, prompts, P + max_new)
    logits, feats = _forward(r, ids, pos, k_cache, v_cache, 0, key_valid)
    fed = _FeatureLog(feats, pad) if features is not None else None
    out, labels_i, labels_v = ([[] for _ in range(B)] for _ in range(3))
    # the bookkeeping stays on the CPU: one copy of the step's tokens (and labels) per step, not one per row
    rows = torch.arange(B)  # original index of each row still in the batch
    done = torch.zeros(B, dtype=torch.bool)
    eos, token_of = torch.tensor(sorted(eos_ids)), r.scored_ids.to(dev) if r.scored_ids is not None else None
    for t in range(max_new):
        if top_k_labels:
            top = torch.topk(torch.log_softmax(logits, dim=-1), top_k_labels, dim=-1)
            top_i, top_v = top.indices.int().cpu(), top.values.half().cpu()
        nxt = _choose(logits, temperature, top_p, g, token_of)
        nxt_cpu = nxt.cpu()
        tokens = nxt_cpu.tolist()
        for j in torch.nonzero(~done).flatten().tolist():
            b = int(rows[j])
            out[b].append(tokens[j])
            if top_k_labels:
                labels_i[b].append(top_i[j])
                labels_v[b].append(top_v[j])
        done |= torch.isin(nxt_cpu, eos)
        if bool(done.all()) or t == max_new - 1:
            break
        if int(done.sum()) * 4 >= len(rows):  # compact: keep the unfinished rows only
            keep = torch.nonzero(~done).flatten()
            rows, done = rows[keep], done[keep]
            keep = keep.to(dev)
            nxt, pad, key_valid = nxt[keep], pad[keep], key_valid[keep]
            k_cache, v_cache = k_cache[:, keep], v_cache[:, keep]
        logits, feats = _forward(r, nxt[:, None], (P - pad + t)[:, None], k_cache, v_cache, P + t, key_valid)
        if fed is not None:
            fed.step(feats[:, -1], rows, done)
    if fed is not None:
        features.extend(fed.rows())
    if not top_k_labels:
        return [(out[b], None, None) for b in range(B)]
    return [(out[b], torch.stack(labels_i[b]), torch.stack(labels_v[b])) for b in range(B)]


@torch.inference_mode()
def generate_served(
    r: LeanLlamaRunner,
    prompts: list[list[int]],
    max_new: int,
    temperature: float,
    top_p: float,
    eos_ids: set[int],
    seed: int,
    top_k_labels: int = 20,
    features: list | None = None,
):
    """``generate`` on the runner's own forward, as a model server runs it: each row a session of its own (no
    padding), the step's rows in one pass of the runner's product form (its float32 kernels, or 8-bit activations
    with ``activations="int8"``) and its C++ layer loop. Same results, and a list ``features`` gets the same rows
    (bf16, every position fed). The data then comes from the numbers the target is served in, at the cost of the
    served form's rows."""
    g = torch.Generator().manual_seed(seed)
    caches = [r.new_cache() for _ in prompts]
    token_of = r.scored_ids
    want = features is not None

    def feed(rows: list[int], ids: list[list[int]]):
        """One pass of the rows' sessions: their last logits, and with ``features`` every fed row's features."""
        got = r.forward_batch(
            [caches[b] for b in rows], ids, [1] * len(rows), True, norm_rows=[len(t) for t in ids] if want else None
        )
        return got if want else (got, [None] * len(rows))

    fed = [feed([b], [p]) for b, p in enumerate(prompts)]
    logits = torch.cat([lg[0] for lg, _ in fed])  # [B, columns]
    parts = [[norms[0]] for _, norms in fed]
    out, labels_i, labels_v = ([[] for _ in prompts] for _ in range(3))
    live = list(range(len(prompts)))  # the rows still answering, in logits' order
    eos = set(eos_ids)
    for t in range(max_new):
        if top_k_labels:
            top = torch.topk(torch.log_softmax(logits, dim=-1), top_k_labels, dim=-1)
            top_i, top_v = top.indices.int(), top.values.half()
        tokens = _choose(logits, temperature, top_p, g, token_of).tolist()
        for j, b in enumerate(live):
            out[b].append(tokens[j])
            if top_k_labels:
                labels_i[b].append(top_i[j])
                labels_v[b].append(top_v[j])
        live = [b for b in live if out[b][-1] not in eos]
        if not live or t == max_new - 1:
            break
        step, norms = feed(live, [out[b][-1:] for b in live])
        for b, rows in zip(live, norms) if want else ():
            parts[b].append(rows)
        logits = torch.cat(step)
    if want:
        features.extend(torch.cat(p).to(torch.bfloat16) for p in parts)
    if not top_k_labels:
        return [(o, None, None) for o in out]
    return [(out[b], torch.stack(labels_i[b]), torch.stack(labels_v[b])) for b in range(len(prompts))]


@torch.inference_mode()
def score(r: LeanLlamaRunner, pairs: list[tuple[list[int], list[int]]], top_k_labels: int = 20):
    """Teacher-forced labels: one batched pass over each (prompt, completion), and at every completion
    position the model's top-k ids [m, k] int32 and log-probs [m, k] fp16, as generate() records them for
    the tokens it samples itself. A pass over given tokens costs a fraction of generating them (no
    KV cache read back step after step), which is what makes labelling a draft's own answers cheap."""
    seqs = [p + c for p, c in pairs]
    T = max(len(s) for s in seqs)
    ids, pos, _, key_valid, k_cache, v_cache = _left_padded(r, seqs, T)
    x = _hidden(r, ids, pos, k_cache, v_cache, 0, key_valid)  # [B, T, hidden]
    out = []
    for b, (_, c) in enumerate(pairs):
        h = _rms(r, x[b, T - len(c) - 1 : T - 1], r.norm)  # the positions that predict each completion token
        top = torch.topk(torch.log_softmax(F.linear(h, r.lm_head).float(), dim=-1), top_k_labels, dim=-1)
        out.append((top.indices.int().cpu(), top.values.half().cpu()))
    return out


def budget_order(lengths: list[int], batch_size: int, seed: int, blocks_of: int = 8) -> list[int]:
    """The order to answer prompts in under a time budget: shuffled in blocks of `blocks_of` batches, sorted
    by length inside each block. Batches stay of similar length (little padding), and whatever the budget
    cuts off is a random share of the prompts rather than the longest ones: a plain shortest-first order
    answered only the shortest fifth to third of them (no passage to summarise, few long code tasks)."""
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    block = batch_size * blocks_of
    return [i for s in range(0, len(order), block) for i in sorted(order[s : s + block], key=lambda i: lengths[i])]


def generate_all(
    r,
    prompts,
    max_new,
    temperature,
    top_p,
    eos_ids,
    seed,
    batch_size,
    deadline=None,
    log=print,
    features=False,
    served=False,
):
    """Batches of similar length in budget_order; stops starting batches after the deadline (monotonic seconds).
    With `features`, each result carries the row's features as a fourth item (generate's `features`); served:
    each batch through generate_served instead of the padded forward."""
    order = budget_order([len(p) for p in prompts], batch_size, seed)
    results, t0, tokens = {}, time.monotonic(), 0
    for s in range(0, len(order), batch_size):
        if deadline is not None and time.monotonic() > deadline:
            log(f"  time budget reached after {len(results)} of {len(prompts)} prompts")
            break
        idx = order[s : s + batch_size]
        fed = [] if features else None
        batch = [prompts[i] for i in idx]
        if served:
            got = generate_served(r, batch, max_new, temperature, top_p, eos_ids, seed + s, features=fed)
        else:
            # a head's data needs no labels, only the features: no top-k over the vocabulary at every token
            labels = 0 if features else 20
            got = generate(r, batch, max_new, temperature, top_p, eos_ids, seed + s, features=fed, top_k_labels=labels)
        for j, (i, res) in enumerate(zip(idx, got)):
            results[i] = (*res, fed[j]) if features else res
            tokens += len(res[0])
        log(
            f"  {len(results)}/{len(prompts)} prompts, {tokens} tokens, {tokens / (time.monotonic() - t0):.0f} tokens/s"
        )
    return results
