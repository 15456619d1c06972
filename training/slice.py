"""Slice the target into a draft's starting point: fewer layers, a narrower residual stream, fewer MLP neurons.

SliceGPT (Ashkboos et al., 2024): once each RMSNorm's weight is folded into the linear layers that read
its output, a Llama computes the same function on a rotated residual stream x -> Qᵀx, for any orthogonal
Q, because the norm of a vector does not change under rotation. Rotated onto the principal directions of
the (normalised) stream, the first `hidden` coordinates carry most of its energy, and the rest are cut.
Layers are kept by block influence (ShortGPT, Men et al., 2024: 1 - cos(input, output), how much a layer
changes the stream), MLP neurons by their mean contribution to the stream (Minitron's activation-based
importance). What comes out is an ordinary LlamaForCausalLM, which distillation then trains.

The draft ties its output layer to its input embedding, as the target does; the target's final norm
weight cannot be folded into a tied matrix, so the draft's final norm keeps its diagonal in the rotated basis.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Calibration:
    """What slicing needs from the target's activations on calibration text."""

    basis: torch.Tensor  # [d, d] orthonormal columns, the stream's principal directions, largest first
    eigenvalues: torch.Tensor  # [d] variance of the normalised stream along each direction, descending
    influence: torch.Tensor  # [layers] block influence, 1 - mean cos(layer input, layer output)
    neuron_importance: torch.Tensor  # [layers, intermediate] mean |activation| x norm of its down column
    tokens: int


@torch.no_grad()
def calibrate(target, sequences: list[list[int]]) -> Calibration:
    """Run the target over token sequences, one at a time, and gather the stream's statistics."""
    m = target.model
    d, n_layers = target.config.hidden_size, len(m.layers)
    cov = torch.zeros(d, d, dtype=torch.float64)
    cos_sum = torch.zeros(n_layers, dtype=torch.float64)
    act_sum = torch.zeros(n_layers, target.config.intermediate_size, dtype=torch.float64)
    layer_in: dict[int, torch.Tensor] = {}
    tokens = 0

    def add_stream(x):  # x: [1, T, d], the stream where a norm reads it
        x = x[0].double()
        x = x / x.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-12)  # rms 1: every token weighs the same
        cov.add_(x.T @ x)

    hooks = []
    for i, layer in enumerate(m.layers):

        def pre_in(_, args, i=i):
            layer_in[i] = args[0]
            add_stream(args[0])

        def post_layer(_, args, out, i=i):
            out = out[0] if isinstance(out, tuple) else out
            cos_sum[i] += torch.nn.functional.cosine_similarity(layer_in[i][0], out[0], dim=-1).double().sum()

        def pre_down(_, args, i=i):
            act_sum[i] += args[0][0].abs().double().sum(0)

        hooks += [
            layer.input_layernorm.register_forward_pre_hook(pre_in),
            layer.post_attention_layernorm.register_forward_pre_hook(lambda _, a: add_stream(a[0])),
            layer.register_forward_hook(post_layer),
            layer.mlp.down_proj.register_forward_pre_hook(pre_down),
        ]
    hooks.append(m.norm.register_forward_pre_hook(lambda _, a: add_stream(a[0])))
    try:
        for seq in sequences:
            target(input_ids=torch.tensor([seq]), use_cache=False)
            tokens += len(seq)
    finally:
        for h in hooks:
            h.remove()
    eigenvalues, vectors = torch.linalg.eigh(cov / (tokens * (2 * n_layers + 1)))  # ascending
    down_norms = torch.stack([layer.mlp.down_proj.weight.norm(dim=0) for layer in m.layers]).double()
    return Calibration(
        basis=vectors.flip(-1).float(),
        eigenvalues=eigenvalues.flip(-1).float(),
        influence=(1 - cos_sum / tokens).float(),
        neuron_importance=(act_sum / tokens * down_norms).float(),
        tokens=tokens,
    )


def choose_layers(influence: torch.Tensor, n: int) -> list[int]:
    """The n layers that change the stream most, in their original order."""
    return sorted(torch.topk(influence, n).indices.tolist())


@torch.no_grad()
def slice_target(target, cal: Calibration, layers: list[int], hidden: int, intermediate: int, kept=None):
    """A LlamaForCausalLM of len(layers) layers, `hidden` wide, with `intermediate` MLP neurons per layer,
    the target's attention heads and vocabulary; its weights are the target's, rotated and cut."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tc = target.config
    d = tc.hidden_size
    if not 0 < hidden <= d or not 0 < intermediate <= tc.intermediate_size:
        raise ValueError(f"hidden must be in 1..{d} and intermediate in 1..{tc.intermediate_size}")
    if hidden % tc.num_attention_heads:  # transformers' LlamaConfig requires it, whatever head_dim is
        raise ValueError(f"hidden must be a multiple of the target's {tc.num_attention_heads} attention heads")
    q = cal.basis[:, :hidden]  # [d, hidden]
    # Cutting the stream to `hidden` of d coordinates shrinks its rms by sqrt(kept energy * d / hidden);
    # the draft's norms scale it back, so the layers read what the target's read.
    scale = (cal.eigenvalues[:hidden].sum() / cal.eigenvalues.sum() * d / hidden).sqrt()
    theta = (getattr(tc, "rope_parameters", None) or {}).get("rope_theta") or getattr(tc, "rope_theta", 10000.0)
    cfg = LlamaConfig(
        vocab_size=tc.vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=len(layers),
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads,
        head_dim=getattr(tc, "head_dim", None) or d // tc.num_attention_heads,
        max_position_embeddings=tc.max_position_embeddings,
        rope_theta=theta,
        rms_norm_eps=tc.rms_norm_eps,
        tie_word_embeddings=True,
        bos_token_id=tc.bos_token_id,
        eos_token_id=tc.eos_token_id,
        pad_token_id=getattr(tc, "pad_token_id", None),
    )
    if kept is not None:
        cfg.specdec_output_token_ids = list(kept)
    draft = LlamaForCausalLM(cfg).eval()
    src, dst = target.model, draft.model
    dst.embed_tokens.weight.copy_(src.embed_tokens.weight @ q)  # [vocab, hidden]
    for j, i in enumerate(layers):
        s, t = src.layers[i], dst.layers[j]
        g1, g2 = s.input_layernorm.weight, s.post_attention_layernorm.weight  # [d]
        for name in ("q_proj", "k_proj", "v_proj"):  # read the stream: fold the norm, rotate, cut
            getattr(t.self_attn, name).weight.copy_((getattr(s.self_attn, name).weight * g1) @ q)
        t.self_attn.o_proj.weight.copy_(q.T @ s.self_attn.o_proj.weight)  # writes the stream: [hidden, heads*d]
        keep = torch.topk(cal.neuron_importance[i], intermediate).indices.sort().values
        t.mlp.gate_proj.weight.copy_((s.mlp.gate_proj.weight[keep] * g2) @ q)
        t.mlp.up_proj.weight.copy_((s.mlp.up_proj.weight[keep] * g2) @ q)
        t.mlp.down_proj.weight.copy_(q.T @ s.mlp.down_proj.weight[:, keep])
        t.input_layernorm.weight.fill_(scale)
        t.post_attention_layernorm.weight.fill_(scale)
    # final norm: the tied output layer is embed @ q, so g_f stays in the norm, as the diagonal of qᵀ diag(g_f) q
    dst.norm.weight.copy_((q.pow(2) * src.norm.weight[:, None]).sum(0) * scale)
    return draft
