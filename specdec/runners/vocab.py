"""What a runner needs to know of a model's output vocabulary, whichever runner it is."""

from __future__ import annotations

import torch


def output_token_ids(model) -> torch.Tensor | None:
    """The tokens a restricted-vocabulary draft scores (config ``specdec_output_token_ids``), or None."""
    ids = getattr(model.config, "specdec_output_token_ids", None)
    return None if ids is None else torch.tensor(sorted(ids), dtype=torch.long)
