"""The lean Llama forward gives the stock transformers logits, through cache growth and rollback."""

import torch

from specdec.lean_llama import LeanLlamaRunner
from specdec.runner import CausalLMRunner


def steps(runner, chunks, crop_at=None):
    cache, out = runner.new_cache(), []
    for i, chunk in enumerate(chunks):
        if crop_at is not None and i == crop_at[0]:
            runner.crop(cache, crop_at[1])
        out.append(runner.forward(cache, chunk, len(chunk)))
    return out


def test_lean_forward_matches_stock_forward(tiny_draft, tokenizer):
    ids = list(range(100, 400))  # 300 tokens: grows the cache past its first 256
    chunks = [ids[:200], ids[200:201], ids[201:206], ids[206:300], ids[150:153]]
    stock = CausalLMRunner(tiny_draft, len(tokenizer))
    lean = LeanLlamaRunner(tiny_draft, len(tokenizer), max_len=1024)
    for a, b in zip(steps(stock, chunks, crop_at=(4, 150)), steps(lean, chunks, crop_at=(4, 150))):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, atol=2e-4, rtol=1e-4)


def test_lean_forward_matches_on_the_embedded_target(target_model, tokenizer):
    ids = tokenizer("The quick brown fox jumps over the lazy dog. " * 4)["input_ids"]
    stock = CausalLMRunner(target_model, len(tokenizer))
    lean = LeanLlamaRunner(target_model, len(tokenizer), max_len=512)
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
