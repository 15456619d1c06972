"""The lean Llama forward gives the stock transformers logits, through cache growth and rollback,
with either form of its few-row products."""

import pytest
import torch
import torch.nn.functional as F

from specdec.lean_llama import LeanLlamaRunner, choose_matmul, weights_first
from specdec.runner import CausalLMRunner

FORMS = ("linear", "weights-first")


def steps(runner, chunks, crop_at=None):
    cache, out = runner.new_cache(), []
    for i, chunk in enumerate(chunks):
        if crop_at is not None and i == crop_at[0]:
            runner.crop(cache, crop_at[1])
        out.append(runner.forward(cache, chunk, len(chunk)))
    return out


@pytest.mark.parametrize("matmul", FORMS)
def test_lean_forward_matches_stock_forward(tiny_draft, tokenizer, matmul):
    ids = list(range(100, 400))  # 300 tokens: grows the cache past its first 256
    # a prefill, a step, a verify-sized pass, a long pass (over SMALL_PASS_ROWS), a pass after rollback
    chunks = [ids[:200], ids[200:201], ids[201:206], ids[206:300], ids[150:153]]
    stock = CausalLMRunner(tiny_draft, len(tokenizer))
    lean = LeanLlamaRunner(tiny_draft, len(tokenizer), max_len=1024, matmul=matmul)
    for a, b in zip(steps(stock, chunks, crop_at=(4, 150)), steps(lean, chunks, crop_at=(4, 150))):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("matmul", FORMS)
def test_lean_forward_matches_on_the_embedded_target(target_model, tokenizer, matmul):
    ids = tokenizer("The quick brown fox jumps over the lazy dog. " * 4)["input_ids"]
    stock = CausalLMRunner(target_model, len(tokenizer))
    lean = LeanLlamaRunner(target_model, len(tokenizer), max_len=512, matmul=matmul)
    chunks = [ids[:-6], ids[-6:-5], ids[-5:]]
    for a, b in zip(steps(stock, chunks), steps(lean, chunks)):
        torch.testing.assert_close(b, a, atol=2e-3, rtol=1e-3)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_restricted_output_vocabulary_gives_zero_probability_outside(tiny_draft, tokenizer):
    import copy

    from specdec.runner import make_runner

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


def test_auto_times_both_forms_and_keeps_linear_unless_weights_first_clearly_wins():
    torch.manual_seed(0)
    weights = [torch.randn(256, 128), torch.randn(128, 256)]
    form, timings = choose_matmul(weights, reps=1)
    assert form in FORMS and set(timings) == set(FORMS) and all(t > 0 for t in timings.values())
    assert choose_matmul(weights, reps=1, margin=0.0)[0] == "linear"  # a tie, or any gain under the margin
    assert choose_matmul(weights, reps=1, margin=float("inf"))[0] == "weights-first"


def test_unknown_product_form_is_refused(tiny_draft, tokenizer):
    with pytest.raises(ValueError, match="matmul must be one of"):
        LeanLlamaRunner(tiny_draft, len(tokenizer), max_len=64, matmul="fast")
