"""Generate: validate, tokenize, run the loop, stream; free the sessions however it ends."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import math
import secrets
import time
import uuid

import grpc

from orchestrator import choices, tools as tooling
from orchestrator.admission import Admission, KvShare
from orchestrator.generation import Generation
from orchestrator.metrics import OrchestratorMetrics
from orchestrator.replicas import ReplicaSet
from orchestrator.rules import RuleChecker
from orchestrator.spec import GenerationSpec
from orchestrator.speculation import Speculation
from specdec.config import OrchestratorConfig
from specdec.errors import ServiceError, invalid
from specdec.logprobs import MAX_TOP_LOGPROBS
from specdec.sampling import SamplingParams
from specdec.v1 import generation_pb2 as gen_pb, generation_pb2_grpc

log = logging.getLogger(__name__)

REPORT_EVERY_S = 1.0  # how often the replicas' reports are fetched: their load, and the pass costs speculation prices


def bearer_matches(header: str, key: str) -> bool:
    """Whether an Authorization header ("Bearer KEY") carries key; compared in constant time."""
    token = header[7:] if header.startswith("Bearer ") else ""
    return hmac.compare_digest(token.encode(), key.encode())


def capacity(cfg: OrchestratorConfig, draft: ReplicaSet, target: ReplicaSet) -> tuple[int, int] | None:
    """Generations and KV tokens admitted at once: what the replicas up hold between them (a generation needs a
    target session, and a draft one while a draft replica is up), or --max-concurrent-requests generations;
    None while no target replica has reported."""
    t, d = target.capacity(), draft.capacity()
    if t is None:
        return None
    slots, tokens = (min(t[0], d[0]), min(t[1], d[1])) if d else t
    return cfg.max_concurrent_requests or slots, tokens


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(
        self,
        cfg: OrchestratorConfig,
        tokenizer,
        draft: ReplicaSet,
        target: ReplicaSet,
        eos_ids: set[int],
        max_model_len: int,
        metrics: OrchestratorMetrics,
        admission: Admission,
    ):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.tool_format = tooling.format_of(tokenizer)  # how tools go in the prompt, and calls come out
        self.draft = draft
        self.target = target
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.metrics = metrics
        # round costs and alpha, learned from every request's rounds, where adaptive speculation uses them
        self.speculation = Speculation() if cfg.adaptive_speculation else None
        self._releases: set[asyncio.Task] = set()  # background calls: sessions' releases
        self._watch: asyncio.Task | None = None
        self._exported: dict[str, set[str]] = {}  # role -> replicas whose gauges are exported
        self.http = None  # the OpenAI-compatible API's runner, where it is served (orchestrator/app.py)
        self.admission = admission
        self.rules = RuleChecker(tokenizer, eos_ids)  # output rules, checked as the model servers check them
        metrics.waiting.set_function(lambda: admission.waiting)

    def build_spec(self, req: gen_pb.GenerateRequest) -> GenerationSpec:
        """The request checked field by field; raises INVALID_ARGUMENT or OUT_OF_RANGE."""
        cfg = self.cfg
        if bool(req.prompt) + bool(req.messages) + bool(req.prompt_token_ids) != 1:
            raise invalid("set exactly one of prompt (non-empty text), messages and prompt_token_ids")
        temperature, top_p, top_k, min_p = self._sampling_fields(req)
        k, adaptive, confidence, lookup_min = self._speculation_fields(req)
        if req.HasField("max_tokens") and req.max_tokens < 1:
            raise invalid("max_tokens must be at least 1")
        if len(req.stop) > cfg.max_stop_strings or any(not s for s in req.stop):
            raise invalid(f"stop takes at most {cfg.max_stop_strings} non-empty strings")
        for m in req.messages:
            if not m.role:
                raise invalid("every message needs a role (system, user or assistant)")
        vocab = len(self.tokenizer)
        if len(req.stop_token_ids) > cfg.max_stop_strings or any(t >= vocab for t in req.stop_token_ids):
            raise invalid(f"stop_token_ids takes at most {cfg.max_stop_strings} token ids below {vocab}")
        if req.top_logprobs > MAX_TOP_LOGPROBS or (req.top_logprobs and not req.logprobs):
            raise invalid(f"top_logprobs takes 0 to {MAX_TOP_LOGPROBS} alternatives, and needs logprobs")
        if req.n > cfg.max_choices:
            raise invalid(f"n takes 1 to {cfg.max_choices} choices (--max-choices), got {req.n}")
        ids = self._tokenize(req)
        if not ids:
            raise invalid("the prompt encodes to no tokens")
        max_tokens = self._max_tokens(req, len(ids))
        seed = req.seed if req.HasField("seed") else secrets.randbits(63)
        rules = self.rules.of(req, len(ids))
        return GenerationSpec(
            ids,
            max_tokens,
            SamplingParams(temperature, top_p, top_k, seed, min_p),
            k,  # adaptive K chooses within 0..k
            list(req.stop),
            min_confidence=confidence,
            lookup=(lookup_min, cfg.prompt_lookup_max),
            speculate_first_round=cfg.speculate_first_round,
            steps=cfg.steps_per_call,
            adaptive=adaptive,
            ignore_eos=req.ignore_eos,
            stop_ids=frozenset(req.stop_token_ids),
            logprobs=req.top_logprobs if req.logprobs else None,
            rules=rules,
            grammar=self.rules.grammar(rules) if lookup_min else None,
            prompt_logprobs=req.echo and req.logprobs,
        )

    def choice_specs(self, spec: GenerationSpec, n: int) -> list[GenerationSpec]:
        """The spec of each of a request's n choices (orchestrator/choices.py): choice i seeded from (seed, i), with
        its own grammar state; only choice 0 asks the target for the prompt's logprobs, which all of them echo."""
        return [spec] + [
            dataclasses.replace(
                spec,
                sampling=dataclasses.replace(spec.sampling, seed=choices.choice_seed(spec.sampling.seed, i)),
                grammar=self.rules.grammar(spec.rules) if spec.grammar is not None else None,
                prompt_logprobs=False,
            )
            for i in range(1, n)
        ]

    def _sampling_fields(self, req: gen_pb.GenerateRequest) -> tuple[float, float, int, float]:
        """temperature, top_p, top_k and min_p, the request's or the defaults; raises INVALID_ARGUMENT."""
        cfg = self.cfg
        temperature = req.temperature if req.HasField("temperature") else cfg.temperature
        top_p = req.top_p if req.HasField("top_p") else cfg.top_p
        top_k = req.top_k if req.HasField("top_k") else cfg.top_k
        if not (math.isfinite(temperature) and temperature >= 0):
            raise invalid(f"temperature must be a finite number >= 0 (0 is greedy), got {temperature}")
        if not (math.isfinite(top_p) and 0 < top_p <= 1):
            raise invalid(f"top_p must be in (0, 1], got {top_p}")
        if top_k < 0:
            raise invalid(f"top_k must be >= 0 (0 disables it), got {top_k}")
        if not (math.isfinite(req.min_p) and 0 <= req.min_p <= 1):
            raise invalid(f"min_p must be in [0, 1] (0 disables it), got {req.min_p}")
        return temperature, top_p, top_k, req.min_p

    def _speculation_fields(self, req: gen_pb.GenerateRequest) -> tuple[int, bool, float, int]:
        """K, whether adaptive speculation may change it, the draft's confidence threshold and prompt lookup's
        minimum match, the request's or the defaults; raises INVALID_ARGUMENT."""
        cfg = self.cfg
        k = req.num_speculative_tokens if req.HasField("num_speculative_tokens") else cfg.num_speculative_tokens
        adaptive = cfg.adaptive_speculation and not req.HasField("num_speculative_tokens")  # a K asked for is kept
        confidence = (
            req.draft_confidence_threshold
            if req.HasField("draft_confidence_threshold")
            else cfg.draft_confidence_threshold
        )
        lookup_min = req.prompt_lookup_min if req.HasField("prompt_lookup_min") else cfg.prompt_lookup_min
        if not 0 <= k <= cfg.max_speculative_tokens:
            raise invalid(f"num_speculative_tokens must be within [0, {cfg.max_speculative_tokens}], got {k}")
        if not 0 <= confidence < 1:
            raise invalid(f"draft_confidence_threshold must be in [0, 1), got {confidence}")
        if lookup_min > cfg.prompt_lookup_max:
            raise invalid(
                f"prompt_lookup_min must be within [0, {cfg.prompt_lookup_max}] (0 turns it off), got {lookup_min}"
            )
        return k, adaptive, confidence, lookup_min

    def _max_tokens(self, req: gen_pb.GenerateRequest, prompt_len: int) -> int:
        """The tokens to generate: the request's max_tokens if the context holds them after the prompt, else the
        default cut to the room left; raises OUT_OF_RANGE."""
        room = self.max_model_len - prompt_len
        if req.HasField("max_tokens"):
            if req.max_tokens > room:
                raise ServiceError(
                    grpc.StatusCode.OUT_OF_RANGE,
                    f"prompt ({prompt_len} tokens) plus max_tokens ({req.max_tokens}) exceeds the "
                    f"context length {self.max_model_len}; shorten one of them",
                )
            return req.max_tokens
        if room < 1:
            raise ServiceError(
                grpc.StatusCode.OUT_OF_RANGE,
                f"prompt ({prompt_len} tokens) leaves no room in the context length {self.max_model_len}",
            )
        return room if req.run_to_context_end else min(self.cfg.max_tokens, room)

    def _tokenize(self, req: gen_pb.GenerateRequest) -> list[int]:
        if req.prompt_token_ids:
            if max(req.prompt_token_ids) >= (vocab := len(self.tokenizer)):
                raise invalid(f"prompt_token_ids must be below the vocabulary's size, {vocab}")
            return list(req.prompt_token_ids)
        if req.prompt:
            return self.encode(req.prompt)
        return self.encode(messages=req.messages, tools=tooling.openai_tools(req))

    def encode(
        self, prompt: str | None = None, messages=None, add_generation_prompt: bool = True, tools: list | None = None
    ) -> list[int]:
        """The token ids of a raw prompt, or of messages (ChatMessages or (role, content) pairs) and tools through
        the chat template (orchestrator/tools.py); raises INVALID_ARGUMENT where the model has no template or the
        template refuses the conversation."""
        if prompt is not None:
            return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        if not getattr(self.tokenizer, "chat_template", None):
            raise invalid("this model has no chat template; send a raw prompt instead of messages")
        chat, keywords = tooling.template_input(messages, tools or [], self.tool_format)
        try:
            out = self.tokenizer.apply_chat_template(
                chat, add_generation_prompt=add_generation_prompt, return_dict=True, **keywords
            )
        except Exception as e:  # the template rejects the conversation (roles out of order...)
            raise invalid(f"the chat template rejected the messages: {e}") from None
        return list(out["input_ids"])

    async def Generate(self, request, context):
        if self.cfg.api_key and not bearer_matches(
            dict(context.invocation_metadata() or ()).get("authorization", ""), self.cfg.api_key
        ):
            self.metrics.request_errors.labels("UNAUTHENTICATED").inc()
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "a valid API key is required: send the metadata authorization: Bearer <key>",
            )
        async with contextlib.aclosing(self.stream(request)) as messages:
            try:
                async for msg in messages:
                    yield msg
            except ServiceError as e:
                await context.abort(e.code, e.message)

    async def stream(self, request: gen_pb.GenerateRequest):
        """One request's generation as the messages its client gets, each choice's last with its stats; the gRPC
        handler and the OpenAI-compatible endpoint (orchestrator/openai_compat/) both serve it. Raises ServiceError
        with the status the client should see (INTERNAL for a defect, whose traceback goes to the log). Every request
        is counted once, finished (with choice 0's finish reason) or errored; its sessions are freed on both servers
        however it ends."""
        arrived = time.perf_counter()
        m = self.metrics
        spec, gens = await self._admit(request)
        m.active.inc()
        m.prompt_tokens.inc(len(spec.prompt_ids))
        last: list[float | None] = [None] * len(gens)
        finished = [False] * len(gens)
        try:
            async with contextlib.aclosing(choices.interleave(gens, self._release)) as messages:
                async for i, msg in messages:
                    gen, now = gens[i], time.perf_counter()
                    if last[i] is None:
                        gen.stats.time_to_first_token_seconds = now - arrived
                        m.ttft.observe(now - arrived)
                        if request.echo:
                            msg.prompt_token_ids.extend(spec.prompt_ids)
                            msg.prompt_logprobs.extend(gens[0].prompt_logprobs or ())
                    else:
                        m.inter_token.observe(now - last[i])
                    last[i], msg.index = now, i
                    if msg.HasField("stats"):
                        msg.stats.time_to_first_token_seconds = gen.stats.time_to_first_token_seconds
                        msg.stats.total_seconds = now - arrived
                        finished[i] = True
                        if all(finished):
                            m.requests.labels(gen_pb.FinishReason.Name(gens[0].stats.finish_reason)).inc()
                        m.request_acceptance.observe(msg.stats.acceptance_rate)
                    yield msg
        except ServiceError as e:
            m.request_errors.labels(e.code.name).inc()
            raise
        except Exception:  # a defect, not the request's fault: the client gets INTERNAL, the log the traceback
            m.request_errors.labels("INTERNAL").inc()
            log.exception("Generate failed")
            raise ServiceError(
                grpc.StatusCode.INTERNAL, "the generation failed on the orchestrator; see its log"
            ) from None
        except (asyncio.CancelledError, GeneratorExit):
            # The client went away: its handler is cancelled at an await, or this generator closed at a yield
            # (GeneratorExit) when the client cancels while a message is on its way.
            if not all(finished):
                m.request_errors.labels("CANCELLED").inc()
            raise
        finally:
            m.active.dec()

    async def _admit(self, request: gen_pb.GenerateRequest) -> tuple[GenerationSpec, list[Generation]]:
        """The request checked and its choices' generations set up, once admission gave them their slots and first
        KV tokens, all at once (given back by ``_release``); a request refused or cancelled while in line is
        counted as an error."""
        m = self.metrics
        try:
            tooling.enforce(request, self.tool_format)  # a required tool call becomes the request's grammar
            spec = self.build_spec(request)
            prompt = len(spec.prompt_ids)
            cap = min(prompt + spec.max_tokens + spec.k, self.max_model_len)
            if request.HasField("max_tokens"):  # asked for more than the pools could ever hold: refused now
                self.admission.check(cap)
            gens = [
                Generation(
                    s,
                    uuid.uuid4().hex,
                    self.draft,
                    self.target,
                    self.tokenizer,
                    self.eos_ids,
                    self.max_model_len,
                    m,
                    self.cfg,
                    self.speculation,
                    KvShare(self.admission, prompt, cap, spec.k, self.cfg.kv_reserve_tokens),
                )
                for s in self.choice_specs(spec, max(request.n, 1))
            ]
            await KvShare.enter_all([g.kv for g in gens])  # given back once each generation's sessions are freed
        except ServiceError as e:
            m.request_errors.labels(e.code.name).inc()
            raise
        except asyncio.CancelledError:  # the client left, or its deadline passed, while it waited in line
            m.request_errors.labels("CANCELLED").inc()
            raise
        return spec, gens

    def _release(self, gen: Generation) -> None:
        """Free the generation's sessions on both servers in the background, then give its KV tokens back."""
        task = asyncio.ensure_future(gen.release())  # survives the cancellation of this handler
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)
        task.add_done_callback(lambda _: gen.kv.leave())  # once both servers freed the sessions

    def start(self) -> None:
        """Watch the replicas in the background (``watch``) until ``close``."""
        self._watch = asyncio.ensure_future(self.watch())

    async def watch(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:
                log.exception("refreshing the replicas failed")
            await asyncio.sleep(REPORT_EVERY_S)

    async def refresh(self) -> None:
        """Fetch every replica's report: which are up and how loaded (placement), how many sessions they have
        between them (admission), and what their passes cost (adaptive speculation)."""
        await asyncio.gather(self.draft.refresh(), self.target.refresh())
        m = self.metrics
        for replicas in (self.draft, self.target):
            for address in self._exported.get(replicas.role, set()) - set(replicas.replicas):
                for gauge in (m.replica_up, m.replica_sessions):  # gone from DNS and left by its generations
                    with contextlib.suppress(KeyError):
                        gauge.remove(replicas.role, address)
            self._exported[replicas.role] = set(replicas.replicas)
            for r in replicas:
                m.replica_seen(replicas.role, r.address)
                m.replica_up.labels(replicas.role, r.address).set(1 if r.up and not r.gone else 0)
                if r.info is not None:
                    m.replica_sessions.labels(replicas.role, r.address).set(r.info.sessions_in_use)
        if (held := capacity(self.cfg, self.draft, self.target)) is not None:
            self.admission.resize(*held)
        if self.speculation is not None:
            curves = [self._curve(replicas) for replicas in (self.target, self.draft)]
            if all(curves):
                self.speculation.costs.set_curves(*curves)

    @staticmethod
    def _curve(replicas: ReplicaSet) -> list[tuple[int, float]]:
        """The pass costs of the least-loaded replica up (all run the same model)."""
        up = [r for r in replicas.placeable() if r.info.pass_costs]
        if not up:
            return []
        r = min(up, key=lambda r: r.load())
        return [(p.rows, p.seconds) for p in r.info.pass_costs]

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        await self.drain_releases()
        await asyncio.gather(self.draft.close(), self.target.close())

    async def drain_releases(self) -> None:
        if self._releases:
            await asyncio.gather(*self._releases, return_exceptions=True)
