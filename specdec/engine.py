"""The batching engine of a model server: each forward pass runs the rows of every call waiting for one.

Calls from all sessions (unary RPCs and stream messages alike) ask for their tokens to be fed
(``Engine.forward``) and wait. Whenever the model is free, the engine takes what is waiting and runs it as
ONE forward pass over a flattened batch of rows: the products read each weight once for all of them, and
attention runs per session over its own cache and positions (the runners' ``forward_batch``). There is no
waiting window: what queued during a pass forms the next one. A token budget bounds a pass
(``max_batch_tokens``): steps and verifies go first, and a long feed (a prompt's prefill, a session rebuild)
is cut into pieces that fill what the budget leaves, so that one user's long prompt shares passes with
everyone's rounds instead of stalling them.

Where the runner is batch-invariant (specdec's CPU kernels: every row summed on its own), a session's logits
are bit for bit what it gets alone, whatever it is batched with and however its feed is cut: greedy output
does not change with load, and a seeded request replays.

All of it runs on the server's event loop thread (see specdec/model_server.py): the pass is a plain call that
holds the loop, and the loop is free between passes (health checks, cancellations, new calls). A call that is
cancelled leaves the queue; a session released while its call waits fails that call alone with NOT_FOUND; a
pass that fails is run again session by session, so that a defect fails only the call that causes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import grpc
import torch

from specdec import costs
from specdec.costs import PassCosts, width_of
from specdec.errors import ServiceError
from specdec.kv_pool import Session, SessionPool
from specdec.runners import to_host

log = logging.getLogger(__name__)

# A pass of more than this many rows is compute-bound on CPU and runs on --prefill-threads, where a step's
# or a verify's few rows run on --threads: the draft's are chains of small ops that a second thread only
# synchronises, and its spinning would take the core the target's verify needs.
LONG_PASS_TOKENS = 32

# Rows per pass when --max-batch-tokens is 0. Once a pass is compute-bound each row costs its multiply-adds, so
# the budget bounds how long every session waits for a pass while a prompt's prefill goes on beside their steps:
# on a CPU a few tens of rows (docs/performance.md), on an accelerator thousands in a few tens of ms.
MAX_BATCH_TOKENS = {"cpu": 64, "accelerator": 2048}

# After a pass, the loop runs at most this many steps before the next one (see Engine._gather).
GATHER_STEPS = 32
# The engine waits for the sessions it just served while they come back within this share of a pass
# (Engine._await_returning); TURNAROUND_RATE weighs the measured turnaround's last ~10 calls most.
TURNAROUND_RATE = 0.1
ACTIVE_WINDOW_S = 1.0  # a session that called within this long counts as active (Engine.active_sessions)


@dataclass(eq=False)
class Feed:
    """One call's tokens for one session, fed in one or more passes; the logits of its last num_logits."""

    session: Session
    tokens: list[int]
    num_logits: int
    scored_only: bool
    future: asyncio.Future
    queued_at: float
    done: int = 0  # tokens fed so far
    started_at: float | None = None  # when its first piece ran
    compute_s: float = 0.0  # seconds of the passes it took part in
    last_rows: int = 0  # rows and sessions of the last pass it took part in
    last_sessions: int = 0
    logits: torch.Tensor | None = None  # once fed
    features_in: torch.Tensor | None = None  # [len(tokens), hidden]: what a head draft reads beside each token
    norm_rows: int = 0  # final-norm rows the caller wants, of the last positions (a head's predicted feature)
    norms: list = field(default_factory=list)  # those rows, a float32 tensor a piece, once fed

    @property
    def normed(self) -> torch.Tensor | None:
        """The final-norm rows of the feed's last norm_rows positions: [norm_rows, hidden] (None without)."""
        return torch.cat(self.norms) if self.norms else None

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.done


@dataclass(frozen=True)
class Piece:
    """The part of a feed one pass runs: n tokens from feed.done; ends the feed when it reaches its end."""

    feed: Feed
    n: int

    @property
    def last(self) -> bool:
        return self.n == self.feed.remaining


def plan_pass(feeds: list[Feed], budget: int) -> list[Piece]:
    """What the next pass runs: feeds of at most LONG_PASS_TOKENS tokens first (steps and verifies, whose
    sessions wait on them a round at a time), then longer ones, each in arrival order, as much of each as the
    budget leaves. A feed cut short keeps at least its num_logits tokens for the piece that ends it."""
    pieces, left = [], budget
    for feed in sorted(feeds, key=lambda f: len(f.tokens) > LONG_PASS_TOKENS):  # stable: arrival order within
        if left <= 0:
            break
        n = min(feed.remaining, left)
        if n < feed.remaining:
            n = min(n, feed.remaining - feed.num_logits)
        if n > 0:
            pieces.append(Piece(feed, n))
            left -= n
    return pieces


class Engine:
    """Feeds the calls of every session to the runner in batched passes (see the module)."""

    def __init__(
        self,
        runner,
        pool: SessionPool,
        max_batch_tokens: int,
        metrics=None,
        threads: int | None = None,
        long_pass_threads: int | None = None,
        pass_context=contextlib.nullcontext,
    ):
        """pass_context: a factory of the context each pass runs in (specdec.runners.attention_kernels)."""
        self.runner = runner
        self.pass_context = pass_context
        self.pool = pool
        self.max_batch_tokens = max_batch_tokens
        self.metrics = metrics
        self.threads = threads
        self.long_pass_threads = long_pass_threads
        self._long_pass_threads = (
            TorchThreads(long_pass_threads, threads)
            if long_pass_threads and long_pass_threads != threads
            else _SAME_THREADS
        )
        self.costs = PassCosts()
        self._queue: list[Feed] = []
        self._task: asyncio.Task | None = None
        self.passes = 0
        self.last_pass_s, self.last_rows = 0.0, 0
        # Sessions whose feed the last pass completed, by when: each is expected back with its next call.
        self._served: dict[str, float] = {}
        self._expected: set[str] = set()
        self._back: asyncio.Event | None = None
        self.turnaround_s: float | None = None  # how long a session takes to call again after its feed is done
        self._seen: dict[str, float] = {}  # session -> when it last called

    def measure(self, widths=(1, 2, 4, 8, 16), context: int = 8) -> None:
        """Seed the cost table with passes of each width, one row for each of that many scratch sessions of
        `context` tokens, so that the first calls already report what a row costs; then it learns online. With CUDA
        graphs these passes run eagerly, and tell the graphs what an eager batch costs (CudaGraphs.in_turn)."""
        graphs = getattr(self.runner, "graphs", None)
        eager = {} if graphs is None else {"plan": self.runner.plan}
        width = max(widths)
        caches = [self.runner.new_cache() for _ in range(width)]
        prompts = [[(i + j) % 7 + 1 for j in range(context)] for i in range(width)]
        self.runner.forward_batch(caches, prompts, [1] * width, **eager)
        for w in widths:
            best = float("inf")
            for _ in range(2):
                start = time.perf_counter()
                with self.pass_context():
                    to_host(self.runner.forward_batch(caches[:w], [[1]] * w, [1] * w, **eager))
                best = min(best, time.perf_counter() - start)
                for c in caches[:w]:
                    self.runner.crop(c, context)
            self.costs.seconds[width_of(w)] = (w, best)
        if graphs is not None:
            graphs.eager.seconds.update(self.costs.seconds)

    # -- what the calls use --------------------------------------------------------
    async def forward(
        self,
        s: Session,
        tokens: list[int],
        num_logits: int,
        scored_only: bool = False,
        features_in: torch.Tensor | None = None,
        norm_rows: int = 0,
    ) -> Feed:
        """Feed tokens to the session in the next passes; the feed, whose logits are those of its last
        num_logits positions as the runner's forward gives them. features_in: a head draft's rows beside the
        tokens; norm_rows: also keep the final-norm rows of the last norm_rows positions (Feed.normed). A session
        that keeps features (Session.features) gets the rows of every token fed, whatever norm_rows. Cancelling
        the caller takes it out of the queue."""
        if not tokens or not 1 <= num_logits <= len(tokens) or not 0 <= norm_rows <= len(tokens):
            raise ValueError(f"a feed of {len(tokens)} tokens cannot give {num_logits} logits, {norm_rows} norms")
        self._start()
        feed = Feed(
            s,
            list(tokens),
            num_logits,
            scored_only,
            asyncio.get_running_loop().create_future(),
            time.perf_counter(),
            features_in=features_in,
            norm_rows=norm_rows,
        )
        self._queue.append(feed)
        self._arrived(s.id, feed.queued_at)
        feed.logits = await feed.future
        return feed

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="specdec-engine")

    async def stop(self) -> None:
        """Fail what still waits with UNAVAILABLE and stop (after the server's grace period)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._fail_waiting(ServiceError(grpc.StatusCode.UNAVAILABLE, "the server is shutting down"))

    def _fail_waiting(self, error: Exception) -> None:
        for feed in self._queue:
            if not feed.future.done():
                feed.future.set_exception(error)
        self._queue.clear()

    # -- the loop ---------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            await self._loop()
        except asyncio.CancelledError:
            raise
        except Exception:  # a defect in the engine itself: fail what waits rather than leave it hanging
            log.exception("the batching engine failed")
            self._fail_waiting(_internal())
            raise

    async def _loop(self) -> None:
        """Pass after pass while calls wait; the task ends when none does, and the next call starts another."""
        while self._queue:
            self._queue = [f for f in self._queue if not f.future.done()]  # cancelled callers
            pieces = plan_pass(self._queue, self.max_batch_tokens)
            pieces = [p for p in pieces if p.feed.scored_only == pieces[0].feed.scored_only]  # one kind a pass
            if (graphs := getattr(self.runner, "graphs", None)) is not None:  # one graph shape a pass, where fixed
                pieces = [p for p, keep in zip(pieces, graphs.one_shape([p.n for p in pieces])) if keep]
            if pieces:
                self._pass(pieces)
                self._queue = [f for f in self._queue if not f.future.done()]
            await self._gather()
            await self._await_returning()

    def active_sessions(self, window_s: float = ACTIVE_WINDOW_S) -> int:
        """Sessions that called within window_s and were not released since."""
        cutoff = time.perf_counter() - window_s
        self._seen = {sid: t for sid, t in self._seen.items() if t >= cutoff}
        return len(self._seen)

    def forget(self, session_id: str) -> None:
        """The session was released: it will not call again."""
        self._seen.pop(session_id, None)
        self._served.pop(session_id, None)
        self._expected.discard(session_id)
        if not self._expected and self._back is not None:
            self._back.set()

    def _arrived(self, session_id: str, now: float) -> None:
        self._seen[session_id] = now
        served = self._served.pop(session_id, None)
        if served is not None:
            self.turnaround_s = costs.ewma(self.turnaround_s, now - served, TURNAROUND_RATE)
        self._expected.discard(session_id)
        if not self._expected and self._back is not None:
            self._back.set()

    async def _await_returning(self) -> None:
        """Wait for the sessions the last pass served to call again, while they are expected soon.

        Each round of a generation crosses the orchestrator between two passes: the answer goes out, the
        accept step runs, the next call comes in. Started at once, the next pass would serve only the sessions
        already back, the rest would wait for the one after, and the batch would split into halves that each
        pay a pass's fixed cost.
        So while the calls come back sooner than splitting the batch would cost (one more pass, less the row it
        would have added to this one, from the measured costs), the engine waits for them, at most that long: a
        window that follows the measured costs, and none where the calls come back slowly (the draft's sessions,
        which return only after a target pass). A session alone waits for nothing: its pass starts as it calls."""
        self._expected = {
            sid for sid in self._served if sid not in {f.session.id for f in self._queue} and sid in self.pool
        }
        # What splitting the batch costs: one more pass, less the row it would have added to this one.
        limit = max(self.costs.at(1)[0] - self.costs.at(self.last_rows)[1], 0.0)
        if not self._expected or self.turnaround_s is None or self.turnaround_s > limit:
            return
        self._back = asyncio.Event()
        try:
            with contextlib.suppress(TimeoutError):  # asyncio.timeout, not wait_for (see orchestrator/link.py)
                async with asyncio.timeout(limit):
                    await self._back.wait()
        finally:
            self._back = None
            self._expected = set()

    async def _gather(self) -> None:
        """Let what arrived during the pass reach the queue before the next one: run the loop until it has
        nothing ready to run (at most GATHER_STEPS steps). A draft's next step is queued at once; a gRPC message
        read while the pass ran takes a few steps from its callback to a handler that queues its tokens."""
        loop = asyncio.get_running_loop()
        for _ in range(GATHER_STEPS):
            await asyncio.sleep(0)
            if not has_ready_callbacks(loop):
                break

    def _pass(self, pieces: list[Piece]) -> None:
        live = []
        for p in pieces:
            s = p.feed.session
            if not self.pool.holds(s):
                self._fail(
                    p.feed,
                    ServiceError(
                        grpc.StatusCode.NOT_FOUND,
                        f"session {s.id!r} was released while its call waited; "
                        "resend the history with expected_length 0",
                    ),
                )
            else:
                live.append(p)
        if not live:
            return
        try:
            self._run_pieces(live)
        except Exception:
            if len(live) == 1:
                self._fail(live[0].feed, _internal())
                return
            log.exception("a batched pass of %d sessions failed; running them one by one", len(live))
            starts = [len(p.feed.session.tokens) for p in live]
            for p, start in zip(live, starts):
                self.runner.crop(p.feed.session.cache, start)
            for p in live:
                try:
                    self._run_pieces([p])
                except Exception:
                    log.exception("the pass of session %s failed", p.feed.session.id)
                    self._fail(p.feed, _internal())

    def _run_pieces(self, pieces: list[Piece]) -> None:
        rows = sum(p.n for p in pieces)
        start = time.perf_counter()
        extra = _feature_arguments(self.runner, pieces)
        with self._long_pass_threads if rows > LONG_PASS_TOKENS else _SAME_THREADS, self.pass_context():
            out = self.runner.forward_batch(
                [p.feed.session.cache for p in pieces],
                [p.feed.tokens[p.feed.done : p.feed.done + p.n] for p in pieces],
                [p.feed.num_logits if p.last else 1 for p in pieces],
                pieces[0].feed.scored_only,
                **extra,
            )
            logits, norms = out if "norm_rows" in extra else (out, [None] * len(pieces))
            logits, norms = to_host(logits), to_host(norms)
        seconds = time.perf_counter() - start
        self.passes += 1
        self.last_pass_s, self.last_rows = seconds, rows
        self._served = {}
        graphs = getattr(self.runner, "graphs", None)  # CUDA graphs learn what passes cost each way
        way = "eager" if graphs is None else graphs.timed([p.n for p in pieces], seconds)
        if way != "captured":
            self.costs.observe(rows, seconds)
        if self.metrics is not None:
            self.metrics.observe_pass(rows, len(pieces), seconds, way)
        for p, last, out, normed in zip(pieces, [p.last for p in pieces], logits, norms):
            f = p.feed
            keeps = f.session.features is not None  # then normed holds every row the piece fed
            f.session.append(f.tokens[f.done : f.done + p.n], normed if keeps else None)
            if normed is not None and (wanted := _norms_wanted(p)):
                f.norms.append(normed[len(normed) - wanted :].float().cpu())
            if f.started_at is None:
                f.started_at = start
                if self.metrics is not None:
                    self.metrics.queue_wait.observe(start - f.queued_at)
            f.done += p.n
            f.compute_s += seconds
            f.last_rows, f.last_sessions = rows, len(pieces)
            if last and not f.future.done():
                f.future.set_result(out)
                self._served[f.session.id] = start + seconds

    def _fail(self, feed: Feed, error: Exception) -> None:
        """The call fails alone; its session, fed part of the way or not, is dropped (the client resends)."""
        self.pool.release(feed.session.id)
        if not feed.future.done():
            feed.future.set_exception(error)
        if feed in self._queue:
            self._queue.remove(feed)


def _norms_wanted(p: Piece) -> int:
    """The piece's rows among its feed's last norm_rows (those the caller keeps in Feed.normed)."""
    return max(0, min(p.n, p.feed.norm_rows - (p.feed.remaining - p.n)))


def _feature_arguments(runner, pieces: list[Piece]) -> dict:
    """What a pass passes the runner beyond tokens: a head's input features of each piece's rows (features_in),
    and how many of each piece's last rows' final-norm output it returns (norm_rows): all of them for a session
    that keeps features (a target's, specdec.features.FeatureStore), else those its feed wants. A pass with
    neither asks for none, so a runner without features serves it unchanged."""
    extra = {}
    if getattr(runner, "mix", None) is not None:
        extra["features_in"] = [
            None if p.feed.features_in is None else p.feed.features_in[p.feed.done : p.feed.done + p.n] for p in pieces
        ]
    wanted = [p.n if p.feed.session.features is not None else _norms_wanted(p) for p in pieces]
    if any(wanted):
        extra["norm_rows"] = wanted
    return extra


class TorchThreads:
    """A context that runs its body on `n` torch threads and goes back to `back` after, an exception included:
    the calling thread's OpenMP team grows and shrinks, and no second team starts. Reusable, so entering it
    allocates nothing."""

    def __init__(self, n: int, back: int):
        self.n, self.back = n, back

    def __enter__(self) -> None:
        torch.set_num_threads(self.n)

    def __exit__(self, *exc) -> None:
        torch.set_num_threads(self.back)


_SAME_THREADS = contextlib.nullcontext()  # a pass that keeps the server's thread count


def has_ready_callbacks(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether the loop has callbacks ready to run at its next step. asyncio offers no public way to ask, so this
    reads BaseEventLoop's queue of ready handles (``_ready``); tests/test_batching.py fails if that changes. A loop
    without it (another implementation) reads as having none."""
    return bool(getattr(loop, "_ready", None))


def _internal() -> ServiceError:
    return ServiceError(grpc.StatusCode.INTERNAL, "the forward pass failed on this server; see its log")
