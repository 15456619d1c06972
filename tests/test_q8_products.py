"""Products with 8-bit activations (kernels/q8_products.cpp, runners/q8_blocks.py): every instruction-set form
this CPU runs is forced in turn and held to the others bit for bit, and to a torch reference of the same
quantized numbers."""

from __future__ import annotations

import pytest
import torch

from specdec.runners import q8_blocks as qb
from tests.conftest import built_kernels


@pytest.fixture(scope="module")
def kernels():
    return built_kernels()


@pytest.fixture(scope="module")
def isas(kernels):
    forms = list(kernels.q8_isas())
    if not forms:
        pytest.skip("this CPU has no AVX2: the float32 product forms serve it")
    return forms


def _q4_1(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (n, k // 32 * 16), dtype=torch.uint8, generator=g)
    scales = (torch.randn(n, k // 32 * 2, generator=g) * 0.05).half().float()  # a file's fp16 values
    return q, scales


def _q8_0(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    return q.view(torch.uint8), (torch.rand(n, k // 32, generator=g) * 0.01).half().float()


def _weights(kind: str, n: int, k: int) -> qb.Q8Weights:
    if kind == "Q4_1":
        return qb.pack_q4_1(*_q4_1(n, k))
    if kind == "Q8_0":
        return qb.pack_q8_0(*_q8_0(n, k))
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-127, 128, (n, -(-k // 16) * 16), dtype=torch.int8, generator=g)
    return qb.pack_int8_rows(q, torch.rand(n, generator=g) * 0.01, k)


def test_the_quantizer_rounds_each_block_of_a_row_on_its_own_ties_to_even(kernels):
    x = torch.randn(3, 64)
    x[1, :32] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5] + [0.0] * 26)  # amax 127: q = x, ties exact
    x[2, 32:] = 0.0  # an all-zero block: d 0, q 0
    q, d, s = kernels.quantize_q8(x)
    rq, rd, rs = qb.quantize_reference(x)
    assert torch.equal(q, rq) and torch.equal(d, rd) and torch.equal(s, rs)
    assert q[1, :6].tolist() == [127, 0, 2, 2, 0, -2]
    assert d[2, 1] == 0 and not q[2, 32:].any() and s[2, 1] == 0
    assert torch.equal(s, q.reshape(3, 2, 32).sum(-1, dtype=torch.int32))


@pytest.mark.parametrize(
    "kind, n, k",
    [
        *((kind, n, k) for kind in ("Q4_1", "Q8_0", "int8 rows") for n, k in [(48, 64), (37, 96), (8, 32)]),
        ("int8 rows", 20, 84),  # 37, 8 and 20: a last tile partly filled; 84 inputs: a last block padded
    ],
)
def test_every_instruction_set_form_gives_the_same_products_bit_for_bit(kernels, isas, kind, n, k):
    w = _weights(kind, n, k)
    x = torch.randn(11, k)  # 11 rows: a tile of 8 rows and one of 3
    ys = {isa: w.product(kernels, x, isa) for isa in isas}
    first = ys[isas[0]]
    assert first.shape == (11, n)
    for isa, y in ys.items():
        assert torch.equal(y, first), isa
    torch.testing.assert_close(first, qb.reference(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_a_rows_product_is_the_one_it_gets_alone_whatever_the_rows_beside_it(kernels, isas, kind):
    w = _weights(kind, 40, 128)
    x = torch.randn(20, 128)
    for isa in isas:
        together = w.product(kernels, x, isa)
        for m in (0, 7, 8, 19):
            assert torch.equal(w.product(kernels, x[m : m + 1], isa)[0], together[m])
            assert torch.equal(w.product(kernels, x[m:], isa)[0], together[m])


def test_the_products_approximate_the_float_ones_of_the_dequantized_weights(kernels, isas):
    # 8-bit activations lose about 1/254 of a block's largest value per input: the product stays within a
    # few per cent of the float product's scale.
    q, scales = _q4_1(64, 256)
    b, s = q.reshape(64, 8, 16), scales.reshape(64, 8, 2)
    w = (torch.cat([b & 15, b >> 4], 2).float() * s[..., :1] + s[..., 1:]).reshape(64, 256)
    x = torch.randn(4, 256)
    exact = x @ w.T
    got = qb.pack_q4_1(q, scales).product(kernels, x, isas[0])
    assert float((got - exact).abs().max()) < 0.02 * float(exact.abs().max())


def test_q4_1s_minimum_term_takes_the_blocks_integer_sum(kernels, isas):
    # weights all equal to their block's minimum (q = 0, d = 1, m = 0.25): y = 0.25 * dx * sum(qx) exactly.
    n, k = 16, 64
    q = torch.zeros(n, k // 32 * 16, dtype=torch.uint8)
    scales = torch.tensor([1.0, 0.25]).repeat(n, k // 32)
    x = torch.randn(2, k)
    _, dx, sx = qb.quantize_reference(x)
    want = (0.25 * (dx * sx.float())).sum(-1)
    for isa in isas:
        got = qb.pack_q4_1(q, scales).product(kernels, x, isa)
        torch.testing.assert_close(got, want[:, None].expand(2, n), rtol=1e-6, atol=0)


def test_auto_takes_8_bit_activations_only_where_the_cpu_the_model_and_its_weights_allow_it(
    tiny_draft, isas, monkeypatch
):
    import specdec.runners
    from specdec.runners import make_runner, resolve_activations

    gguf = "model.gguf"
    assert resolve_activations("auto", "target", tiny_draft, "cpu", "auto", "none", gguf) == "float32"  # by default
    monkeypatch.setattr(specdec.runners, "AUTO_INT8_ROLES", ("draft", "target"))
    assert resolve_activations("auto", "target", tiny_draft, "cpu", "auto", "none", gguf) == "int8"
    assert resolve_activations("auto", "draft", tiny_draft, "cpu", "auto", "int8", None) == "int8"
    assert resolve_activations("auto", "target", tiny_draft, "cpu", "auto", "none", None) == "float32"  # no blocks
    assert resolve_activations("auto", "target", tiny_draft, "cuda", "auto", "none", gguf) == "float32"
    assert resolve_activations("auto", "target", tiny_draft, "cpu", "hf", "none", gguf) == "float32"
    assert resolve_activations("float32", "target", tiny_draft, "cpu", "auto", "none", gguf) == "float32"
    assert resolve_activations("int8", "target", tiny_draft, "cuda", "auto", "none", None) == "int8"  # as asked
    with pytest.raises(ValueError, match="lean runner"):
        make_runner(tiny_draft, 49152, 64, "hf", activations="int8")


def test_int8_activations_without_blocks_to_multiply_are_refused_saying_why(tiny_draft, tokenizer, isas):
    from specdec.runners import LeanLlamaRunner

    with pytest.raises(ValueError, match="not loaded from a GGUF file"):
        LeanLlamaRunner(tiny_draft, len(tokenizer), 64, activations="int8")


def test_a_draft_whose_width_is_not_a_multiple_of_32_runs_on_8_bit_activations(tokenizer, isas):
    # The shipped draft is 252 wide: its int8 rows are padded to whole blocks, and so is x, with zeros.
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec.runners import LeanLlamaRunner

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=84,
        intermediate_size=100,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    runner = LeanLlamaRunner(model, len(tokenizer), 256, quantize="int8", activations="int8")
    assert runner.plan.long.name == "int8-q8"
    ids = list(range(100, 130))
    runner.forward(cache := runner.new_cache(), ids[:20], 1)
    verify = runner.forward(cache, ids[20:25], 5)
    runner.forward(cache := runner.new_cache(), ids[:20], 1)
    assert torch.equal(verify, torch.cat([runner.forward(cache, [t], 1) for t in ids[20:25]]))
    float_runner = LeanLlamaRunner(model, len(tokenizer), 256, matmul="linear")
    p = float_runner.forward(float_runner.new_cache(), ids, 1).softmax(-1)
    q = runner.forward(runner.new_cache(), ids, 1).softmax(-1)
    assert float(0.5 * (p - q).abs().sum()) < 0.05  # total variation: the same model, within 8 bits' rounding
