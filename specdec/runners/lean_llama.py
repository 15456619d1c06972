"""A lean forward pass for Llama-architecture models over a batch of sessions.

The stock transformers forward spends milliseconds per call on Python bookkeeping, which for a small draft costs
more than its arithmetic. This runner takes the weights of any ``LlamaForCausalLM`` (fused QKV and gate/up
projections, the model's own rotary tables, so rope scaling is honoured) and keeps a growable KV cache per
session. Logits match the stock forward to float rounding; both model servers use it for Llama models
(``--runner auto``, the default). Which form each pass's matrix products take, on which packed weights, is the
runner's ``plan`` (``products.py``: ``--matmul``, ``--quantize``); the work between the products runs in
specdec's CPU kernels where they build (``kernels/``), else in torch.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from specdec.runners.forms import quantize_rows
from specdec.runners.kernels import kernels_for
from specdec.runners.kv_cache import LeanCache, Slabs, kv_dtype
from specdec.runners.products import (
    ACTIVATION_BITS,
    SMALL_PASS_ROWS,
    TIMED_ROWS,
    LayerWeights,
    Plan,
    check_weights,
    make_plan,
)
from specdec.runners.q8_blocks import q8_kernels, quantized
from specdec.runners.vocab import output_token_ids


class TorchLayerOps:
    """The work of a layer between its products, in eager torch: any device and dtype, and the reference
    that specdec's CPU kernels (``specdec/runners/kernels/layer.cpp``, same signatures) are tested against."""

    @staticmethod
    def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """Llama's RMSNorm. Below float32 as transformers rounds it: normalized in float32, rounded to the
        model's dtype, then scaled by the weight in that dtype."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), w, eps)
        h = x.float()
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    @staticmethod
    def attend(
        qkv: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        start: int,
        n_heads: int,
    ) -> torch.Tensor:
        """qkv [n, (h + 2 kv) d] of n new tokens; k, v [kv, capacity, d], one layer of a cache holding `start`
        tokens; cos, sin [n, d]. Writes the new keys (rotated) and values at start .. start + n - 1; returns
        the causal attention of the rotated queries over everything before them and themselves: [n, h d]."""
        n, (kv, _, d), h = qkv.shape[0], k.shape, n_heads
        end = start + n
        q = qkv[:, : h * d].view(n, h, d).transpose(0, 1)  # [h, n, d]
        k[:, start:end] = rope(qkv[:, h * d : (h + kv) * d].view(n, kv, d).transpose(0, 1), cos, sin)
        v[:, start:end] = qkv[:, (h + kv) * d :].view(n, kv, d).transpose(0, 1)
        att = sdpa(rope(q, cos, sin), k[:, :end].to(q.dtype), v[:, :end].to(q.dtype))  # a float16 cache widened
        return att.transpose(0, 1).reshape(n, h * d)

    @staticmethod
    def silu_mul(gu: torch.Tensor) -> torch.Tensor:
        gate, up = gu.chunk(2, dim=-1)
        return F.silu(gate) * up


def _to_device(w: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A weight detached and on the device: the same tensor where it already is there, else a copy."""
    return w.detach().to(device)


def rope(x, cos, sin):
    """Llama's rotary embedding (rotate_half form). x: [..., n, d]; cos, sin: [n, d]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of n new queries over a cache that ends with them: q [h, n, d], k, v [kv, end, d]
    -> [h, n, d], in the model's dtype, by a call that CUDA's flash or memory-efficient kernel takes (a dense
    mask together with enable_gqa leaves only the float32 math kernel). A lone query sees every key: no mask,
    the kernel groups the KV heads itself. Several queries take the lower-right causal bias: with the KV heads
    grouped in the kernel where flash attention runs (and on CPU), else widened to every query head for the
    memory-efficient kernel, which takes the bias but not grouped heads."""
    if q.shape[1] == 1:
        return F.scaled_dot_product_attention(q[None], k[None], v[None], enable_gqa=True)[0]
    bias = causal_lower_right(q.shape[1], k.shape[1])
    if groups_heads_in_kernel(q.device):
        return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=bias, enable_gqa=True)[0]
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)  # [h, end, d]
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=bias)[0]


@functools.cache
def groups_heads_in_kernel(device: torch.device) -> bool:
    """Whether the several-query attention above keeps KV heads grouped: on CPU, and on CUDA where flash
    attention runs (compute capability 8.0 on)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 0)


class LeanLlamaRunner:
    """Same interface as CausalLMRunner: new_cache, crop, forward."""

    cache_step = LeanCache.GROW  # a session's cache holds up to this many tokens more than it counts

    def __init__(
        self,
        model,
        vocab_size: int,
        max_len: int,
        matmul: str = "auto",
        quantize: str = "none",
        gguf: str | None = None,
        device=None,
        activations: str = "float32",
        kv_cache: str = "model",
    ):
        """gguf: the GGUF file the model was loaded from, if any: its blocks give the gguf product form.
        activations: float32, or int8 (x quantized to 8 bits in every product, on the GGUF blocks or int8 rows).
        kv_cache: the KV cache's dtype, "model" (the weights') or "float16" (kv_cache.kv_dtype).
        device: where the runner's weights live (default: where the model's are). The fused matrices are built
        where the model is and only they move, so a model loaded on the CPU leaves nothing of itself on the
        device: the device holds each weight once."""
        cfg = model.config
        if getattr(cfg, "model_type", "") != "llama":
            raise ValueError(f"the lean runner handles Llama models, not {cfg.model_type!r}")
        self.vocab_size = vocab_size
        self.max_len = max_len
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.kv_dtype = kv_dtype(kv_cache, self.dtype, self.device)
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.scored_ids = output_token_ids(model)  # [scored] on the CPU, or None: the head scores only these tokens
        self._scored_ids_on_device = None if self.scored_ids is None else self.scored_ids.to(self.device)
        move = functools.partial(_to_device, device=self.device)
        self.embed, self.layers, self.norm, self.lm_head = _llama_weights(model, vocab_size, self.scored_ids, move)
        self.mix, self._mix_product = _input_mix(model, move, quantize, activations)
        self.cos, self.sin = rotary_tables(model, max_len, self.dtype, move)
        self.quantize = quantize
        self.activations = activations
        self.matmul = matmul
        self.layer_ops = kernels_for(self.embed) or TorchLayerOps
        self.graphs = None  # a CudaGraphs (specdec/runners/cuda_graphs.py) where few-row passes replay as graphs
        # the caches' tensors, recycled where graphs run
        self.slabs = Slabs(len(self.layers), self.n_kv, self.head_dim, self.kv_dtype, self.device)
        self.plan: Plan = make_plan(
            self.layers,
            self.lm_head,
            matmul,
            quantize,
            gguf=gguf,
            restricted=self.scored_ids is not None,
            layer_kernels=None if self.layer_ops is TorchLayerOps else self.layer_ops,
            n_heads=self.n_heads,
            n_kv=self.n_kv,
            eps=self.eps,
            run_pass=self._scratch_pass(),
            timed_rows=tuple(n for n in TIMED_ROWS if n <= max_len) or (max_len,),
            activations=activations,
        )
        if quantize != "none":  # the runner keeps the quantized weights alone, no float copy of the matrices
            self.layers, self.lm_head = self.plan.long.products.layers, self.plan.long.products.head

    def _scratch_pass(self, context: int = 64):
        """run_pass(plan, n) for the plan's timing: a pass of n rows under `plan` on a scratch session of
        `context` tokens (fewer if the model's length leaves no room), cut back after each pass."""
        context = max(0, min(context, self.max_len - SMALL_PASS_ROWS))
        cache = None

        def run_pass(plan: Plan, n: int) -> None:
            nonlocal cache
            try:
                if cache is None:
                    cache = self.new_cache()
                    if context:
                        self.forward_batch([cache], [[i % self.vocab_size for i in range(context)]], [1], plan=plan)
                self.forward_batch([cache], [[(context + i) % self.vocab_size for i in range(n)]], [n], plan=plan)
            finally:
                self.crop(cache, context)

        return run_pass

    def describe(self) -> str:
        layer = "" if self.layer_ops is TorchLayerOps else " with specdec's CPU layer kernels"
        if stacks := self.plan.stacks:
            layer += f" (the layers' loop in C++ for {', '.join(sorted(stacks))})"
        graphs = "" if self.graphs is None else f"; {self.graphs.describe()}"
        cache = "" if self.kv_dtype == self.dtype else f"; a {str(self.kv_dtype).removeprefix('torch.')} KV cache"
        return f"lean forward{layer}; {self.plan.description}{cache}{graphs}"

    @property
    def numerics(self) -> str:
        """What a pass's numbers are (ModelInfo.numerics): the weights' dtype and what quantizes the products'
        operands. The product forms of one setting give the same values up to float rounding."""
        parts = [str(self.dtype).removeprefix("torch.")]
        if self.quantize != "none":
            parts.append(f"{self.quantize} weights")
        if self.activations != "float32":
            parts.append(f"{ACTIVATION_BITS[self.activations]}-bit activations")
        if self.kv_dtype != self.dtype:
            parts.append(f"{str(self.kv_dtype).removeprefix('torch.')} KV cache")
        return ", ".join(parts)

    @property
    def batch_invariant(self) -> bool:
        """Whether a session's logits are the same bit for bit whatever it is batched with and however its tokens
        are split into passes (Plan.batch_invariant)."""
        return self.plan.batch_invariant

    @property
    def feature_size(self) -> int:
        """Values in a feature row (forward_batch's features_in and norm rows): the hidden size."""
        return self.embed.shape[1]

    def new_cache(self) -> LeanCache:
        return LeanCache(len(self.layers), self.n_kv, self.head_dim, self.kv_dtype, self.device, self.slabs)

    @staticmethod
    def crop(cache: LeanCache, length: int) -> None:
        cache.length = min(cache.length, length)

    @staticmethod
    def read_kv(cache: LeanCache, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the keys and values of positions start .. start + n - 1 (specdec/prefix_cache.py)."""
        return cache.k[:, :, start : start + n].clone(), cache.v[:, :, start : start + n].clone()

    @staticmethod
    def write_kv(cache: LeanCache, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Put read_kv's keys and values at positions start .. of a cache holding `start` tokens."""
        n = k.shape[2]
        if start != cache.length:
            raise ValueError(f"a cache of {cache.length} tokens takes positions from {cache.length}, not {start}")
        cache.reserve(n)
        cache.k[:, :, start : start + n] = k
        cache.v[:, :, start : start + n] = v
        cache.length = start + n

    def forward(self, cache: LeanCache, token_ids, num_logits: int, scored_only: bool = False) -> torch.Tensor:
        """Append token_ids (a list, or a 1-D tensor on the device); logits of the last num_logits positions:
        [num_logits, vocab] float32, or with scored_only [num_logits, len(scored_ids)], the columns of the
        tokens the model scores (a restricted draft's scored_ids, without widening them to the vocabulary)."""
        return self.forward_batch([cache], [token_ids], [num_logits], scored_only)[0]

    @torch.inference_mode()
    def forward_batch(
        self,
        caches: list[LeanCache],
        token_ids: list,
        num_logits: list[int],
        scored_only: bool = False,
        *,
        plan: Plan | None = None,
        features_in: list | None = None,
        norm_rows: list[int] | None = None,
    ):
        """One pass over several sessions: session i appends token_ids[i] to caches[i] and gets the logits of
        its last num_logits[i] positions, as ``forward`` gives them. The products run once over every session's
        rows (the weights are read once), in the form the runner's plan has for the pass's rows (`plan`: another
        plan, for the timing at load); attention runs per session, over its own cache and positions.

        features_in: a head draft's runner (``mix``, specdec/head.py) reads features_in[i], [len(token_ids[i]),
        hidden] rows beside the tokens (zeros where None: the timing passes); another runner refuses them.
        norm_rows: return also the final-norm output of each session's last norm_rows[i] rows (a target's
        features: every row fed; a head's predicted feature: its last) as (logits, norms), norms[i]
        [norm_rows[i], hidden] in the runner's dtype or None for 0, the logits computed from them (_final_norm)."""
        ns, starts = [len(t) for t in token_ids], [c.length for c in caches]
        self._reserve(caches, ns, norm_rows)
        graphs = self.graphs
        if graphs and (graphed := graphs.run(caches, token_ids, num_logits, plan, features_in, norm_rows)) is not None:
            logits, norms = graphed if norm_rows is not None else (graphed, None)
            if self.scored_ids is not None and not scored_only:
                logits = [self._widen(out) for out in logits]
            return logits if norm_rows is None else (logits, norms)
        rows = sum(ns)
        plan = self.plan if plan is None else plan
        form = plan.by_rows[rows] if rows <= SMALL_PASS_ROWS else plan.long
        linear, layers, lm_head = form.products
        if len(caches) == 1:
            ids = token_ids[0]
            if not isinstance(ids, torch.Tensor):  # a tensor on the device can be a CUDA graph's static input
                ids = torch.tensor(ids, device=self.device)
            cos, sin = self.cos[starts[0] : starts[0] + rows], self.sin[starts[0] : starts[0] + rows]
        else:
            ids = torch.tensor([t for ts in token_ids for t in ts], device=self.device)
            positions = torch.cat([torch.arange(start, start + n) for start, n in zip(starts, ns)]).to(self.device)
            cos, sin = self.cos[positions], self.sin[positions]
        x = self._mixed(self.embed[ids], features_in, ns)  # [rows, hidden]
        ops, eps = self.layer_ops, self.eps
        if form.stack is not None:
            x = form.stack.forward_batch(x, [c.k for c in caches], [c.v for c in caches], cos, sin, starts, ns)
        else:
            for i, (ln1, wqkv, wo, ln2, wgu, wd) in enumerate(layers):
                att = self._attend(linear(ops.rms_norm(x, ln1, eps), wqkv), caches, i, cos, sin, starts, ns)
                x = x + linear(att, wo)
                x = x + linear(ops.silu_mul(linear(ops.rms_norm(x, ln2, eps), wgu)), wd)
        for c, start, n in zip(caches, starts, ns):
            c.length = start + n
        normed, norms = self._final_norm(x, ns, num_logits, norm_rows)
        logits = linear(normed, lm_head).float()  # [sum num_logits, vocab or scored]
        out = list(logits.split(num_logits)) if len(caches) > 1 else [logits]
        if self.scored_ids is not None and not scored_only:
            out = [self._widen(part) for part in out]
        return out if norm_rows is None else (out, norms)

    def _reserve(self, caches: list[LeanCache], ns: list[int], norm_rows: list[int] | None) -> None:
        """Check a pass of ns[i] rows on caches[i] before any work, and make the room for its rows."""
        for c, n in zip(caches, ns):
            if c.length + n > self.max_len:
                raise ValueError(f"sequence of {c.length + n} tokens exceeds {self.max_len}")
        if norm_rows is not None and any(not 0 <= m <= n for m, n in zip(norm_rows, ns)):
            raise ValueError(f"final-norm rows {norm_rows} asked of passes of {ns} rows")
        for c, n in zip(caches, ns):
            c.reserve(n)

    def _final_norm(self, x, ns, num_logits, norm_rows):
        """(the final norm of the logits rows [sum num_logits, hidden], each session's last norm_rows[i] normed
        rows or None): the norm runs once over the rows either needs, row by row."""
        keep = num_logits if norm_rows is None else [max(k, m) for k, m in zip(num_logits, norm_rows)]
        normed = self.layer_ops.rms_norm(self._last_rows(x, ns, keep), self.norm, self.eps)  # [sum keep, hidden]
        if norm_rows is None:
            return normed, None
        parts = normed.split(keep) if len(ns) > 1 else [normed]
        norms = [part[len(part) - m :] if m else None for part, m in zip(parts, norm_rows)]
        if keep != num_logits:
            rows_of_logits = [part[len(part) - k :] for part, k in zip(parts, num_logits)]
            normed = rows_of_logits[0] if len(parts) == 1 else torch.cat(rows_of_logits)
        return normed, norms

    def _widen(self, scored: torch.Tensor) -> torch.Tensor:
        """Logits of the scored tokens [k, len(scored_ids)] as [k, vocab], -inf for the others."""
        full = torch.full((scored.shape[0], self.vocab_size), float("-inf"), device=scored.device)
        return full.index_copy_(1, self._scored_ids_on_device, scored)

    def _last_rows(self, x: torch.Tensor, ns: list[int], keep: list[int]) -> torch.Tensor:
        """The last keep[i] of each session's ns[i] rows of x [sum ns, hidden], in order."""
        if len(ns) == 1:
            return x[ns[0] - keep[0] :]
        ends = torch.tensor(ns).cumsum(0).tolist()
        return x[torch.cat([torch.arange(end - k, end) for end, k in zip(ends, keep)]).to(self.device)]

    def _mixed(self, x: torch.Tensor, features_in: list | None, ns: list[int]) -> torch.Tensor:
        """A head's input: fc . [embedding ; feature] for every row ([rows, hidden]); a plain model's embeddings."""
        if self.mix is None:
            if features_in is not None:
                raise ValueError("this model reads no features")
            return x
        rows = [
            torch.zeros(n, x.shape[1], dtype=x.dtype, device=x.device) if f is None else f.to(x.device, x.dtype)
            for f, n in zip(features_in or [None] * len(ns), ns)
        ]
        return self._mix_product(torch.cat([x, torch.cat(rows)], dim=1), self.mix)

    def _attend(self, qkv, caches, layer, cos, sin, starts, ns):
        """Layer `layer`'s attention of every session's rows over its own cache: [rows, heads * head_dim]."""
        ops, h = self.layer_ops, self.n_heads
        if len(caches) == 1:
            return ops.attend(qkv, caches[0].k[layer], caches[0].v[layer], cos, sin, starts[0], h)
        if ops is not TorchLayerOps:  # specdec's kernel: all sessions in one parallel region
            return ops.attend_batch(
                qkv, [c.k[layer] for c in caches], [c.v[layer] for c in caches], cos, sin, starts, ns, h
            )
        parts, row = [], 0
        for c, start, n in zip(caches, starts, ns):
            parts.append(
                ops.attend(qkv[row : row + n], c.k[layer], c.v[layer], cos[row : row + n], sin[row : row + n], start, h)
            )
            row += n
        return torch.cat(parts)


def _llama_weights(model, vocab_size: int, scored_ids: torch.Tensor | None, move):
    """(embed [vocab, hidden], [LayerWeights per layer], final norm [hidden], head [scored, hidden]) of a
    LlamaForCausalLM, each moved by `move`: QKV and gate/up fused where the model is, then moved. A tied head
    is a view of the embedding, not a second copy; a head that scores only scored_ids keeps their rows."""
    m = model.model
    embed = move(m.embed_tokens.weight)
    layers = []
    for layer in m.layers:
        attn, mlp = layer.self_attn, layer.mlp
        layers.append(
            LayerWeights(
                ln1=move(layer.input_layernorm.weight),
                wqkv=move(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])),
                wo=move(attn.o_proj.weight),
                ln2=move(layer.post_attention_layernorm.weight),
                wgu=move(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
                wd=move(mlp.down_proj.weight),
            )
        )
    head = model.get_output_embeddings().weight
    if scored_ids is not None:
        lm_head = move(head[scored_ids])
    elif head.data_ptr() == m.embed_tokens.weight.data_ptr():
        lm_head = embed[:vocab_size]
    else:
        lm_head = move(head[:vocab_size])
    return embed, layers, move(m.norm.weight), lm_head


def _input_mix(model, move, quantize: str = "none", activations: str = "float32"):
    """A head draft's fc ([hidden, 2 hidden]) and the product that applies it, or (None, None). On specdec's CPU
    kernels where they take it, so that a row's input is the same whatever pass it is in (batch invariance); on
    the quantized weights the runner's products take (a draft's numbers change only q): in float32 fc was a third
    of the bytes a head's step reads."""
    head = getattr(model, "specdec_head", None)
    if head is None:
        return None, None
    fc = move(head.fc)
    kernels = kernels_for(fc)
    if kernels is None:
        return fc, F.linear
    if quantize == "int4":  # the layers' form (products.make_plan): Q4_1 blocks, x quantized per row
        check_weights(quantize, activations)
        bits = ACTIVATION_BITS[activations]
        _, isa = q8_kernels(fc, bits)
        return quantized(fc, quantize, isa, bits), lambda x, w: w.product(kernels, x)
    if quantize == "int8":
        return quantize_rows(fc), lambda x, rows: kernels.few_rows_int8(x, *rows)
    return fc, kernels.few_rows


def rotary_tables(model, max_len: int, dtype, move) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own rotary cos and sin ([max_len, head_dim] each), computed where it is, then moved."""
    m = model.model
    positions = torch.arange(max_len, device=m.embed_tokens.weight.device)[None]
    probe = torch.zeros(1, 1, model.config.hidden_size, dtype=dtype, device=positions.device)
    cos, sin = m.rotary_emb(probe, positions)  # [1, max_len, head_dim]
    return move(cos[0]), move(sin[0])
