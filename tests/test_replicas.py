"""Several replicas of each model server: generations spread over them, survive the loss of one, and several
orchestrators share them without failing a request."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client import CollectorRegistry

from conftest import Stack, eventually
from draft_service.app import SERVICE_NAME as DRAFT_NAME
from draft_service.servicer import DraftServicer
from orchestrator.app import start_orchestrator
from orchestrator.clients import ModelClient
from orchestrator.replicas import Endpoint, ReplicaSet, parse_addresses
from specdec.config import ConfigError, ModelServerConfig, OrchestratorConfig
from specdec.model_server import ModelServer, start_model_server
from specdec.v1 import draft_pb2_grpc, model_server_pb2 as ms_pb, target_pb2_grpc
from target_service.app import SERVICE_NAME as TARGET_NAME
from target_service.servicer import TargetServicer

CHAT = [("user", "Write a haiku about the sea.")]


# -- addresses and placement, without servers ------------------------------------------------------------
def test_an_address_list_names_replicas_and_dns_names():
    assert parse_addresses("a:1, [::1]:2,dns:///svc.ns.svc:50053") == [
        Endpoint("a", 1),
        Endpoint("::1", 2),
        Endpoint("svc.ns.svc", 50053, dns=True),
    ]
    for bad in ("a", "a:", ":1", "a:x", "a:70000", "a:1,,b:2", "a:1,a:1"):
        with pytest.raises(ConfigError, match="--target-address"):
            parse_addresses(bad)


def _set(addresses: str, resolver=None) -> ReplicaSet:
    cfg = OrchestratorConfig()
    return ReplicaSet(
        "target",
        addresses,
        lambda a: ModelClient("target", a, target_pb2_grpc.TargetServiceStub, cfg),
        resolver=resolver or (lambda host, port: None),
    )


def _report(r, in_use: int, max_sessions: int = 4, tokens: int = 0):
    r.report(ms_pb.ModelInfo(max_sessions=max_sessions, max_tokens=1000, sessions_in_use=in_use, tokens_in_use=tokens))


def test_a_new_generation_goes_to_the_least_loaded_replica_that_is_up(event_loop_thread):
    async def placement():
        s = _set("a:1,b:2,c:3")
        a, b, c = (s.replicas[x] for x in ("a:1", "b:2", "c:3"))
        _report(a, 1), _report(b, 3), _report(c, 0, tokens=900)
        assert s.place() is a
        a.placed += 2
        assert s.place() in (a, b)  # both at 3/4, below c's 0.9
        b.mark_down()
        assert s.place() is a and s.place(exclude=a) is c
        a.mark_down(), c.mark_down()
        assert s.place() is None
        assert s.fallback() is b  # down the longest: the first to try again
        _report(a, 0)
        assert s.place() is a  # back once it reports
        a.report(ms_pb.ModelInfo(max_sessions=4, max_tokens=1000, draining=True))
        assert not a.up
        await s.close()

    event_loop_thread.run(placement())


def test_a_generation_goes_only_to_target_replicas_with_the_first_targets_numerics(event_loop_thread):
    # A failover to a replica that computes in other numbers could change a greedy answer mid-stream.
    async def placement():
        s = _set("a:1,b:2")
        s.numerics = "float32, 16-bit activations"
        a, b = s.replicas["a:1"], s.replicas["b:2"]
        for r, numerics, in_use in ((a, "float32, 16-bit activations", 3), (b, "float32", 0)):
            info = ms_pb.ModelInfo(max_sessions=4, max_tokens=1000, sessions_in_use=in_use, numerics=numerics)
            s.check(r, info)
            r.report(info)
        assert s.placeable() == [a] and s.place() is a and s.place(exclude=a) is None
        await s.close()

    event_loop_thread.run(placement())


def test_dns_names_are_resolved_again_and_replicas_come_and_go(event_loop_thread):
    answers = {"svc": ["10.0.0.1:50053", "10.0.0.2:50053"]}

    async def resolver(host, port):
        if host not in answers:
            raise OSError("no such name")
        return answers[host]

    async def check():
        s = _set("dns:///svc:50053,127.0.0.1:9", resolver)
        assert set(s.replicas) == {"127.0.0.1:9"}
        await s.resolve()
        assert set(s.replicas) == {"127.0.0.1:9", "10.0.0.1:50053", "10.0.0.2:50053"}
        s.replicas["10.0.0.1:50053"].placed = 1  # a generation still runs there
        answers["svc"] = ["10.0.0.2:50053", "10.0.0.3:50053"]
        await s.resolve()
        assert set(s.replicas) == {"127.0.0.1:9", "10.0.0.1:50053", "10.0.0.2:50053", "10.0.0.3:50053"}
        assert s.replicas["10.0.0.1:50053"].gone and s.replicas["10.0.0.1:50053"] not in s.placeable()
        s.replicas["10.0.0.1:50053"].placed = 0
        del answers["svc"]  # the resolver fails: what we had stands
        await s.resolve()
        assert set(s.replicas) == {"127.0.0.1:9", "10.0.0.2:50053", "10.0.0.3:50053"}
        await s.close()

        empty = _set("dns:///svc:50053", resolver)
        answers["svc"] = []  # every pod gone: no replica to place on or to wait for
        await empty.resolve()
        assert empty.place() is None and empty.fallback() is None

    event_loop_thread.run(check())


# -- real servers on loopback ----------------------------------------------------------------------------
class Cluster:
    """Target and draft replicas and orchestrators in the test's event loop, each on its own port."""

    def __init__(
        self,
        lt,
        tokenizer,
        draft_model,
        target_model,
        *,
        targets=2,
        drafts=1,
        orchestrators=1,
        target_cfg=None,
        draft_cfg=None,
        orch_cfg=None,
        target_address=None,
    ):
        """target_cfg (and draft_cfg): settings of every replica, or a list of them, one per replica."""
        self.lt = lt
        self.targets, self.drafts, self.stacks, self.servers = [], [], [], {}

        async def start():
            for role, n, model, servicer, add, name, extra in (
                (
                    "draft",
                    drafts,
                    draft_model,
                    DraftServicer,
                    draft_pb2_grpc.add_DraftServiceServicer_to_server,
                    DRAFT_NAME,
                    draft_cfg or {},
                ),
                (
                    "target",
                    targets,
                    target_model,
                    TargetServicer,
                    target_pb2_grpc.add_TargetServiceServicer_to_server,
                    TARGET_NAME,
                    target_cfg or {},
                ),
            ):
                for i in range(n):
                    settings = {"threads": 1} if role == "draft" else {}
                    settings.update(extra[i] if isinstance(extra, list) else extra)
                    core = ModelServer(
                        ModelServerConfig(role=role, model=f"test-{role}", port=0, metrics_port=0, **settings),
                        model,
                        tokenizer,
                    )
                    server, port, *_ = await start_model_server(core, [(add, servicer(core), name)], "127.0.0.1", 0)
                    (self.drafts if role == "draft" else self.targets).append(core)
                    self.servers[core] = (server, f"127.0.0.1:{port}")
            addresses = {
                role: ",".join(self.servers[c][1] for c in cores)
                for role, cores in (("draft", self.drafts), ("target", self.targets))
            }
            for _ in range(orchestrators):
                cfg = OrchestratorConfig(
                    host="127.0.0.1",
                    port=0,
                    metrics_port=0,
                    http_port=0,
                    draft_address=addresses["draft"],
                    target_address=target_address(self) if target_address else addresses["target"],
                    **(orch_cfg or {}),
                )
                registry = CollectorRegistry()
                server, port, _, servicer = await start_orchestrator(cfg, registry, tokenizer)
                self.stacks.append(
                    Stack(lt, self.drafts[0], self.targets[0], f"127.0.0.1:{port}", registry, servicer, [server])
                )

        lt.run(start())

    def stop(self):
        async def stop():
            for stack in self.stacks:
                await stack.servicer.close()
                await stack.servers[0].stop(0)
            for server, _ in self.servers.values():
                await server.stop(0)

        self.lt.run(stop())


def concurrently(fn, args):
    with ThreadPoolExecutor(len(args)) as pool:
        return list(pool.map(fn, args))


def test_generations_spread_over_the_target_replicas_and_give_the_target_alone_output(
    event_loop_thread, tokenizer, tiny_draft, target_model, tiny_stack
):
    expected = [
        tiny_stack.generate(
            prompt=f"Count from {i} to {i + 9}:", max_tokens=12, temperature=0.0, num_speculative_tokens=0
        )[0]
        for i in range(8)
    ]
    cluster = Cluster(event_loop_thread, tokenizer, tiny_draft, target_model, targets=2)
    try:
        stack = cluster.stacks[0]
        got = concurrently(
            lambda i: stack.generate(
                prompt=f"Count from {i} to {i + 9}:", max_tokens=12, temperature=0.0, num_speculative_tokens=2
            )[0],
            range(8),
        )
        assert got == expected
        placed = [
            stack.metric("specdec_replica_generations_total", {"role": "target", "replica": cluster.servers[c][1]})
            for c in cluster.targets
        ]
        assert sum(placed) == 8 and min(placed) >= 2, placed  # least-loaded placement, not all on one
        assert eventually(lambda: event_loop_thread.call(lambda: [len(c.pool) for c in cluster.targets]) == [0, 0])
    finally:
        cluster.stop()


@pytest.mark.parametrize("how", ["killed", "drained"])
def test_a_target_replica_lost_mid_stream_costs_no_request_and_no_token(
    event_loop_thread, tokenizer, tiny_draft, target_model, tiny_stack, how
):
    """killed: its server stops at once, its sessions with it. drained: it shuts down as on SIGTERM (the streams
    between two calls end UNAVAILABLE, no new call is taken, the calls in flight finish)."""
    prompts = [f"Write a list of {i + 3} fruits:" for i in range(6)]
    expected = [
        tiny_stack.generate(prompt=p, max_tokens=40, temperature=0.0, num_speculative_tokens=0)[0] for p in prompts
    ]
    cluster = Cluster(event_loop_thread, tokenizer, tiny_draft, target_model, targets=2)
    try:
        stack = cluster.stacks[0]
        started = threading.Barrier(len(prompts) + 1)

        def run(p):
            ids, first = [], True
            for msg in stack.stub().Generate(_request(p), timeout=120):
                ids.extend(msg.token_ids)
                if first:
                    first = False
                    started.wait(timeout=60)
            return ids

        with ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(run, p) for p in prompts]
            started.wait(timeout=60)
            victim = cluster.targets[0]
            server = cluster.servers[victim][0]
            if how == "killed":
                event_loop_thread.run(server.stop(0))
            else:
                event_loop_thread.call(victim.begin_shutdown)
                event_loop_thread.run(server.stop(5.0))
            got = [f.result(timeout=120) for f in futures]
        assert got == expected
        assert (
            stack.metric("specdec_replica_failovers_total", {"role": "target", "replica": cluster.servers[victim][1]})
            >= 1
        )
        assert stack.metric("specdec_failover_recovery_seconds_count", {"role": "target"}) >= 1
    finally:
        cluster.stop()


def _request(prompt):
    from specdec.v1 import generation_pb2 as gen_pb

    return gen_pb.GenerateRequest(prompt=prompt, max_tokens=40, temperature=0.0, num_speculative_tokens=2)


def test_orchestrators_sharing_full_replicas_wait_instead_of_failing(
    event_loop_thread, tokenizer, tiny_draft, target_model, tiny_stack
):
    """Two orchestrators, each admitting as many generations as the replicas hold: the replicas refuse the
    surplus with RESOURCE_EXHAUSTED, and the orchestrators place it elsewhere or wait, so every request ends."""
    prompts = [f"Name {i + 2} colours:" for i in range(6)]
    expected = [
        tiny_stack.generate(prompt=p, max_tokens=16, temperature=0.0, num_speculative_tokens=0)[0] for p in prompts
    ]
    cluster = Cluster(
        event_loop_thread,
        tokenizer,
        tiny_draft,
        target_model,
        targets=2,
        orchestrators=2,
        target_cfg={"max_sessions": 1},
    )
    try:
        got = concurrently(
            lambda i: cluster.stacks[i % 2].generate(
                prompt=prompts[i], max_tokens=16, temperature=0.0, num_speculative_tokens=0
            )[0],
            range(len(prompts)),
        )
        assert got == expected
        refused = sum(
            c.metrics.rpc_errors.labels(method, "RESOURCE_EXHAUSTED")._value.get()
            for c in cluster.targets
            for method in ("Verify", "VerifyStream")
        )
        assert refused >= 1  # the replicas did turn generations away: the orchestrators waited and placed them
    finally:
        cluster.stop()


def test_a_dns_name_resolves_to_replicas(event_loop_thread, tokenizer, tiny_draft, target_model, tiny_stack):
    """dns:///localhost:PORT: every address localhost has is a replica; the one the server listens on serves."""
    expected = tiny_stack.generate(messages=CHAT, max_tokens=8, temperature=0.0, num_speculative_tokens=0)[0]
    cluster = Cluster(
        event_loop_thread,
        tokenizer,
        tiny_draft,
        target_model,
        targets=1,
        target_address=lambda c: "dns:///localhost:" + c.servers[c.targets[0]][1].split(":")[1],
    )
    try:
        stack = cluster.stacks[0]
        assert stack.generate(messages=CHAT, max_tokens=8, temperature=0.0, num_speculative_tokens=2)[0] == expected
        assert "127.0.0.1:" + cluster.servers[cluster.targets[0]][1].split(":")[1] in stack.servicer.target.replicas
    finally:
        cluster.stop()


def test_killing_a_target_and_a_draft_replica_under_load_costs_no_request_and_no_token():
    """Real processes: two target and two draft replicas, two orchestrators, 16 streams; SIGKILL one target and
    one draft mid-stream; the killed target restarts on its port and takes generations again."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    from failover_drill import run_drill

    report = run_drill(streams=16, max_tokens=32)
    print(report)
    assert report["failed_requests"] == 0 and report["wrong_outputs"] == 0, report
    assert report["moved_generations"] >= 1, report  # the kill did land on running generations
    assert min(report["placement_before_kill"].values()) >= 4, report  # spread, not all on one replica
    assert min(report["target_sessions_before_kill"].values()) >= 3, report  # as both targets' own metrics show
    assert report["restarted_replica_took"] >= 1 and report["after_restart_failed"] == 0, report
    assert report["after_restart_wrong"] == 0, report
