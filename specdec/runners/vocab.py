"""What a runner needs to know of a model's output vocabulary, whichever runner it is."""

from __future__ import annotations

import torch


def output_token_ids(model) -> torch.Tensor | None:
    """The tokens a restricted-vocabulary draft scores (config ``specdec_output_token_ids``), or None."""
    kept = getattr(model.config, "specdec_output_token_ids", None)
    return None if kept is None else torch.tensor(sorted(kept), dtype=torch.long)
