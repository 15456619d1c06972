"""What a generation does when a model server fails one of its calls: one table, and the one call that reads it.

A failure is keyed by the role that failed, the phase its call was in and the status it ended with. RULES maps
the key to an Action; a key the table does not name fails the request with the status the client should see
(``upstream``). ``call`` sends every call a round makes (ProposeTokens, Verify, GetDistribution) on the
generation's Link to that role (orchestrator/link.py) and carries the action out; ``place`` puts a new
generation's links on their first replicas. A stream torn down under a message reaches the table as
UNAVAILABLE (``broken_stream``). The output never depends on any of this: the orchestrator's history is the
truth, and any replica computes from it what the lost one would have.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from typing import TYPE_CHECKING

import grpc

from orchestrator.replicas import Role
from specdec.errors import ServiceError

if TYPE_CHECKING:
    from orchestrator.link import Link

log = logging.getLogger(__name__)

Code = grpc.StatusCode
DRAFT_REST_S = 1.0  # after a full draft refuses a generation, its rounds run on the target alone this long
DRAFT_TRIES = 3  # a round's draft call is tried at most this often; then the round goes on with the target alone


class Phase(enum.Enum):
    START = "start"  # a round's call that builds the session from the history: the prompt's, or a resend
    ROUND = "round"  # a round's call on the session the replica holds
    DISTRIBUTION = "distribution"  # GetDistribution: the row the round's accept step needs


class Action(enum.Enum):
    FAIL = "fail"  # the request fails with the status the client should see (upstream)
    REBUILD = "rebuild"  # the session is gone, not the replica: resend the history there
    MOVE = "move"  # the replica is down: go on at another, or wait for one to answer
    MOVE_NO_WAIT = "move, no wait"  # the replica hangs: go on at another; with none, fail
    MOVE_WHEN_FREE = "move when free"  # the replica is full, not down: go on at another, or wait for a free one
    DROP_DRAFT = "drop draft"  # the draft is down: another draft replica, or the target alone
    REST_DRAFT = "rest draft"  # the draft is full: another draft replica, or the target alone for DRAFT_REST_S
    RERUN = "rerun"  # the row went with the session: the round runs again
    RERUN_ELSEWHERE = "rerun elsewhere"  # the row went with the replica: the round runs again on another


_BROKEN = (Code.INTERNAL, Code.UNKNOWN, Code.CANCELLED)  # how a stream torn down under a message may end


def _rows(roles, phases, actions: dict[grpc.StatusCode, Action]) -> dict:
    return {(role, phase, code): action for role in roles for phase in phases for code, action in actions.items()}


_CALLS = (Phase.START, Phase.ROUND)
RULES: dict[tuple[Role, Phase, grpc.StatusCode], Action] = {
    **_rows(
        (Role.DRAFT,),
        _CALLS,
        {
            Code.NOT_FOUND: Action.REBUILD,  # the server no longer holds the session (restarted, expired, evicted)
            Code.FAILED_PRECONDITION: Action.REBUILD,  # it holds it at another length
            Code.UNAVAILABLE: Action.DROP_DRAFT,
            Code.DEADLINE_EXCEEDED: Action.DROP_DRAFT,
            Code.INTERNAL: Action.DROP_DRAFT,  # a draft is optional: a defect there costs its speed-up, not the request
            Code.RESOURCE_EXHAUSTED: Action.REST_DRAFT,
        },
    ),
    **_rows(
        (Role.TARGET,),
        _CALLS,
        {
            Code.NOT_FOUND: Action.REBUILD,
            Code.FAILED_PRECONDITION: Action.REBUILD,
            Code.UNAVAILABLE: Action.MOVE,
            Code.DEADLINE_EXCEEDED: Action.MOVE_NO_WAIT,
        },
    ),
    **_rows(
        (Role.TARGET,),
        (Phase.START,),
        {
            Code.RESOURCE_EXHAUSTED: Action.MOVE_WHEN_FREE  # only as the session starts; mid-generation it fails
        },
    ),
    **_rows(
        tuple(Role),
        (Phase.DISTRIBUTION,),
        {
            Code.NOT_FOUND: Action.RERUN,
            Code.FAILED_PRECONDITION: Action.RERUN,
            Code.UNAVAILABLE: Action.RERUN_ELSEWHERE,
            Code.DEADLINE_EXCEEDED: Action.RERUN_ELSEWHERE,
        },
    ),
}
_MOVES = (Action.MOVE, Action.MOVE_NO_WAIT, Action.MOVE_WHEN_FREE)


class RoundLost(Exception):
    """A replica failed mid-round, after its verdict: the round runs again on the replica the generation moved to."""


def broken_stream(code: grpc.StatusCode, details: str, reused: bool) -> tuple[grpc.StatusCode, str]:
    """The status a stream's failed call counts as. On a stream that already carried a call, INTERNAL, UNKNOWN and
    CANCELLED mean it was torn down under the message (a server stopped or killed): UNAVAILABLE, so the call goes
    again, on a fresh stream, where a real error shows with its own code. Resending is safe: the session cursor
    makes a request that did run answer FAILED_PRECONDITION."""
    if reused and code in _BROKEN:
        return Code.UNAVAILABLE, f"the stream broke ({code.name}: {details})"
    return code, details


def place(link: Link) -> None:
    """Put a new generation's link on its role's least-loaded replica, or on the one down the longest. A role with
    no replica at all: the target's fails the request UNAVAILABLE; without a draft the target alone carries it."""
    replica = link.replicas.place() or link.replicas.fallback()
    if replica is not None:
        link.bind(replica)
    elif link.role is Role.TARGET:
        raise ServiceError(
            Code.UNAVAILABLE,
            "no target replica is known: "
            f"{', '.join(e.address for e in link.replicas.endpoints)} resolves to no address",
        )


async def call(link: Link, make_request, distribution: bool = False):
    """(request, response, wall seconds of the call that answered) of a round's call on link; make_request builds
    the request from the link's mirror as it stands. A failure goes to RULES, and its action is carried out here:
    the call goes again (rebuilt, or on another replica), the round runs again (RoundLost), the draft's call gives
    None (the round goes on with the target alone), or the request fails (ServiceError). A draft replica known down
    or resting is not called at all."""
    if link.role is Role.DRAFT and not distribution and not _draft_ready(link):
        return None
    retries = moves = 0
    rebuilt, deadline = False, None
    while True:
        request = make_request()
        t = time.perf_counter()
        try:
            response = await link.send(request, distribution)
        except grpc.aio.AioRpcError as e:
            code = e.code()
            phase = Phase.DISTRIBUTION if distribution else Phase.ROUND if link.mirror else Phase.START
            action = RULES.get((link.role, phase, code), Action.FAIL)
            # a draft session is rebuilt only as the round's first retry; a target session once on each replica
            if action is Action.REBUILD and (rebuilt or (link.role is Role.DRAFT and retries)):
                action = Action.FAIL
            if action is Action.REBUILD:
                link.rebuild()
                rebuilt = True
            elif action in (Action.DROP_DRAFT, Action.REST_DRAFT):
                if not _draft_elsewhere(link, action, retries, e):
                    return None
            elif action in _MOVES:
                if deadline is None:
                    deadline = asyncio.get_running_loop().time() + link.cfg.unavailable_retry_s
                if not await _move(link, action, code, deadline, moves):
                    raise upstream(link.role, e) from None
                moves, rebuilt = moves + 1, False
            elif action in (Action.RERUN, Action.RERUN_ELSEWHERE):
                _lose_round(link, action, code)
            else:
                raise upstream(link.role, e) from None
            retries += 1
            continue
        link.answered()
        return request, response, time.perf_counter() - t


def _draft_ready(link: Link) -> bool:
    """Whether the draft is called this round: its replica is down (a report or a call said so), and another is
    up, the generation moves there; with none, or while a full draft rests, the round goes to the target alone."""
    if (link.replica is None or not link.replica.up) and (other := link.replicas.place()) is not None:
        link.switch(other, "is down")
    if link.replica is None or not link.replica.up or time.monotonic() < link.resting_until:
        link.metrics.draft_fallbacks.inc()
        return False
    return True


def _draft_elsewhere(link: Link, action: Action, retries: int, e: grpc.aio.AioRpcError) -> bool:
    """A draft that failed is optional: True when the generation moved to another draft replica, to call it there;
    False when the round goes on with the target alone until a draft replica answers."""
    if action is Action.REST_DRAFT:
        link.resting_until = time.monotonic() + DRAFT_REST_S
    else:
        link.replica.mark_down()
    other = link.replicas.place(exclude=link.replica)
    if other is not None and retries + 1 < DRAFT_TRIES:
        link.switch(other, f"failed ({e.code().name})")
        link.resting_until = 0.0
        return True
    log.warning("draft failed (%s: %s); target alone until a draft replica answers", e.code().name, e.details())
    link.forget()
    link.metrics.draft_fallbacks.inc()
    return False


async def _move(link: Link, action: Action, code: grpc.StatusCode, deadline: float, moves: int) -> bool:
    """Go on at another replica of the role, or at the same one once it is back, waiting with backoff until
    deadline; False when the time is up, or when the replica hangs and there is no other."""
    replicas, old = link.replicas, link.replica
    if action is not Action.MOVE_WHEN_FREE:  # full is not down: it takes generations again as others end
        old.mark_down()
        link.failed()
    new = replicas.place(exclude=old)
    if new is None and action is Action.MOVE_NO_WAIT:
        return False  # a replica that hangs is not waited for again: with no other, the request fails
    all_full = action is Action.MOVE_WHEN_FREE and moves + 1 >= len(replicas.placeable())
    if new is None or all_full:  # wait for a replica to come back or to free a session
        loop = asyncio.get_running_loop()
        delay = min(0.05 * 2**moves, 1.0)
        if loop.time() + delay > deadline:
            return False
        await asyncio.sleep(delay)
        new = replicas.place() or replicas.fallback() or old
    link.switch(new, f"failed ({code.name})")
    return True


def _lose_round(link: Link, action: Action, code: grpc.StatusCode) -> None:
    """The distribution row went away with the session or the replica: the round runs again, the session resent
    (on another replica when its own is down)."""
    if action is Action.RERUN_ELSEWHERE:
        link.replica.mark_down()
        replicas = link.replicas
        link.switch(replicas.place() or replicas.fallback() or link.replica, f"failed ({code.name})")
    link.forget()
    raise RoundLost


def upstream(role: Role, e: grpc.aio.AioRpcError) -> ServiceError:
    """An error from a model server, as the client should see it."""
    code = e.code()
    if code in (Code.RESOURCE_EXHAUSTED, Code.OUT_OF_RANGE, Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED):
        return ServiceError(code, f"{role} service: {e.details()}")
    return ServiceError(Code.INTERNAL, f"{role} service answered {code.name}: {e.details()}")
