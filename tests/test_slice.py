"""Slicing the target into a draft: rotation and norm folding change nothing until the cut."""

import pytest
import torch

from training.slice import calibrate, choose_layers, slice_target


@pytest.fixture(scope="module")
def small_target():
    """A 3-layer random Llama with non-trivial norm weights (the final one uniform: see below)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=300,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    for layer in model.model.layers:
        layer.input_layernorm.weight.uniform_(0.5, 2.0)
        layer.post_attention_layernorm.weight.uniform_(0.5, 2.0)
    # a tied output layer cannot absorb a per-channel final norm, so the slice keeps its diagonal in the
    # rotated basis: exact for a uniform weight, an approximation otherwise
    model.model.norm.weight.fill_(1.7)
    return model


def sequences(n, length, vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def test_full_width_slice_of_every_layer_computes_the_target(small_target):
    cal = calibrate(small_target, sequences(4, 40, 300))
    draft = slice_target(small_target, cal, layers=[0, 1, 2], hidden=48, intermediate=96)
    ids = torch.tensor(sequences(2, 30, 300, seed=2))
    torch.testing.assert_close(draft(input_ids=ids).logits, small_target(input_ids=ids).logits, atol=1e-4, rtol=1e-4)


def test_calibration_gives_an_orthonormal_basis_with_the_largest_variance_first(small_target):
    cal = calibrate(small_target, sequences(4, 40, 300))
    torch.testing.assert_close(cal.basis.T @ cal.basis, torch.eye(48), atol=1e-5, rtol=0)
    assert (cal.eigenvalues[:-1] >= cal.eigenvalues[1:]).all()
    assert cal.eigenvalues.sum().item() == pytest.approx(48, rel=1e-4)  # normalised stream: rms 1 per token
    assert cal.influence.shape == (3,) and cal.neuron_importance.shape == (3, 96) and cal.tokens == 160


def test_cut_slice_has_the_requested_shape_and_keeps_the_target_vocabulary(small_target):
    cal = calibrate(small_target, sequences(4, 40, 300))
    draft = slice_target(small_target, cal, layers=[0, 2], hidden=24, intermediate=40, kept=range(10, 200))
    c = draft.config
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.vocab_size) == (2, 24, 40, 300)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 16)
    assert c.specdec_output_token_ids == list(range(10, 200))
    assert draft.get_output_embeddings().weight.data_ptr() == draft.get_input_embeddings().weight.data_ptr()


def test_layers_are_kept_by_influence_in_their_original_order():
    assert choose_layers(torch.tensor([0.1, 0.5, 0.2, 0.9, 0.3]), 3) == [1, 3, 4]


def test_slice_refuses_a_width_the_target_cannot_be_cut_to(small_target):
    cal = calibrate(small_target, sequences(1, 10, 300))
    with pytest.raises(ValueError, match="hidden must be in"):
        slice_target(small_target, cal, layers=[0], hidden=64, intermediate=96)
    with pytest.raises(ValueError, match="multiple of the target's 4 attention heads"):
        slice_target(small_target, cal, layers=[0], hidden=30, intermediate=96)
