"""A float16 KV cache (--kv-cache-dtype): what it stores, what it changes, and where auto takes it.

The kernels' own properties (rounding, reads, a row alone and batched, a verify row and a step) are tested with the
attention kernel in test_lean_llama.py and for the form gguf-q16-kv16 wherever KERNEL_FORMS is.
"""

from __future__ import annotations

import pytest
import torch

from conftest import kernel_runner
from specdec.config import ConfigError, ModelServerConfig


def test_a_float16_cache_starts_from_the_same_keys_and_stays_near_the_float32_caches_logits(
    tiny_draft, tiny_gguf, tokenizer
):
    """The first layer's keys and values are the float32 cache's rounded to halves (nothing before them differs);
    later layers read rounded keys, so the logits move a little, and only a little."""
    f32 = kernel_runner("gguf-q16", tiny_draft, tiny_gguf, tokenizer)
    f16 = kernel_runner("gguf-q16-kv16", tiny_draft, tiny_gguf, tokenizer)
    assert f16.new_cache().k.dtype == torch.float16 and f32.new_cache().k.dtype == torch.float32
    ids = list(range(100, 260))
    a = f32.forward(c32 := f32.new_cache(), ids, 8)
    b = f16.forward(c16 := f16.new_cache(), ids, 8)
    assert torch.equal(c16.k[0, :, :160], c32.k[0, :, :160].half()) and torch.equal(
        c16.v[0, :, :160], c32.v[0, :, :160].half()
    )
    assert not torch.equal(a, b)
    tv = 0.5 * (a.softmax(-1) - b.softmax(-1)).abs().sum(-1)  # total variation per position
    assert tv.max() < 0.01, f"total variation {tv.max():.4f}"
    assert f16.numerics == "float32, 16-bit activations, float16 KV cache"
    assert f16.describe().endswith("; a float16 KV cache")


def test_the_torch_layer_ops_read_a_float16_cache_as_the_kernels_do(tiny_draft, tokenizer, monkeypatch):
    """Where specdec's kernels cannot be built, torch's attention writes and reads the same halves (float rounding
    of the products apart)."""
    import specdec.runners.lean_llama as lean
    from conftest import built_kernels

    built_kernels()
    ids = list(range(300, 380))
    kernels = lean.LeanLlamaRunner(tiny_draft, len(tokenizer), 1024, matmul="fewrow", kv_cache="float16")
    expected = kernels.forward(kernels.new_cache(), ids, 4)
    monkeypatch.setattr(lean, "kernels_for", lambda t: None)
    torch_ops = lean.LeanLlamaRunner(tiny_draft, len(tokenizer), 1024, matmul="linear", kv_cache="float16")
    assert torch_ops.layer_ops is lean.TorchLayerOps and kernels.layer_ops is not lean.TorchLayerOps
    got = torch_ops.forward(cache := torch_ops.new_cache(), ids, 4)
    assert cache.k.dtype == torch.float16
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_a_float16_cache_is_refused_where_the_weights_are_not_float32_on_cpu(tiny_draft, tokenizer):
    from specdec.runners import make_runner
    from specdec.runners.kv_cache import kv_dtype

    with pytest.raises(ValueError, match=r"float32 weights on CPU, not torch\.bfloat16 on cpu"):
        kv_dtype("float16", torch.bfloat16, torch.device("cpu"))
    with pytest.raises(ValueError, match="kv_cache must be one of model, float16"):
        kv_dtype("int8", torch.float32, torch.device("cpu"))
    assert kv_dtype("model", torch.bfloat16, torch.device("cuda")) == torch.bfloat16
    with pytest.raises(ValueError, match="lean runner"):
        make_runner(tiny_draft, len(tokenizer), 64, "hf", kv_cache="float16")
    with pytest.raises(ConfigError, match="--kv-cache-dtype float16 runs on CPU from float32 weights, not cuda"):
        ModelServerConfig(device="cuda", kv_cache_dtype="float16").validate()
    with pytest.raises(ConfigError, match="--kv-cache-dtype must be auto, model or float16, not 'fp8'"):
        ModelServerConfig(kv_cache_dtype="fp8").validate()


def test_auto_takes_a_float16_cache_only_with_quantized_activations_and_for_a_target_a_passed_gate(
    tmp_path, monkeypatch
):
    from specdec.runners import gate, resolve_kv_cache

    monkeypatch.setattr(gate, "RECORDS", tmp_path / "gates.json")
    model = tmp_path / "model.gguf"
    model.write_bytes(b"weights")
    gguf = str(model)
    measured = lambda top1: {"positions": 10, "top1_agreement": top1, "mean_kl": 0.0, "perplexity_change": 0.001}
    report = lambda top1: {
        "int16": {text: measured(1.0) for text in gate.TEXTS},
        gate.form_name("int16", "float16"): {text: measured(top1) for text in gate.TEXTS},
    }
    assert resolve_kv_cache("auto", "target", "int16", gguf) == "model"  # no record
    gate.record(gguf, report(0.98))
    assert gate.passed(gguf) == ("int16",)
    assert resolve_kv_cache("auto", "target", "int16", gguf) == "model"  # the float16 form failed the gate
    gate.record(gguf, report(0.995))
    assert gate.passed(gguf) == ("int16", "int16 + float16 KV cache")
    assert resolve_kv_cache("auto", "target", "int16", gguf) == "float16"
    assert resolve_kv_cache("auto", "target", "int8", gguf) == "model"  # passed in other activations only
    assert resolve_kv_cache("auto", "target", "float32", gguf) == "model"  # transformers' numerics kept
    assert resolve_kv_cache("auto", "draft", "int8", None) == "float16"  # a draft's numbers change q alone
    assert resolve_kv_cache("auto", "draft", "float32", None) == "model"
    assert resolve_kv_cache("float16", "target", "float32", None) == "float16"  # as asked


def test_the_repositorys_gate_record_passes_the_embedded_target_with_a_float16_cache():
    from specdec import models
    from specdec.runners import gate

    assert gate.form_name("int16", "float16") in gate.passed(models.gguf_file(models.DEFAULT_TARGET))
