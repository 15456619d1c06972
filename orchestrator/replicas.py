"""The model servers of a role: one or several replicas, where generations go, and where they go when one fails.

``--target-address`` (and ``--draft-address``) is a comma-separated list of ``host:port``, each a replica, and of
``dns:///NAME:PORT``, a name every address of which is a replica (what a Kubernetes headless Service gives),
resolved again every ``--resolve-interval-s``. Each replica reports its load in ModelInfo (sessions and KV tokens
in use against its capacity), fetched every second. A new generation goes to the least-loaded replica that is up
and stays there, since its KV lives there. A replica that fails a call (down, restarting, draining) is left out
until it answers again; the generations on it rebuild elsewhere from their history (orchestrator/failover.py).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
import socket
import time
from dataclasses import dataclass

import grpc

from orchestrator.clients import ModelClient
from specdec.config import ConfigError
from specdec.v1 import model_server_pb2 as ms_pb

log = logging.getLogger(__name__)

DNS_SCHEME = "dns:///"


class Role(enum.StrEnum):
    """The two model servers a generation calls; each value is the name metric labels and flags give it."""

    DRAFT = "draft"
    TARGET = "target"


@dataclass(frozen=True)
class Endpoint:
    """One entry of an address list: a replica, or (dns) a name that resolves to replicas."""

    host: str
    port: int
    dns: bool = False

    @property
    def address(self) -> str:
        return join_host_port(self.host, self.port)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_addresses(text: str, flag: str = "--target-address") -> list[Endpoint]:
    """'a:1, [::1]:2, dns:///svc.ns:3' -> endpoints; ConfigError names what is wrong."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        dns = part.startswith(DNS_SCHEME)
        rest = part[len(DNS_SCHEME) :] if dns else part
        host, sep, port = rest.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"{flag}: {part!r} is not host:port or {DNS_SCHEME}name:port")
        out.append(Endpoint(host, int(port), dns))
    if len(set(out)) != len(out):
        raise ConfigError(f"{flag}: {text!r} names a replica twice")
    return out


async def resolve(host: str, port: int) -> list[str]:
    """Every address a name has, as host:port, sorted (a headless Service's pods)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({join_host_port(info[4][0], port) for info in infos})


class Replica:
    """One model server, as this orchestrator sees it."""

    def __init__(self, client: ModelClient):
        self.client = client
        self.info: ms_pb.ModelInfo | None = None  # its last report
        self.up = True  # until a call or a report says otherwise
        self.down_since = 0.0
        self.placed = 0  # this orchestrator's generations on it now
        self._placed_at_report = 0
        self.gone = False  # no longer resolved; closed once its generations left
        self.compatible = True

    @property
    def address(self) -> str:
        return self.client.address

    def load(self) -> float:
        """Fraction of its sessions or KV tokens in use, the larger; what other orchestrators placed counts from its
        last report, this one's at once."""
        if self.info is None or not self.info.max_sessions:
            return float(self.placed)
        sessions = self.info.sessions_in_use + max(self.placed - self._placed_at_report, 0)
        return max(sessions / self.info.max_sessions, self.info.tokens_in_use / max(self.info.max_tokens, 1))

    def report(self, info: ms_pb.ModelInfo | None) -> None:
        if info is None or info.draining:
            self.mark_down()
        else:
            self.info, self.up, self._placed_at_report = info, True, self.placed

    def mark_down(self) -> None:
        if self.up:
            self.up, self.down_since = False, time.monotonic()


class ReplicaSet:
    """The replicas of one role (draft or target), kept current by ``refresh``."""

    def __init__(self, role: Role, addresses: str, make_client, resolve_interval_s: float = 10.0, resolver=resolve):
        self.role = role
        self.endpoints = parse_addresses(addresses, f"--{role}-address")
        self.make_client = make_client  # address -> ModelClient
        self.resolve_interval_s = resolve_interval_s
        self.resolver = resolver
        self.replicas: dict[str, Replica] = {}
        self._resolved_at = -float("inf")
        self.fingerprint: str | None = None  # the tokenizer all replicas must share (set by the orchestrator)
        # With a head draft (set by the orchestrator): the draft reads the target's features, feature_size a row, and
        # every replica of either role must report this feature fingerprint.
        self.reads_features = False
        self.feature_size = 0
        self.feature_fingerprint: str | None = None
        # Targets: the numerics every replica must report (set by the orchestrator from the first target's report), so
        # that a failover or a rebuild never changes a greedy answer.
        self.numerics: str | None = None
        for e in self.endpoints:
            if not e.dns:
                self._add(e.address)

    def __iter__(self):
        return iter(list(self.replicas.values()))

    def _add(self, address: str) -> Replica:
        r = self.replicas.get(address)
        if r is None:
            r = self.replicas[address] = Replica(self.make_client(address))
            log.info("%s replica %s added", self.role, address)
        r.gone = False
        return r

    async def resolve(self) -> None:
        """Resolve the dns:/// entries again: new addresses become replicas, vanished ones leave once idle."""
        self._resolved_at = time.monotonic()
        dns = [e for e in self.endpoints if e.dns]
        if not dns:
            return
        found, failed = set(), False
        for e in dns:
            try:
                found.update(await self.resolver(e.host, e.port))
            except OSError as err:
                log.warning("cannot resolve %s replicas %s: %s", self.role, e.address, err)
                failed = True
        fixed = {e.address for e in self.endpoints if not e.dns}
        for address in sorted(found):
            self._add(address)
        if not (failed and not found):  # a resolver outage keeps what we had
            for address, r in list(self.replicas.items()):
                if address not in found and address not in fixed and not r.gone:
                    log.info("%s replica %s no longer resolves; it takes no new generations", self.role, address)
                    r.gone = True
        await self.close_idle()

    async def refresh(self, timeout_s: float = 5.0) -> None:
        """Resolve if due, then fetch every replica's report; one that cannot be reached, or drains, is down."""
        if time.monotonic() - self._resolved_at >= self.resolve_interval_s:
            await self.resolve()
        replicas = list(self)
        reports = await asyncio.gather(
            *(r.client.stub.GetModelInfo(ms_pb.GetModelInfoRequest(), timeout=timeout_s) for r in replicas),
            return_exceptions=True,
        )
        for r, info in zip(replicas, reports):
            if isinstance(info, grpc.aio.AioRpcError) and info.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                continue  # slow, not gone (a long pass on a loaded CPU): its calls say if it fails
            if isinstance(info, grpc.aio.AioRpcError):
                r.report(None)
            elif isinstance(info, BaseException):
                raise info
            else:
                self.check(r, info)
                r.report(info)

    def check(self, r: Replica, info: ms_pb.ModelInfo) -> None:
        """A replica whose tokenizer is not the pair's never takes a generation."""
        ok = self.fingerprint is None or info.tokenizer_fingerprint == self.fingerprint
        if self.feature_fingerprint is not None and info.feature_fingerprint != self.feature_fingerprint:
            ok = False  # another target's features, or a head of another target
        if self.role is Role.DRAFT and self.fingerprint is not None and info.reads_features != self.reads_features:
            ok = False  # a standalone draft among heads, or the reverse
        if self.numerics is not None and info.numerics != self.numerics:
            ok = False  # another target's numbers: its greedy answers may differ
        if r.compatible and not ok:
            log.error(
                "%s replica %s serves %r with tokenizer %s and numerics %r, not the pair's %s and %r: it takes no "
                "generations",
                self.role,
                r.address,
                info.model,
                info.tokenizer_fingerprint,
                info.numerics,
                self.fingerprint,
                self.numerics,
            )
        r.compatible = ok

    def placeable(self) -> list[Replica]:
        """The replicas a new generation may go to: up, still resolved, with the pair's tokenizer, and reported at
        least once (a replica just found is placed on once it has answered)."""
        return [r for r in self if r.up and not r.gone and r.compatible and r.info is not None]

    def place(self, exclude: Replica | None = None) -> Replica | None:
        """The least-loaded replica that is up (ties at random), other than exclude; None when there is none."""
        choices = [r for r in self.placeable() if r is not exclude]
        if not choices:
            return None
        least = min(r.load() for r in choices)
        return random.choice([r for r in choices if r.load() == least])

    def fallback(self) -> Replica | None:
        """With none up: the replica down the longest, to try again (a lone server that restarts comes back so);
        None when the role has no replica at all (a name that resolves to no address)."""
        candidates = [r for r in self if not r.gone and r.compatible] or list(self)
        return min(candidates, key=lambda r: (r.up, r.down_since)) if candidates else None

    def capacity(self) -> tuple[int, int] | None:
        """Sessions and KV tokens of the replicas up, each the sum; None while none has reported."""
        up = self.placeable()
        if not up:
            return None
        return sum(r.info.max_sessions for r in up), sum(r.info.max_tokens for r in up)

    async def close_idle(self) -> None:
        for address, r in list(self.replicas.items()):
            if r.gone and r.placed == 0:
                del self.replicas[address]
                await r.client.close()

    async def close(self) -> None:
        await asyncio.gather(*(r.client.close() for r in self))
