"""Prompt prefixes that new sessions share, kept as KV blocks: a session starts from the longest cached prefix of
its tokens and feeds only the rest.

Chat requests share their template's opening (SmolLM2's system turn is 24 tokens of a 40-50-token prompt), and a
session rebuilt from its history shares all of it with the session it replaces. Where a row of a pass costs its
multiply-adds, as on a CPU, a prefill row costs what a decode row does, so each shared token computed again is a
token some stream does not get. Like vLLM's automatic prefix caching, the cache keys blocks of BLOCK tokens by
a hash chained over every token before them, so a block is reused only after the very same tokens.

Only where the runner is batch-invariant (specdec's kernels): there a position's keys and values depend on the
tokens up to it and nothing else, so a copied block holds exactly what the session would have computed, bit for
bit, and the output cannot change. Elsewhere the cache stays off.

A block also keeps the features of its positions (specdec.features) when the session that computed it kept them:
a session that keeps features takes only blocks that have them, and computes the rest itself (its blocks then
give their features to the cache).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

BLOCK = 8  # tokens per block: small, so that a shared opening of 24 tokens is reused whole


class PrefixCache:
    """An LRU of KV blocks, at most `capacity` tokens of them. The runner moves blocks in and out of its caches
    (``read_kv(cache, start, n) -> (k, v)``, ``write_kv(cache, start, k, v)``)."""

    def __init__(self, runner, capacity: int, block: int = BLOCK):
        self.runner = runner
        self.block = block
        self.capacity_blocks = capacity // block
        # The chain starts from the runner's product form and numerics: blocks computed in one form (float32 or
        # 8-bit activations, a float16 KV cache) never stand in for another's.
        plan = getattr(runner, "plan", None)
        form = plan.long.name if plan is not None else type(runner).__name__
        self.root = f"{form}: {getattr(runner, 'numerics', '')}"
        # key -> [tokens, parent key, k, v, features [block, hidden] or None]
        self._blocks: OrderedDict[int, list] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks) * self.block  # tokens held

    def _chain(self, tokens: list[int], n_blocks: int):
        """(key, block tokens, parent key) of the first n_blocks blocks of tokens."""
        parent = self.root
        for i in range(n_blocks):
            chunk = tuple(tokens[i * self.block : (i + 1) * self.block])
            key = hash((parent, chunk))
            yield key, chunk, parent
            parent = key

    def attach(self, cache, tokens: list[int], limit: int, features=None) -> int:
        """Copy into an empty cache the longest cached prefix of tokens, at most `limit` tokens long; its length.
        features: an empty FeatureStore of a session that keeps features: only blocks with features are taken,
        and their features are appended to it."""
        used = []
        for key, chunk, parent in self._chain(tokens, max(limit, 0) // self.block):
            entry = self._blocks.get(key)
            if entry is None or entry[0] != chunk or entry[1] != parent:  # a hash collision is a miss
                break
            if features is not None and entry[4] is None:  # computed by a session that kept none
                break
            self.runner.write_kv(cache, len(used) * self.block, entry[2], entry[3])
            if features is not None:
                features.append(entry[4])
            used.append(key)
        self._touch(used)
        return len(used) * self.block

    def _touch(self, chain: list[int]) -> None:
        """Mark a chain used, its first blocks last: the LRU drops a chain's ends before the blocks it hangs on."""
        for key in reversed(chain):
            self._blocks.move_to_end(key)

    def store(self, cache, tokens: list[int], features=None) -> None:
        """Keep the full blocks of a cache holding `tokens` that are not kept yet, dropping the least recently
        used past the capacity. features: the session's FeatureStore, if it keeps one: its rows go with the
        blocks, those kept already without features included."""
        if not self.capacity_blocks:
            return
        chain = []
        for i, (key, chunk, parent) in enumerate(self._chain(tokens, len(tokens) // self.block)):
            start = i * self.block
            entry = self._blocks.get(key)
            if entry is None:
                entry = self._blocks[key] = [chunk, parent, *self.runner.read_kv(cache, start, self.block), None]
            if features is not None and entry[4] is None and entry[:2] == [chunk, parent]:
                entry[4] = features.read(start, start + self.block).clone()
            chain.append(key)
        self._touch(chain)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two token lists. A session's copies part near their ends (the
    orchestrator's mirror and its history, a grammar's matcher and the output: the last round's rejected drafts), so
    the head is compared whole and only the last tokens one by one; numpy only where the heads differ (a rebuilt
    session), as converting both lists cost 20 us each a call at a few hundred tokens (py-spy)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # one is the other's prefix: a matcher behind its output, a mirror behind its history
        return n
    head = max(n - 64, 0)
    if a[:head] == b[:head]:
        return next((i for i in range(head, n) if a[i] != b[i]), n)
    return int(np.argmax(np.asarray(a[:head]) != np.asarray(b[:head])))
