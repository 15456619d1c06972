"""What a request asks of its generation, once its fields are checked and its defaults filled in
(GenerationServicer.build_spec)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specdec.sampling import SamplingParams
from specdec.v1 import model_server_pb2 as ms_pb


@dataclass
class GenerationSpec:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    k: int
    stops: list[str] = field(default_factory=list)
    min_confidence: float = 0.0  # the draft stops a round early below it (ProposeTokensRequest.min_confidence)
    lookup: tuple[int, int] = (0, 0)  # prompt lookup's (n_min, n_max); n_min 0 turns it off
    speculate_first_round: bool = False  # False: the first round is the target's prefill alone (K = 0)
    ignore_eos: bool = False  # EOS tokens are emitted like any other instead of ending the generation
    stop_ids: frozenset[int] = frozenset()  # token ids that end the generation, not emitted
    logprobs: int | None = None  # set: the target's log-prob of each token and this many top alternatives
    rules: ms_pb.OutputRules | None = None  # sent on every model call (specdec/rules.py); None: no rules
    grammar: Any = None  # a specdec.rules.RuleState of the rules' grammar, which cuts prompt-lookup proposals
    prompt_logprobs: bool = False  # ask the target for the prompt's logprobs (an echo's) in the first round
    steps: int = 1  # tokens a round at K = 0 may ask the target for in one call (Generation.steps)
    adaptive: bool = False  # each round chooses K in 0..k (orchestrator.speculation), k until the process has
    # measured a drafted round; False: every round drafts k
