"""A lean forward pass for Llama-architecture models at batch 1.

The stock transformers forward spends milliseconds per call on Python
bookkeeping, which for a small draft costs more than its arithmetic. This
runner takes the weights of any ``LlamaForCausalLM`` (fused QKV and gate/up
projections, the model's own rotary tables, so rope scaling is honoured) and
keeps a growable KV cache per session. Logits match the stock forward to float
rounding; both model servers use it for Llama models (``--runner auto``, the default).
The products of a step or a verify pass take whichever of two equivalent forms this
CPU's BLAS runs faster at a few rows, timed once at load (``--matmul auto``). On CPU
the products can instead run on int8 weights (``--quantize int8``, the draft's default
there): a draft step is memory-bound, and a quarter of the bytes is most of its time.
"""

from __future__ import annotations

import logging
import time
import warnings

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# A pass of at most this many rows is a step or a verify (K + 1 tokens plus the few the session has not seen);
# its products take the form chosen at load. Longer passes (prefills, rebuilds) keep F.linear, which MKL runs
# well at many rows (batch-128 generation: 190 tokens/s with it, 130 with the weights-first form).
SMALL_PASS_ROWS = 32
MATMUL_FORMS = ("auto", "linear", "weights-first")
QUANTIZE = ("none", "int8")


def weights_first(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T computed as (w @ x.T).T: [n, in], [out, in] -> [n, out].

    The same product as F.linear, summed in another order (float rounding apart). On an AVX2-only
    AMD EPYC, MKL runs this form at the memory roof from 2 to 5 rows, while F.linear's few-row GEMM
    runs at half that: a 3-token target verify took 70 ms against 140 ms, a 1-token step 62-64 ms both."""
    return (w @ x.t()).t().contiguous()


def choose_matmul(weights: list[torch.Tensor], rows=(2, 5, 9), reps: int = 3, margin: float = 0.9) -> tuple[str, dict]:
    """The faster form of a few-row product on this machine's BLAS, timed over `weights` (all of a model's
    matrices, so they come cold from memory as in a real pass). Weights-first must beat F.linear by
    `margin`, so that a near tie keeps the usual form rather than flipping between restarts."""
    if weights[0].device.type != "cpu":
        return "linear", {}
    forms = {"linear": F.linear, "weights-first": weights_first}
    xs = {(n, w.shape[1]): torch.randn(n, w.shape[1], dtype=w.dtype) for n in rows for w in weights}
    best = {name: float("inf") for name in forms}
    with torch.inference_mode():
        for _ in range(reps + 1):  # the first sweep warms up
            for name, fn in forms.items():
                t0 = time.perf_counter()
                for n in rows:
                    for w in weights:
                        fn(xs[n, w.shape[1]], w)
                best[name] = min(best[name], time.perf_counter() - t0)
    chosen = "weights-first" if best["weights-first"] < margin * best["linear"] else "linear"
    return chosen, {name: round(1e3 * t, 2) for name, t in best.items()}


def pack_int8(w: torch.Tensor):
    """[out, in] float weights -> fbgemm's packed int8 form: symmetric, one scale per output row."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12).double()
    with warnings.catch_warnings():  # quantized tensors are deprecated for new code, the ops are not gone
        warnings.simplefilter("ignore")
        q = torch.quantize_per_channel(w, scale, torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
    return torch.ops.quantized.linear_prepack(q, None)


def int8_linear(x: torch.Tensor, packed) -> torch.Tensor:
    """x @ w.T on packed int8 weights; x is quantized per pass (dynamic), the result is float32.
    reduce_range keeps AVX2's 16-bit int8 dot products from saturating.

    The pass's one range makes a row's result depend a little on the rows beside it, and float rounding that
    crosses a quantization step moves a logit by ~1e-2 rather than ~1e-7: a session rebuilt in one prefill sees
    slightly other draft probabilities than the one it replaces. Sampling stays exact (any q is), but a seeded
    sampled request replays token for token across a rebuild only with a float draft. Quantizing each row on
    its own grid was measured: 1 ms more per draft step for +0.005 agreement, and attention's rounding still
    crosses steps, so it bought no replay."""
    return torch.ops.quantized.linear_dynamic(x, packed, True)


class LeanCache:
    """Keys and values of one session: [layers, kv_heads, capacity, head_dim].

    The capacity grows in steps of GROW tokens, not by doubling: the pool budgets memory by tokens held,
    and doubling could hold up to twice that (a 16 GB GPU's budget has no room for it). Copying the cache
    once every GROW tokens costs under 1% of the decoding time of those tokens."""

    GROW = 256

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype, device):
        self.k = torch.empty(layers, kv_heads, self.GROW, head_dim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.length = 0

    def reserve(self, n: int) -> None:
        need = self.length + n
        if need > self.k.shape[2]:
            cap = -(-need // self.GROW) * self.GROW
            grow = lambda t: torch.cat([t, t.new_empty(t.shape[0], t.shape[1], cap - t.shape[2], t.shape[3])], dim=2)
            self.k, self.v = grow(self.k), grow(self.v)

    def get_seq_length(self) -> int:
        return self.length


class LeanLlamaRunner:
    """Same interface as CausalLMRunner: new_cache, crop, forward."""

    def __init__(self, model, vocab_size: int, max_len: int, matmul: str = "auto", quantize: str = "none"):
        cfg = model.config
        if getattr(cfg, "model_type", "") != "llama":
            raise ValueError(f"the lean runner handles Llama models, not {cfg.model_type!r}")
        self.vocab_size = vocab_size
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        m = model.model
        self.embed = m.embed_tokens.weight.detach()  # [vocab, hidden]
        self.layers = []
        for layer in m.layers:
            a, mlp = layer.self_attn, layer.mlp
            self.layers.append((
                layer.input_layernorm.weight.detach(),
                torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach(),  # [(h + 2 kv) * d, hidden]
                a.o_proj.weight.detach(),
                layer.post_attention_layernorm.weight.detach(),
                torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach(),  # [2 * inter, hidden]
                mlp.down_proj.weight.detach(),
            ))
        self.norm = m.norm.weight.detach()
        from specdec.runner import output_token_ids

        self.kept = output_token_ids(model)  # [kept] or None: score only these rows
        head = model.get_output_embeddings().weight.detach()[:vocab_size]  # [vocab, hidden]
        self.lm_head = head if self.kept is None else head[self.kept].contiguous()  # [vocab or kept, hidden]
        positions = torch.arange(max_len, device=self.device)[None]
        probe = torch.zeros(1, 1, cfg.hidden_size, dtype=self.dtype, device=self.device)
        cos, sin = m.rotary_emb(probe, positions)  # [1, max_len, head_dim]
        self.cos, self.sin = cos[0], sin[0]
        self.max_len = max_len
        if matmul not in MATMUL_FORMS:
            raise ValueError(f"matmul must be one of {', '.join(MATMUL_FORMS)}, not {matmul!r}")
        if quantize not in QUANTIZE:
            raise ValueError(f"quantize must be one of {', '.join(QUANTIZE)}, not {quantize!r}")
        if quantize == "int8" and (self.device.type != "cpu" or self.dtype != torch.float32):
            raise ValueError(f"int8 products run on CPU from float32 weights, not {self.device.type} {self.dtype}")
        self.quantize = quantize
        self.matmul_timings_ms: dict = {}
        if quantize == "int8":  # every product, any width: fbgemm's int8 GEMM is fast at one row and at many
            self.layers = [(ln1, pack_int8(wqkv), pack_int8(wo), ln2, pack_int8(wgu), pack_int8(wd))
                           for ln1, wqkv, wo, ln2, wgu, wd in self.layers]
            self.lm_head = pack_int8(self.lm_head)
            matmul = "int8"
            log.info("lean runner: products on int8 weights (per output row), activations quantized per pass")
        elif matmul == "auto":
            weights = [w for layer in self.layers for w in (layer[1], layer[2], layer[4], layer[5])] + [self.lm_head]
            matmul, self.matmul_timings_ms = choose_matmul(weights)
            log.info("lean runner: passes of up to %d rows use the %s product (one timed sweep, ms: %s)",
                     SMALL_PASS_ROWS, matmul, self.matmul_timings_ms)
        self.matmul = matmul

    def new_cache(self) -> LeanCache:
        return LeanCache(len(self.layers), self.n_kv, self.head_dim, self.dtype, self.device)

    @staticmethod
    def crop(cache: LeanCache, length: int) -> None:
        cache.length = min(cache.length, length)

    def _rms(self, x, w):
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)

    def _rope(self, x, cos, sin):  # x: [heads, n, d]; cos/sin: [n, d]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    @torch.inference_mode()
    def forward(self, cache: LeanCache, token_ids, num_logits: int) -> torch.Tensor:
        """Append token_ids (a list, or a 1-D tensor on the device); logits of the last num_logits positions:
        [num_logits, vocab] float32."""
        n, start = len(token_ids), cache.length
        if start + n > self.max_len:
            raise ValueError(f"sequence of {start + n} tokens exceeds {self.max_len}")
        cache.reserve(n)
        h, kv, d = self.n_heads, self.n_kv, self.head_dim
        linear = (int8_linear if self.quantize == "int8" else
                  weights_first if self.matmul == "weights-first" and n <= SMALL_PASS_ROWS else F.linear)
        if not isinstance(token_ids, torch.Tensor):  # a tensor on the device can be a CUDA graph's static input
            token_ids = torch.tensor(token_ids, device=self.device)
        x = self.embed[token_ids]  # [n, hidden]
        cos, sin = self.cos[start:start + n], self.sin[start:start + n]
        end = start + n
        mask = None
        if n > 1:  # causal within the new tokens, everything before them visible
            mask = torch.ones(n, end, dtype=torch.bool, device=self.device).tril(start)
        for i, (ln1, wqkv, wo, ln2, wgu, wd) in enumerate(self.layers):
            qkv = linear(self._rms(x, ln1), wqkv)  # [n, (h + 2 kv) * d]
            q = qkv[:, : h * d].view(n, h, d).transpose(0, 1)  # [h, n, d]
            k = qkv[:, h * d:(h + kv) * d].view(n, kv, d).transpose(0, 1)  # [kv, n, d]
            v = qkv[:, (h + kv) * d:].view(n, kv, d).transpose(0, 1)
            cache.k[i, :, start:end] = self._rope(k, cos, sin)
            cache.v[i, :, start:end] = v
            att = F.scaled_dot_product_attention(self._rope(q, cos, sin)[None], cache.k[i, :, :end][None],
                                                 cache.v[i, :, :end][None], attn_mask=mask, enable_gqa=True)
            x = x + linear(att[0].transpose(0, 1).reshape(n, h * d), wo)
            gate, up = linear(self._rms(x, ln2), wgu).chunk(2, dim=-1)
            x = x + linear(F.silu(gate) * up, wd)
        cache.length = end
        x = self._rms(x[n - num_logits:], self.norm)
        logits = linear(x, self.lm_head).float()  # [num_logits, vocab or kept]
        if self.kept is None:
            return logits
        full = torch.full((num_logits, self.vocab_size), float("-inf"), device=logits.device)
        return full.index_copy_(1, self.kept.to(logits.device), logits)  # [num_logits, vocab]
