"""A session's KV cache (``LeanCache``), and where it takes its tensors (``Slabs``): new ones, or on a GPU with CUDA
graphs, those an ended session left.

A CUDA graph replays fixed addresses, so the graphs of a session's passes are captured on its cache's tensors
(specdec/runners/cuda_graphs.py). Captured per session, every request paid for its own captures: on an H100
(2026-11-26) they added 0.8 ms to each of the embedded target's steps and 3.4 ms to each verify, over requests of
96 tokens. Kept with the tensors instead (``Slab.graphs``), they serve every later cache that takes the same tensors.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter, deque

import torch


class Slab:
    """Keys and values [layers, kv heads, capacity, head dim] of one cache, and the CUDA graphs captured on them."""

    __slots__ = ("graphs", "k", "lane", "v")

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v
        self.graphs: dict = {}  # (rows, logits rows, final-norm rows) -> a cuda_graphs.Graph on these addresses
        self.lane: int | None = None  # where its graphs replay (cuda_graphs.CudaGraphs), given at its first capture

    @property
    def capacity(self) -> int:
        return self.k.shape[2]


class Slabs:
    """The slabs of one runner's caches. Without ``recycle`` every slab is new and freed with its cache (a CPU's
    way). With it, a slab a cache leaves (grown out of, or ended with its session) is kept, and the next cache that
    needs its capacity takes it, zeroed, with its graphs. The kept slabs never hold more than the caches held at
    their most: a new slab is made only after kept ones of other capacities, as many tokens' worth, are dropped."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype, device, recycle: bool = False):
        self.shape, self.dtype, self.device = (layers, kv_heads, head_dim), dtype, device
        self.recycle = recycle
        self.kept: dict[int, list[Slab]] = {}  # capacity -> slabs no cache holds
        # Caches are freed on whichever thread drops a session, inside a collection too: a slab given back waits
        # here, taking no lock, until the next take files it.
        self._given: deque[Slab] = deque()
        self._lock = threading.Lock()
        self.made = 0
        self.live: Counter[int] = Counter()  # lane -> slabs of that lane that caches hold (cuda_graphs' lanes)

    def take(self, capacity: int) -> Slab:
        """A slab of `capacity` tokens, zeros throughout: a CUDA graph's masked attention reads past a cache's
        length (weight 0, which a NaN left in unused memory would survive)."""
        with self._lock:
            self._file_given()
            slab = self._pop(capacity)
            if slab is None:
                self._drop(capacity)
        if slab is not None:
            if slab.lane is not None:
                self.live[slab.lane] += 1
            slab.k.zero_()
            slab.v.zero_()
            return slab
        layers, kv_heads, head_dim = self.shape
        k = torch.zeros(layers, kv_heads, capacity, head_dim, dtype=self.dtype, device=self.device)
        self.made += 1
        return Slab(k, torch.zeros_like(k))

    def give(self, slab: Slab) -> None:
        """A cache is done with `slab`: kept for the next (recycling), else freed with its last reference."""
        if self.recycle:
            self._given.append(slab)

    def assign_lane(self, slab: Slab, lanes: int) -> int:
        """The lane of a slab that has none yet: the one the fewest held slabs are in, so that the sessions of a pass
        spread over the lanes (given in turn, 4 sessions would be in 4 lanes of 4 about one time in 10)."""
        with self._lock:
            slab.lane = min(range(lanes), key=lambda lane: (self.live[lane], lane))
            self.live[slab.lane] += 1
        return slab.lane

    def _file_given(self) -> None:
        while self._given:
            slab = self._given.popleft()
            self.kept.setdefault(slab.capacity, []).append(slab)
            if slab.lane is not None:
                self.live[slab.lane] -= 1

    def _pop(self, capacity: int) -> Slab | None:
        """A kept slab of `capacity`, if any (the latest kept of those in the lane the fewest held slabs are in; one
        without a lane gets the least held at its first capture); a capacity with none left has no entry."""
        kept = self.kept.get(capacity)
        if not kept:
            return None
        least = min(self.live.values(), default=0)
        i = min(reversed(range(len(kept))), key=lambda j: least if kept[j].lane is None else self.live[kept[j].lane])
        slab = kept.pop(i)
        if not kept:
            del self.kept[capacity]
        return slab

    def _drop(self, tokens: int) -> None:
        """Frees kept slabs, largest first, until `tokens` tokens' worth are gone or none is left."""
        while tokens > 0 and self.kept:
            capacity = max(self.kept)
            self._pop(capacity)
            tokens -= capacity

    def kept_tokens(self) -> int:
        with self._lock:
            self._file_given()
            return sum(capacity * len(slabs) for capacity, slabs in self.kept.items())


class LeanCache:
    """Keys and values of one session: [layers, kv_heads, capacity, head_dim].

    The capacity grows in steps of GROW tokens, not by doubling: the pool budgets memory by tokens held,
    and doubling could hold up to twice that, which a GPU's budget has no room for. Copying the cache
    once every GROW tokens costs under 1% of the decoding time of those tokens. The tensors are a slab taken from
    `slabs`, given back when the cache grows out of it or is freed."""

    GROW = 256

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype, device, slabs: Slabs | None = None):
        slabs = Slabs(layers, kv_heads, head_dim, dtype, device) if slabs is None else slabs
        self._slab = [slabs.take(self.GROW)]  # a list the finalizer shares: the slab held when the cache is freed
        weakref.finalize(self, lambda held: slabs.give(held[0]), self._slab).atexit = False
        self.slabs, self.length = slabs, 0

    @property
    def slab(self) -> Slab:
        return self._slab[0]

    @property
    def k(self) -> torch.Tensor:
        return self._slab[0].k

    @property
    def v(self) -> torch.Tensor:
        return self._slab[0].v

    def reserve(self, n: int) -> None:
        need = self.length + n
        if need > self.slab.capacity:
            old, new = self.slab, self.slabs.take(-(-need // self.GROW) * self.GROW)
            new.k[:, :, : old.capacity] = old.k
            new.v[:, :, : old.capacity] = old.v
            self._slab[0] = new
            self.slabs.give(old)

    def get_seq_length(self) -> int:
        return self.length


KV_CACHES = ("model", "float16")  # a lean runner's KV cache dtypes: the weights', or half a float32 model's bytes


def kv_dtype(kv_cache: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's dtype for a runner's kv_cache setting, weights' dtype and device. float16 is for float32
    weights on CPU: each key and value is rounded to the nearest half (ties to even) as it is written, and attention
    reads them widened to float32, so a step reads half the cache's bytes (a GPU's model is 16-bit already)."""
    if kv_cache == "model":
        return dtype
    if kv_cache != "float16":
        raise ValueError(f"kv_cache must be one of {', '.join(KV_CACHES)}, not {kv_cache!r}")
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError(f"a float16 KV cache is for float32 weights on CPU, not {dtype} on {device.type}")
    return torch.float16
