"""The lean Llama forward gives the stock transformers logits, through cache growth and rollback,
with every form of its few-row products and the per-row-count plan `auto` makes of them, and with the
work between the products in specdec's CPU kernels or in torch; its int8 products stay close to them."""

import contextlib
import dataclasses

import pytest
import torch
import torch.nn.functional as F

import specdec.runners.products as product_forms
from conftest import KERNEL_FORMS, built_kernels, can_run, kernel_runner
from specdec import models
from specdec.runners import CausalLMRunner, make_runner, resolve_activations, resolve_quantize
from specdec.runners.lean_llama import LeanLlamaRunner, TorchLayerOps
from specdec.runners.products import (
    FORMS,
    SMALL_PASS_ROWS,
    Form,
    Products,
    describe_plan,
    one_form_plan,
    onednn_linear,
    pack_onednn,
    plan_products,
    quantize_rows,
    time_passes,
    weights_first,
)


def steps(runner, chunks, crop_at=None):
    cache, out = runner.new_cache(), []
    for i, chunk in enumerate(chunks):
        if crop_at is not None and i == crop_at[0]:
            runner.crop(cache, crop_at[1])
        out.append(runner.forward(cache, chunk, len(chunk)))
    return out


@pytest.mark.parametrize("matmul", FORMS)
def test_lean_forward_matches_stock_forward(tiny_draft, tiny_gguf, tokenizer, matmul):
    can_run(matmul)
    model, gguf = tiny_gguf if matmul == "gguf" else (tiny_draft, None)
    ids = list(range(100, 400))  # 300 tokens: grows the cache past its first 256
    # a prefill, a step, a verify-sized pass, a long pass (over SMALL_PASS_ROWS), a pass after rollback
    chunks = [ids[:200], ids[200:201], ids[201:206], ids[206:300], ids[150:153]]
    stock = CausalLMRunner(model, len(tokenizer))
    lean = LeanLlamaRunner(model, len(tokenizer), max_len=1024, matmul=matmul, gguf=gguf)
    for a, b in zip(steps(stock, chunks, crop_at=(4, 150)), steps(lean, chunks, crop_at=(4, 150))):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, atol=2e-4, rtol=1e-4)


def test_lean_forward_matches_stock_forward_with_torch_layer_ops(tiny_draft, tokenizer, no_kernel):
    ids = list(range(100, 400))
    chunks = [ids[:200], ids[200:201], ids[201:206], ids[206:300], ids[150:153]]
    stock = CausalLMRunner(tiny_draft, len(tokenizer))
    lean = LeanLlamaRunner(tiny_draft, len(tokenizer), max_len=1024)
    assert lean.layer_ops is TorchLayerOps
    for a, b in zip(steps(stock, chunks, crop_at=(4, 150)), steps(lean, chunks, crop_at=(4, 150))):
        torch.testing.assert_close(b, a, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("matmul", FORMS)
def test_lean_forward_matches_on_the_embedded_target(target_model, tokenizer, matmul):
    can_run(matmul)
    ids = tokenizer("The quick brown fox jumps over the lazy dog. " * 4)["input_ids"]
    stock = CausalLMRunner(target_model, len(tokenizer))
    lean = LeanLlamaRunner(
        target_model, len(tokenizer), max_len=512, matmul=matmul, gguf=models.gguf_file(models.DEFAULT_TARGET)
    )
    chunks = [ids[:-6], ids[-6:-5], ids[-5:]]
    for a, b in zip(steps(stock, chunks), steps(lean, chunks)):
        torch.testing.assert_close(b, a, atol=2e-3, rtol=1e-3)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_restricted_output_vocabulary_gives_zero_probability_outside(tiny_draft, tokenizer):
    import copy

    from specdec.runners import make_runner

    draft = copy.deepcopy(tiny_draft)
    draft.config.specdec_output_token_ids = list(range(1000, 5000))
    ids = list(range(100, 140))
    outs = []
    for kind in ("hf", "lean"):
        runner = make_runner(draft, len(tokenizer), 512, kind)
        outs.append(runner.forward(runner.new_cache(), ids, 3))  # [3, vocab]
    for logits in outs:
        assert torch.isinf(logits[:, :1000]).all() and torch.isinf(logits[:, 5000:]).all()
        assert torch.isfinite(logits[:, 1000:5000]).all()
    torch.testing.assert_close(outs[1][:, 1000:5000], outs[0][:, 1000:5000], atol=2e-4, rtol=1e-4)


def test_weights_first_is_the_same_product_as_linear():
    torch.manual_seed(0)
    x, w = torch.randn(5, 64), torch.randn(96, 64)  # [n, in], [out, in]
    y = weights_first(x, w)
    assert y.shape == (5, 96) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_onednn_is_the_same_product_as_linear():
    torch.manual_seed(0)
    x, w = torch.randn(5, 64), torch.randn(96, 64)
    y = onednn_linear(x, pack_onednn(w))
    assert y.shape == (5, 96)
    torch.testing.assert_close(y, F.linear(x, w), atol=1e-5, rtol=1e-5)


class PassClock:
    """A clock that a fake pass moves by its form's cost at its row count, in ms; a hiccup {(form, n): ms}
    holds up that pass once, the first time it runs."""

    def __init__(self, costs, hiccups=None):
        self.costs, self.now, self.ran, self.hiccups = costs, 0.0, [], dict(hiccups or {})

    def __call__(self) -> float:
        return self.now / 1e3

    def run_pass(self, form, n):
        self.ran.append((form, n))
        self.now += self.costs[form][n] + self.hiccups.pop((form, n), 0.0)


def test_timing_covers_every_form_and_row_count_alternating_forms():
    clock = PassClock({"linear": {1: 10.0, 4: 12.0}, "fewrow": {1: 9.0, 4: 13.0}})
    timings = time_passes(["linear", "fewrow"], run_pass=clock.run_pass, rows=(1, 4), reps=2, clock=clock)
    assert all(timings[form] == pytest.approx(clock.costs[form]) for form in clock.costs)
    timed = clock.ran[2:]  # after one warm-up pass per form
    assert timed == [("linear", 1), ("fewrow", 1), ("linear", 4), ("fewrow", 4)] * 2


def test_a_form_twice_as_slow_after_two_sweeps_is_not_timed_again_at_that_row_count():
    costs = {"linear": {1: 20.0, 4: 22.0}, "weights-first": {1: 41.0, 4: 23.0}, "gguf": {1: 7.0, 4: 12.0}}
    clock = PassClock(costs)
    timings = time_passes(list(costs), run_pass=clock.run_pass, rows=(1, 4), reps=4, clock=clock)
    assert all(
        timings[form] == pytest.approx(costs[form]) for form in costs
    )  # each keeps its timing: the plan sees all
    timed = clock.ran[3:]
    assert timed.count(("gguf", 1)) == 4 and timed.count(("gguf", 4)) == 4
    assert timed.count(("linear", 1)) == 2 and timed.count(("weights-first", 1)) == 2  # 20 and 41 ms > 2 x 7
    assert timed.count(("linear", 4)) == 4 and timed.count(("weights-first", 4)) == 4  # 22 and 23 ms <= 2 x 12
    assert plan_products(timings, max_rows=4)[1:] == ("gguf",) * 4


def test_one_held_up_pass_does_not_take_the_fastest_form_out_of_the_race():
    # Timings of a service's start on a 2-core CPU, where gguf's first 4-row pass was held up to 36.6 ms (5 ms alone)
    costs = {"linear": {1: 29.7, 4: 70.9}, "fewrow": {1: 14.6, 4: 14.6}, "gguf": {1: 3.4, 4: 5.1}}
    clock = PassClock(costs, hiccups={("gguf", 4): 31.5})
    timings = time_passes(list(costs), run_pass=clock.run_pass, rows=(1, 4), reps=3, clock=clock)
    assert timings["gguf"][4] == pytest.approx(5.1)
    assert plan_products(timings, max_rows=4)[1:] == ("gguf",) * 4


def test_auto_times_whole_passes_in_each_form_and_leaves_the_session_state_alone(tiny_draft, tokenizer, no_kernel):
    runner = LeanLlamaRunner(tiny_draft, len(tokenizer), max_len=512, matmul="linear")
    run_pass = runner._scratch_pass()
    seen = []
    probe = Products(lambda x, w: seen.append(x.shape[0]) or F.linear(x, w), runner.layers, runner.lm_head)
    run_pass(one_form_plan(Form("probe", probe), runner.plan.long), 3)
    assert seen == [3] * (4 * len(runner.layers) + 1)  # every product of the pass, the head included, in that form
    assert runner.plan.forms == ("linear",) * (SMALL_PASS_ROWS + 1)  # the runner's own plan is untouched
    small = LeanLlamaRunner(
        tiny_draft, len(tokenizer), max_len=20, matmul="auto"
    )  # no room for 32 rows: times what fits
    assert set(small.plan.timings_ms["linear"]) == {1, 2, 3, 4, 6, 9, 16}


def test_plan_keeps_linear_unless_another_form_clearly_wins_at_that_row_count():
    timings = {
        "linear": {1: 20.0, 2: 20.5, 4: 35.0, 9: 48.0},
        "weights-first": {1: 21.0, 2: 40.0, 4: 40.0, 9: 41.0},
        "onednn": {1: 23.0, 2: 19.0, 4: 24.0, 9: 30.0},
    }
    plan = plan_products(timings, margin=0.9, max_rows=12)
    assert len(plan) == 13
    assert plan[1] == "linear"  # onednn is slower at one row
    assert plan[2] == "linear"  # 19 < 20.5 but not by the margin: a near tie keeps the usual form
    assert plan[3:10] == ("onednn",) * 7  # 3 takes 4's timings, 5-9 take 9's; onednn beats weights-first there
    assert plan[10:] == ("onednn",) * 3  # past the last timed count: the last timings
    assert plan_products(timings, margin=0.0, max_rows=12)[1:] == ("linear",) * 12
    assert describe_plan(plan) == "1-2 rows: linear, 3-12 rows: onednn"
    mixed = ("linear", "linear", "weights-first", "linear")
    assert describe_plan(mixed) == "1 row: linear, 2 rows: weights-first, 3 rows: linear"


@pytest.fixture
def kernel():
    """specdec's few-row CPU product; its tests skip where the kernels cannot be built."""
    return built_kernels().few_rows


@pytest.fixture
def no_kernel(monkeypatch):
    """A machine where specdec's kernels cannot be built (no compiler): auto falls back on oneDNN's packed form,
    and the work between the products on torch."""
    import specdec.runners.kernels

    monkeypatch.setattr(specdec.runners.kernels, "cpu_kernels", lambda: None)


@pytest.fixture
def layer_kernels():
    """specdec's CPU layer kernels (rms_norm, attend, silu_mul); their tests skip where they cannot be built."""
    return built_kernels()


def test_auto_follows_its_plan_and_drops_a_packed_copy_it_does_not_use(tiny_draft, tokenizer, monkeypatch, no_kernel):
    wins_from_3 = lambda forms, **_: {
        name: {n: (10.0 if name == "onednn" and n >= 3 else 20.0) for n in (1, 2, 3, 32)} for name in forms
    }
    monkeypatch.setattr(product_forms, "time_passes", wins_from_3)
    runner = LeanLlamaRunner(tiny_draft, len(tokenizer), max_len=512, matmul="auto")
    assert runner.plan.forms[1:3] == ("linear", "linear") and set(runner.plan.forms[3:]) == {"onednn"}
    stock = CausalLMRunner(tiny_draft, len(tokenizer))
    ids = list(range(100, 160))
    chunks = [ids[:40], ids[40:41], ids[41:46]]  # long pass and step in linear, a 5-row pass in onednn
    for a, b in zip(steps(stock, chunks), steps(runner, chunks)):
        torch.testing.assert_close(b, a, atol=2e-4, rtol=1e-4)
    never = lambda forms, **_: {
        name: {n: (30.0 if name == "onednn" else 20.0) for n in (1, SMALL_PASS_ROWS)} for name in forms
    }
    monkeypatch.setattr(product_forms, "time_passes", never)
    runner = LeanLlamaRunner(tiny_draft, len(tokenizer), max_len=512, matmul="auto")
    assert set(runner.plan.forms) == {"linear"} and "onednn" not in runner.plan.products


def test_auto_leaves_out_the_packed_copy_when_memory_is_short(tiny_draft, tokenizer, monkeypatch, no_kernel):
    timed = []
    monkeypatch.setattr(
        product_forms,
        "time_passes",
        lambda forms, **_: timed.append(set(forms)) or {name: {1: 20.0, SMALL_PASS_ROWS: 20.0} for name in forms},
    )
    monkeypatch.setattr(product_forms, "memory_available", lambda: 10**6)  # 1 MB: a copy of the weights would not fit
    runner = LeanLlamaRunner(tiny_draft, len(tokenizer), max_len=64, matmul="auto")
    assert timed == [{"linear", "weights-first"}] and "onednn" not in runner.plan.products
    monkeypatch.setattr(product_forms, "memory_available", lambda: 10**12)
    LeanLlamaRunner(tiny_draft, len(tokenizer), max_len=64, matmul="auto")
    assert timed[-1] == {"linear", "weights-first", "onednn"}


def test_auto_runs_every_pass_in_the_kernel_where_it_builds_and_times_nothing(
    tiny_draft, tiny_gguf, tokenizer, monkeypatch, kernel
):
    """Where specdec's kernel builds, every pass of any width runs in it: its rows are summed each on its own,
    which is what makes a session's logits independent of the batch (see test_batching.py)."""
    monkeypatch.setattr(product_forms, "time_passes", lambda *a, **k: pytest.fail("auto timed forms"))
    runner = LeanLlamaRunner(tiny_draft, len(tokenizer), max_len=64, matmul="auto")
    assert set(runner.plan.forms) == {"fewrow"} and runner.plan.long.name == "fewrow" and runner.batch_invariant
    assert set(runner.plan.products) == {"fewrow"}
    model, gguf = tiny_gguf
    runner = LeanLlamaRunner(model, len(tokenizer), max_len=64, matmul="auto", gguf=gguf)
    assert set(runner.plan.forms) == {"gguf"} and runner.plan.long.name == "gguf" and runner.batch_invariant
    assert runner.describe().endswith("products: every pass gguf (gguf: the file's Q4_1 layers, Q8_0 head, 4 MB)")
    assert LeanLlamaRunner(tiny_draft, len(tokenizer), max_len=64, quantize="int8").batch_invariant
    assert not LeanLlamaRunner(tiny_draft, len(tokenizer), max_len=64, matmul="linear").batch_invariant


def test_the_kernel_is_the_same_product_as_linear_at_any_shape(kernel):
    torch.manual_seed(0)
    for rows, inner, out in [(1, 576, 960), (4, 1536, 576), (9, 64, 7), (16, 100, 33), (17, 48, 50), (40, 576, 130)]:
        x, w = torch.randn(rows, inner), torch.randn(out, inner)  # inner 100, 48: a tail past the last 16
        torch.testing.assert_close(kernel(x, w), F.linear(x, w), atol=1e-4, rtol=1e-5)
    x, w = torch.randn(576, 6).t(), torch.randn(20, 576)  # x not contiguous
    torch.testing.assert_close(kernel(x, w), F.linear(x, w), atol=1e-4, rtol=1e-5)
    with pytest.raises(RuntimeError, match="float32 tensors on CPU"):
        kernel(x.double(), w.double())


@pytest.mark.parametrize("cache", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 2, 32), (4, 4, 48), (2, 1, 128), (3, 1, 10)])
def test_the_attention_kernel_is_torch_attention_and_writes_the_same_cache(
    layer_kernels, heads, kv_heads, head_dim, cache
):
    # head_dim 48: three 16-lane vectors; 10: no vector path. Rows and starts: a step at the start, a step,
    # a verify, one starting past a multiple of 16, a long pass (many rows, parallel). A float16 cache: the new
    # keys and values are written as halves and every one is read widened, in both.
    torch.manual_seed(0)
    for n, start in [(1, 0), (1, 37), (4, 100), (9, 250), (40, 17)]:
        qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim)
        cos, sin = torch.randn(n, head_dim), torch.randn(n, head_dim)
        k, v = (torch.randn(kv_heads, 320, head_dim).to(cache) for _ in range(2))
        k_ref, v_ref = k.clone(), v.clone()
        out = layer_kernels.attend(qkv, k, v, cos, sin, start, heads)
        expected = TorchLayerOps.attend(qkv, k_ref, v_ref, cos, sin, start, heads)
        assert k.dtype == v.dtype == cache
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        # rotated keys, written in place (a half may round the other way where the two ropes' float32 differ)
        torch.testing.assert_close(k, k_ref, atol=1e-6, rtol=1e-6 if cache == torch.float32 else 2**-10)
        assert torch.equal(v, v_ref)


def test_a_float16_cache_holds_each_new_key_and_value_rounded_to_the_nearest_half(layer_kernels):
    """The float16 cache stores the float32 cache's new keys and values rounded to nearest (ties to even, torch's
    conversion) and keeps the rest; attention then reads those halves (the test above: torch on the same cache)."""
    torch.manual_seed(3)
    heads, kv_heads, d, start, n = 9, 3, 64, 45, 4
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d)
    cos, sin = torch.randn(n, d), torch.randn(n, d)
    old = torch.randn(2, kv_heads, 64, d).half()  # the cached keys and values before the pass
    k16, v16 = old[0].clone(), old[1].clone()
    k32, v32 = old[0].float(), old[1].float()
    out16 = layer_kernels.attend(qkv, k16, v16, cos, sin, start, heads)
    out32 = layer_kernels.attend(qkv, k32, v32, cos, sin, start, heads)
    assert torch.equal(k16, k32.half()) and torch.equal(v16, v32.half())  # the new rows rounded, the rest kept
    assert not torch.equal(k16.float(), k32) and not torch.equal(out16, out32)  # the halves are what it read
    torch.testing.assert_close(out16, out32, atol=2e-3, rtol=0)


@contextlib.contextmanager
def torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("cache", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 2, 32), (2, 1, 128), (3, 1, 10)])
def test_the_attention_kernel_gives_a_row_what_it_gets_alone_bit_for_bit(
    layer_kernels, heads, kv_heads, head_dim, cache
):
    """A verify's row j must equal the step at that position exactly, or a near-tie could flip greedy output
    against the target alone: the rows of a pass share key reads but not arithmetic, whatever the thread count.
    Passes end on and across 16-key blocks and at a capacity that is not a multiple of 16."""
    torch.manual_seed(2)
    cap = 333
    for n, start in [(4, 12), (9, 7), (5, 311), (9, 324), (3, 0)]:
        qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim)
        cos, sin = torch.randn(n, head_dim), torch.randn(n, head_dim)
        k, v = torch.randn(kv_heads, cap, head_dim).to(cache), torch.randn(kv_heads, cap, head_dim).to(cache)
        for threads in (1, 2):
            with torch_threads(threads):
                whole = layer_kernels.attend(qkv, k.clone(), v.clone(), cos, sin, start, heads)
                kk, vv = k.clone(), v.clone()  # row by row: each step writes its key, as a decoding step does
                alone = [
                    layer_kernels.attend(qkv[j : j + 1], kk, vv, cos[j : j + 1], sin[j : j + 1], start + j, heads)
                    for j in range(n)
                ]
            assert torch.equal(whole, torch.cat(alone)), (n, start, threads)


def test_the_attention_kernel_sees_only_earlier_tokens(layer_kernels):
    """Changing the cache past a row's own position leaves that row's output unchanged."""
    torch.manual_seed(1)
    qkv, cos, sin = torch.randn(3, 15 * 16), torch.ones(3, 16), torch.zeros(3, 16)
    k, v = torch.randn(3, 64, 16), torch.randn(3, 64, 16)
    first = layer_kernels.attend(qkv, k.clone(), v.clone(), cos, sin, 20, 9)
    k[:, 23:], v[:, 23:] = 100.0, 100.0  # beyond the last new token (position 22): must not be read
    torch.testing.assert_close(layer_kernels.attend(qkv, k, v, cos, sin, 20, 9), first)


def test_the_attention_kernel_refuses_a_pass_past_the_cache(layer_kernels):
    k = v = torch.zeros(3, 8, 64)
    with pytest.raises(RuntimeError, match="exceed the cache's capacity of 8"):
        layer_kernels.attend(torch.zeros(2, 15 * 64), k, v, torch.zeros(2, 64), torch.zeros(2, 64), 7, 9)


def test_the_norm_and_gate_kernels_are_the_torch_functions(layer_kernels):
    torch.manual_seed(2)
    for width in (576, 252, 7):  # 252: a tail past the last 16; 7: tail only
        x, w = torch.randn(5, width), torch.randn(width)
        torch.testing.assert_close(layer_kernels.rms_norm(x, w, 1e-5), TorchLayerOps.rms_norm(x, w, 1e-5))
    x = torch.randn(40, 6).t()  # not contiguous
    torch.testing.assert_close(
        layer_kernels.rms_norm(x, torch.ones(40), 1e-5), TorchLayerOps.rms_norm(x, torch.ones(40), 1e-5)
    )
    gu = torch.randn(3, 2 * 1536)
    torch.testing.assert_close(layer_kernels.silu_mul(gu), TorchLayerOps.silu_mul(gu))


def test_quantize_rows_rounds_each_row_on_its_own_scale_and_pads_to_16():
    torch.manual_seed(0)
    w = torch.randn(30, 37) * torch.logspace(-3, 1, 30)[:, None]  # rows of very different magnitudes
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and q.shape == (30, 48) and scale.shape == (30,)
    assert (q[:, 37:] == 0).all() and (q[:, :37].abs().amax(dim=1) == 127).all()
    assert ((q[:, :37].float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7).all()


def test_the_int8_kernel_is_the_product_with_the_dequantized_weights(layer_kernels):
    torch.manual_seed(0)
    for rows, inner, out in [(1, 252, 960), (3, 1024, 252), (4, 37, 50), (9, 576, 7), (16, 64, 130), (40, 100, 33)]:
        x, (q, scale) = torch.randn(rows, inner), quantize_rows(torch.randn(out, inner))
        expected = F.linear(x, q[:, :inner].float() * scale[:, None])
        torch.testing.assert_close(layer_kernels.few_rows_int8(x, q, scale), expected, atol=1e-4, rtol=1e-5)
    with pytest.raises(RuntimeError, match="padded to 16"):
        layer_kernels.few_rows_int8(torch.randn(2, 20), q, scale)
    with pytest.raises(RuntimeError, match="int8 w"):
        layer_kernels.few_rows_int8(torch.randn(2, 100), q.float(), scale)


def test_the_int8_kernel_gives_each_row_the_result_it_gets_alone(tiny_draft, tokenizer, layer_kernels):
    """x stays float32, so a pass's rows do not share a quantization grid: a verify, a prefill and a rebuild give
    what steps give, to float rounding. That is what lets a seeded request replay across a session rebuild."""
    runner = LeanLlamaRunner(tiny_draft, len(tokenizer), max_len=1024, quantize="int8")
    ids = list(range(100, 160))
    one_by_one = [runner.forward(cache := runner.new_cache(), ids[:40], 1)]
    one_by_one += [runner.forward(cache, [t], 1) for t in ids[40:]]
    prefill = runner.forward(runner.new_cache(), ids, 21)  # a long pass: F.linear on the dequantized weights
    chunked = runner.forward(cache := runner.new_cache(), ids[:40], 1)
    verify = runner.forward(cache, ids[40:], 20)  # a verify-sized pass: the kernel at 20 rows
    torch.testing.assert_close(prefill, torch.cat(one_by_one), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat([chunked, verify]), torch.cat(one_by_one), atol=1e-4, rtol=1e-4)


def test_asking_for_the_kernel_where_it_cannot_build_is_a_clear_error(tiny_draft, tokenizer, no_kernel):
    with pytest.raises(ValueError, match="could not be built here"):
        LeanLlamaRunner(tiny_draft, len(tokenizer), max_len=64, matmul="fewrow")


def test_a_runner_says_how_it_runs(tiny_draft, tokenizer, no_kernel):
    assert CausalLMRunner(tiny_draft, len(tokenizer)).describe() == "transformers forward"
    assert (
        LeanLlamaRunner(tiny_draft, len(tokenizer), max_len=64, quantize="int8").describe()
        == "lean forward; products on int8 weights in fbgemm"
    )
    assert (
        LeanLlamaRunner(tiny_draft, len(tokenizer), max_len=64, matmul="onednn").describe()
        == f"lean forward; products: 1-{SMALL_PASS_ROWS} rows: onednn, longer passes: linear"
    )


def test_a_runner_names_the_layer_kernels_it_uses(tiny_draft, tokenizer, layer_kernels):
    runner = LeanLlamaRunner(tiny_draft, len(tokenizer), max_len=64, quantize="int8")
    assert runner.layer_ops is layer_kernels
    assert runner.describe() == (
        "lean forward with specdec's CPU layer kernels (the layers' loop in C++ for int8); "
        "products on int8 weights in specdec's kernel"
    )


@pytest.mark.parametrize("form", list(KERNEL_FORMS))
def test_the_layers_loop_in_cpp_gives_the_python_loops_logits_bit_for_bit(
    tiny_draft, tiny_gguf, tokenizer, form, layer_kernels
):
    """LayerStack runs the same operations in the same order as the Python loop, so greedy output and seeded
    sampling are unchanged by it: steps, verify-sized passes and a pass after rollback, on a cache that grows."""
    runner = kernel_runner(form, tiny_draft, tiny_gguf, tokenizer)
    assert runner.plan.long.name in runner.plan.stacks
    ids = list(range(100, 400))
    chunks = [ids[:250], ids[250:251], ids[251:255], ids[255:264], ids[264:265], ids[200:203]]
    with_stack = steps(runner, chunks, crop_at=(5, 200))
    no_stack = runner.plan.long._replace(stack=None)  # the same products, the layers' loop in Python
    runner.plan = dataclasses.replace(runner.plan, by_rows=(no_stack,) * (SMALL_PASS_ROWS + 1), long=no_stack)
    assert not runner.plan.stacks
    for a, b in zip(with_stack, steps(runner, chunks, crop_at=(5, 200))):
        assert torch.equal(a, b)


@pytest.mark.parametrize("form", list(KERNEL_FORMS))
def test_a_verify_pass_gives_each_row_the_steps_logits_bit_for_bit(
    tiny_draft, tiny_gguf, tokenizer, form, layer_kernels
):
    """Greedy speculative output equals the target alone's only if a verify's logits at a position are the
    step's there, exactly: every product and attention row is summed on its own whatever the pass's width."""
    runner = kernel_runner(form, tiny_draft, tiny_gguf, tokenizer)
    ids = list(range(100, 160))
    runner.forward(cache := runner.new_cache(), ids[:41], 1)
    verify = runner.forward(cache, ids[41:50], 9)
    runner.forward(cache := runner.new_cache(), ids[:41], 1)
    steps_ = torch.cat([runner.forward(cache, [t], 1) for t in ids[41:50]])
    assert torch.equal(verify, steps_)


def test_unknown_product_form_is_refused(tiny_draft, tokenizer):
    with pytest.raises(ValueError, match="matmul must be one of"):
        LeanLlamaRunner(tiny_draft, len(tokenizer), max_len=64, matmul="fast")


@pytest.mark.parametrize("products", ["specdec's kernel", "fbgemm"])
def test_int8_products_stay_close_to_float_products(tiny_draft, tokenizer, products, monkeypatch):
    import specdec.runners.kernels

    if products == "fbgemm":
        monkeypatch.setattr(specdec.runners.kernels, "cpu_kernels", lambda: None)
    else:
        built_kernels()
    ids = list(range(100, 400))
    chunks = [ids[:200], ids[200:201], ids[201:206], ids[206:300], ids[150:153]]
    full = LeanLlamaRunner(tiny_draft, len(tokenizer), max_len=1024, matmul="linear")
    int8 = LeanLlamaRunner(tiny_draft, len(tokenizer), max_len=1024, quantize="int8")
    for a, b in zip(steps(full, chunks, crop_at=(4, 150)), steps(int8, chunks, crop_at=(4, 150))):
        assert a.shape == b.shape and b.dtype == torch.float32
        tv = 0.5 * (a.softmax(-1) - b.softmax(-1)).abs().sum(-1)  # total variation per position; measured 0.002
        assert tv.max() < 0.02, f"total variation {tv.max():.4f}"
        assert not torch.equal(a, b)  # the int8 path really ran
    assert int8.describe().endswith(f"int8 weights in {products}")


def test_int8_keeps_the_restricted_output_vocabulary(tiny_draft, tokenizer):
    import copy

    draft = copy.deepcopy(tiny_draft)
    draft.config.specdec_output_token_ids = list(range(1000, 5000))
    runner = make_runner(draft, len(tokenizer), 512, "lean", quantize="int8")
    logits = runner.forward(runner.new_cache(), list(range(100, 140)), 3)
    assert torch.isinf(logits[:, :1000]).all() and torch.isinf(logits[:, 5000:]).all()
    assert torch.isfinite(logits[:, 1000:5000]).all()


def test_quantized_weights_are_refused_where_they_cannot_run(tiny_draft, tokenizer):
    import copy

    with pytest.raises(ValueError, match="quantize must be one of"):
        LeanLlamaRunner(tiny_draft, len(tokenizer), max_len=64, quantize="int2")
    with pytest.raises(ValueError, match="int4 weights are multiplied with quantized activations"):
        LeanLlamaRunner(tiny_draft, len(tokenizer), max_len=64, quantize="int4")
    with pytest.raises(ValueError, match="from float32 weights"):
        LeanLlamaRunner(copy.deepcopy(tiny_draft).to(torch.bfloat16), len(tokenizer), max_len=64, quantize="int8")
    with pytest.raises(ValueError, match="needs the lean runner"):
        make_runner(tiny_draft, len(tokenizer), 64, "hf", quantize="int8")


@pytest.mark.parametrize("pays, weights", [(True, "int4"), (False, "int8")])
def test_auto_quantizes_only_a_float32_draft_on_cpu(tiny_draft, monkeypatch, pays, weights):
    """A draft's numbers only change q, which the ratio test accounts for; a target's numbers are the output. Q4_1
    blocks where quantized activations pay on the CPU (they multiply them), else int8 rows."""
    import specdec.runners

    monkeypatch.setattr(specdec.runners, "quantized_rows_pay", lambda: pays)
    assert resolve_quantize("auto", "draft", tiny_draft) == weights
    assert resolve_quantize("auto", "target", tiny_draft) == "none"
    assert resolve_quantize("none", "draft", tiny_draft) == "none"
    assert resolve_quantize("int8", "target", tiny_draft) == "int8"  # asked for explicitly


def test_auto_activations_give_int4_weights_8_bit_activations_and_a_draft_float32_otherwise(tiny_draft):
    assert resolve_activations("auto", "draft", tiny_draft, quantize="int4") == "int8"
    assert resolve_activations("auto", "draft", tiny_draft, quantize="int8") == "float32"
    assert resolve_activations("int16", "draft", tiny_draft, quantize="int4") == "int16"  # asked for explicitly
