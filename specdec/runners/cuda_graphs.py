"""Passes of few rows a session, replayed as CUDA graphs.

On a GPU an eager pass of a small model is bound by launching its kernels from Python, not by the device: the
embedded target's step, about 40 small kernels in each of its 30 layers, took 16 ms on an H100 (2026-11-26) whose
memory reads its 270 MB of bfloat16 weights in 0.1 ms. A CUDA graph launches a whole captured pass at once, as vLLM
and TGI run their decode steps.

A graph replays fixed addresses and shapes. So the pass it captures (``static_pass``) reads its tokens and its first
position from buffers on the device, writes the new keys and values by index, and attends over the cache's whole
capacity under a mask of the positions so far (the keys past them are zeros: a cache's slab is zeroed). A graph is
captured per cache slab (specdec/runners/kv_cache.py) and per (rows, logits rows, final-norm rows) on the first such
pass, and kept with
the slab: with graphs, slabs are recycled, so the next request, or a cache grown into a kept slab, replays the graphs
an earlier one captured. A pass of several sessions replays their graphs one after another where that measures
cheaper than one eager pass (``CudaGraphs.in_turn``); with lanes, the graphs of sessions in different lanes replay
on streams of their own, at once (a small model's graph is a chain of tiny kernels that leaves most of the card
idle). A head's features go into a graph's own buffer, and the final-norm rows a pass asks for (a target's
features, a head's predicted one) come out of one. Passes of more than ``MAX_ROWS`` rows a session run eagerly. The numbers are the
eager pass's up to rounding: attention takes another kernel (memory-efficient, masked) than the eager pass's (flash,
the keys so far).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from specdec.costs import PassCosts, width_of
from specdec.runners.products import SMALL_PASS_ROWS

log = logging.getLogger(__name__)

# A step (1 row), a verify of K + 1 rows (K up to 15); a wider pass is a prefill, whose launches its rows amortize.
MAX_ROWS = 16
# Lanes at most: a card runs at most CUDA_DEVICE_MAX_CONNECTIONS streams' work at once (8 unless set).
MAX_LANES = 8
# One pass of several sessions in this many that would replay their graphs in turn runs eagerly instead, so that the
# eager pass's cost, which the choice compares with, follows the load rather than its first measure; but only while
# that cost is within EXPLORE_WITHIN times the in-turn pass's. Further off, a measure could not change the choice, and
# each one stalls every session of the pass for an eager pass: on an H100 (2026-11-26) the p99 inter-token latency
# at 4-16 streams was that pass, 77-114 ms against a p50 of 11-44 ms.
EAGER_EVERY = 64
EXPLORE_WITHIN = 2.0


def static_pass(
    runner,
    k: torch.Tensor,
    v: torch.Tensor,
    ids: torch.Tensor,
    pos: torch.Tensor,
    num_logits: int,
    feats: torch.Tensor | None = None,
    norm_rows: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits [num_logits, vocab or scored] float32, the final-norm output of the last norm_rows rows or None) of
    appending ids ([n] on the device) at position pos ([1] on the device) to the cache whose keys and values are k, v
    ([layers, kv heads, capacity, head dim], room for the n rows reserved), a head's features feats ([n, hidden])
    beside them: the runner's eager pass in shapes fixed by n and the capacity, with no value read on the host."""
    from specdec.runners.lean_llama import TorchLayerOps

    n, capacity = ids.shape[0], k.shape[2]
    positions = pos + torch.arange(n, device=ids.device)  # [n]
    cos, sin = runner.cos[positions], runner.sin[positions]
    allowed = torch.arange(capacity, device=ids.device)[None, :] <= positions[:, None]  # [n, capacity]
    form = runner.plan.by_rows[n] if n <= SMALL_PASS_ROWS else runner.plan.long
    linear, layers, lm_head = form.products
    ops, eps, h = TorchLayerOps, runner.eps, runner.n_heads
    x = runner._mixed(runner.embed[ids], None if feats is None else [feats], [n])  # a head's input; else embeddings
    for i, (ln1, wqkv, wo, ln2, wgu, wd) in enumerate(layers):
        att = attend_masked(linear(ops.rms_norm(x, ln1, eps), wqkv), k[i], v[i], cos, sin, positions, allowed, h)
        x = x + linear(att, wo)
        x = x + linear(ops.silu_mul(linear(ops.rms_norm(x, ln2, eps), wgu)), wd)
    keep = max(num_logits, norm_rows)  # the final norm once over the rows either needs, as the eager pass
    normed = ops.rms_norm(x[n - keep :], runner.norm, eps)
    logits = linear(normed[keep - num_logits :], lm_head).float()
    return logits, normed[keep - norm_rows :] if norm_rows else None


def attend_masked(qkv, k, v, cos, sin, positions, allowed, n_heads: int) -> torch.Tensor:
    """TorchLayerOps.attend with the positions on the device: writes the rotated keys and the values of qkv's n rows
    at `positions` of one layer's k, v [kv, capacity, d]; returns the attention of the rotated queries over the
    keys `allowed` [n, capacity] marks: [n, h d].

    The kernels that take a dense mask (memory-efficient) do not group KV heads, and widening the cache to every
    query head would copy it h / kv times a layer. So the queries of each KV head's group are stacked as rows of
    that head instead (query head j reads KV head j // (h / kv), as transformers' repeat_kv), each row with its
    position's mask: attention with kv heads of (h / kv) n rows, over the cache as it is."""
    from specdec.runners.lean_llama import rope

    n, (kv, _, d), h = qkv.shape[0], k.shape, n_heads
    group = h // kv
    q = rope(qkv[:, : h * d].view(n, h, d).transpose(0, 1), cos, sin)  # [h, n, d]
    keys = rope(qkv[:, h * d : (h + kv) * d].view(n, kv, d).transpose(0, 1), cos, sin)
    k.index_copy_(1, positions, keys.to(k.dtype))  # a cache in another dtype (a CPU's float16) takes it rounded
    v.index_copy_(1, positions, qkv[:, (h + kv) * d :].view(n, kv, d).transpose(0, 1).to(v.dtype))
    k, v = k.to(q.dtype), v.to(q.dtype)  # and is read widened; the same tensors where the dtypes agree (a GPU's)
    rows = q.reshape(kv, group * n, d)  # row g n + i of KV head c: query head c group + g at position i
    att = F.scaled_dot_product_attention(rows[None], k[None], v[None], attn_mask=allowed.repeat(group, 1))[0]
    return att.reshape(h, n, d).transpose(0, 1).reshape(n, h * d)


@dataclass
class Graph:
    replay: Callable[[], None]  # runs the captured pass on the buffers below
    ids: torch.Tensor  # [n] the tokens, on the device
    pos: torch.Tensor  # [1] the first position, on the device
    feats: torch.Tensor | None  # [n, hidden] a head's features beside the tokens, on the device
    out: torch.Tensor  # the logits the replay writes
    norms: torch.Tensor | None  # the final-norm rows it writes, where the pass asks for them


def cuda_capture(run: Callable[[], torch.Tensor], pool, stream) -> tuple[Callable[[], None], torch.Tensor]:
    """(replay, output) of run() captured as a CUDA graph in the memory pool `pool` on `stream`, after one run (the
    warm-up torch.cuda.graphs asks for; it writes what the replay writes again: the keys and values of the same rows).
    The stream is one a lane keeps, and nothing but its graphs' captures and replays runs on it. cuBLAS keeps a
    workspace a stream, whose address a graph holds, so graphs replayed at once must have been captured on streams of
    their own (a new stream a capture would leave a workspace each, 32 MiB on an H100, that no budget counts). The
    warm-up runs on the current stream, so that the lane stream's workspace is made during its first capture, in the
    lane's pool: torch 2.11 frees a stream's workspace with any graph captured on it (a dropped slab's), and made
    eagerly, in the device's general memory, it would be taken by other tensors while the lane's other graphs still
    write to it; in the pool it is scratch only the lane's graphs use, and they never run at once."""
    run()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
        out = run()
    return graph.replay, out


class CudaGraphs:
    """The runner's graphed passes: ``run`` runs a pass as graphs where it can be, ``timed`` learns what passes cost
    each way. capture(run, pool, stream): how a pass is captured (``cuda_capture``; a test's stand-in runs it eagerly).

    A pass of several sessions runs as each session's graph in turn where their measured costs add up to less than
    an eager pass of as many sessions: on an H100 (2026-11-26) the embedded target's eager pass of 4 sessions took
    31.4 ms against 2.85 ms a graphed step; Llama-3.2-3B's eager pass gains on its graphs from about 4 sessions on.
    An eager pass of few rows a session is priced by its sessions, not its rows: on a GPU its cost is each
    session's attention and launches (4 sessions' steps 31.4 ms, their verifies of 5 rows 35.4)."""

    def __init__(
        self, runner, max_rows: int = MAX_ROWS, capture=cuda_capture, lanes: int = 1, streams=None, rows: int = 0
    ):
        self.runner, self.max_rows, self._capture = runner, max_rows, capture
        # rows > 0: every pass of up to `rows` rows a session replays the graph of exactly `rows` (its own rows
        # first, the rest padding), with every row's logits, and several sessions' passes always in turn. A graph
        # fixes its kernels and their order of summation, and a row's sums do not depend on the other rows of a
        # GEMM, so a position's logits are the same from a step, any row of a verify, or a batch: greedy output is
        # the target's alone in bfloat16 too, at `rows` rows' cost a step.
        self.rows = rows
        self._mixed_passes = 0  # passes whose pieces fit the fixed rows and did not (one_shape's turns)
        runner.slabs.recycle = True  # a slab's graphs serve the caches that take it after its first
        # Graphs of one lane share a memory pool and outputs, so they replay one after another; lanes replay at once.
        # A slab's lane is given at its first capture (kv_cache.Slabs.assign_lane) and kept with its graphs.
        self.lanes = lanes
        self._streams = streams if streams is not None else CudaStreams(lanes)
        self._pools: dict[int, object] = {}  # lane -> the torch.cuda.MemPool its graphs are captured in
        self.turns = PassCosts()  # with lanes: in-turn passes' seconds by sessions (they overlap, so no sum prices one)
        self.captured = self.replayed = 0
        self.failed: str | None = None  # why a capture failed; every pass runs eagerly from then on
        self.graphed, self.eager = PassCosts(), PassCosts()  # one session's replays by rows; eager by sessions
        self.way = "eager"  # how the last pass ran: eager, graphed (one session), in_turn (several)
        self._captured_before = 0  # the captures before the last pass
        # (lane, rows, logits rows, norm rows) -> (the logits, the final-norm rows or None) its graphs write
        self._outputs: dict[tuple[int, int, int, int], tuple] = {}
        self._turns = 0  # passes of several sessions that could run in turn

    def describe(self) -> str:
        lanes = f", several sessions' in {self.lanes} lanes at once" if self.lanes > 1 else ""
        if self.rows:
            return f"each session's passes of 1-{self.rows} rows replayed as CUDA graphs of {self.rows} rows{lanes}"
        return f"each session's passes of 1-{self.max_rows} rows replayed as CUDA graphs{lanes}"

    def run(self, caches, token_ids, num_logits, plan, features_in, norm_rows):
        """The logits of the pass (its rooms reserved) replayed as graphs, a [num_logits[i], vocab or scored] per
        session, the caches' lengths moved on, and with norm_rows (logits, norms) as the eager pass returns them;
        None: run it eagerly (a pass graphs do not take, or one whose capture failed, said once in the log; nothing
        of it has run). A head's features_in go into its graphs' own buffer (zeros where a session has none)."""
        self.way, self._captured_before = "eager", self.captured
        ns = [len(t) for t in token_ids]
        if self.failed or plan is not None or (features_in is not None and self.runner.mix is None):
            return None  # (features for a model that reads none: the eager pass says why not)
        if not 0 < max(ns) <= (self.rows or self.max_rows) or (len(ns) > 1 and not (self.rows or self.in_turn(ns))):
            return None
        norms = norm_rows or [0] * len(ns)
        shapes = list(zip(ns, num_logits, norms))  # the session's rows, and what it asks of them
        if self.rows:  # one shape for every pass: room for the padding, and every row's logits (and norms)
            if any(c.length + self.rows > self.runner.max_len for c in caches):
                return None  # (the context's last rows: no room to pad)
            for c in caches:
                c.reserve(self.rows)
            token_ids = [_as_list(t) + [0] * (self.rows - n) for t, n in zip(token_ids, ns)]
            ns, num_logits, norms = [self.rows] * len(ns), [self.rows] * len(ns), [self.rows if m else 0 for m in norms]
        ids = self._on_device(token_ids, ns)
        feats = self._features(features_in, [n for n, _, _ in shapes], ns)
        graphs = [self._graph(*args) for args in zip(caches, ids, num_logits, norms, feats)]  # captures first
        if any(g is None for g in graphs):
            return None
        self.way = "graphed" if len(ns) == 1 else "in_turn"
        calls = [partial(self._replay, *args) for args in zip(graphs, caches, ids, feats, shapes)]
        if len(ns) == 1 or self.lanes == 1:
            outs = [call() for call in calls]
        else:
            outs = self._streams.each([c.slab.lane for c in caches], calls)
        logits = [out for out, _ in outs]
        return logits if norm_rows is None else (logits, [normed for _, normed in outs])

    def one_shape(self, ns: list[int]) -> list[bool]:
        """Which of a planned pass's pieces (of ns rows) it runs: all, but with fixed rows either those that fit the
        graphs (steps, verifies) or the longer ones (prefills), in turn where both wait. One longer piece would make
        the whole pass eager, and the steps and verifies in it would leave the one shape their positions come from."""
        fit = [n <= self.rows for n in ns]
        if not self.rows or all(fit) or not any(fit):
            return [True] * len(ns)
        self._mixed_passes += 1
        return [f == (self._mixed_passes % 2 == 1) for f in fit]

    def in_turn(self, ns: list[int]) -> bool:
        """Whether sessions of ns rows run cheaper as their graphs in turn than in one eager pass, by the costs
        measured (eagerly, which measures it, until an eager pass of about as many sessions has been)."""
        if width_of(len(ns)) not in self.eager.seconds or any(width_of(n) not in self.graphed.seconds for n in ns):
            return False
        self._turns += 1
        in_turn = sum(self.graphed.at(n)[0] for n in ns)  # one after another: the upper bound of lanes at once
        if self.lanes > 1 and width_of(len(ns)) in self.turns.seconds:  # lanes at once, as measured: never dearer
            in_turn = min(in_turn, self.turns.at(len(ns))[0])
        eager = self.eager.at(len(ns))[0]
        explore = self._turns % EAGER_EVERY == 0 and eager < EXPLORE_WITHIN * in_turn
        return in_turn < eager and not explore

    def timed(self, ns: list[int], seconds: float) -> str:
        """Learns the cost of the last pass (of ns rows a session); how it ran: eager, graphed, in_turn, or captured
        for a pass that captured a graph, which ran it twice more (a warm-up, the replay) and is no pass's cost."""
        if self.captured != self._captured_before:
            return "captured"
        if self.way == "graphed":
            self.graphed.observe(ns[0], seconds)
        elif self.way == "in_turn" and self.lanes > 1:
            self.turns.observe(len(ns), seconds)
        elif self.way == "in_turn":  # each session's share, in proportion to what its graph was priced at
            priced = [self.graphed.at(n)[0] for n in ns]  # (none yet with fixed rows, which never wait for prices)
            for n, share in zip(ns, priced):
                self.graphed.observe(n, seconds * share / sum(priced) if sum(priced) else seconds / len(ns))
        elif self.way == "eager" and max(ns) <= self.max_rows:  # a prefill's piece is no guide to a few rows'
            self.eager.observe(len(ns), seconds)
        return self.way

    def _graph(self, cache, ids: torch.Tensor, num_logits: int, norm_rows: int, feats) -> Graph | None:
        key = (len(ids), num_logits, norm_rows)
        if (graph := cache.slab.graphs.get(key)) is None and (
            graph := self._capture_pass(cache, ids, num_logits, norm_rows, feats)
        ):
            cache.slab.graphs[key] = graph
        return graph

    def _on_device(self, token_ids, ns: list[int]) -> list[torch.Tensor]:
        """The pass's ids on the device, a view a session, in one copy: from pinned memory, asynchronous on a GPU (a
        copy from pageable memory waits for the stream, which would leave the card idle between replays)."""
        device = self.runner.device
        if any(isinstance(t, torch.Tensor) for t in token_ids):
            return [torch.as_tensor(t, dtype=torch.long).to(device) for t in token_ids]
        flat = torch.tensor([t for ts in token_ids for t in ts], dtype=torch.long)
        if device.type == "cuda":
            flat = flat.pin_memory().to(device, non_blocking=True)
        return list(flat.split(ns))

    def _features(self, features_in, ns: list[int], widths: list[int]) -> list[torch.Tensor | None]:
        """A head's input features of each session's ns[i] rows on the device, zeros where a session has none and
        past its rows up to widths[i] (padding), in one copy as the ids; None a session for a model that reads none."""
        r = self.runner
        if r.mix is None:
            return [None] * len(ns)
        rows = [torch.zeros(w, r.embed.shape[1]) for w in widths]
        for row, f, n in zip(rows, features_in or [None] * len(ns), ns):
            if f is not None:
                row[:n] = torch.as_tensor(f).float().cpu()
        flat = torch.cat(rows).to(r.dtype)  # rounded as the eager pass's .to(device, dtype) rounds, on the host
        if r.device.type == "cuda":
            flat = flat.pin_memory().to(r.device, non_blocking=True)
        return list(flat.split(widths))

    def _replay(self, graph: Graph, cache, ids: torch.Tensor, feats: torch.Tensor | None, shape: tuple[int, int, int]):
        """(logits, final-norm rows or None) of one session's graph, copied out of its buffers at once, on the
        replay's stream: a lane's graphs share their scratch (an older graph's cuBLAS workspace, once torch freed it
        with a dropped graph, may lie under a newer one's buffers), so nothing a replay wrote is read after the next
        replay of its lane, and every input buffer is written before its own replay."""
        graph.ids.copy_(ids)
        graph.pos.fill_(cache.length)
        if graph.feats is not None:
            graph.feats.copy_(feats)
        graph.replay()
        self.replayed += 1
        n, logits_rows, norm_rows = shape  # the session's own rows: all of its graph's, or its first n of `rows`
        cache.length += n
        out, normed = graph.out, graph.norms if norm_rows else None
        if self.rows:  # a padded graph's outputs are of every row
            out, normed = out[n - logits_rows : n], None if normed is None else normed[n - norm_rows : n]
        return out.clone(), None if normed is None else normed.clone()

    def _lane(self, slab) -> int:
        return slab.lane if slab.lane is not None else self.runner.slabs.assign_lane(slab, self.lanes)

    def _pool_id(self, lane: int):
        """The memory pool a lane's graphs are captured in: one a lane, as its graphs never run at once (graphs in one
        pool may share their scratch memory). This MemPool holds it, so it outlives the graphs of ended sessions: a
        bare pool handle dies with the last graph that used it, and a capture into it then fails in the allocator
        (seen on an H100, torch 2.11, 2026-11-26)."""
        if self.runner.device.type != "cuda":
            return None
        if lane not in self._pools:
            self._pools[lane] = torch.cuda.MemPool()
        return self._pools[lane].id

    def _capture_pass(self, cache, ids: torch.Tensor, num_logits: int, norm_rows: int, feats) -> Graph | None:
        r = self.runner
        # buffers of the graph's own: a caller's tensor of ids, already on the device, is not kept (nor written)
        buffers = ids.to(r.device, copy=True), torch.full((1,), cache.length, dtype=torch.long, device=r.device)
        # the pass's own features, so that the warm-up and the capture write the keys and values the replay writes
        feats = None if feats is None else feats.to(r.device, copy=True)
        k, v = cache.k, cache.v  # the slab's tensors, which the graph serves whichever cache holds them
        lane = self._lane(cache.slab)
        key = (lane, len(ids), num_logits, norm_rows)
        # The graphs of a lane and shape share one output, the first's (their replays never overlap, and each is
        # copied out at once): kept per graph, every slab's graphs' outputs would take memory no budget counts.
        shared = self._outputs.get(key)

        def run() -> tuple[torch.Tensor, torch.Tensor | None]:
            logits, normed = static_pass(r, k, v, *buffers, num_logits, feats, norm_rows)
            if shared is None:
                return logits, normed
            return shared[0].copy_(logits), None if normed is None else shared[1].copy_(normed)

        try:
            stream = self._streams.stream(lane) if r.device.type == "cuda" else None
            replay, (out, normed) = self._capture(run, self._pool_id(lane), stream)
        except Exception as e:  # a kernel that cannot be captured: the server still serves, eagerly
            self.failed = f"{type(e).__name__}: {e}"
            log.warning("a CUDA graph could not be captured; every pass runs eagerly: %s", self.failed)
            return None
        self._outputs.setdefault(key, (out, normed))
        self.captured += 1
        if self.captured == 1:
            log.info("CUDA graphs: captured the first (%d rows, %d logits rows)", len(ids), num_logits)
        return Graph(replay, *buffers, feats, out, normed)


def _as_list(ids) -> list[int]:
    return ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)


class CudaStreams:
    """A CUDA stream a lane, made once: its graphs are captured on it, and a pass's sessions replay on theirs, started
    after what the current stream has queued (the pass's ids, the caches' writes) and joined by it before anything
    reads the outputs, even where a replay fails. ``each`` runs the calls in order, each on its lane's stream; a
    test's stand-in runs them in order and records the lanes."""

    def __init__(self, lanes: int):
        self.lanes = lanes
        self._streams: list[torch.cuda.Stream] = []

    def stream(self, lane: int) -> torch.cuda.Stream:
        if not self._streams:  # made together, so that the streams torch hands out in turn are distinct
            self._streams = [torch.cuda.Stream() for _ in range(self.lanes)]
        return self._streams[lane]

    def each(self, lanes: list[int], calls: list[Callable[[], tuple]]) -> list[tuple]:
        main = torch.cuda.current_stream()
        streams = {lane: self.stream(lane) for lane in lanes}
        for stream in streams.values():
            stream.wait_stream(main)
        outs = []
        try:
            for lane, call in zip(lanes, calls):
                with torch.cuda.stream(streams[lane]):
                    out = call()
                for t in out:
                    if t is not None:  # made on the lane's stream, read on the current one: not reused before then
                        t.record_stream(main)
                outs.append(out)
        finally:
            for stream in streams.values():
                main.wait_stream(stream)
        return outs
