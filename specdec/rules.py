"""A generation's output rules on a model server: its grammar, logit_bias, penalties and min_tokens.

The rules change each row's logits before temperature, top-k and top-p, on both model servers alike: the target's
p becomes the constrained distribution the output follows, and the draft's q proposes what it allows, so the
ratio test keeps the output exact (Leviathan et al. hold for any p and q). A sampled draft step skips the grammar's
mask where the grammar allows the likeliest tokens of its q (``sample_row``): its q may then draw a token the grammar
refuses, which ends its round and which the target rejects. Row by row, in this order:

  1. logit_bias: added to the token's logit;
  2. repetition_penalty r (vLLM's): a token seen in the prompt or the output before the row has a positive logit
     divided by r and a negative one multiplied by r;
  3. frequency_penalty f and presence_penalty e (OpenAI's): logit - f * count - e * (count > 0), count the token's
     occurrences in the output before the row;
  4. min_tokens: while the output before the row is shorter, the blocked tokens (EOS, stop token ids) get -inf;
  5. the grammar: a token the grammar does not allow after the output before the row gets -inf.

Every rule reads only the tokens before its row, so a Verify's row i counts the drafts before it, and a row's
logits are the same in any batch or call. The grammar runs on llguidance (bench/grammar.py: 43-57 us a token, against
xgrammar's 96-152 us). A session keeps a matcher at its committed tokens; a call's masks walk a copy of it through
the drafts (greedy's ``argmax`` walks the matcher itself; the next call rolls back what it does not hold). Rows after
a draft the grammar rejects keep the last allowed row's mask (never all -inf); the ratio test never reads them, since
that draft has p = 0. Greedy rows need only their best allowed token, which ``argmax`` finds by asking the matcher
about the row's best few tokens, filling a mask only where that cannot decide (specdec/grammar.py); a sampled row
where the grammar forces a token needs no mask either (``probs``).
"""

from __future__ import annotations

import functools
import math

import grpc
import numpy as np
import torch

from specdec.errors import ServiceError
from specdec.grammar import allows, best_allowed, forced_tokens, unpack
from specdec.penalties import TokenCounts, row_edits
from specdec.prefix_cache import common_prefix
from specdec.rule_fields import Rules
from specdec.runners.kernels import kernels_for
from specdec.sampling import argmax_rows, likeliest

_NO_IDS = torch.empty(0, dtype=torch.long)  # mask_rows' columns for a full row
# A sampled draft row skips its grammar mask only where the grammar allows the tokens that hold all but
# UNCHECKED_MASS of its q, in a support of at most CHECKED_TOKENS (a nucleus), or a wider row's best token
# (RuleState.sample_row): a token asked costs about 1 us, a mask 60-200 us, and q's mass on tokens the grammar
# refuses is mass the target rejects (docs/performance.md, item 44)
CHECKED_TOKENS = 16
UNCHECKED_MASS = 0.05


class RuleState:
    """A session's rules and its grammar matcher at the session's committed tokens (the history before a call's
    drafts). Kept on the session; a call whose rules differ builds a new one."""

    def __init__(self, rules: Rules, tokenizer=None, eos_ids=(), matcher=None):
        """matcher: a fresh matcher of the grammar to take (a copy of a pristine one), else one is built."""
        self.rules = rules
        self.eos_ids = frozenset(eos_ids)  # the grammar's end: after one, nothing is allowed
        self.matcher = None
        self.ends = frozenset(tokenizer.eos_tokens) if tokenizer is not None else frozenset()  # where masks allow
        self.consumed: list[int] = []  # output tokens the matcher has taken
        self._mask_buffer = None  # the grammar's bitmasks, [rows, words] int32
        self._mask_tensor = None  # the same as a tensor
        self._counts: TokenCounts | None = None  # the penalties' token counts, following the session's history
        self._run: tuple[int, list[int]] | None = None  # forced tokens found at a position of consumed (forced_here)
        self._here: tuple[int, list[int] | None] | None = None  # forced_here's answer at a position of consumed
        if rules.grammar is not None:
            import llguidance

            self.matcher = matcher if matcher is not None else llguidance.LLMatcher(tokenizer, rules.grammar)

    def apply(
        self,
        logits: torch.Tensor,
        tokens: list[int],
        first: int,
        vocab: int,
        ids: torch.Tensor | None = None,
        packed: np.ndarray | None = None,
    ) -> torch.Tensor:
        """The rows' logits under the rules: float32 on the host, the logits themselves, edited in place, when they are
        float32 there; a token the grammar refuses has -inf. Row i predicts position first + i
        after tokens[: first + i] (tokens[first:] are a call's drafts). logits: [n, vocab], or [n, len(ids)] for a
        draft that scores the tokens ids only (column c is token ids[c]). packed: the grammar's masks of these rows,
        computed beforehand by ``masks`` (beside the forward pass), else computed here.

        Only the grammar's mask is vocabulary-wide (specdec's kernel, else numpy); the other rules touch the columns
        they name or the history holds. Torch ops would wake a thread team beside the engine's (5x slower)."""
        out = self._edited(logits, tokens, first, ids, vocab)
        if self.matcher is not None:
            packed = self.masks(tokens, first, logits.shape[0], vocab) if packed is None else packed  # [n, words]
            self._mask(out, packed, vocab, ids)
        return out

    def argmax(
        self, logits, tokens: list[int], first: int, vocab: int, ids=None, to_mismatch=False, canonical=True
    ) -> tuple[list[int], torch.Tensor]:
        """Each row's argmax column under the rules, the same as ``apply`` then argmax_rows, and the rows (float32 on
        the host, edited; masked only where a mask decided): greedy needs only the best token the grammar allows,
        which the matcher finds in most rows without filling the mask (grammar.best_allowed). Arguments as
        ``apply``'s; to_mismatch: a verify's rows (columns are tokens), which stop after the first whose token differs
        from the draft after it, since greedy's verdict reads no row past that; canonical: whether a pick must be
        the mask's (a target's, whose picks are the output), else a token whose bytes fit the grammar is enough (a
        draft's proposal: where the grammar forces bytes whose first token is open, token checks then stand in for
        the mask, 100-250 us cold; a tokenization the mask might refuse would be a draft the target rejects)."""
        n = logits.shape[0]
        out = self._edited(logits, tokens, first, ids, vocab)
        if self.matcher is None:
            return argmax_rows(out), out
        if not self._follow(tokens[self.rules.output_start : first]):  # past the grammar's end: nothing allowed
            return argmax_rows(self._mask(out, self.masks(tokens, first, n, vocab), vocab, ids)), out
        drafts, matcher = tokens[first : first + n - 1], self.matcher
        # a verify's rows walk only drafts equal to their picks, which the grammar allows: no validation needed
        valid = len(drafts) if to_mismatch else matcher.validate_tokens(drafts) if drafts else 0
        host, columns = out.numpy(), None if ids is None else _column_array(ids)
        picks = []
        # the session's matcher walks the drafts itself (a copy costs more, cold after a pass, than the rollback of
        # what the next call does not hold, ``_follow``); rows after a draft the grammar rejects keep it where it
        # stopped
        for i in range(n):
            forced = self.forced_here()
            if forced is None and not canonical:  # bytes forced, their first token open: a draft's checks will do
                forced = []
            pick = best_allowed(matcher, host[i], columns, self.ends, forced)
            if pick is None:  # the mask decides, for this row alone
                row = self._bitmask(1, vocab)[:1]
                matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
                masked = self._mask(out[i : i + 1], row, vocab, ids)
                pick = argmax_rows(masked)[0]
                token = pick if columns is None else int(columns[pick])  # -inf: the mask allows none of the columns
                if host[i, pick] > -np.inf and not allows(matcher, token, self.ends):  # never emitted (masked in place)
                    raise ServiceError(
                        grpc.StatusCode.INTERNAL, f"the grammar's mask allowed {token}, which it refuses"
                    )
            picks.append(pick)
            if to_mismatch and (i == n - 1 or pick != drafts[i]):
                break
            if i < min(valid, n - 1):
                self._take(drafts[i])
        return picks, out

    def sample_row(
        self, logits, tokens: list[int], first: int, vocab: int, ids, q_support
    ) -> tuple[torch.Tensor, np.ndarray | None]:
        """A sampled draft step's row under the rules, and the tokens its mask was skipped for (None: masked, as by
        ``apply``). q_support(row): the support of the q the unmasked row gives (ids, p as ``sampling.support``).
        Where nothing is forced and the grammar allows the tokens checked (those holding all but UNCHECKED_MASS of
        a support of at most CHECKED_TOKENS, else the row's best), the row stays unmasked: q is the row under the
        other rules, which the ratio test takes like any q. A token drawn outside those (``allows``) that the
        grammar refuses ends the round, a draft the target rejects (p = 0; its residual max(0, p - q) is the
        constrained p's). That saves the mask, 60-200 us, in most rows (docs/performance.md, item 44). Arguments as
        ``apply``'s, for one row."""
        out = self._edited(logits, tokens, first, ids, vocab)
        if self._follow(tokens[self.rules.output_start : first]) and self._forces_nothing():
            ids_q, p_q = q_support(out)
            # a small support (a nucleus): the tokens holding all but UNCHECKED_MASS of q; a wide one: its best
            # token alone, since finding its likeliest would cost about what the mask does
            checked = likeliest(ids_q, p_q, UNCHECKED_MASS) if len(p_q) <= CHECKED_TOKENS else ids_q[[p_q.argmax()]]
            if all(allows(self.matcher, int(t), self.ends) for t in checked):
                return out, checked
        return self._mask(out, self.masks(tokens, first, 1, vocab), vocab, ids), None

    def probs(self, logits, tokens: list[int], first: int, vocab: int, transform) -> torch.Tensor:
        """transform (the sampling transforms) of ``apply``'s one full row. Where the grammar forces tokens its mask
        allows the first alone (tests/test_rules.py): that token's logit among -inf, written without the mask (80 us
        a row cold), the run found once for its rows (``forced_here``); a finite one is probability 1 whatever the
        temperature, top-k, top-p and min-p, so the row is written without the transform too (100-480 us cold).
        Arguments as ``apply``'s."""
        out = self._edited(logits, tokens, first, None, vocab)
        if self.matcher is None:
            return transform(out)
        if self._follow(tokens[self.rules.output_start : first]) and (forced := self.forced_here()):
            logit = float(out.numpy()[0, forced[0]])
            if math.isfinite(logit):  # one finite logit: every transform gives it probability 1, exactly
                one = torch.zeros_like(out)
                one.numpy()[0, forced[0]] = 1.0
                return one
            alone = torch.full_like(out, float("-inf"))
            alone[0, forced[0]] = logit
            return transform(alone)
        return transform(self._mask(out, self.masks(tokens, first, 1, vocab), vocab, None))

    def forced_here(self) -> list[int] | None:
        """grammar.forced_tokens at the matcher's history, the rest of a run found earlier where the matcher has taken
        its first tokens since (a verify's rows through a key): a run is tokenized once, not at each of its rows, and
        a position is asked once (a draft asks before its step's pass and after it)."""
        at = len(self.consumed)
        if self._here is not None and self._here[0] == at:
            return self._here[1]
        forced = None
        if self._run is not None:
            start, run = self._run
            if 0 <= at - start < len(run) and self.consumed[start:at] == run[: at - start]:
                forced = run[at - start :]
        if forced is None:
            forced = forced_tokens(self.matcher)
            self._run = (at, forced) if forced else None
        self._here = (at, forced)
        return forced

    def _forces_nothing(self) -> bool:
        """Whether the grammar forces no bytes at the matcher's history: forced_here's answer where it has one, else
        the engine's question about bytes alone (a few us; finding forced tokens costs about 100)."""
        if self._here is not None and self._here[0] == len(self.consumed):
            return self._here[1] == []
        return not self.matcher.compute_ff_bytes()

    def _take(self, token: int) -> None:
        """The matcher takes token, which the grammar allows at its history."""
        if not self.matcher.consume_token(token):
            error = self.matcher.get_error()
            self.matcher.reset()
            self.consumed, self._run, self._here = [], None, None
            raise ServiceError(grpc.StatusCode.INTERNAL, f"the grammar refused {token}, which it allowed: {error}")
        self.consumed.append(token)

    def allows(self, token: int) -> bool:
        """Whether the grammar allows token after the history of the last ``sample_row``."""
        return allows(self.matcher, token, self.ends)

    def _edited(self, logits: torch.Tensor, tokens: list[int], first: int, ids, vocab: int) -> torch.Tensor:
        """The rows with biases, penalties and min_tokens applied: float32 on the host, in place where they are."""
        out = logits.cpu()  # the rules run on the host: a device's few rows cross once, and are sampled there
        out = out if out.dtype == torch.float32 else out.float()  # [n, columns], edited in place
        if self.rules.has_edits:
            if self.rules.counts_tokens and self._counts is None:
                self._counts = TokenCounts(self.rules.output_start, vocab)
            scored = None if ids is None else _column_array(ids)
            host = out.numpy()
            for rows, cols, fn in row_edits(self.rules, self._counts, tokens, first, host.shape[0], scored):
                host[rows, cols] = fn(host[rows, cols])
        return out

    def _mask(self, out: torch.Tensor, packed: np.ndarray, vocab: int, ids) -> torch.Tensor:
        """out with -inf where the bitmasks packed ([rows, words] int32) refuse the column's token, in place."""
        kernels = kernels_for(out)
        if kernels is not None:  # specdec's kernel: one pass over each row, in place
            kernels.mask_rows(out, self._as_tensor(packed), _NO_IDS if ids is None else _columns_of(ids))
            return out
        host = out.numpy()
        if ids is None:
            np.putmask(host, ~unpack(packed, vocab), -np.inf)
        else:  # only the draft's columns: a quarter of the row for the embedded draft
            where = _column_array(ids)
            np.putmask(host, ((packed[:, where >> 5] >> (where & 31)) & 1) == 0, -np.inf)
        return out

    def _as_tensor(self, packed: np.ndarray) -> torch.Tensor:
        """packed as a tensor: a view of the session's buffer made once, when it is that buffer's rows."""
        if self._mask_buffer is not None and packed.base is self._mask_buffer:
            return self._mask_tensor[: packed.shape[0]]
        return torch.from_numpy(packed)

    def allowed(self, tokens: list[int], first: int, n: int, vocab: int) -> np.ndarray:
        """[n, vocab] bool: what the grammar allows at each row. FAILED_PRECONDITION when the committed tokens
        break the grammar (they were not generated under it)."""
        return unpack(self.masks(tokens, first, n, vocab), vocab)

    def masks(self, tokens: list[int], first: int, n: int, vocab: int) -> np.ndarray:
        """``allowed`` as llguidance's bitmask, [n, ceil(vocab / 32)] int32 (a buffer the next call reuses). It reads
        only the tokens, so a server computes it while the rows' forward pass runs (RuleBook.masks)."""
        if not self._follow(tokens[self.rules.output_start : first]):
            return np.zeros((n, (vocab + 31) // 32), dtype=np.int32)  # a draft's own steps past the end: nothing
        drafts = tokens[first : first + n - 1]
        walker = self.matcher.deep_copy() if drafts else self.matcher  # filling a mask leaves a matcher as it was
        valid = walker.validate_tokens(drafts) if drafts else 0
        bitmask = self._bitmask(n, vocab)  # [n, ceil(vocab / 32)] int32, kept between calls
        row_bytes, at = bitmask.shape[1] * 4, bitmask.ctypes.data
        for i in range(n):
            if i > valid:  # after a draft the grammar rejects: a meaningless row, kept well defined
                bitmask[i] = bitmask[i - 1]
                continue
            walker.unsafe_compute_mask_ptr(at + i * row_bytes, row_bytes)
            if i < min(valid, n - 1):
                walker.consume_token(drafts[i])
        return bitmask[:n]

    def _bitmask(self, n: int, vocab: int) -> np.ndarray:
        if self._mask_buffer is None or self._mask_buffer.shape[0] < n:
            self._mask_buffer = np.empty((max(n, 9), (vocab + 31) // 32), dtype=np.int32)
            self._mask_tensor = torch.from_numpy(self._mask_buffer)  # the same memory
        return self._mask_buffer

    def forced(self, tokens: list[int]) -> list[int]:
        """The tokens the grammar forces after tokens (grammar.forced_tokens); [] past its end or without one."""
        ok = self.matcher is not None and self._follow(tokens[self.rules.output_start :])
        return (self.forced_here() or []) if ok else []

    def valid_prefix(self, tokens: list[int], drafts: list[int]) -> int:
        """How many of the drafts after tokens the grammar accepts, in order: where proposals made without the
        grammar (prompt lookup) are cut before a Verify, which would give the rest p = 0."""
        if self.matcher is None or not drafts:
            return len(drafts)
        if not self._follow(tokens[self.rules.output_start :]):
            return 0
        return self.matcher.validate_tokens(drafts)

    def _follow(self, output: list[int]) -> bool:
        """Move the matcher to the output given: roll back what it no longer holds, take what it adds; unless the
        output has passed the grammar's end (an end-of-sequence token): then nothing more is allowed, and False. The
        matcher never takes an end, so only the tokens past what it holds are searched for one: a call costs its
        round's tokens, not the output's (an 8,000-token output took 90 us a call)."""
        keep = common_prefix(self.consumed, output)
        if self._run is not None and keep < self._run[0]:  # the run was found after a history rolled back
            self._run = None
        if self._here is not None and keep < self._here[0]:
            self._here = None
        if self.eos_ids.intersection(output[keep:]):
            return False
        if len(self.consumed) > keep and not self.matcher.rollback(len(self.consumed) - keep):
            self.matcher.reset()
            keep = 0
        del self.consumed[keep:]
        fresh = output[keep:]
        if fresh and not self.matcher.consume_tokens(fresh):
            error = self.matcher.get_error()
            self.matcher.reset()
            self.consumed, self._run, self._here = [], None, None
            raise ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the session's output breaks its grammar (it was not generated under these rules): {error}",
            )
        self.consumed.extend(fresh)
        return True


@functools.lru_cache(maxsize=4)
def _columns_of(ids: torch.Tensor) -> torch.Tensor:
    """A draft's scored ids (its server's one tensor, hashed by identity) as an int64 CPU tensor, made once for the
    server, not for each session (13,146 entries for the embedded draft)."""
    return torch.tensor(ids.tolist(), dtype=torch.long)


@functools.lru_cache(maxsize=4)
def _column_array(ids: torch.Tensor) -> np.ndarray:
    """_columns_of(ids) as numpy, made once: a view made at every row cost 5-30 us with the caches cold."""
    return _columns_of(ids).numpy()
