"""A head draft (EAGLE-1 style): one Llama decoder layer that reads the target's own features.

At position p the head reads the token t_p and the target's feature f_{p-1} (its final-norm output at p - 1,
specdec/features.py): x0 = fc . [E(t_p) ; f_{p-1}], with E the target's token embedding; then one Llama decoder
layer (the target's attention layout, RoPE at p), then g_p = rms_norm(x1) with the head's own norm weight. g_p is
the head's prediction of f_p, and the target's lm_head rows score it. Drafting feeds each drafted token with the
g of the step before, since the target's feature there is not known yet.

On disk a head is a folder: ``config.json``, a transformers LlamaConfig of one layer with ``specdec_head`` (kind,
the target's model spec, the target's feature fingerprint) and, optionally, ``specdec_output_token_ids``; and
``model.safetensors`` with fc.weight, model.layers.0.* and model.norm.weight only. The embedding and the lm_head
are the target's, loaded at start-up, so the file stays small. In memory a head is a LlamaForCausalLM of that layer,
with the target's embedding and lm_head, carrying a ``specdec_head`` (HeadInfo) that the lean runner reads.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec import features

KIND = "eagle1"
WEIGHTS = "model.safetensors"
LAYER_NAMES = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)


@dataclass
class HeadInfo:
    """What makes a one-layer Llama a head: its input mix and the target it reads."""

    fc: torch.Tensor  # [hidden, 2 hidden]
    target: str  # the target's model spec, e.g. embedded:smollm2-135m-instruct
    feature_fingerprint: str  # the target's (specdec.features.fingerprint of its lm_head)

    @property
    def feature_size(self) -> int:
        return self.fc.shape[0]


def is_head(path: str) -> bool:
    """Whether path is a head's folder (its config.json names ``specdec_head``)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    return "specdec_head" in json.loads(config.read_text())


def head_target(path: str) -> str:
    """The model spec of the target a head's folder reads."""
    return json.loads((Path(path) / "config.json").read_text())["specdec_head"]["target"]


def head_config(target_model, intermediate_size: int | None = None, output_token_ids=None):
    """A one-layer LlamaConfig with the target's attention layout, vocabulary and positions."""
    from transformers import LlamaConfig

    t = target_model.config
    cfg = LlamaConfig(
        vocab_size=t.vocab_size,
        hidden_size=t.hidden_size,
        intermediate_size=intermediate_size or t.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads,
        head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
        rms_norm_eps=t.rms_norm_eps,
        max_position_embeddings=t.max_position_embeddings,
        rope_parameters=dict(getattr(t, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}),
        tie_word_embeddings=False,
        bos_token_id=t.bos_token_id,
        eos_token_id=t.eos_token_id,
    )
    if output_token_ids is not None:
        cfg.specdec_output_token_ids = sorted(int(i) for i in output_token_ids)
    return cfg


def build(cfg, weights: dict[str, torch.Tensor], target_model, target: str):
    """The in-memory head: a one-layer LlamaForCausalLM from cfg and weights (the file's names), whose embedding and
    lm_head are the target's own tensors (no copy), carrying its HeadInfo. Raises ValueError on a mismatch."""
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    _check(cfg, weights, target_model)
    dtype = target_model.model.embed_tokens.weight.dtype
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    state = {k: v.to(dtype) for k, v in weights.items() if k != "fc.weight"}
    model.load_state_dict(state, strict=False, assign=True)
    model.model.embed_tokens.weight = target_model.model.embed_tokens.weight
    model.lm_head.weight = target_model.get_output_embeddings().weight
    model.model.rotary_emb = LlamaRotaryEmbedding(config=cfg)
    model.eval().requires_grad_(False)
    fc = weights["fc.weight"].to(dtype)
    model.specdec_head = HeadInfo(fc, target, features.fingerprint(target_model.get_output_embeddings().weight))
    return model


def _check(cfg, weights: dict[str, torch.Tensor], target_model) -> None:
    t, h = target_model.config, cfg.hidden_size
    expected = {"fc.weight", "model.norm.weight", *(f"model.layers.0.{n}" for n in LAYER_NAMES)}
    if set(weights) != expected:
        raise ValueError(
            f"a head's weights are {sorted(expected)}; missing {sorted(expected - set(weights))}, "
            f"unexpected {sorted(set(weights) - expected)}"
        )
    if cfg.num_hidden_layers != 1 or h != t.hidden_size or cfg.vocab_size != t.vocab_size:
        raise ValueError(
            f"a head has 1 layer of the target's hidden size {t.hidden_size} and vocabulary {t.vocab_size}; this one "
            f"has {cfg.num_hidden_layers} layers, hidden size {h}, vocabulary {cfg.vocab_size}"
        )
    if tuple(weights["fc.weight"].shape) != (h, 2 * h):
        raise ValueError(f"fc.weight must be [{h}, {2 * h}], not {list(weights['fc.weight'].shape)}")


def random_head(target_model, target: str, seed: int = 0, intermediate_size: int | None = None, output_token_ids=None):
    """A head with random weights for target_model (spec `target`), in memory: for tests, and a trainer's start."""
    cfg = head_config(target_model, intermediate_size, output_token_ids)
    g = torch.Generator().manual_seed(seed)
    h, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    shapes = {
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (inter, h),
        "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
    }
    weights = {f"model.layers.0.{n}": torch.randn(s, generator=g) * s[1] ** -0.5 for n, s in shapes.items()}
    for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        weights[f"model.layers.0.{n}"] = torch.ones(h)
    weights["model.norm.weight"] = torch.ones(h)
    weights["fc.weight"] = torch.randn(h, 2 * h, generator=g) * (2 * h) ** -0.5
    return build(cfg, weights, target_model, target)


def head_weights(model) -> dict[str, torch.Tensor]:
    """The tensors a head's file holds, by the file's names."""
    state = model.state_dict()
    out = {f"model.layers.0.{n}": state[f"model.layers.0.{n}"] for n in LAYER_NAMES}
    out["model.norm.weight"] = state["model.norm.weight"]
    out["fc.weight"] = model.specdec_head.fc
    return out


def save_head(
    folder,
    model=None,
    *,
    config=None,
    weights: dict | None = None,
    target: str | None = None,
    feature_fingerprint: str | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write a head's folder: from an in-memory head (`model`), or from a LlamaConfig, its weights by the file's
    names, the target's spec and feature fingerprint (what a trainer has). Weights are stored in dtype."""
    from safetensors.torch import save_file

    if model is not None:
        config, weights = model.config, head_weights(model)
        target, feature_fingerprint = model.specdec_head.target, model.specdec_head.feature_fingerprint
    if config is None or weights is None or not target or not feature_fingerprint:
        raise ValueError("save_head needs a head model, or config, weights, target and feature_fingerprint")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    data = config.to_dict()
    data.update(model_type="llama", num_hidden_layers=1, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    data["specdec_head"] = {"kind": KIND, "target": target, "feature_fingerprint": feature_fingerprint}
    _write_config(folder, data)
    save_file({k: v.detach().to("cpu", dtype).contiguous() for k, v in weights.items()}, str(folder / WEIGHTS))
    return folder


def rescore(folder, token_ids: list[int]) -> None:
    """A head's folder made to score `token_ids`: the output rows are the target's, taken at load, so only the
    config changes; q is renormalized over what is scored."""
    folder = Path(folder)
    data = json.loads((folder / "config.json").read_text())
    data["specdec_output_token_ids"] = sorted(token_ids)
    _write_config(folder, data)


def _write_config(folder: Path, data: dict) -> None:
    (folder / "config.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def load_head(folder, dtype: str = "float32", device: str = "cpu"):
    """A head's folder -> the in-memory head, its target loaded by specdec.models.load_model (cached)."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    from specdec import models

    data = json.loads((Path(folder) / "config.json").read_text())
    meta = data.pop("specdec_head")
    if meta.get("kind") != KIND:
        raise models.ModelSpecError(f"{folder}: head kind {meta.get('kind')!r}; this server runs {KIND!r} heads")
    target_model = models.load_model(meta["target"], dtype, "cpu")
    cfg = LlamaConfig(**data)
    head = build(cfg, load_file(os.path.join(folder, WEIGHTS)), target_model, meta["target"])
    head.specdec_head.feature_fingerprint = meta["feature_fingerprint"]  # what the file says it was trained on
    return head.to(device)
