"""Each row of the failover table does what it says, on a generation's link to fake replicas: no servers, no
model. Every row is run twice, with another replica of the role up and with none, since what an action does
depends on whether there is somewhere else to go."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from prometheus_client import CollectorRegistry

from orchestrator import failover
from orchestrator.clients import rpc_error
from orchestrator.failover import Action, Phase
from orchestrator.link import Link
from orchestrator.metrics import OrchestratorMetrics
from orchestrator.replicas import ReplicaSet, Role
from specdec.config import OrchestratorConfig
from specdec.errors import ServiceError
from specdec.prefix_cache import common_prefix
from specdec.v1 import model_server_pb2 as ms_pb

Code = grpc.StatusCode


class FakeClient:
    def __init__(self, address: str, cfg: OrchestratorConfig):
        self.address, self.cfg, self.stub = address, cfg, None


def _link(role: Role, replicas: int, fails: list[Code]) -> tuple[Link, list[str]]:
    """A link bound to replica a:1 of role (with b:2, c:3... beside it, replicas in all) whose calls fail with the
    codes in fails, in turn, then answer; the list collects the address each call went to."""
    cfg = OrchestratorConfig(unavailable_retry_s=2.0)
    addresses = ",".join(["a:1", "b:2", "c:3", "d:4"][:replicas])
    rs = ReplicaSet(role, addresses, lambda a: FakeClient(a, cfg), resolver=lambda host, port: None)
    for r in rs:
        r.report(ms_pb.ModelInfo(max_sessions=4, max_tokens=1000))
    registry = CollectorRegistry()
    link = Link(role, rs, "s", cfg, OrchestratorMetrics(registry, 4))
    link.registry = registry
    link.bind(rs.replicas["a:1"])
    called = []

    async def send(request, distribution=False):
        called.append(link.replica.address)
        if fails:
            raise rpc_error(fails.pop(0), "what the server said")
        return "answer"

    link.send = send
    return link, called


def _count(link: Link, metric: str, **labels) -> float:
    return link.registry.get_sample_value(metric, labels) or 0.0


def _run(link: Link, phase: Phase):
    """failover.call on link in phase: its result, or the exception it raised."""
    link.mirror = [1, 2, 3] if phase is Phase.ROUND else []

    async def go():
        try:
            return await failover.call(link, lambda: "request", distribution=phase is Phase.DISTRIBUTION)
        except (ServiceError, failover.RoundLost) as e:
            return e

    return asyncio.run(go())


# What each action leads to, with another replica up ("b:2") and without (None): the replica the generation
# ends on, whether the one that failed (a:1) is marked down, and what the call gives.
ANSWERED, LOST, TARGET_ALONE, FAILED = "answered", "round lost", "target alone", "failed"
OUTCOMES = {
    Action.REBUILD: {"b:2": ("a:1", False, ANSWERED), None: ("a:1", False, ANSWERED)},
    Action.MOVE: {"b:2": ("b:2", True, ANSWERED), None: ("a:1", True, ANSWERED)},  # waits for a:1 to answer
    Action.MOVE_NO_WAIT: {"b:2": ("b:2", True, ANSWERED), None: ("a:1", True, FAILED)},
    Action.MOVE_WHEN_FREE: {"b:2": ("b:2", False, ANSWERED), None: ("a:1", False, ANSWERED)},
    Action.DROP_DRAFT: {"b:2": ("b:2", True, ANSWERED), None: ("a:1", True, TARGET_ALONE)},
    Action.REST_DRAFT: {"b:2": ("b:2", False, ANSWERED), None: ("a:1", False, TARGET_ALONE)},
    Action.RERUN: {"b:2": ("a:1", False, LOST), None: ("a:1", False, LOST)},
    Action.RERUN_ELSEWHERE: {"b:2": ("b:2", True, LOST), None: ("a:1", True, LOST)},
}


def _id(value) -> str:
    if isinstance(value, tuple):
        return "-".join(getattr(v, "name", str(v)) for v in value)
    return value.name


def _outcome(result) -> str:
    if result is None:
        return TARGET_ALONE
    if isinstance(result, failover.RoundLost):
        return LOST
    if isinstance(result, ServiceError):
        return FAILED
    return ANSWERED


@pytest.mark.parametrize("other", ["b:2", None], ids=["another replica up", "no other replica"])
@pytest.mark.parametrize("key,action", list(failover.RULES.items()), ids=_id)
def test_each_row_of_the_failover_table_does_what_its_action_says(key, action, other):
    role, phase, code = key
    link, called = _link(role, 2 if other else 1, [code])
    a = link.replica
    result = _run(link, phase)
    where, down, outcome = OUTCOMES[action][other]
    assert _outcome(result) == outcome, result
    assert link.replica.address == where and a.up is not down
    if outcome == ANSWERED:
        assert result == ("request", "answer", result[2]) and called == ["a:1", where]
    if action is Action.REBUILD:
        assert _count(link, "specdec_session_rebuilds_total", service=role.value) == 1
    if where != "a:1":  # a failover is counted off the replica left, and the session is resent on the new one
        assert _count(link, "specdec_replica_failovers_total", role=role.value, replica="a:1") == 1
    if outcome in (LOST, TARGET_ALONE):
        assert link.mirror == []  # the next call resends the history
    if action is Action.REST_DRAFT:  # a full draft rests, unless another took the generation
        assert (link.resting_until > time.monotonic()) is (other is None)
    if outcome == TARGET_ALONE:
        assert _count(link, "specdec_draft_fallback_rounds_total") == 1
    if action in (Action.MOVE, Action.MOVE_NO_WAIT) and outcome == ANSWERED:
        assert _count(link, "specdec_failover_recovery_seconds_count", role="target") == 1


@pytest.mark.parametrize(
    "key,code",
    [
        ((Role.TARGET, Phase.ROUND, Code.RESOURCE_EXHAUSTED), Code.RESOURCE_EXHAUSTED),  # full mid-generation
        ((Role.TARGET, Phase.ROUND, Code.INTERNAL), Code.INTERNAL),
        ((Role.TARGET, Phase.START, Code.OUT_OF_RANGE), Code.OUT_OF_RANGE),
        ((Role.DRAFT, Phase.ROUND, Code.INVALID_ARGUMENT), Code.INTERNAL),  # the client's request was checked: a defect
        ((Role.TARGET, Phase.DISTRIBUTION, Code.INTERNAL), Code.INTERNAL),
    ],
    ids=_id,
)
def test_a_status_the_table_does_not_name_fails_the_request_with_what_the_client_should_see(key, code):
    role, phase, failed = key
    assert key not in failover.RULES
    link, called = _link(role, 2, [failed])
    result = _run(link, phase)
    assert isinstance(result, ServiceError) and result.code == code
    assert f"{role} service" in result.message and "what the server said" in result.message
    assert called == ["a:1"] and link.replica.up


def test_a_session_lost_again_on_the_same_replica_fails_the_request():
    link, called = _link(Role.TARGET, 2, [Code.NOT_FOUND, Code.NOT_FOUND])
    result = _run(link, Phase.ROUND)
    assert isinstance(result, ServiceError) and result.code == Code.INTERNAL and called == ["a:1", "a:1"]


def test_a_target_session_lost_on_the_replica_it_moved_to_is_rebuilt_there():
    link, called = _link(Role.TARGET, 2, [Code.NOT_FOUND, Code.UNAVAILABLE, Code.NOT_FOUND])
    assert _outcome(_run(link, Phase.ROUND)) == ANSWERED and called == ["a:1", "a:1", "b:2", "b:2"]


def test_a_draft_session_is_rebuilt_only_as_the_rounds_first_retry():
    link, called = _link(Role.DRAFT, 2, [Code.UNAVAILABLE, Code.NOT_FOUND])
    result = _run(link, Phase.ROUND)
    assert isinstance(result, ServiceError) and result.code == Code.INTERNAL and called == ["a:1", "b:2"]


def test_a_draft_call_is_tried_three_times_then_the_round_goes_on_with_the_target_alone():
    link, called = _link(Role.DRAFT, 4, [Code.UNAVAILABLE] * 3)
    assert _run(link, Phase.ROUND) is None and len(called) == 3
    assert sum(r.up for r in link.replicas) == 1  # one replica was left untried


def test_a_draft_replica_known_down_is_not_called():
    link, called = _link(Role.DRAFT, 2, [])
    link.replica.mark_down()
    assert _outcome(_run(link, Phase.ROUND)) == ANSWERED and called == ["b:2"]
    link.replica.mark_down()
    assert _run(link, Phase.ROUND) is None and called == ["b:2"]  # none up: the target alone, no call


@pytest.mark.parametrize("code", [Code.INTERNAL, Code.UNKNOWN, Code.CANCELLED])
def test_a_stream_torn_down_under_a_message_counts_as_unavailable(code):
    assert failover.broken_stream(code, "x", reused=True) == (Code.UNAVAILABLE, f"the stream broke ({code.name}: x)")
    assert failover.broken_stream(code, "x", reused=False) == (code, "x")  # a new stream's error is the server's
    assert failover.broken_stream(Code.NOT_FOUND, "x", reused=True) == (Code.NOT_FOUND, "x")


def test_a_round_call_cancelled_as_its_answer_arrives_ends_cancelled():
    """The request's task cancelled in the same turn of the loop as its stream's answer arrives (its client left as
    the round came back) ends cancelled rather than going on to its next round: a generation that ignored it ran
    to max_tokens, holding its sessions."""
    from orchestrator.link import Duplex

    async def go():
        answer = asyncio.get_running_loop().create_future()

        class Call:
            async def write(self, request):
                pass

            async def read(self):
                return await answer

            def cancel(self):
                pass

        client = FakeClient("a:1", OrchestratorConfig())
        client.stub = type("Stub", (), {"VerifyStream": staticmethod(Call)})()
        task = asyncio.ensure_future(Duplex(client, "VerifyStream").call("request"))
        for _ in range(3):  # to the read
            await asyncio.sleep(0)
        answer.set_result("answer")  # the read is woken first, then the task's cancellation
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())


def test_a_cursor_keeps_exactly_the_prefix_the_mirror_shares_with_the_history():
    """common_prefix, which sets a cursor's keep_length, against a count one token at a time: lists parting at
    their ends (a round's rejected drafts), far from them (a rebuilt session), or not at all."""
    import random

    rng = random.Random(0)
    for _ in range(3000):
        a = [rng.randrange(3) for _ in range(rng.randrange(0, 300))]
        b = a[: rng.randrange(0, len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(0, 80))]
        a, b = (b, a) if rng.random() < 0.5 else (a, b)
        same = 0
        while same < min(len(a), len(b)) and a[same] == b[same]:
            same += 1
        assert common_prefix(a, b) == same
