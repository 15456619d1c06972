"""A model server's rules: the tokenizer its grammars mask over, each session's RuleState (specdec/rules.py), and
the timing of every rules call into the server's metrics, its work apart from what a call waited for it."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from specdec.grammar import check_grammar, lltokenizer
from specdec.mask_check import Trust
from specdec.rule_fields import Rules, from_proto
from specdec.rules import RuleState

_MASKS: ThreadPoolExecutor | None = None


def _masks_thread() -> ThreadPoolExecutor:
    """The process's one thread for grammar masks computed beside forward passes: it lives with the process, as a
    server does, and holds nothing of a server between calls."""
    global _MASKS
    if _MASKS is None:
        _MASKS = ThreadPoolExecutor(1, thread_name_prefix="rules")
    return _MASKS


class RuleBook:
    """A model server's rules: the tokenizer its grammars mask over, built on first use, and each session's state."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_ids: list[int], metrics=None, beside: bool = True):
        self.hf_tokenizer, self.vocab_size, self.eos_ids = hf_tokenizer, vocab_size, list(eos_ids)
        # compute a grammar's masks on a thread beside the forward pass: where the pass leaves a core free (a GPU's
        # host, a one-thread draft); a CPU pass on every core would only lose what the masks take from it
        self.beside = beside
        self.metrics = metrics  # a server's ModelServerMetrics: the rules' seconds and rows
        self._tokenizer = None
        self._checked: dict[bytes, Rules | None] = {}
        self._matchers: dict[str, object] = {}  # grammar text -> a matcher at its start (``_pristine``)
        self._trust = Trust()  # whether this machine's masks agree with the grammar engine (specdec/mask_check.py)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = lltokenizer(self.hf_tokenizer, self.vocab_size, self.eos_ids)
        return self._tokenizer

    def check(self, msg) -> Rules | None:
        """A request's rules (OutputRules, or None), checked; INVALID_ARGUMENT when out of range or when the grammar
        does not compile. The last few are remembered, since every call of a generation sends the same."""
        key = msg.SerializeToString(deterministic=True) if msg is not None else b""
        if key not in self._checked:
            rules = from_proto(msg, self.vocab_size) if key else None
            if rules is not None and rules.grammar is not None:
                check_grammar(rules.grammar, self.tokenizer)
                self._trust.require(self)
            if len(self._checked) >= 64:
                self._checked.pop(next(iter(self._checked)))
            self._checked[key] = rules
        return self._checked[key]

    def masks(self, state: RuleState | None, tokens: list[int], first: int, n: int) -> asyncio.Future | None:
        """The grammar's masks of n rows (RuleState.masks), computed on the rules' own thread while the caller runs
        the rows' forward pass (llguidance releases the GIL, and the pass mostly runs in C++); None without a
        grammar, or where no core is free for them (``apply`` computes them then). tokens: what the session will hold
        once the pass has fed it."""
        if state is None or state.matcher is None or not self.beside:
            return None
        future = asyncio.get_running_loop().run_in_executor(_masks_thread(), self._timed, state, tokens, first, n)
        future.add_done_callback(lambda f: f.cancelled() or f.exception())  # a failed call may never await it
        return future

    def _timed(self, state: RuleState, tokens: list[int], first: int, n: int) -> np.ndarray:
        t0 = time.perf_counter()
        try:
            return state.masks(tokens, first, n, self.vocab_size)
        finally:
            if self.metrics is not None:
                self.metrics.rules_seconds.inc(time.perf_counter() - t0)

    async def apply(self, state: RuleState, logits: torch.Tensor, tokens: list[int], first: int, ids=None, masks=None):
        """state.apply over this server's vocabulary, with the masks ``masks`` started (or None), timed into the
        server's metrics: the work (rules_seconds) and what the call waited for it (rules_wait_seconds)."""
        t0 = time.perf_counter()
        packed = await masks if masks is not None else None
        t1 = time.perf_counter()
        out = state.apply(logits, tokens, first, self.vocab_size, ids, packed)
        self._count(time.perf_counter() - t1, time.perf_counter() - t0, logits.shape[0])
        return out

    def argmax(self, state: RuleState, logits: torch.Tensor, tokens: list[int], first: int, ids=None, **how):
        """state.argmax over this server's vocabulary (greedy's columns and the rows), timed into the server's
        metrics; it needs no masks started beside the pass."""
        return self.timed(logits.shape[0], state.argmax, logits, tokens, first, self.vocab_size, ids, **how)

    def sample_row(self, state: RuleState, logits: torch.Tensor, tokens: list[int], first: int, ids, q_support):
        """state.sample_row over this server's vocabulary and its rules' seconds, timed into the server's metrics
        without q_support's own time, which is the sampler's (no mask beside the pass: most rows need none)."""
        (row, checked), rules_s = self._timed_without(q_support, state.sample_row, logits, tokens, first, ids)
        return row, checked, rules_s

    def probs(self, state: RuleState, logits: torch.Tensor, tokens: list[int], first: int, transform):
        """state.probs over this server's vocabulary and its rules' seconds, timed into the server's metrics without
        transform's own time, which is the sampler's (no mask beside the pass: rows in forced runs need none)."""
        return self._timed_without(transform, state.probs, logits, tokens, first)

    def _timed_without(self, sampler, fn, logits, tokens, first, *args):
        """fn(logits, tokens, first, vocab, *args, sampler) for one row, and its seconds less the sampler's, counted."""
        spent = [0.0]

        def timed(row):
            t0 = time.perf_counter()
            try:
                return sampler(row)
            finally:
                spent[0] += time.perf_counter() - t0

        t0 = time.perf_counter()
        out = fn(logits, tokens, first, self.vocab_size, *args, timed)
        rules_s = time.perf_counter() - t0 - spent[0]
        self._count(rules_s, rules_s, 1)
        return out, rules_s

    def forced(self, state: RuleState, tokens: list[int]) -> list[int]:
        """state.forced, timed into the server's metrics (no row: nothing is masked)."""
        return self.timed(0, state.forced, tokens)

    def timed(self, rows: int, fn, *args, **kwargs):
        """fn(*args, **kwargs), a RuleState method that the call waits for, timed into the server's metrics (work and
        wait alike); rows: the rows it rules (0 for a question about tokens, such as ``forced`` or ``allows``)."""
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        spent = time.perf_counter() - t0
        self._count(spent, spent, rows)
        return out

    def _count(self, work_s: float, wait_s: float, rows: int) -> None:
        """A call's rules into the server's metrics: their work, what the call waited for them, its rows."""
        if self.metrics is not None:
            self.metrics.rules_seconds.inc(work_s)
            self.metrics.rules_wait_seconds.inc(wait_s)
            self.metrics.rules_rows.inc(rows)

    def state_for(self, session, rules: Rules | None) -> RuleState | None:
        """The session's RuleState for a request's rules (as ``check`` returned them), kept on the session and rebuilt
        when the rules change."""
        if session.rules is not None and session.rules[0] == rules:
            return session.rules[1]
        state = None
        if rules is not None:
            fresh = self._pristine(rules.grammar).deep_copy() if rules.grammar else None
            state = RuleState(rules, self.tokenizer if rules.grammar else None, self.eos_ids, fresh)
        session.rules = (rules, state)
        return state

    def _pristine(self, grammar: str):
        """A matcher of the grammar at its start, kept for the last few grammars: each new session takes a copy (a
        matcher built anew compiles the grammar, 0.3-0.7 ms, once a request on each server)."""
        import llguidance

        if grammar not in self._matchers:
            if len(self._matchers) >= 16:
                self._matchers.pop(next(iter(self._matchers)))
            self._matchers[grammar] = llguidance.LLMatcher(self.tokenizer, grammar)
        return self._matchers[grammar]
