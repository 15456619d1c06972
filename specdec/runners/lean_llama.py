"""A lean forward pass for Llama-architecture models at batch 1.

The stock transformers forward spends milliseconds per call on Python
bookkeeping, which for a small draft costs more than its arithmetic. This
runner takes the weights of any ``LlamaForCausalLM`` (fused QKV and gate/up
projections, the model's own rotary tables, so rope scaling is honoured) and
keeps a growable KV cache per session. Logits match the stock forward to float
rounding; both model servers use it for Llama models (``--runner auto``, the default).
The products of a step or a verify pass take, for each row count, whichever equivalent form this
CPU runs fastest, timed once at load (``--matmul auto``): MKL's F.linear, weights-first, specdec's
own few-row kernel (``specdec/runners/kernels``, compiled on first use) or, where that cannot be built,
oneDNN's packed GEMM. Few-row GEMMs fall off cliffs that differ from CPU to CPU, and speculative
decoding needs a verify of K + 1 rows to cost what a step costs. On CPU
the products can instead run on int8 weights (``--quantize int8``, the draft's default
there): a draft step is memory-bound, and a quarter of the bytes is most of its time. specdec's
kernel widens them to float in registers (one scale per row, x stays float32); where it cannot be
built, fbgemm's dynamic int8 product runs them.
"""

from __future__ import annotations

import functools
import logging
import time
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

import specdec.runners.gguf_blocks as gguf_blocks
from specdec.runners.kernels import kernels_for
from specdec.runners.vocab import output_token_ids

log = logging.getLogger(__name__)

# A pass of at most this many rows is a step or a verify (K + 1 tokens plus the few the session has not seen);
# its products take the form planned at load for its row count. Longer passes (prefills, rebuilds) keep F.linear,
# which MKL runs well at many rows (batch-128 generation: 190 tokens/s with it, 130 with the weights-first form;
# a 256-row pass over the target's matrices: 262 ms with it, 320 with oneDNN's packed form).
SMALL_PASS_ROWS = 32
FORMS = ("linear", "weights-first", "onednn", "fewrow", "gguf")
MATMUL_FORMS = ("auto", *FORMS)
TIMED_ROWS = (1, 2, 3, 4, 6, 9, 16, SMALL_PASS_ROWS)  # row counts `auto` times; the ones between take the next up
QUANTIZE = ("none", "int8")
# Product forms in specdec's kernel: each output row is summed on its own, in an order that depends on nothing
# but the row (products.cpp), so a row's result is the one it gets alone, whatever the pass's width.
ROW_INDEPENDENT = ("fewrow", "gguf", "int8")


def weights_first(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T computed as (w @ x.T).T: [n, in], [out, in] -> [n, out].

    The same product as F.linear, summed in another order (float rounding apart). On an AVX2-only
    AMD EPYC, MKL runs this form at the memory roof from 2 to 5 rows, while F.linear's few-row GEMM
    runs at half that: a 3-token target verify took 70 ms against 140 ms, a 1-token step 62-64 ms both."""
    return (w @ x.t()).t().contiguous()


def cpu_float32(w: torch.Tensor) -> bool:
    """Whether specdec's kernel and oneDNN's packed form can take these weights."""
    return w.device.type == "cpu" and w.dtype == torch.float32


def memory_available() -> int | None:
    """Bytes the kernel could give this process now (Linux MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def pack_onednn(w: torch.Tensor) -> torch.Tensor:
    """[out, in] float32 weights -> oneDNN's blocked layout for its GEMM (an opaque tensor, same bytes)."""
    return torch.ops.mkldnn._reorder_linear_weight(w, None)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x @ w.T on weights packed by pack_onednn: the same product, summed in oneDNN's order.

    On an AVX-512 Xeon (2 threads, the target's 121 matrices), MKL's F.linear takes 20 ms at 1-3 rows and
    35-48 ms at 4-9, a cliff where its few-row GEMM changes kernel; this form takes 23-24 ms from 1 to 6 rows
    and 29.5 at 9. It loses at 1 row (the reorder suits a GEMM, not a GEMV), hence a plan per row count.
    It needs a second copy of the weights, so auto tries it only where specdec's kernel cannot be built."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


OUT_OF_THE_RACE = 2.0  # a form this many times slower than the best at a row count after two sweeps is not timed again there


def time_passes(forms, run_pass, rows=TIMED_ROWS, reps: int = 3, clock=time.perf_counter) -> dict[str, dict[int, float]]:
    """forms: product form names; run_pass(form, n) runs one whole forward pass of n rows with every product
    in that form. The best of `reps` timed sweeps, in ms, per form and row count; the sweeps alternate forms,
    so a slow moment of the machine hits all of them. After two sweeps, a form still more than OUT_OF_THE_RACE
    times slower than the best at a row count keeps its best timing there: passes vary by a few percent, and
    its later sweeps would only spend start-up time (the target's gguf form beats the float32 ones by 3x at
    1-9 rows; skipping them took the timing at load from 4.2 to 2.6 s on the Xeon, same plan). Not after one:
    a pass held up once (the Zen 5 VM timed the gguf form's 4-row pass at 36.6 ms, against 5 ms, while another
    process started) took the fastest form out of the race, and every 4-row verify ran 3x slower until restart.

    Whole passes, not the products alone: a form's cost in a pass is not its cost in a loop of products (on
    the Xeon, specdec's kernel beat MKL at 1-3 rows by 2-3 ms a pass, interleaved, where the products alone
    said 1.3 ms, inside the margin)."""
    for name in forms:  # warm-up: every matrix read once in each form
        run_pass(name, rows[0])
    best = {name: {n: float("inf") for n in rows} for name in forms}
    racing = {n: list(forms) for n in rows}
    for sweep in range(reps):
        for n in rows:
            for name in racing[n]:
                t0 = clock()
                run_pass(name, n)
                best[name][n] = min(best[name][n], 1e3 * (clock() - t0))
            if sweep >= 1:
                fastest = min(best[name][n] for name in forms)
                racing[n] = [name for name in racing[n] if best[name][n] <= OUT_OF_THE_RACE * fastest]
    return best


def plan_products(timings: dict[str, dict[int, float]], margin: float = 0.95,
                  max_rows: int = SMALL_PASS_ROWS) -> tuple[str, ...]:
    """The product form of a pass of n rows, for n = 0 .. max_rows (index n; 0 unused). A row count takes
    the timings of the nearest timed count at or above it. Another form replaces F.linear only where it
    beats it by `margin`, so that a near tie keeps the usual form rather than flipping between restarts.
    5%: best-of-3 whole passes vary by 2-4% between restarts on the Xeon, while the kernel's 6-10% lead over
    MKL at 1-3 rows (interleaved) straddled the 10% margin used before and flipped the plan at random."""
    timed = sorted(timings["linear"])
    plan = ["linear"]
    for n in range(1, max_rows + 1):
        at = next((r for r in timed if r >= n), timed[-1])
        best = min(timings, key=lambda name: timings[name][at])
        plan.append(best if timings[best][at] < margin * timings["linear"][at] else "linear")
    return tuple(plan)


def describe_plan(plan: tuple[str, ...]) -> str:
    """("linear", "linear", "linear", "onednn", ...) -> "1-2 rows: linear, 3-32 rows: onednn"."""
    spans, start = [], 1
    for n in range(2, len(plan) + 1):
        if n == len(plan) or plan[n] != plan[start]:
            rows = f"{start}-{n - 1} rows" if n - 1 > start else f"{start} row" + "s" * (start > 1)
            spans.append(f"{rows}: {plan[start]}")
            start = n
    return ", ".join(spans)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float weights -> (int8 [out, in rounded up to 16, zero-padded], float32 scale [out]):
    symmetric, one scale per output row; the form specdec's ``few_rows_int8`` reads."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)  # [out]
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return F.pad(q, (0, -w.shape[1] % 16)).contiguous(), scale


def pack_int8(w: torch.Tensor):
    """[out, in] float weights -> fbgemm's packed int8 form: symmetric, one scale per output row."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12).double()
    with warnings.catch_warnings():  # quantized tensors are deprecated for new code, the ops are not gone
        warnings.simplefilter("ignore")
        q = torch.quantize_per_channel(w, scale, torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
    return torch.ops.quantized.linear_prepack(q, None)


def int8_linear(x: torch.Tensor, packed) -> torch.Tensor:
    """x @ w.T on fbgemm's packed int8 weights, where specdec's kernels cannot be built; x is quantized per pass
    (dynamic), the result is float32. reduce_range keeps AVX2's 16-bit int8 dot products from saturating.

    The pass's one range makes a row's result depend a little on the rows beside it, and float rounding that
    crosses a quantization step moves a logit by ~1e-2 rather than ~1e-7: a session rebuilt in one prefill sees
    slightly other draft probabilities than the one it replaces. Sampling stays exact (any q is), but a seeded
    sampled request then replays token for token across a rebuild only with a float draft. specdec's
    ``few_rows_int8`` keeps x in float32, so with it the int8 draft replays as a float one does."""
    return torch.ops.quantized.linear_dynamic(x, packed, True)


def _matrices(layers, head) -> list:
    """A model's product weights in pass order: each layer's QKV, O, gate/up and down, then the head."""
    return [w for layer in layers for w in (layer[1], layer[2], layer[4], layer[5])] + [head]


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
    def attend(qkv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               start: int, n_heads: int) -> torch.Tensor:
        """qkv [n, (h + 2 kv) d] of n new tokens; k, v [kv, capacity, d], one layer of a cache holding `start`
        tokens; cos, sin [n, d]. Writes the new keys (rotated) and values at start .. start + n - 1; returns
        the causal attention of the rotated queries over everything before them and themselves: [n, h d]."""
        n, (kv, _, d), h = qkv.shape[0], k.shape, n_heads
        end = start + n
        q = qkv[:, : h * d].view(n, h, d).transpose(0, 1)  # [h, n, d]
        k[:, start:end] = rope(qkv[:, h * d:(h + kv) * d].view(n, kv, d).transpose(0, 1), cos, sin)
        v[:, start:end] = qkv[:, (h + kv) * d:].view(n, kv, d).transpose(0, 1)
        att = sdpa(rope(q, cos, sin), k[:, :end], v[:, :end])
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


@functools.lru_cache(maxsize=None)
def groups_heads_in_kernel(device: torch.device) -> bool:
    """Whether the several-query attention above keeps KV heads grouped: on CPU, and on CUDA where flash
    attention runs (compute capability 8.0 on)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 0)


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

    cache_step = LeanCache.GROW  # a session's cache holds up to this many tokens more than it counts

    def __init__(self, model, vocab_size: int, max_len: int, matmul: str = "auto", quantize: str = "none",
                 gguf: str | None = None, device=None):
        """gguf: the GGUF file the model was loaded from, if any: its blocks give the gguf product form.
        device: where the runner's weights live (default: where the model's are). The fused matrices are built
        where the model is and only they move, so a model loaded on the CPU leaves nothing of itself on the
        device: the device holds each weight once."""
        cfg = model.config
        if getattr(cfg, "model_type", "") != "llama":
            raise ValueError(f"the lean runner handles Llama models, not {cfg.model_type!r}")
        self.vocab_size = vocab_size
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        move = functools.partial(_to_device, device=self.device)
        m = model.model
        self.embed = move(m.embed_tokens.weight)  # [vocab, hidden]
        self.layers = []
        for layer in m.layers:
            a, mlp = layer.self_attn, layer.mlp
            self.layers.append((
                move(layer.input_layernorm.weight),
                move(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])),  # [(h + 2 kv) * d, hidden]
                move(a.o_proj.weight),
                move(layer.post_attention_layernorm.weight),
                move(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),  # [2 * inter, hidden]
                move(mlp.down_proj.weight),
            ))
        self.norm = move(m.norm.weight)
        self.kept = self.scored_ids = output_token_ids(model)  # [kept] on the CPU, or None: score only these rows
        self._kept_on_device = None if self.kept is None else self.kept.to(self.device)
        head = model.get_output_embeddings().weight
        if self.kept is not None:
            self.lm_head = move(head[self.kept])  # [kept, hidden]
        elif head.data_ptr() == m.embed_tokens.weight.data_ptr():
            self.lm_head = self.embed[:vocab_size]  # tied: a view of the embedding, not a second copy
        else:
            self.lm_head = move(head[:vocab_size])  # [vocab, hidden]
        positions = torch.arange(max_len, device=m.embed_tokens.weight.device)[None]
        probe = torch.zeros(1, 1, cfg.hidden_size, dtype=self.dtype, device=positions.device)
        cos, sin = m.rotary_emb(probe, positions)  # [1, max_len, head_dim]
        self.cos, self.sin = move(cos[0]), move(sin[0])
        self.max_len = max_len
        if matmul not in MATMUL_FORMS:
            raise ValueError(f"matmul must be one of {', '.join(MATMUL_FORMS)}, not {matmul!r}")
        if quantize not in QUANTIZE:
            raise ValueError(f"quantize must be one of {', '.join(QUANTIZE)}, not {quantize!r}")
        if quantize == "int8" and (self.device.type != "cpu" or self.dtype != torch.float32):
            raise ValueError(f"int8 products run on CPU from float32 weights, not {self.device.type} {self.dtype}")
        if matmul in ("onednn", "fewrow", "gguf") and not cpu_float32(self.lm_head):
            raise ValueError(f"matmul {matmul} runs on CPU on float32 weights, not {self.device.type} {self.dtype}")
        if matmul == "onednn" and not torch.backends.mkldnn.is_available():
            raise ValueError("matmul onednn needs a torch built with oneDNN (mkldnn); use auto, linear or fewrow")
        self.quantize = quantize
        self.matmul = matmul
        self.layer_ops = self._layer_ops()
        self.matmul_timings_ms: dict = {}
        self.stacks: dict = {}  # product form -> its LayerStack: all the layers in one kernel call
        if quantize == "int8":
            self._quantize_int8()
            self._add_stacks()
            return
        self.long_pass = "linear"
        self.products = {"linear": (F.linear, self.layers, self.lm_head),
                         "weights-first": (weights_first, self.layers, self.lm_head)}
        self.gguf_blocks = None  # what the gguf form reads, once it is set up
        self._add_forms(matmul, gguf)
        self._add_stacks()
        kernel_form = next((f for f in ("gguf", "fewrow") if f in self.products), None)
        if matmul in ROW_INDEPENDENT or (matmul == "auto" and kernel_form):
            # Every pass, of any width and batch, in specdec's kernel: its rows are summed each on its own, so a
            # session's logits are the same alone, batched with others or fed in other chunks, bit for bit.
            # (The gguf form reads a fifth of fewrow's bytes for the same values, so auto takes it where it can.)
            form = kernel_form if matmul == "auto" else matmul
            self.plan, self.long_pass = (form,) * (SMALL_PASS_ROWS + 1), form
        elif matmul != "auto":
            self.plan = ("linear",) + (matmul,) * SMALL_PASS_ROWS
        elif self.device.type != "cpu":
            self.plan = ("linear",) * (SMALL_PASS_ROWS + 1)
        else:
            self.matmul_timings_ms = time_passes(list(self.products), run_pass=self._scratch_pass(),
                                                 rows=tuple(n for n in TIMED_ROWS if n <= max_len) or (max_len,))
            self.plan = plan_products(self.matmul_timings_ms)
            log.info("lean runner: product forms (best whole passes, ms: %s) -> %s",
                     {name: {n: round(t, 1) for n, t in by_rows.items()} for name, by_rows in self.matmul_timings_ms.items()},
                     describe_plan(self.plan))
        for unused in set(self.products) - set(self.plan) - {self.long_pass}:
            del self.products[unused]  # a packed copy nothing uses: give its memory back
            self.stacks.pop(unused, None)

    def _add_stacks(self) -> None:
        """A LayerStack for each form whose products all run in specdec's kernels (fewrow, gguf, int8 in the
        kernel), where the layer kernels run too: the layers' loop then runs in C++, the same operations in
        the same order, so the same values, for one Python call a pass instead of ten a layer."""
        kernels = self.layer_ops
        if kernels is TorchLayerOps:
            return
        for form in ("fewrow", "gguf", "int8"):
            if form not in self.products or (form == "int8" and self.int8_products != "specdec's kernel"):
                continue
            norms, weights, forms = [], [], []
            for ln1, wqkv, wo, ln2, wgu, wd in self.products[form][1]:
                norms += [ln1, ln2]
                for w in (wqkv, wo, wgu, wd):  # fewrow: w; int8: (w, scale); gguf: (q, scales, format)
                    weights.append([w] if form == "fewrow" else list(w[:2]))
                    forms.append(w[2] if form == "gguf" else form)
            self.stacks[form] = kernels.LayerStack(norms, weights, forms, self.n_heads, self.eps)

    def _quantize_int8(self) -> None:
        """Every product on int8 weights, one scale per output row. With specdec's kernels: every pass in
        few_rows_int8, x float32, so a row's result depends on that row alone. Without them, fbgemm's int8 GEMM
        at every width."""
        if (kernels := kernels_for(self.lm_head)) is not None:
            # Long passes too: rows summed each on its own (see ROW_INDEPENDENT), and on the 2-core Zen 4 VM the
            # kernel's tiles of 8 rows beat a float copy in MKL's GEMM at a prefill's width anyway.
            pack = quantize_rows
            few_rows = long = lambda x, rows: kernels.few_rows_int8(x, *rows)
            self.int8_products = "specdec's kernel"
        else:
            pack, few_rows, long = pack_int8, int8_linear, int8_linear
            self.int8_products = "fbgemm"
        self.layers = [(ln1, pack(wqkv), pack(wo), ln2, pack(wgu), pack(wd)) for ln1, wqkv, wo, ln2, wgu, wd in self.layers]
        self.lm_head = pack(self.lm_head)
        self.products = {"int8": (few_rows, self.layers, self.lm_head), "int8-long": (long, self.layers, self.lm_head)}
        self.plan = ("int8",) * (SMALL_PASS_ROWS + 1)
        self.long_pass = "int8-long"
        log.info("lean runner: products on int8 weights (one scale per output row) in %s", self.int8_products)

    def _add_forms(self, matmul: str, gguf: str | None) -> None:
        """Products beside linear and weights-first: fewrow, specdec's kernel, on CPU float32 where it builds
        (it reads the plain weights); gguf, the same kernel on the blocks of the GGUF file the model came from
        (bit for bit fewrow's products, from a fifth of the bytes); oneDNN's packed form when asked for, or
        under auto where the kernel is missing and a second copy of the weights is a small share of the free
        memory."""
        kernels = kernels_for(self.lm_head) if matmul in ("auto", "fewrow", "gguf") else None
        if kernels is None and matmul in ("fewrow", "gguf"):  # CPU float32 weights were checked: no build
            raise ValueError(f"matmul {matmul} needs specdec's CPU kernel, which could not be built here "
                             "(see the log); use auto, linear or onednn")
        if kernels is not None and matmul != "gguf":
            self.products["fewrow"] = (kernels.few_rows, self.layers, self.lm_head)
        if kernels is not None and matmul in ("auto", "gguf"):
            self._add_gguf(kernels, gguf, required=matmul == "gguf")
        if matmul == "onednn" or (matmul == "auto" and cpu_float32(self.lm_head) and torch.backends.mkldnn.is_available()
                                  and "fewrow" not in self.products and self._second_copy_fits()):
            self.products["onednn"] = (onednn_linear, [(ln1, pack_onednn(wqkv), pack_onednn(wo), ln2, pack_onednn(wgu),
                                                        pack_onednn(wd)) for ln1, wqkv, wo, ln2, wgu, wd in self.layers],
                                       pack_onednn(self.lm_head))

    def _add_gguf(self, kernels, gguf: str | None, required: bool) -> None:
        try:
            if gguf is None:
                raise gguf_blocks.BlocksUnavailable("the model was not loaded from a GGUF file")
            if self.kept is not None:
                raise gguf_blocks.BlocksUnavailable("the model scores a restricted vocabulary")
            t = time.perf_counter()
            blocks, head = gguf_blocks.read_llama_blocks(gguf, self.layers, self.lm_head, self.n_heads, self.n_kv)
        except gguf_blocks.BlocksUnavailable as e:
            if required:
                raise ValueError(f"matmul gguf: {e}") from None
            log.info("lean runner: no gguf product form (%s)", e)
            return
        self.gguf_blocks = gguf_blocks.describe(blocks, head)
        layers = [(ln1, *b[:2], ln2, *b[2:]) for (ln1, _, _, ln2, _, _), b in zip(self.layers, blocks)]
        self.products["gguf"] = (lambda x, w: kernels.few_rows_gguf(x, *w), layers, head)
        log.info("lean runner: the gguf form reads %s (read and checked in %.1f s)", self.gguf_blocks,
                 time.perf_counter() - t)

    def _scratch_pass(self, context: int = 64):
        """run_pass(form, n) for time_passes: a pass of n rows, every product in `form`, on a scratch session
        of `context` tokens (fewer if the model's length leaves no room), cut back after each pass."""
        context = max(0, min(context, self.max_len - SMALL_PASS_ROWS))
        cache = None

        def run_pass(form: str, n: int) -> None:
            nonlocal cache
            plan, self.plan = getattr(self, "plan", None), ("linear",) + (form,) * SMALL_PASS_ROWS
            try:
                if cache is None:
                    cache = self.new_cache()
                    if context:
                        self.forward(cache, [i % self.vocab_size for i in range(context)], 1)
                self.forward(cache, [(context + i) % self.vocab_size for i in range(n)], n)
            finally:
                self.plan = plan
                self.crop(cache, context)

        return run_pass

    def _layer_ops(self):
        """specdec's CPU kernels for the work between the products (float32 on CPU, where they build),
        else the same functions in torch."""
        return kernels_for(self.embed) or TorchLayerOps

    def _second_copy_fits(self) -> bool:
        size = sum(w.numel() * w.element_size() for w in _matrices(self.layers, self.lm_head))
        room = memory_available()
        if room is not None and size > room // 4:
            log.info("lean runner: not timing oneDNN's packed products, a second copy of %.2f GB with %.2f GB "
                     "available", size / 1e9, room / 1e9)
            return False
        return True

    def describe(self) -> str:
        layer = "" if self.layer_ops is TorchLayerOps else " with specdec's CPU layer kernels"
        if self.stacks:
            layer += f" (the layers' loop in C++ for {', '.join(sorted(self.stacks))})"
        if self.quantize == "int8":
            return f"lean forward{layer}; products on int8 weights in {self.int8_products}"
        blocks = f" (gguf: the file's {self.gguf_blocks})" if "gguf" in self.plan else ""
        if self.batch_invariant:
            return f"lean forward{layer}; products: every pass {self.long_pass}{blocks}"
        return f"lean forward{layer}; products: {describe_plan(self.plan)}{blocks}, longer passes: {self.long_pass}"

    @property
    def batch_invariant(self) -> bool:
        """Whether a session's logits are the same bit for bit whatever it is batched with and however its tokens
        are split into passes: every product in a ROW_INDEPENDENT form, attention in specdec's kernel (each
        query's arithmetic its own). torch's GEMMs and attention choose kernels by shape, so elsewhere logits
        move with the batch by float rounding: the output's distribution stays exact, greedy ties can break
        either way."""
        forms = {*self.plan[1:], self.long_pass}
        if self.quantize == "int8":
            forms = {"int8"} if self.int8_products == "specdec's kernel" else {"fbgemm"}
        return self.layer_ops is not TorchLayerOps and forms <= set(ROW_INDEPENDENT)

    def new_cache(self) -> LeanCache:
        return LeanCache(len(self.layers), self.n_kv, self.head_dim, self.dtype, self.device)

    @staticmethod
    def crop(cache: LeanCache, length: int) -> None:
        cache.length = min(cache.length, length)

    @staticmethod
    def read_kv(cache: LeanCache, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the keys and values of positions start .. start + n - 1 (specdec/prefix_cache.py)."""
        return cache.k[:, :, start:start + n].clone(), cache.v[:, :, start:start + n].clone()

    @staticmethod
    def write_kv(cache: LeanCache, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Put read_kv's keys and values at positions start .. of a cache holding `start` tokens."""
        n = k.shape[2]
        if start != cache.length:
            raise ValueError(f"a cache of {cache.length} tokens takes positions from {cache.length}, not {start}")
        cache.reserve(n)
        cache.k[:, :, start:start + n] = k
        cache.v[:, :, start:start + n] = v
        cache.length = start + n

    def forward(self, cache: LeanCache, token_ids, num_logits: int, scored_only: bool = False) -> torch.Tensor:
        """Append token_ids (a list, or a 1-D tensor on the device); logits of the last num_logits positions:
        [num_logits, vocab] float32, or with scored_only [num_logits, len(scored_ids)], the columns of the
        tokens the model scores (a restricted draft's kept tokens, without widening them to the vocabulary)."""
        return self.forward_batch([cache], [token_ids], [num_logits], scored_only)[0]

    @torch.inference_mode()
    def forward_batch(self, caches: list[LeanCache], token_ids: list, num_logits: list[int],
                      scored_only: bool = False) -> list[torch.Tensor]:
        """One pass over several sessions: session i appends token_ids[i] to caches[i] and gets the logits of
        its last num_logits[i] positions, as ``forward`` gives them. The products run once over every session's
        rows (the weights are read once); attention runs per session, over its own cache and positions."""
        ns, starts = [len(t) for t in token_ids], [c.length for c in caches]
        for c, n, start in zip(caches, ns, starts):
            if start + n > self.max_len:
                raise ValueError(f"sequence of {start + n} tokens exceeds {self.max_len}")
        for c, n in zip(caches, ns):
            c.reserve(n)
        rows = sum(ns)
        form = self.plan[rows] if rows <= SMALL_PASS_ROWS else self.long_pass
        linear, layers, lm_head = self.products[form]
        if len(caches) == 1:
            ids = token_ids[0]
            if not isinstance(ids, torch.Tensor):  # a tensor on the device can be a CUDA graph's static input
                ids = torch.tensor(ids, device=self.device)
            cos, sin = self.cos[starts[0]:starts[0] + rows], self.sin[starts[0]:starts[0] + rows]
        else:
            ids = torch.tensor([t for ts in token_ids for t in ts], device=self.device)
            positions = torch.cat([torch.arange(start, start + n) for start, n in zip(starts, ns)]).to(self.device)
            cos, sin = self.cos[positions], self.sin[positions]
        x = self.embed[ids]  # [rows, hidden]
        ops, eps = self.layer_ops, self.eps
        if (stack := self.stacks.get(form)) is not None:
            x = stack.forward_batch(x, [c.k for c in caches], [c.v for c in caches], cos, sin, starts, ns)
        else:
            for i, (ln1, wqkv, wo, ln2, wgu, wd) in enumerate(layers):
                att = self._attend(linear(ops.rms_norm(x, ln1, eps), wqkv), caches, i, cos, sin, starts, ns)
                x = x + linear(att, wo)
                x = x + linear(ops.silu_mul(linear(ops.rms_norm(x, ln2, eps), wgu)), wd)
        for c, start, n in zip(caches, starts, ns):
            c.length = start + n
        if len(caches) == 1:
            x = x[rows - num_logits[0]:]
        else:
            ends = torch.tensor(ns).cumsum(0)
            x = x[torch.cat([torch.arange(end - k, end) for end, k in zip(ends.tolist(), num_logits)]).to(self.device)]
        logits = linear(ops.rms_norm(x, self.norm, eps), lm_head).float()  # [sum num_logits, vocab or kept]
        out = list(logits.split(num_logits)) if len(caches) > 1 else [logits]
        if self.kept is None or scored_only:
            return out
        kept = self._kept_on_device
        return [torch.full((k, self.vocab_size), float("-inf"), device=logits.device).index_copy_(1, kept, part)
                for k, part in zip(num_logits, out)]  # [num_logits, vocab] each

    def _attend(self, qkv, caches, layer, cos, sin, starts, ns):
        """Layer `layer`'s attention of every session's rows over its own cache: [rows, heads * head_dim]."""
        ops, h = self.layer_ops, self.n_heads
        if len(caches) == 1:
            return ops.attend(qkv, caches[0].k[layer], caches[0].v[layer], cos, sin, starts[0], h)
        if ops is not TorchLayerOps:  # specdec's kernel: all sessions in one parallel region
            return ops.attend_batch(qkv, [c.k[layer] for c in caches], [c.v[layer] for c in caches], cos, sin,
                                    starts, ns, h)
        parts, row = [], 0
        for c, start, n in zip(caches, starts, ns):
            parts.append(ops.attend(qkv[row:row + n], c.k[layer], c.v[layer], cos[row:row + n], sin[row:row + n],
                                    start, h))
            row += n
        return torch.cat(parts)
