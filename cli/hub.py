"""Access to the Hugging Face hub, checked before a server loads anything, and `specdec fetch`.

A gated model (Meta's Llama) with no token and no copy in the local cache cannot load: the service says so in
one line and exits 2 at once, instead of failing in from_pretrained after its imports, again at every restart.
Imports huggingface_hub alone, not torch.
"""

from __future__ import annotations

import os
import re
import sys

# Organisations whose models download only with a token of an account that accepted their licence.
GATED_ORGS = ("meta-llama",)
# What from_pretrained reads: config, weights, tokenizer, generation config; not the original/ checkpoints that
# Meta's repositories also carry, which double the download.
FETCH_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


class HubAccessError(ValueError):
    """A model that cannot be had; the message says what to set."""


def hub_id(spec: str) -> str | None:
    """The repository id of a model spec that names one on the hub; None for a local folder or an embedded model."""
    if spec.startswith("embedded:") or os.path.exists(spec) or not _HUB_ID.match(spec):
        return None
    return spec


def _cached(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def require_access(spec: str) -> None:
    """Raise HubAccessError for a gated hub model with neither a token (HF_TOKEN, or `hf auth login`) nor a cached
    copy; anything else may load, and fails in loading with the hub's own message where it cannot."""
    repo_id = hub_id(spec)
    if repo_id is None or repo_id.split("/")[0] not in GATED_ORGS:
        return
    from huggingface_hub import get_token

    if get_token() is None and not _cached(repo_id):
        raise HubAccessError(
            f"{repo_id} is gated and not in the local Hugging Face cache: set HF_TOKEN to a token "
            f"of an account that accepted its licence on huggingface.co/{repo_id}"
        )


def fetch(specs: list[str]) -> int:
    """`specdec fetch MODEL...`: download each hub model's weights and tokenizer into the Hugging Face cache, so
    that the servers start from it. Exit status 2 for a gated model without access; local and embedded models are
    skipped."""
    try:
        for spec in specs:
            require_access(spec)
        from huggingface_hub import snapshot_download

        for spec in specs:
            if (repo_id := hub_id(spec)) is not None:
                print(f"specdec fetch: {repo_id}", file=sys.stderr)
                print(snapshot_download(repo_id, allow_patterns=FETCH_PATTERNS), file=sys.stderr)
    except HubAccessError as e:
        print(f"specdec fetch: {e}", file=sys.stderr)
        return 2
    return 0
