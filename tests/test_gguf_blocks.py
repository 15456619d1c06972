"""The gguf product form reads a GGUF file's own Q4_1 and Q8_0 blocks and gives exactly the products
of the float32 weights they dequantize to: bit for bit few_rows' result, so greedy output cannot move.
A file that does not hold the loaded weights is refused, never used."""

import copy

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from conftest import built_kernels, write_gguf
from specdec import models
from specdec.runners import gguf_blocks
from specdec.runners.lean_llama import LeanLlamaRunner


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("n, k, m", [(1, 32, 1), (7, 32, 3), (50, 576, 4), (33, 1536, 9), (64, 96, 16), (13, 64, 20)])
def test_the_gguf_kernel_is_few_rows_on_the_dequantized_weights_bit_for_bit(fmt, n, k, m):
    kernels = built_kernels()
    rng = np.random.default_rng(n * k + m)
    raw = quantize(rng.standard_normal((n, k)).astype(np.float32), GGMLQuantizationType[fmt])
    weights = torch.from_numpy(dequantize(raw, GGMLQuantizationType[fmt]))
    x = torch.randn(m, k)
    out = kernels.few_rows_gguf(x, *gguf_blocks.split_blocks(raw, fmt))
    assert torch.equal(out, kernels.few_rows(x, weights))
    torch.testing.assert_close(out, x @ weights.T, atol=1e-4, rtol=1e-4)


def test_the_gguf_kernel_refuses_blocks_that_do_not_fit_x():
    kernels = built_kernels()
    q, scales, _ = gguf_blocks.split_blocks(quantize(np.ones((4, 64), np.float32), GGMLQuantizationType.Q4_1), "Q4_1")
    with pytest.raises(RuntimeError, match="do not hold"):
        kernels.few_rows_gguf(torch.ones(1, 96), q, scales, "Q4_1")
    with pytest.raises(RuntimeError, match="do not hold"):
        kernels.few_rows_gguf(torch.ones(1, 64), q, scales, "Q8_0")  # 32 bytes a row are one Q8_0 block, not two
    with pytest.raises(RuntimeError, match="format"):
        kernels.few_rows_gguf(torch.ones(1, 64), q, scales, "Q4_0")


def test_the_gguf_form_gives_the_fewrow_logits_bit_for_bit(tiny_gguf, tokenizer):
    built_kernels()
    model, path = tiny_gguf
    runners = [LeanLlamaRunner(model, len(tokenizer), 512, matmul=form, gguf=path) for form in ("fewrow", "gguf")]
    assert runners[1].plan.gguf_blocks.startswith("Q4_1 layers, Q8_0 head")
    ids = list(range(300, 340))
    outs = []
    for runner in runners:
        cache = runner.new_cache()
        runner.forward(cache, ids[:20], 1)  # a prefill: F.linear in both
        outs.append([runner.forward(cache, ids[a:b], b - a) for a, b in ((20, 21), (21, 25), (25, 34))])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_a_file_that_does_not_hold_the_loaded_weights_is_refused(tiny_draft, tiny_gguf, tokenizer):
    built_kernels()
    _, path = tiny_gguf  # the blocks of other weights: tiny_draft before rounding to them
    with pytest.raises(ValueError, match="do not reproduce the loaded weights"):
        LeanLlamaRunner(tiny_draft, len(tokenizer), 512, matmul="gguf", gguf=path)
    runner = LeanLlamaRunner(tiny_draft, len(tokenizer), 512, matmul="auto", gguf=path)
    assert "gguf" not in runner.plan.products and runner.plan.gguf_blocks is None  # auto goes on without the form


def test_block_types_the_kernel_does_not_read_are_refused(tiny_draft, tokenizer, tmp_path):
    built_kernels()
    model, path = write_gguf(copy.deepcopy(tiny_draft), tmp_path / "q5.gguf", formats=("Q5_0", "Q8_0"))
    with pytest.raises(ValueError, match="is Q5_0"):
        LeanLlamaRunner(model, len(tokenizer), 512, matmul="gguf", gguf=path)


def test_the_tensor_index_reads_what_ggufs_own_reader_reads(tmp_path):
    """read_tensors parses only the header and the tensor index; every tensor, its type and its bytes must be
    the ones gguf's GGUFReader finds, past string arrays, nested arrays and a custom alignment."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    path = tmp_path / "index.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(64)
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "héllo", "", "x" * 300])
    writer.add_array("tokenizer.ggml.scores", [0.5, -1.0, 2.0])
    writer.add_key_value("test.nested", [[1, 2], [3]], GGUFValueType.ARRAY, sub_type=GGUFValueType.ARRAY)
    writer.add_uint64("test.big", 1 << 40)
    rng = np.random.default_rng(0)
    for name, shape, kind in (
        ("a", (3, 64), "Q4_1"),
        ("b", (5, 96), "Q8_0"),
        ("c", (7,), "F32"),
        ("d", (2, 32), "F16"),
    ):
        values = rng.standard_normal(shape).astype(np.float32)
        if kind in ("Q4_1", "Q8_0"):
            writer.add_tensor(name, quantize(values, GGMLQuantizationType[kind]), raw_dtype=GGMLQuantizationType[kind])
        else:
            writer.add_tensor(name, values.astype(np.float16 if kind == "F16" else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    index = gguf_blocks.read_tensors(str(path))
    theirs = {t.name: t for t in GGUFReader(str(path)).tensors}
    assert set(index) == set(theirs) == {"a", "b", "c", "d"}
    for name, t in theirs.items():
        raw, kind = index[name]
        assert kind == t.tensor_type.name
        assert raw.tobytes() == np.asarray(t.data).tobytes()
    assert index["a"][0].shape == (3, 2 * 20) and index["b"][0].shape == (5, 3 * 34)


def test_a_file_that_is_not_gguf_is_refused_with_its_reason(tmp_path):
    for body, reason in (
        (b"PK\x03\x04 not gguf", "not a GGUF file"),
        (b"GGUF\x03\x00\x00\x00\x05", "unpack"),
        (b"GGUF\x01\x00\x00\x00" + bytes(16), "version 1"),
    ):
        (path := tmp_path / "bad.gguf").write_bytes(body)
        with pytest.raises(gguf_blocks.BlocksUnavailable, match=reason):
            gguf_blocks.read_tensors(str(path))
    with pytest.raises(gguf_blocks.BlocksUnavailable, match="cannot read"):
        gguf_blocks.read_tensors(str(tmp_path / "missing.gguf"))


def test_the_gguf_form_needs_a_gguf_file(tiny_draft, tokenizer):
    built_kernels()
    with pytest.raises(ValueError, match="not loaded from a GGUF file"):
        LeanLlamaRunner(tiny_draft, len(tokenizer), 512, matmul="gguf")


def test_every_block_of_the_embedded_target_reproduces_its_weights(target_model, tokenizer):
    path = models.gguf_file(models.DEFAULT_TARGET)
    runner = LeanLlamaRunner(target_model, len(tokenizer), 64, matmul="linear")
    layers, head = gguf_blocks.read_llama_blocks(path, runner.layers, runner.lm_head, runner.n_heads, runner.n_kv)
    assert gguf_blocks.describe(layers, head) == "Q4_1 layers, Q8_0 head, 111 MB"
    for fused, weights in zip(layers, runner.layers):
        for split, w in zip(fused, weights.matrices):
            assert np.array_equal(dequantized(*split), w.numpy())
    assert np.array_equal(dequantized(*head), runner.lm_head.numpy())


def dequantized(q, scales, fmt) -> np.ndarray:
    """split_blocks undone into GGUF's own blocks, then gguf's dequantization: the float32 weights they hold."""
    n = q.shape[0]
    start, end = gguf_blocks.FORMATS[fmt]["scales"]
    halves = scales.numpy().astype(np.float16).view(np.uint8).reshape(n, -1, end - start)  # exact: they were fp16
    raw = np.concatenate([halves, q.numpy().reshape(n, halves.shape[1], -1)], axis=-1).reshape(n, -1)
    return dequantize(raw, GGMLQuantizationType[fmt])
