"""Products with quantized activations, 8 and 16 bits (kernels/q8_products.cpp, runners/q8_blocks.py): every
instruction-set form this CPU runs is forced in turn and held to the others bit for bit, and to a torch reference
of the same quantized numbers."""

from __future__ import annotations

import json

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


def _weights(kind: str, n: int, k: int, bits: int = 8) -> qb.Q8Weights:
    if kind == "Q4_1":
        w = qb.pack_q4_1(*_q4_1(n, k))
    elif kind == "Q8_0":
        w = qb.pack_q8_0(*_q8_0(n, k))
    else:
        g = torch.Generator().manual_seed(1)
        q = torch.randint(-127, 128, (n, -(-k // 16) * 16), dtype=torch.int8, generator=g)
        w = qb.pack_int8_rows(q, torch.rand(n, generator=g) * 0.01, k)
    return w.with_isa(w.isa, bits)


@pytest.mark.parametrize("bits", [8, 16])
def test_the_quantizer_rounds_each_block_of_a_row_on_its_own_ties_to_even(kernels, bits):
    levels = qb.LEVELS[bits]  # amax = levels: q = x, and the halves are ties
    x = torch.randn(3, 64)
    x[1, :32] = torch.tensor([levels, 0.5, 1.5, 2.5, -0.5, -1.5, -levels] + [0.0] * 25)
    x[2, 32:] = 0.0  # an all-zero block: d 0, q 0
    q, d, s = kernels.quantize_q8(x, bits)
    rq, rd, rs = qb.quantize_reference(x, bits)
    assert q.dtype == (torch.int8 if bits == 8 else torch.int16)
    assert torch.equal(q, rq) and torch.equal(d, rd) and torch.equal(s, rs)
    assert q[1, :7].tolist() == [levels, 0, 2, 2, 0, -2, -levels]
    assert d[2, 1] == 0 and not q[2, 32:].any() and s[2, 1] == 0
    assert torch.equal(s, q.reshape(3, 2, 32).sum(-1, dtype=torch.int32))


def test_16_bit_activations_follow_x_128_times_closer_than_8_bit_ones(kernels):
    x = torch.randn(4, 256)
    err = {}
    for bits in (8, 16):
        q, d, _ = kernels.quantize_q8(x, bits)
        err[bits] = float((q.float().reshape(4, 8, 32) * d[..., None] - x.reshape(4, 8, 32)).abs().max())
    assert err[16] < err[8] / 100


@pytest.mark.parametrize(
    "kind, n, k",
    [
        *((kind, n, k) for kind in ("Q4_1", "Q8_0", "int8 rows") for n, k in [(48, 64), (37, 96), (8, 32)]),
        ("int8 rows", 20, 84),  # 37, 8 and 20: a last tile partly filled; 84 inputs: a last block padded
    ],
)
@pytest.mark.parametrize("bits", [8, 16])
def test_every_instruction_set_form_gives_the_same_products_bit_for_bit(kernels, isas, kind, n, k, bits):
    w = _weights(kind, n, k, bits)
    x = torch.randn(11, k)  # 11 rows: a tile of 8 rows and one of 3 (each block's largest |x| takes q = +-levels)
    ys = {isa: w.product(kernels, x, isa) for isa in isas}
    first = ys[isas[0]]
    assert first.shape == (11, n)
    for isa, y in ys.items():
        assert torch.equal(y, first), isa
    torch.testing.assert_close(first, qb.reference(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind, k", [("Q8_0", 96), ("int8 rows", 84)])  # 84: x padded to the weights' blocks
@pytest.mark.parametrize("bits", [8, 16])
def test_an_output_layers_products_on_amxs_tiles_equal_avx512s_bit_for_bit(kernels, isas, kind, k, bits):
    """The AMX form multiplies Q8_0 products of 8,192 output rows or more (output layers) on the tiles, 16 rows of x
    at a time, and leaves a last chunk under 4 rows to the AVX-512 form: every row count gives AVX-512's products,
    bit for bit."""
    if "amx" not in isas:
        pytest.skip("this CPU (or its kernel) gives no AMX tiles")
    w = _weights(kind, 8192 + 24, k, bits)  # a last tile partly filled
    x = torch.randn(37, k)
    x[5, 32:64] = 0.0  # a block of zeros: d 0
    width = w.w.shape[1] * 32
    for rows, tiled in [(1, 0), (3, 0), (4, 4), (5, 5), (16, 16), (17, 16), (20, 20), (37, 37)]:
        assert kernels.q8_amx_rows(w.format, w.n, width, rows) == tiled  # the tiles run these rows
        assert torch.equal(w.product(kernels, x[:rows], "amx"), w.product(kernels, x[:rows], "avx512-vnni")), rows
    assert kernels.q8_amx_rows(w.format, 8191, width, 16) == 0  # a layer's product: AVX-512
    assert kernels.q8_amx_rows("Q4_1", w.n, width, 16) == 0


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("bits", [8, 16])
def test_a_rows_product_is_the_one_it_gets_alone_whatever_the_rows_beside_it(kernels, isas, kind, bits):
    w = _weights(kind, 40, 128, bits)
    x = torch.randn(20, 128)
    for isa in isas:
        together = w.product(kernels, x, isa)
        for m in (0, 7, 8, 19):
            assert torch.equal(w.product(kernels, x[m : m + 1], isa)[0], together[m])
            assert torch.equal(w.product(kernels, x[m:], isa)[0], together[m])


@pytest.mark.parametrize("bits, within", [(8, 0.02), (16, 0.0002)])
def test_the_products_approximate_the_float_ones_of_the_dequantized_weights(kernels, isas, bits, within):
    # 8-bit activations lose about 1/254 of a block's largest value per input, 16-bit ones 1/32512: the product
    # stays within a few per cent, or a few hundredths of one, of the float product's scale.
    q, scales = _q4_1(64, 256)
    b, s = q.reshape(64, 8, 16), scales.reshape(64, 8, 2)
    w = (torch.cat([b & 15, b >> 4], 2).float() * s[..., :1] + s[..., 1:]).reshape(64, 256)
    x = torch.randn(4, 256)
    exact = x @ w.T
    got = qb.pack_q4_1(q, scales).with_isa(isas[0], bits).product(kernels, x)
    assert float((got - exact).abs().max()) < within * float(exact.abs().max())


@pytest.mark.parametrize("bits", [8, 16])
def test_q4_1s_minimum_term_takes_the_blocks_integer_sum(kernels, isas, bits):
    # weights all equal to their block's minimum (q = 0, d = 1, m = 0.25): y = 0.25 * dx * sum(qx) exactly.
    n, k = 16, 64
    q = torch.zeros(n, k // 32 * 16, dtype=torch.uint8)
    scales = torch.tensor([1.0, 0.25]).repeat(n, k // 32)
    x = torch.randn(2, k)
    _, dx, sx = qb.quantize_reference(x, bits)
    want = (0.25 * (dx * sx.float())).sum(-1)
    for isa in isas:
        got = qb.pack_q4_1(q, scales).with_isa(isa, bits).product(kernels, x)
        torch.testing.assert_close(got, want[:, None].expand(2, n), rtol=1e-6, atol=0)


@pytest.mark.parametrize("bits", [8, 16])
def test_q4_1_blocks_at_their_largest_sum_exactly(kernels, isas, bits):
    """Every nibble 15 and every x at its block's largest |q|, one sign a row: the largest sums a block's integer
    products reach (AVX2 adds a block's maddubs pairs in 16 bits, 16 * 15 * 127 = 30,480 at most)."""
    n, k = 16, 64
    q = torch.full((n, k // 32 * 16), 255, dtype=torch.uint8)
    scales = torch.tensor([1.0, 0.0]).repeat(n, k // 32)
    x = torch.ones(2, k)
    x[1] = -1.0
    for isa in isas:
        got = qb.pack_q4_1(q, scales).with_isa(isa, bits).product(kernels, x)
        assert torch.equal(got, torch.tensor([[15.0 * k], [-15.0 * k]]).expand(2, n)), isa


def test_q4_1_quantization_writes_blocks_llama_cpp_reads_each_weight_within_half_a_step():
    """A draft's int4 weights (forms.quantize_q4_1) are GGUF Q4_1 blocks: laid out as a file's, gguf's own
    dequantizer gives back every weight within half its block's step (d / 2, plus fp16's rounding of d and m)."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from specdec.runners.forms import quantize_q4_1

    w = torch.randn(24, 96) * torch.rand(24, 1)
    w[3, :32] = 0.25  # a constant block: d 0, every weight its minimum
    q, scales = quantize_q4_1(w)
    d, m = scales.reshape(24, 3, 2).unbind(-1)
    file_blocks = torch.cat([scales.reshape(24, 3, 2).half().view(torch.uint8), q.reshape(24, 3, 16)], dim=-1)
    values = torch.from_numpy(dequantize(file_blocks.reshape(24, 60).numpy(), GGMLQuantizationType.Q4_1))
    step = d.repeat_interleave(32, dim=1)
    assert (values - w).abs().le(0.51 * step + 1e-3 * m.abs().repeat_interleave(32, dim=1)).all()
    assert torch.equal(values[3, :32], w[3, :32])
    assert float((values - w).abs().mean() / step.mean()) < 0.3  # rounded to the nearest level, not truncated
    assert np.array_equal(scales.numpy(), scales.half().float().numpy())  # the file's fp16 values


def _gate_report(int8_top1: float, int16_top1: float) -> dict:
    texts = lambda top1: {
        text: {"positions": 10, "top1_agreement": top1, "mean_kl": 0.0, "perplexity_change": 0.001}
        for text in ("answers", "passages")
    }
    return {"machine": {"cpu": "test"}, "int8": texts(int8_top1), "int16": texts(int16_top1)}


def test_the_gate_records_a_verdict_for_the_files_exact_bytes(tmp_path, monkeypatch):
    from specdec.runners import gate

    monkeypatch.setattr(gate, "RECORDS", tmp_path / "gates.json")
    model = tmp_path / "model.gguf"
    model.write_bytes(b"weights")
    assert gate.passed(str(model)) == () and gate.passed(None) == ()  # no record: no quantized activations
    entry = gate.record(str(model), _gate_report(0.97, 0.999))
    assert entry["activations"]["int8"]["passed"] is False and entry["activations"]["int16"]["passed"] is True
    assert gate.passed(str(model)) == ("int16",)
    report = _gate_report(0.995, 0.999)
    report["int16"]["passages"]["perplexity_change"] = -0.006  # perplexity moved too far, the other way
    gate.record(str(model), report)
    assert gate.passed(str(model)) == ("int8",)
    model.write_bytes(b"other weights")  # a record holds for those bytes alone
    assert gate.passed(str(model)) == ()


def test_auto_gives_a_target_the_activations_its_file_passed_the_gate_with(tiny_draft, isas, tmp_path, monkeypatch):
    import specdec.runners
    from specdec.runners import gate, make_runner, resolve_activations

    monkeypatch.setattr(gate, "RECORDS", tmp_path / "gates.json")
    model = tmp_path / "model.gguf"
    model.write_bytes(b"weights")
    gguf = str(model)
    resolve = lambda *args, role="target", matmul="auto": resolve_activations(
        "auto", role, tiny_draft, *args, matmul=matmul
    )
    assert resolve("cpu", "auto", gguf) == "float32"  # no record yet
    gate.record(gguf, _gate_report(0.97, 0.999))
    wide = "int16" if specdec.runners.quantized_rows_pay() else "float32"  # where they are the faster (below)
    assert resolve("cpu", "auto", gguf) == wide
    gate.record(gguf, _gate_report(0.995, 0.999))
    assert resolve("cpu", "auto", gguf) == ("int8" if wide != "float32" else "float32")  # the faster first
    assert resolve("cpu", "auto", gguf, role="draft") == "float32"  # a draft's stay float32
    assert resolve("cpu", "auto", gguf, matmul="gguf") == "float32"  # a float form asked for
    assert resolve("cpu", "auto", None) == "float32"  # no blocks
    assert resolve("cuda", "auto", gguf) == "float32"
    assert resolve("cpu", "hf", gguf) == "float32"
    monkeypatch.setattr(specdec.runners, "quantized_rows_pay", lambda: False)
    assert resolve("cpu", "auto", gguf) == "float32"  # only where the quantized forms were measured faster
    assert resolve_activations("float32", "target", tiny_draft, "cpu", "auto", gguf) == "float32"
    assert resolve_activations("int8", "target", tiny_draft, "cuda", "auto", None) == "int8"  # as asked
    with pytest.raises(ValueError, match="lean runner"):
        make_runner(tiny_draft, 49152, 64, "hf", activations="int16")


@pytest.mark.parametrize(
    "best, flags, pays",
    [
        ("amx", {"avx2", "avx512f"}, True),
        ("avx512-vnni", {"avx2", "avx512f"}, True),
        ("avx2", {"avx2", "avx512f"}, False),  # AVX-512 without VNNI: float32 rows run in 512 bits, int8 in 256
        ("avx-vnni", {"avx2", "avx512f"}, False),
        ("avx2", {"avx2"}, True),  # no AVX-512F: both run in 256 bits
        ("avx-vnni", {"avx2", "avx_vnni"}, True),
        (None, {"avx2"}, False),  # no quantized forms built
    ],
)
def test_quantized_rows_are_chosen_where_float32_rows_run_no_wider(best, flags, pays, monkeypatch):
    import specdec.runners
    from specdec.runners import kernels

    monkeypatch.setattr(specdec.runners, "q8_isas", lambda: [best, "avx2"] if best else [])
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset(flags))
    assert specdec.runners.quantized_rows_pay() is pays


def test_the_repositorys_gate_record_is_for_the_embedded_targets_file():
    # The record is keyed by the file's sha256: a new release of the package's GGUF file needs `specdec gate` again.
    from specdec import models
    from specdec.runners import gate

    gguf = models.gguf_file(models.DEFAULT_TARGET)
    assert gate.file_sha256(gguf) in json.loads(gate.RECORDS.read_text())
    assert "int16" in gate.passed(gguf)


def test_int8_activations_without_blocks_to_multiply_are_refused_saying_why(tiny_draft, tokenizer, isas):
    from specdec.runners import LeanLlamaRunner

    with pytest.raises(ValueError, match="not loaded from a GGUF file"):
        LeanLlamaRunner(tiny_draft, len(tokenizer), 64, activations="int8")


@pytest.mark.parametrize("quantize, bits, within", [("int8", 8, 0.05), ("int4", 8, 0.1), ("int4", 16, 0.1)])
@pytest.mark.parametrize("width", [64, 84])  # 84: the shipped draft is 252 wide, its rows padded to whole blocks
def test_a_quantized_draft_gives_each_row_what_it_gets_alone_near_the_float_model(
    tokenizer, isas, quantize, bits, within, width
):
    """A draft's int8 rows or Q4_1 blocks in few_rows_q8 (x padded with zeros to the weights' whole blocks): a verify
    of 5 rows equals 5 one-row steps bit for bit, and the model stays the float one within the weights' rounding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec.runners import LeanLlamaRunner

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=width,
        intermediate_size=width + 16,
        num_hidden_layers=2,
        num_attention_heads=width // 16 if width % 16 == 0 else 3,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    runner = LeanLlamaRunner(model, len(tokenizer), 256, quantize=quantize, activations=f"int{bits}")
    assert runner.plan.long.name == f"{qb.QUANTIZED[quantize]}-q{bits}" and runner.batch_invariant
    assert runner.numerics == f"float32, {quantize} weights, {bits}-bit activations"
    ids = list(range(100, 130))
    runner.forward(cache := runner.new_cache(), ids[:20], 1)
    verify = runner.forward(cache, ids[20:25], 5)
    runner.forward(cache := runner.new_cache(), ids[:20], 1)
    assert torch.equal(verify, torch.cat([runner.forward(cache, [t], 1) for t in ids[20:25]]))
    float_runner = LeanLlamaRunner(model, len(tokenizer), 256, matmul="linear")
    p = float_runner.forward(float_runner.new_cache(), ids, 1).softmax(-1)
    q = runner.forward(runner.new_cache(), ids, 1).softmax(-1)
    assert float(0.5 * (p - q).abs().sum()) < within  # total variation
