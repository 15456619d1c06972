"""The product forms of the lean Llama forward: which form each pass's matrix products take, on what weights.

A form computes x @ w.T for every matrix of a pass, on the weights as it packs them; all forms give F.linear's
values, summed in other orders. ``make_plan`` packs the forms a runner can use, picks one for each row count and
returns a ``Plan``; the forward (``lean_llama.py``) only looks its pass's form up in it. The forms: MKL's F.linear,
weights-first, specdec's own few-row kernel (``kernels/products.cpp``, compiled on first use; ``gguf``, the same
kernel on the blocks of the GGUF file the model came from) or, where that cannot be built, oneDNN's packed GEMM.
Few-row GEMMs fall off cliffs that differ from CPU to CPU, and speculative decoding needs a verify of K + 1 rows
to cost what a step costs, so ``--matmul auto`` times whole passes in each form at load where it cannot run every
pass in the kernel. On CPU the products can instead run on int8 weights (``--quantize int8``, the draft's default
there): a draft step is memory-bound, and a quarter of the bytes is most of its time. specdec's kernel widens them
to float in registers (one scale per row, x stays float32); where it cannot be built, fbgemm's dynamic int8
product runs them.

A new form is a local change here: its pack and product functions, its place in ``_candidates``, and, where
specdec's kernel sums each row on its own, ROW_INDEPENDENT and ``_STACKED``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

import specdec.runners.gguf_blocks as gguf_blocks
import specdec.runners.q8_blocks as q8_blocks
from specdec.runners.forms import (
    cpu_float32,
    int8_linear,
    memory_available,
    onednn_linear,
    pack_int8,
    pack_onednn,
    quantize_rows,
    weights_first,
)
from specdec.runners.kernels import kernels_for

log = logging.getLogger(__name__)

# A pass of at most this many rows is a step or a verify (K + 1 tokens plus the few the session has not seen);
# its products take the form planned for its row count. A longer pass (a prefill, a rebuild) is compute-bound
# and keeps F.linear, whose many-row GEMM MKL runs well, unless every pass runs in specdec's kernel.
SMALL_PASS_ROWS = 32
FORMS = ("linear", "weights-first", "onednn", "fewrow", "gguf")
MATMUL_FORMS = ("auto", *FORMS)
TIMED_ROWS = (1, 2, 3, 4, 6, 9, 16, SMALL_PASS_ROWS)  # row counts `auto` times; the ones between take the next up
QUANTIZE = ("none", "int8", "int4")  # int4: Q4_1 blocks, with quantized activations only
# The activations of the products: float32, or quantized per row in blocks of 32 (kernels/q8_products.cpp) to 8 bits
# or to 16, on the GGUF file's blocks ("gguf-q8", "gguf-q16") or on a draft's int8 rows or Q4_1 blocks ("int8-q8",
# "q4_1-q16"...): Q8_FORMS.
Q8_FORMS = tuple(f"{weights}-q{bits}" for weights in ("gguf", *q8_blocks.QUANTIZED.values()) for bits in (8, 16))
# Product forms in specdec's kernel: each output row is summed on its own, in an order that depends on nothing
# but the row (products.cpp), so a row's result is the one it gets alone, whatever the pass's width.
ROW_INDEPENDENT = ("fewrow", "gguf", "int8", *Q8_FORMS)
INT8_FORMS = {"int8": "specdec's kernel", "fbgemm": "fbgemm"}  # the forms on int8 weights, by what runs them
ACTIVATION_BITS = {"int8": 8, "int16": 16}
ACTIVATIONS = ("float32", *ACTIVATION_BITS)
# A form this many times slower than the best at a row count after two sweeps is not timed again there.
OUT_OF_THE_RACE = 2.0


class LayerWeights(NamedTuple):
    """One layer's weights as a pass reads them: two norms and four matrices, QKV and gate/up fused. In a form's
    Products each matrix is as that form packs it."""

    ln1: torch.Tensor  # [hidden]
    wqkv: Any  # [(h + 2 kv) * d, hidden]
    wo: Any  # [hidden, h * d]
    ln2: torch.Tensor  # [hidden]
    wgu: Any  # [2 * inter, hidden]
    wd: Any  # [hidden, inter]

    @property
    def matrices(self) -> tuple:
        return self.wqkv, self.wo, self.wgu, self.wd

    def packed(self, pack: Callable) -> LayerWeights:
        """The layer with each matrix packed by pack; the norms as they are."""
        return self._replace(wqkv=pack(self.wqkv), wo=pack(self.wo), wgu=pack(self.wgu), wd=pack(self.wd))


class Products(NamedTuple):
    """A form's products: fn(x, w) -> x @ w.T ([rows, in] -> [rows, out]) on every matrix, packed for fn."""

    fn: Callable
    layers: list[LayerWeights]
    head: Any  # [scored, hidden] as packed


class Form(NamedTuple):
    """A product form as a pass runs it: its name, its products and, where the products and the work between them
    all run in specdec's kernels, the LayerStack that runs the layers' loop in one C++ call (else None)."""

    name: str
    products: Products
    stack: Any = None


@dataclass(frozen=True)
class Plan:
    """What each pass runs: the form of a pass by its rows, and whether a session's logits depend on its batch."""

    by_rows: tuple[Form, ...]  # [SMALL_PASS_ROWS + 1]: a pass of n rows runs by_rows[n] (index 0 unused)
    long: Form  # a pass of more rows
    layer_kernels: bool = False  # the work between the products runs in specdec's kernels
    timings_ms: dict = field(default_factory=dict)  # what `auto` planned from: form -> rows -> best pass, ms
    gguf_blocks: str | None = None  # what the gguf form reads, where it was set up

    @property
    def forms(self) -> tuple[str, ...]:
        """The form's name by row count, as by_rows."""
        return tuple(form.name for form in self.by_rows)

    @property
    def products(self) -> dict[str, Products]:
        return {form.name: form.products for form in (*self.by_rows, self.long)}

    @property
    def stacks(self) -> dict:
        return {form.name: form.stack for form in (*self.by_rows, self.long) if form.stack is not None}

    @property
    def batch_invariant(self) -> bool:
        """Whether a session's logits are the same bit for bit whatever it is batched with and however its tokens
        are split into passes: every product in a ROW_INDEPENDENT form, attention in specdec's kernel (each
        query's arithmetic its own). torch's GEMMs and attention choose kernels by shape, so elsewhere logits
        move with the batch by float rounding: the output's distribution stays exact, greedy ties can break
        either way."""
        return self.layer_kernels and {*self.forms[1:], self.long.name} <= set(ROW_INDEPENDENT)

    @property
    def description(self) -> str:
        """ "products: 1-32 rows: onednn, longer passes: linear" and the like, for ModelInfo.forward."""
        if self.long.name in INT8_FORMS:
            return f"products on int8 weights in {INT8_FORMS[self.long.name]}"
        if isinstance(head := self.long.products.head, q8_blocks.Q8Weights):
            return f"products with {head.bits}-bit activations: every pass {self.long.name} ({head.isa})"
        blocks = f" (gguf: the file's {self.gguf_blocks})" if "gguf" in self.forms else ""
        if self.batch_invariant:
            return f"products: every pass {self.long.name}{blocks}"
        return f"products: {describe_plan(self.forms)}{blocks}, longer passes: {self.long.name}"


def one_form_plan(form: Form, long: Form) -> Plan:
    """Passes of up to SMALL_PASS_ROWS rows in `form`, longer ones in `long`: how load-time timing runs a form."""
    return Plan((long,) + (form,) * SMALL_PASS_ROWS, long)


def packed(fn: Callable, pack: Callable, layers: list[LayerWeights], head) -> Products:
    return Products(fn, [layer.packed(pack) for layer in layers], pack(head))


# How LayerStack takes each matrix of a form whose products all run in specdec's kernel: (tensors, its format).
_STACKED = {
    "fewrow": lambda w: ([w], "fewrow"),
    "int8": lambda w: (list(w), "int8"),  # (q, scale)
    "gguf": lambda w: (list(w[:2]), w[2]),  # (q, scales, format)
    **{name: lambda w: w.stacked for name in Q8_FORMS},  # Q8Weights
}


def _stack(layer_kernels, name: str, products: Products, n_heads: int, eps: float):
    """The LayerStack of a form whose products all run in specdec's kernels, where the layer kernels run too: the
    layers' loop in C++, the same operations in the same order, so the same values, for one Python call a pass
    instead of ten a layer. None for any other form."""
    if layer_kernels is None or name not in _STACKED:
        return None
    norms, weights, formats = [], [], []
    for layer in products.layers:
        norms += [layer.ln1, layer.ln2]
        for w in layer.matrices:
            tensors, fmt = _STACKED[name](w)
            weights.append(tensors)
            formats.append(fmt)
    return layer_kernels.LayerStack(norms, weights, formats, n_heads, eps)


# -- timing and planning ---------------------------------------------------------------------------------------
def time_passes(
    forms, run_pass, rows=TIMED_ROWS, reps: int = 3, clock=time.perf_counter
) -> dict[str, dict[int, float]]:
    """forms: product form names; run_pass(form, n) runs one whole forward pass of n rows with every product
    in that form. The best of `reps` timed sweeps, in ms, per form and row count; the sweeps alternate forms,
    so a slow moment of the machine hits all of them. After two sweeps, a form still more than OUT_OF_THE_RACE
    times slower than the best at a row count keeps its best timing there: passes vary by a few percent, and its
    later sweeps would only spend start-up time. Not after one: a single pass held up by another process would
    take the fastest form out of the race, and its row count would run the slower form until restart.

    Whole passes, not the products alone: a form's cost in a pass is not its cost in a loop of products (the
    caches hold other data between them), and the margin between forms is often within that difference."""
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


def plan_products(
    timings: dict[str, dict[int, float]], margin: float = 0.95, max_rows: int = SMALL_PASS_ROWS
) -> tuple[str, ...]:
    """The product form of a pass of n rows, for n = 0 .. max_rows (index n; 0 unused). A row count takes
    the timings of the nearest timed count at or above it. Another form replaces F.linear only where it
    beats it by `margin`, so that a near tie keeps the usual form rather than flipping between restarts:
    the margin must exceed how much best-of-3 whole passes vary between restarts."""
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


# -- the plan --------------------------------------------------------------------------------------------------
def make_plan(
    layers: list[LayerWeights],
    head: torch.Tensor,
    matmul: str = "auto",
    quantize: str = "none",
    *,
    layer_kernels=None,
    n_heads: int,
    n_kv: int,
    eps: float,
    gguf: str | None = None,
    restricted: bool = False,
    run_pass: Callable[[Plan, int], None] | None = None,
    timed_rows: tuple[int, ...] = TIMED_ROWS,
    activations: str = "float32",
) -> Plan:
    """The plan of a runner's products. layers, head: its float weights, on its device ([scored, hidden] head);
    layer_kernels: specdec's kernels where they run the work between the products, else None; gguf: the GGUF file
    the model was loaded from, whose blocks give the gguf form; restricted: the head scores a subset of the
    vocabulary (no gguf form then); run_pass(plan, n): one whole pass of n rows under a plan, on a scratch
    session, for `auto`'s timing of timed_rows; activations: float32, int8 or int16 (every pass in a q8 form).
    Raises ValueError for a form, quantization or activations that cannot run."""
    _check(matmul, quantize, head, activations)
    with_stack = lambda name, products: Form(name, products, _stack(layer_kernels, name, products, n_heads, eps))
    if quantize == "int8" or activations in ACTIVATION_BITS:
        if activations in ACTIVATION_BITS:
            bits = ACTIVATION_BITS[activations]
            form = with_stack(*_q8_products(layers, head, quantize, gguf, restricted, n_heads, n_kv, bits))
        else:
            form = with_stack(*_int8_products(layers, head))
        return Plan((form,) * (SMALL_PASS_ROWS + 1), form, layer_kernels is not None)
    candidates, blocks = _candidates(layers, head, matmul, gguf, restricted, n_heads, n_kv)
    forms = {name: with_stack(name, products) for name, products in candidates.items()}
    timings = {}
    kernel_form = next((name for name in ("gguf", "fewrow") if name in forms), None)
    if matmul in ROW_INDEPENDENT or (matmul == "auto" and kernel_form):
        # Every pass, of any width and batch, in specdec's kernel: its rows are summed each on its own, so a
        # session's logits are the same alone, batched with others or fed in other chunks, bit for bit.
        # (The gguf form reads a fifth of fewrow's bytes for the same values, so auto takes it where it can.)
        long = kernel_form if matmul == "auto" else matmul
        chosen = (long,) * (SMALL_PASS_ROWS + 1)
    else:
        long = "linear"
        if matmul != "auto":
            chosen = ("linear",) + (matmul,) * SMALL_PASS_ROWS
        elif head.device.type != "cpu":
            chosen = ("linear",) * (SMALL_PASS_ROWS + 1)
        else:
            chosen, timings = _timed_plan(forms, run_pass, timed_rows)
    return Plan(tuple(forms[name] for name in chosen), forms[long], layer_kernels is not None, timings, blocks)


def _timed_plan(forms: dict[str, Form], run_pass, rows: tuple[int, ...]) -> tuple[tuple[str, ...], dict]:
    """plan_products over whole passes timed in each form (each under a plan that runs its passes in it), and the
    timings."""
    timing = {name: one_form_plan(form, forms["linear"]) for name, form in forms.items()}
    timings = time_passes(list(forms), run_pass=lambda name, n: run_pass(timing[name], n), rows=rows)
    chosen = plan_products(timings)
    log.info(
        "lean runner: product forms (best whole passes, ms: %s) -> %s",
        {name: {n: round(t, 1) for n, t in by_rows.items()} for name, by_rows in timings.items()},
        describe_plan(chosen),
    )
    return chosen, timings


def _check(matmul: str, quantize: str, head: torch.Tensor, activations: str) -> None:
    if matmul not in MATMUL_FORMS:
        raise ValueError(f"matmul must be one of {', '.join(MATMUL_FORMS)}, not {matmul!r}")
    if quantize not in QUANTIZE:
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE)}, not {quantize!r}")
    where = f"{head.device.type} {head.dtype}"
    if quantize != "none" and not cpu_float32(head):
        raise ValueError(f"{quantize} products run on CPU from float32 weights, not {where}")
    check_weights(quantize, activations)
    if matmul in ("onednn", "fewrow", "gguf") and not cpu_float32(head):
        raise ValueError(f"matmul {matmul} runs on CPU on float32 weights, not {where}")
    if matmul == "onednn" and not torch.backends.mkldnn.is_available():
        raise ValueError("matmul onednn needs a torch built with oneDNN (mkldnn); use auto, linear or fewrow")


def _int8_products(layers: list[LayerWeights], head) -> tuple[str, Products]:
    """Every product on int8 weights, one scale per output row. With specdec's kernels: every pass in
    few_rows_int8, x float32, so a row's result depends on that row alone; long passes too, with no float copy of
    the weights kept for them. Without the kernels, fbgemm's int8 GEMM at every width."""
    if (kernels := kernels_for(head)) is not None:
        name, products = "int8", packed(lambda x, rows: kernels.few_rows_int8(x, *rows), quantize_rows, layers, head)
    else:
        name, products = "fbgemm", packed(int8_linear, pack_int8, layers, head)
    log.info("lean runner: products on int8 weights (one scale per output row) in %s", INT8_FORMS[name])
    return name, products


def _q8_products(
    layers: list[LayerWeights],
    head,
    quantize: str,
    gguf: str | None,
    restricted: bool,
    n_heads: int,
    n_kv: int,
    bits: int = 8,
) -> tuple[str, Products]:
    """Every product with x quantized to `bits` (8 or 16), in the best instruction-set form this CPU runs: on the
    weights a draft is quantized to (int8-qB, q4_1-qB: q8_blocks.quantized), else on the GGUF file's blocks
    (gguf-qB)."""
    kernels, isa = q8_blocks.q8_kernels(head, bits)
    product = lambda x, w: w.product(kernels, x)
    if quantize in q8_blocks.QUANTIZED:
        pack = lambda w: q8_blocks.quantized(w, quantize, isa, bits)
        name, products = f"{q8_blocks.QUANTIZED[quantize]}-q{bits}", packed(product, pack, layers, head)
    else:
        blocks = _gguf_products(kernels, layers, head, gguf, restricted, n_heads, n_kv, required=True)[0]
        pack_blocks = lambda b: (q8_blocks.pack_q4_1 if b[2] == "Q4_1" else q8_blocks.pack_q8_0)(b[0], b[1])
        pack = lambda b: pack_blocks(b).with_isa(isa, bits)
        name, products = f"gguf-q{bits}", packed(product, pack, blocks.layers, blocks.head)
    log.info("lean runner: products with %d-bit activations (%s, %s)", bits, name, isa)
    return name, products


def check_weights(quantize: str, activations: str) -> None:
    """Raises ValueError where the weights cannot be multiplied with the activations: int4 needs quantized ones."""
    if quantize == "int4" and activations not in ACTIVATION_BITS:
        raise ValueError(f"int4 weights are multiplied with quantized activations (int8 or int16), not {activations}")


def _candidates(
    layers: list[LayerWeights], head, matmul: str, gguf: str | None, restricted: bool, n_heads: int, n_kv: int
) -> tuple[dict[str, Products], str | None]:
    """The float forms a plan may take, and what the gguf form reads (None without it). linear and weights-first
    always; fewrow, specdec's kernel, on CPU float32 where it builds (it reads the plain weights); gguf, the same
    kernel on the blocks of the GGUF file the model came from (bit for bit fewrow's products, from a fifth of the
    bytes); oneDNN's packed form when asked for, or under auto where the kernel is missing and a second copy of
    the weights is a small share of the free memory."""
    forms = {"linear": Products(F.linear, layers, head), "weights-first": Products(weights_first, layers, head)}
    blocks = None
    kernels = kernels_for(head) if matmul in ("auto", "fewrow", "gguf") else None
    if kernels is None and matmul in ("fewrow", "gguf"):  # CPU float32 weights were checked: no build
        raise ValueError(
            f"matmul {matmul} needs specdec's CPU kernel, which could not be built here "
            "(see the log); use auto, linear or onednn"
        )
    if kernels is not None and matmul != "gguf":
        forms["fewrow"] = Products(kernels.few_rows, layers, head)
    if kernels is not None and matmul in ("auto", "gguf"):
        gguf_form = _gguf_products(kernels, layers, head, gguf, restricted, n_heads, n_kv, required=matmul == "gguf")
        if gguf_form is not None:
            forms["gguf"], blocks = gguf_form
    if matmul == "onednn" or (
        matmul == "auto"
        and cpu_float32(head)
        and torch.backends.mkldnn.is_available()
        and "fewrow" not in forms
        and _second_copy_fits(layers, head)
    ):
        forms["onednn"] = packed(onednn_linear, pack_onednn, layers, head)
    return forms, blocks


def _gguf_products(
    kernels,
    layers: list[LayerWeights],
    head,
    gguf: str | None,
    restricted: bool,
    n_heads: int,
    n_kv: int,
    required: bool,
) -> tuple[Products, str] | None:
    """The gguf form's products and what they read, or None (a ValueError where required) without the blocks."""
    try:
        if gguf is None:
            raise gguf_blocks.BlocksUnavailable("the model was not loaded from a GGUF file")
        if restricted:
            raise gguf_blocks.BlocksUnavailable("the model scores a restricted vocabulary")
        started = time.perf_counter()
        blocks, head_blocks = gguf_blocks.read_llama_blocks(gguf, layers, head, n_heads, n_kv)
    except gguf_blocks.BlocksUnavailable as e:
        if required:
            raise ValueError(f"the gguf blocks: {e}") from None
        log.info("lean runner: no gguf product form (%s)", e)
        return None
    described = gguf_blocks.describe(blocks, head_blocks)
    log.info(
        "lean runner: the gguf form reads %s (read and checked in %.1f s)", described, time.perf_counter() - started
    )
    layers = [
        LayerWeights(layer.ln1, qkv, o, layer.ln2, gate_up, down)
        for layer, (qkv, o, gate_up, down) in zip(layers, blocks)
    ]
    return Products(lambda x, w: kernels.few_rows_gguf(x, *w), layers, head_blocks), described


def _second_copy_fits(layers: list[LayerWeights], head) -> bool:
    """Whether a packed copy of every matrix takes at most a quarter of the memory available now."""
    size = sum(w.numel() * w.element_size() for w in [*(w for layer in layers for w in layer.matrices), head])
    room = memory_available()
    if room is not None and size > room // 4:
        log.info(
            "lean runner: not timing oneDNN's packed products, a second copy of %.2f GB with %.2f GB available",
            size / 1e9,
            room / 1e9,
        )
        return False
    return True
