"""A generation's link to one role's model server: the replica its session lives on, the stream to it, and a
mirror of the tokens that session holds.

The orchestrator holds the truth, the token history; a session is a cache of it. The mirror tells every call
where the session stands and how far to roll it back (``cursor``), and an empty mirror makes the next call
resend the history. Binding, rebinding and forgetting happen here and nowhere else; when to do them is
orchestrator/failover.py's.

A round's ProposeTokens or Verify rides one bidirectional stream per generation and server (``Duplex``): one
message each way on a warm stream instead of a new call with its own set-up. ``Unary`` gives the same interface
over unary calls, where --rpc-streams is off.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from orchestrator.clients import ModelClient, rpc_error
from orchestrator.failover import broken_stream
from orchestrator.metrics import OrchestratorMetrics
from orchestrator.replicas import Replica, ReplicaSet, Role
from specdec.config import OrchestratorConfig
from specdec.prefix_cache import common_prefix
from specdec.v1 import model_server_pb2 as ms_pb

log = logging.getLogger(__name__)

_METHODS = {Role.DRAFT: ("ProposeTokensStream", "ProposeTokens"), Role.TARGET: ("VerifyStream", "Verify")}


class Link:
    def __init__(
        self, role: Role, replicas: ReplicaSet, session_id: str, cfg: OrchestratorConfig, metrics: OrchestratorMetrics
    ):
        self.role = role
        self.replicas = replicas
        self.session_id = session_id
        self.cfg = cfg
        self.metrics = metrics
        self.replica: Replica | None = None  # where the session lives; None: unbound
        self.stream: Duplex | Unary | None = None
        self.mirror: list[int] = []  # the tokens the session holds; empty: the next call resends the history
        self.hosts: set[Replica] = set()  # every replica that may hold the session, to free it on all
        self.resting_until = 0.0  # a full draft refused the generation: its rounds run on the target alone until then
        self._failed_at: float | None = None  # when the replica failed a call, until the next answered one

    def bind(self, replica: Replica) -> None:
        """Move the session to replica: a fresh stream there, and an empty mirror (the history is resent)."""
        if self.replica is replica:
            return
        self.unbind()
        replica.placed += 1
        self.replica = replica
        self.hosts.add(replica)
        streamed, unary = _METHODS[self.role]
        self.stream = Duplex(replica.client, streamed) if self.cfg.rpc_streams else Unary(replica.client, unary)
        self.forget()
        self.metrics.replica_generations.labels(self.role, replica.address).inc()

    def unbind(self) -> None:
        """Leave the replica: its stream closes, and it counts one generation less."""
        if self.replica is not None:
            self.replica.placed -= 1
            self.stream.close()
            self.replica = None

    def switch(self, new: Replica, why: str) -> None:
        """Go on at another replica, counting a failover off the one it leaves."""
        old = self.replica
        if new is old:
            return
        if old is not None:
            log.info(
                "generation %s: %s replica %s %s; going on at %s",
                self.session_id,
                self.role,
                old.address,
                why,
                new.address,
            )
            self.metrics.replica_failovers.labels(self.role, old.address).inc()
        self.bind(new)

    def rebuild(self) -> None:
        """The replica lost the session: the next call resends the history there."""
        self.metrics.rebuilds.labels(self.role).inc()
        self.metrics.replica_rebuilds.labels(self.role, self.replica.address).inc()
        self.forget()

    def forget(self) -> None:
        """The session is gone or moved: the next call resends the history."""
        self.mirror = []

    def failed(self) -> None:
        """The replica failed a call: the time to recover counts from the first failure."""
        if self._failed_at is None:
            self._failed_at = time.perf_counter()

    def answered(self) -> None:
        """A call was answered: a recovery in progress ends."""
        if self._failed_at is not None:
            self.metrics.failover_seconds.labels(self.role).observe(time.perf_counter() - self._failed_at)
            self._failed_at = None

    def cursor(self, history: list[int]) -> ms_pb.SessionCursor:
        """Where the session must stand, how far to roll it back (the last round's rejected drafts), and the
        tokens it has not seen; an empty mirror makes it (re)build from the whole history."""
        keep = min(common_prefix(self.mirror, history), len(history) - 1) if self.mirror else 0
        return ms_pb.SessionCursor(
            session_id=self.session_id, expected_length=len(self.mirror), keep_length=keep, tokens=history[keep:]
        )

    async def send(self, request, distribution: bool = False):
        """A round's call on the stream, or (distribution) a call on the replica about the round's rows: a
        GetDistribution, or the target's GetLogprobs (the method named after the request)."""
        if distribution:
            return await self.replica.client.call(type(request).__name__.removesuffix("Request"), request)
        return await self.stream.call(request)


class Unary:
    """``Duplex``'s interface over unary calls (``rpc_streams = false``)."""

    def __init__(self, client: ModelClient, method: str):
        self.client = client
        self.method = method

    async def call(self, request):
        return await self.client.call(self.method, request)

    def close(self) -> None:
        pass


class Duplex:
    """A bidirectional stream used as a sequence of calls: ``call`` writes one request and reads
    its response. Errors surface as ``AioRpcError`` with the server's status, exactly as a unary
    call's would (a torn stream's as failover.broken_stream says); a broken stream is dropped and
    the next call opens a fresh one."""

    def __init__(self, client: ModelClient, method: str):
        self.client = client
        self.method = method
        self._call = None
        self._answered = 0  # calls the current stream has answered

    async def call(self, request):
        if self._call is None:
            self._call, self._answered = getattr(self.client.stub, self.method)(), 0
        call, reused = self._call, self._answered > 0
        try:
            # asyncio.timeout, not wait_for: before Python 3.12, wait_for returns an answer that arrives as its
            # task is cancelled and drops the cancellation, so a request whose client left ran on to its end.
            async with asyncio.timeout(self.client.cfg.rpc_timeout_s):
                response = await _write_read(call, request)
        except TimeoutError:
            self.close()
            raise rpc_error(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {self.client.cfg.rpc_timeout_s:g} s"
            ) from None
        except grpc.aio.AioRpcError as e:
            self.close()
            raise rpc_error(*broken_stream(e.code(), e.details(), reused)) from None
        except asyncio.InvalidStateError:  # the stream had ended; its status says why
            response = grpc.aio.EOF
        if response is grpc.aio.EOF:
            self._call = None
            code, details = await call.code(), await call.details()
            if code == grpc.StatusCode.OK:  # ended without an error: the server went away cleanly
                code, details = grpc.StatusCode.UNAVAILABLE, "the server closed the stream"
            raise rpc_error(*broken_stream(code, details, reused))
        self._answered += 1
        return response

    def close(self) -> None:
        """Drop the stream; the server frees its side at once."""
        if self._call is not None:
            self._call.cancel()
            self._call = None


async def _write_read(call, request):
    await call.write(request)
    return await call.read()
