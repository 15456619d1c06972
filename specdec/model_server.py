"""What the draft and target servers share: a model, its session pool, its batching engine, the session RPCs.

All model and pool work runs on the server's event loop thread, with no hand-off: a hand-off to a worker
thread and back costs two thread wake-ups a call, and a round makes two calls. One thread also keeps one
OpenMP team per process: a second thread that runs one parallel op starts a second team, libgomp then counts
more threads than cores and stops spinning at its barriers, and every forward pass is slower for good
(docs/performance.md, items 5 and 6). So the model loads on the loop thread too.

The calls do not run forward passes themselves: they queue their tokens with the engine (specdec/engine.py),
which runs each pass over the rows of every call waiting, and await their logits. So the server's throughput
grows with the number of sessions, and the loop is free between passes: health checks answer, cancelled
calls leave the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import os
import time
import weakref
from dataclasses import dataclass

import grpc
import numpy as np
import torch
from prometheus_client import CollectorRegistry

from specdec import features, models
from specdec.config import ModelServerConfig
from specdec.engine import MAX_BATCH_TOKENS, Engine, Feed
from specdec.errors import ServiceError, invalid
from specdec.kv_pool import Session, SessionPool
from specdec.memory import kv_capacity
from specdec.prefix_cache import PrefixCache
from specdec.rule_book import RuleBook
from specdec.runners import attention_kernels, make_runner, resolve_forms
from specdec.sampling import SamplingParams, supports
from specdec.server_metrics import ModelServerMetrics
from specdec.v1 import model_server_pb2 as pb

log = logging.getLogger(__name__)

_TORCH_THREADS = torch.get_num_threads()  # torch's default, before any server sets its own


class ModelServer:
    """A loaded model behind a session pool; the servicers call into it."""

    def __init__(self, cfg: ModelServerConfig, model, tokenizer, registry: CollectorRegistry | None = None):
        self.cfg = cfg
        self.vocab_size = len(tokenizer)
        limit = getattr(model.config, "max_position_embeddings", None) or 1 << 20
        self.max_model_len = min(cfg.max_model_len or limit, limit)
        gguf = models.gguf_file(cfg.model)
        self.runner = make_runner(
            model,
            self.vocab_size,
            self.max_model_len,
            cfg.runner,
            cfg.matmul,
            gguf=gguf,
            device=cfg.device,
            **resolve_forms(cfg, model, gguf),
            **cfg.graph_options(),
        )
        on_cpu = self.runner.device.type == "cpu"
        max_batch_tokens = cfg.max_batch_tokens or MAX_BATCH_TOKENS["cpu" if on_cpu else "accelerator"]
        self.max_tokens, self.max_model_len = kv_capacity(
            cfg, self.runner, model.config, max_batch_tokens, self.max_model_len
        )
        self.pool = SessionPool(
            self.runner.new_cache,
            self.runner.crop,
            max_sessions=cfg.max_sessions,
            max_tokens=self.max_tokens,
            max_model_len=self.max_model_len,
            idle_ttl_s=cfg.idle_ttl_s,
        )
        self.head = getattr(model, "specdec_head", None)  # a head draft's HeadInfo (specdec/head.py), else None
        self.feature_size = self._feature_size()
        self.info = self._model_info(model, tokenizer)
        self.registry = registry or CollectorRegistry()
        self.metrics = ModelServerMetrics(self.registry, self.info)
        self.metrics.sessions_capacity.set(cfg.max_sessions)
        self.metrics.tokens_capacity.set(self.max_tokens)
        self.threads = torch.get_num_threads()  # ModelServer.load set cfg.threads
        beside = not on_cpu or self.threads < (os.cpu_count() or 1)  # a core the passes leave free for the masks
        self.rules = RuleBook(tokenizer, self.vocab_size, self.info.eos_token_ids, self.metrics, beside)
        prefill_threads = (cfg.prefill_threads or _TORCH_THREADS) if on_cpu else self.threads
        self.engine = Engine(
            self.runner,
            self.pool,
            max_batch_tokens,
            self.metrics,
            self.threads,
            prefill_threads,
            functools.partial(attention_kernels, self.runner.device, cfg.strict_attention),
        )
        self.metrics.queued.set_function(lambda: self.engine.waiting)
        self.prefix = self._prefix_cache()
        self.metrics.prefix_tokens.set_function(lambda: len(self.prefix) if self.prefix is not None else 0)
        self.engine.measure()  # what a row costs at each width, before the first call asks
        self._stopping: asyncio.Future | None = None  # set by begin_shutdown; ends idle streams
        self.draining = False

    def _prefix_cache(self) -> PrefixCache | None:
        """The prefix cache, where the runner is batch-invariant and the model reads no features (a head's keys and
        values depend on the features it was fed, which the cache's keys do not name)."""
        cfg = self.cfg
        if cfg.prefix_cache_tokens and getattr(self.runner, "batch_invariant", False) and not self.reads_features:
            return PrefixCache(self.runner, cfg.prefix_cache_tokens)
        return None

    def _model_info(self, model, tokenizer) -> pb.ModelInfo:
        """What GetModelInfo reports that does not change while the server runs."""
        cfg, runner = self.cfg, self.runner
        strict = cfg.strict_attention and runner.device.type != "cpu"
        return pb.ModelInfo(
            model=cfg.model,
            vocab_size=self.vocab_size,
            tokenizer_fingerprint=models.tokenizer_fingerprint(tokenizer),
            eos_token_ids=models.eos_token_ids(model, tokenizer),
            max_model_len=self.max_model_len,
            max_sessions=cfg.max_sessions,
            max_tokens=self.max_tokens,
            max_draft_tokens=cfg.max_draft_tokens,
            dtype=str(runner.dtype).removeprefix("torch."),
            device=str(runner.device),
            forward=(f"EAGLE-1 head over {self.head.target}; " if self.head else "")
            + runner.describe()
            + ("; attention held to the fused SDPA kernels" if strict else ""),
            feature_size=self.feature_size,
            feature_fingerprint=(
                self.head.feature_fingerprint
                if self.head
                else features.fingerprint(model.get_output_embeddings().weight)
                if self.feature_size
                else ""
            ),
            reads_features=self.reads_features,
            numerics=runner.numerics,
        )

    def _feature_size(self) -> int:
        """Values in a feature row: those a head reads, or those a target's runner computes and returns
        (Verify.return_features, GetFeatures); 0 for a standalone draft and a runner without features."""
        if self.head is not None:
            return self.head.feature_size
        return getattr(self.runner, "feature_size", 0) if self.cfg.role == "target" else 0

    @property
    def reads_features(self) -> bool:
        return self.head is not None

    @classmethod
    def load(cls, cfg: ModelServerConfig, registry: CollectorRegistry | None = None) -> ModelServer:
        """Load on the calling thread, which must be the loop's: it runs every forward pass (see the module)."""
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        t = time.monotonic()
        tokenizer = models.load_tokenizer(cfg.model)
        # on the CPU first: the runner fuses its matrices there and moves each to the device once
        model = models.load_model(cfg.model, models.resolve_dtype(cfg.dtype, cfg.device), "cpu")
        log.info("%s: loaded %s in %.1f s", cfg.role, cfg.model, time.monotonic() - t)
        return cls(cfg, model, tokenizer, registry)

    # -- plumbing ------------------------------------------------------------
    async def call(self, method: str, fn, request, context: grpc.aio.ServicerContext):
        """Serve fn(request), a function or a coroutine function; a ServiceError becomes its status."""
        start = time.perf_counter()
        try:
            response = fn(request)
            if inspect.isawaitable(response):
                response = await response
            return response
        except ServiceError as e:
            self.metrics.rpc_errors.labels(method, e.code.name).inc()
            await context.abort(e.code, e.message)
        except Exception:
            self.metrics.rpc_errors.labels(method, "INTERNAL").inc()
            log.exception("%s failed", method)
            await context.abort(grpc.StatusCode.INTERNAL, f"{method} failed on the {self.cfg.role} server; see its log")
        finally:
            self.metrics.rpc_seconds.labels(method).observe(time.perf_counter() - start)
            self._update_pool_metrics()

    async def stream(self, method: str, fn, requests, context: grpc.aio.ServicerContext):
        """Serve a stream of requests in order, each as ``call`` serves one; an error ends the stream.

        A stream lives as long as a generation, so shutdown must not wait for it: between two
        requests it ends with UNAVAILABLE as soon as ``begin_shutdown`` runs, and the client
        reconnects elsewhere or waits for the restart as it would for a unary call."""
        if self._stopping is None:
            self._stopping = asyncio.get_running_loop().create_future()
        pending = requests.__aiter__()
        while True:
            nxt = asyncio.ensure_future(pending.__anext__())
            nxt.add_done_callback(_consume)  # a client that cancels leaves it to end unread
            await asyncio.wait((nxt, self._stopping), return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():
                nxt.cancel()
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"the {self.cfg.role} server is shutting down")
            try:
                request = nxt.result()
            except StopAsyncIteration:
                return
            yield await self.call(method, fn, request, context)

    def begin_shutdown(self) -> None:
        """End the open streams between requests (see ``stream``); report draining (ModelInfo.draining)."""
        self.draining = True
        if self._stopping is not None and not self._stopping.done():
            self._stopping.set_result(None)

    def _update_pool_metrics(self) -> None:
        self.metrics.sessions.set(len(self.pool))
        self.metrics.tokens.set(self.pool.tokens_in_use)

    def expire_idle(self) -> None:
        n = self.pool.expire_idle()
        if n:
            self.metrics.sessions_expired.inc(n)
            self._update_pool_metrics()

    # -- shared pieces of the model RPCs ---------------------------------------
    def sampling(self, p: pb.SamplingParams) -> SamplingParams:
        if p.temperature < 0 or not 0 < p.top_p <= 1 or not 0 <= p.min_p <= 1:
            raise invalid(f"temperature >= 0, top_p in (0, 1], min_p in [0, 1]: {p.temperature}, {p.top_p}, {p.min_p}")
        return SamplingParams(p.temperature, p.top_p, p.top_k, p.seed, p.min_p)

    def check_tokens(self, ids) -> list[int]:
        ids = list(ids)
        bad = [t for t in ids if t >= self.vocab_size]
        if bad:
            raise invalid(f"token id {bad[0]} is outside the vocabulary of {self.vocab_size}")
        return ids

    @contextlib.contextmanager
    def session(self, cursor: pb.SessionCursor, n_new: int, keep_features: bool = False):
        """The cursor's session, positioned and holding room for n_new tokens, for one call: another call on it
        meanwhile is ABORTED. If the call fails or is cancelled after feeding part of its tokens, or created the
        session, the session is dropped (the client resends the history): a partial feed serves no one, and a
        session created by a cancelled call would wait out its idle time unreleased, since its client may have sent
        its ReleaseSession before the call came through.
        keep_features: the call wants features; a session it creates keeps them from its first token on."""
        if keep_features and not self.feature_size:
            raise ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this {self.cfg.role} server returns no features (ModelInfo.feature_size 0: "
                f"runner {self.runner.describe()!r}); call without return_features",
            )
        sid = cursor.session_id
        if keep_features and cursor.expected_length and sid in self.pool and self.pool.lookup(sid).features is None:
            raise ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"session {sid!r} was created without return_features and kept no features; "
                "resend the history with expected_length 0 and return_features",
            )
        s = self.pool.open(sid, cursor.expected_length, cursor.keep_length)
        if keep_features and cursor.expected_length == 0:
            s.features = features.FeatureStore(self.feature_size)
        try:
            self.pool.reserve(s, n_new)
        except ServiceError:
            if cursor.expected_length == 0:  # do not keep an empty session the call just created
                self.pool.release(s.id)
            raise
        length = len(s.tokens)
        s.begin_call()
        try:
            yield s
        except BaseException:
            if len(s.tokens) != length or cursor.expected_length == 0:  # a partial feed, or a session it created
                self.pool.release(s.id)
            raise
        finally:
            s.end_call()

    async def forward(self, s: Session, token_ids: list[int], num_logits: int, stats: CallStats, **kw) -> torch.Tensor:
        """Feed tokens to the session in the engine's next passes; [num_logits, vocab] logits, or
        [num_logits, len(runner.scored_ids)] with scored_only (see the runners). A new session first takes the
        longest prefix of its tokens the prefix cache holds (with their features, for a session that keeps
        them), and leaves its own blocks there. A session that keeps features gets a row for every token fed
        (Session.features). A failed pass drops the session. Keywords: ``feed``'s (scored_only, features_in, norm_rows)."""
        return (await self.feed(s, token_ids, num_logits, stats, **kw)).logits

    async def feed(
        self,
        s: Session,
        token_ids: list[int],
        num_logits: int,
        stats: CallStats,
        scored_only: bool = False,
        features_in: torch.Tensor | None = None,
        norm_rows: int = 0,
    ) -> Feed:
        """``forward``'s feed, whose ``normed`` holds the final-norm rows of its last norm_rows positions (a
        head's predicted feature); features_in: a head draft's rows beside the tokens."""
        fresh = not s.tokens and self.prefix is not None
        if fresh and (n := self.prefix.attach(s.cache, token_ids, len(token_ids) - num_logits, s.features)):
            s.append(token_ids[:n])
            token_ids = token_ids[n:]
            self.metrics.prefix_hits.inc(n)
        feed = await self.engine.forward(s, token_ids, num_logits, scored_only, features_in, norm_rows)
        stats.add(feed)
        if fresh:
            self.prefix.store(s.cache, s.tokens, s.features)
        return feed

    def sparse_rows(self, probs: torch.Tensor) -> list[pb.SparseDistribution]:
        """sparse() of each row of probs [n, vocab], a support past the limit not built; in numpy, as a torch op over
        a row between passes would wake the idle OpenMP threads (docs/performance.md, item 35). A row's nonzero count
        is its int32 bits' (5x quicker than over floats or along an axis; a -0.0 could only send a row wide)."""
        fits = [np.count_nonzero(row) <= self.cfg.max_sparse_support for row in probs.numpy().view(np.int32)]
        wide = pb.SparseDistribution(complete=False)
        return [self.sparse(supports(probs[i : i + 1])[0]) if f else wide for i, f in enumerate(fits)]

    def sparse(self, found: tuple[np.ndarray, np.ndarray]) -> pb.SparseDistribution:
        """A distribution's support (sampling.support) on the wire, or complete=False past max_sparse_support."""
        ids, probs = found
        if len(ids) > self.cfg.max_sparse_support:
            return pb.SparseDistribution(complete=False)
        return pb.SparseDistribution(token_ids=ids.tolist(), probs=probs.tolist(), complete=True)

    # -- session RPCs, identical on both servers ---------------------------------
    def truncate(self, req: pb.TruncateRequest) -> pb.TruncateResponse:
        s = self.pool.get(req.session_id, req.expected_length)
        if req.length > req.expected_length:
            raise invalid(f"length {req.length} exceeds expected_length {req.expected_length}")
        self.pool.truncate(s, req.length)
        return pb.TruncateResponse(length=len(s.tokens))

    def release(self, req: pb.ReleaseSessionRequest) -> pb.ReleaseSessionResponse:
        self.engine.forget(req.session_id)
        return pb.ReleaseSessionResponse(released=self.pool.release(req.session_id))

    def get_distribution(self, req: pb.GetDistributionRequest) -> pb.GetDistributionResponse:
        s = self.pool.lookup(req.session_id)
        if req.token_ids:  # a rejection's candidates: their probabilities only
            at = s.kept_row(req.position, self.vocab_size, np.asarray(self.check_tokens(req.token_ids)))
            return pb.GetDistributionResponse(token_probs_f32=at.astype("<f4").tobytes())
        return pb.GetDistributionResponse(probs_f32=s.kept_row(req.position, self.vocab_size).astype("<f4").tobytes())

    def model_info(self, req) -> pb.ModelInfo:
        info = pb.ModelInfo()
        info.CopyFrom(self.info)
        info.pass_costs.extend(
            pb.PassCost(rows=round(rows), seconds=seconds) for rows, seconds in self.engine.costs.curve()
        )
        info.sessions_in_use, info.tokens_in_use = len(self.pool), self.pool.tokens_in_use
        info.draining = self.draining
        return info


@dataclass
class CallStats:
    """What a call's feeds cost, for its response: compute_seconds and BatchInfo."""

    engine: Engine
    compute_s: float = 0.0
    queue_s: float | None = None
    last: Feed | None = None

    def add(self, feed: Feed) -> None:
        """A feed of the call's (a run's steps are several): its compute and queue wait add up."""
        self.compute_s += feed.compute_s
        self.queue_s = (self.queue_s or 0.0) + (feed.started_at or feed.queued_at) - feed.queued_at
        self.last = feed

    def fill(self, response) -> None:
        response.compute_seconds = self.compute_s
        if self.last is not None:
            response.batch.CopyFrom(
                pb.BatchInfo(
                    queue_seconds=self.queue_s,
                    rows=self.last.last_rows,
                    sessions=self.last.last_sessions,
                    active_sessions=self.engine.active_sessions(),
                )
            )


def _consume(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


class SessionRpcs:
    """The RPCs both servicers expose unchanged; subclasses set ``self.core``."""

    core: ModelServer

    async def Truncate(self, request, context):
        return await self.core.call("Truncate", self.core.truncate, request, context)

    async def ReleaseSession(self, request, context):
        return await self.core.call("ReleaseSession", self.core.release, request, context)

    async def GetDistribution(self, request, context):
        return await self.core.call("GetDistribution", self.core.get_distribution, request, context)

    async def GetModelInfo(self, request, context):
        return await self.core.call("GetModelInfo", self.core.model_info, request, context)


async def _expire_idle_forever(core: weakref.ref, every_s: float = 5.0) -> None:
    """Expire idle sessions every every_s seconds, for as long as the server's core lives: the loop holds it weakly,
    so a core whose server has stopped is freed (with its weights) and the loop ends."""
    while True:
        await asyncio.sleep(every_s)
        if (alive := core()) is None:
            return
        alive.expire_idle()
        del alive


async def start_model_server(core: ModelServer, services: list[tuple], host: str, port: int):
    """Bind, start and mark serving; returns (server, bound port, health servicer, expiry task)."""
    from specdec.server import create_server, mark_serving, server_credentials

    server, bound, health_servicer = create_server(f"{host}:{port}", services, credentials=server_credentials(core.cfg))
    await server.start()
    await mark_serving(health_servicer, [name for _, _, name in services])
    expiry = asyncio.create_task(_expire_idle_forever(weakref.ref(core)))
    log.info("%s service (%s) listening on %s:%d", core.cfg.role, core.cfg.model, host, bound)
    return server, bound, health_servicer, expiry


async def run_model_server(cfg: ModelServerConfig, make_services) -> None:
    """Load the model, serve until SIGTERM/SIGINT, drain, exit. make_services(core) -> [(add_fn, servicer, name)]."""
    from specdec.server import serve, start_health_server, start_metrics

    registry = CollectorRegistry()
    core = ModelServer.load(cfg, registry)
    start_metrics(cfg.metrics_port, registry)
    server, _, health_servicer, expiry = await start_model_server(core, make_services(core), cfg.host, cfg.port)
    health_server = await start_health_server(cfg.host, cfg.health_port, health_servicer)

    async def on_stop():
        expiry.cancel()
        if health_server is not None:
            await health_server.stop(0)
        await core.engine.stop()

    await serve(server, health_servicer, cfg.grace_s, on_stop, on_draining=core.begin_shutdown)
