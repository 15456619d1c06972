"""Between services: TLS, mutual TLS to the model servers, and the clients' bearer token."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import grpc
import pytest

from conftest import make_stack, stop_stack
from specdec.config import ConfigError, ModelServerConfig, OrchestratorConfig
from specdec.health import health_status
from specdec.server import channel_credentials, start_health_server
from specdec.v1 import generation_pb2 as gen_pb, generation_pb2_grpc, model_server_pb2 as ms, target_pb2_grpc

REQUEST = dict(prompt="The capital of France is", max_tokens=10, temperature=0.0, num_speculative_tokens=2)


def _certificates(folder):
    """A CA, a server certificate and a client certificate it signed, and a client certificate from another CA;
    PEM files in folder, as a Kubernetes Secret would mount them."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def issue(name, issuer=None, ca=False, sans=()):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer[0].subject if issuer else subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
        cert = builder.sign(issuer[1] if issuer else key, hashes.SHA256())
        return cert, key

    def write(name, cert, key):
        (folder / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (folder / f"{name}.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )

    ca = issue("specdec test CA", ca=True)
    write("ca", *ca)
    write(
        "server",
        *issue(
            "specdec-model-server",
            ca,
            sans=[
                x509.DNSName("specdec-model-server"),
                x509.DNSName("localhost"),
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            ],
        ),
    )
    write("client", *issue("specdec-orchestrator", ca))
    other = issue("another CA", ca=True)
    write("other", *issue("intruder", other))
    return {
        name: str(folder / name)
        for name in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key", "other.pem", "other.key")
    }


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return _certificates(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def secure_stack(event_loop_thread, tokenizer, tiny_draft, target_model, certs):
    """Model servers that require client certificates from the CA; an orchestrator that presents one, serves
    TLS itself and requires a bearer token."""
    server = {"tls_cert": certs["server.pem"], "tls_key": certs["server.key"], "tls_client_ca": certs["ca.pem"]}
    stack = make_stack(
        event_loop_thread,
        tokenizer,
        tiny_draft,
        target_model,
        draft_cfg=server,
        target_cfg=server,
        orch_cfg={
            "tls_cert": certs["server.pem"],
            "tls_key": certs["server.key"],
            "api_key": "s3cret",
            "upstream_tls_ca": certs["ca.pem"],
            "upstream_tls_cert": certs["client.pem"],
            "upstream_tls_key": certs["client.key"],
            "upstream_tls_name": "specdec-model-server",
        },
    )
    yield stack
    stop_stack(stack)


def _generate(address, certs, token=None, **fields):
    creds = channel_credentials(certs["ca.pem"])
    metadata = [("authorization", f"Bearer {token}")] if token is not None else None
    with grpc.secure_channel(address, creds) as channel:
        ids = []
        for msg in generation_pb2_grpc.GenerationStub(channel).Generate(
            gen_pb.GenerateRequest(**fields), timeout=60, metadata=metadata
        ):
            ids.extend(msg.token_ids)
        return ids


def test_over_mutual_tls_with_the_token_the_output_is_the_plaintext_output(secure_stack, tiny_stack, certs):
    expected = tiny_stack.generate(**REQUEST)[0]
    assert _generate(secure_stack.address, certs, "s3cret", **REQUEST) == expected


@pytest.mark.parametrize("token", [None, "wrong", ""])
def test_a_client_without_the_token_is_unauthenticated(secure_stack, certs, token):
    with pytest.raises(grpc.RpcError) as err:
        _generate(secure_stack.address, certs, token, **REQUEST)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "authorization: Bearer" in err.value.details()
    assert secure_stack.metric("specdec_request_errors_total", {"code": "UNAUTHENTICATED"}) >= 1


def test_a_plaintext_client_of_a_tls_orchestrator_is_refused(secure_stack):
    with pytest.raises(grpc.RpcError) as err:
        secure_stack.generate(**REQUEST)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("client", ["plaintext", "no certificate", "another CA's certificate"])
def test_a_model_server_refuses_a_client_without_a_certificate_from_its_ca(secure_stack, certs, client, tiny_stack):
    address = next(iter(secure_stack.servicer.target)).address
    if client == "plaintext":
        channel = grpc.insecure_channel(address)
    else:
        key, cert = (
            (None, None)
            if client == "no certificate"
            else (Path(certs["other.key"]).read_bytes(), Path(certs["other.pem"]).read_bytes())
        )
        channel = grpc.secure_channel(
            address,
            grpc.ssl_channel_credentials(Path(certs["ca.pem"]).read_bytes(), key, cert),
            options=[("grpc.ssl_target_name_override", "specdec-model-server")],
        )
    with channel, pytest.raises(grpc.RpcError) as err:
        target_pb2_grpc.TargetServiceStub(channel).GetModelInfo(ms.GetModelInfoRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    # nothing else harmed: the orchestrator's own calls still go through
    assert _generate(secure_stack.address, certs, "s3cret", **REQUEST) == tiny_stack.generate(**REQUEST)[0]


def test_the_plaintext_health_port_serves_the_servers_statuses_and_nothing_else(event_loop_thread):
    """Kubernetes' gRPC probes speak no TLS: --health-port serves the main server's health statuses in plaintext."""
    from grpc_health.v1 import health, health_pb2

    from specdec.server import free_ports

    port = free_ports(1)[0]
    servicer = health.aio.HealthServicer()  # the main server's, shared

    async def start():
        await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        return await start_health_server("127.0.0.1", port, servicer)

    server = event_loop_thread.run(start())
    try:
        assert health_status(f"127.0.0.1:{port}") == "SERVING"
        event_loop_thread.run(servicer.enter_graceful_shutdown())  # what the main server does as it drains
        assert health_status(f"127.0.0.1:{port}") == "NOT_SERVING"
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, pytest.raises(grpc.RpcError) as err:
            next(generation_pb2_grpc.GenerationStub(channel).Generate(gen_pb.GenerateRequest(prompt="hi"), timeout=5))
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        event_loop_thread.run(server.stop(0))


def test_tls_settings_that_do_not_fit_together_are_refused(certs):
    with pytest.raises(ConfigError, match="--tls-cert and --tls-key go together"):
        ModelServerConfig(tls_cert=certs["server.pem"]).validate()
    with pytest.raises(ConfigError, match="needs --tls-cert"):
        ModelServerConfig(tls_client_ca=certs["ca.pem"]).validate()
    with pytest.raises(ConfigError, match="no such file"):
        ModelServerConfig(tls_cert="/nonexistent.pem", tls_key=certs["server.key"]).validate()
    with pytest.raises(ConfigError, match="need --upstream-tls-ca"):
        OrchestratorConfig(upstream_tls_cert=certs["client.pem"], upstream_tls_key=certs["client.key"]).validate()


def test_a_replica_without_the_right_certificate_takes_no_generation_and_harms_none(
    event_loop_thread, tokenizer, tiny_draft, target_model, tiny_stack, certs, tmp_path
):
    """Two target replicas behind mutual TLS, one serving a certificate another CA signed: the orchestrator's
    handshakes with it fail, so it is down to the orchestrator, and every request runs on the other."""
    from test_replicas import Cluster

    good = {"tls_cert": certs["server.pem"], "tls_key": certs["server.key"], "tls_client_ca": certs["ca.pem"]}
    intruder = {"tls_cert": certs["other.pem"], "tls_key": certs["other.key"], "tls_client_ca": certs["ca.pem"]}
    upstream = {
        "upstream_tls_ca": certs["ca.pem"],
        "upstream_tls_cert": certs["client.pem"],
        "upstream_tls_key": certs["client.key"],
        "upstream_tls_name": "specdec-model-server",
    }
    expected = [
        tiny_stack.generate(prompt=f"Count to {i + 3}:", max_tokens=8, temperature=0.0, num_speculative_tokens=0)[0]
        for i in range(4)
    ]
    cluster = Cluster(
        event_loop_thread,
        tokenizer,
        tiny_draft,
        target_model,
        targets=2,
        target_cfg=[good, intruder],
        draft_cfg=good,
        orch_cfg=upstream,
    )
    try:
        stack = cluster.stacks[0]
        got = [
            stack.generate(prompt=f"Count to {i + 3}:", max_tokens=8, temperature=0.0, num_speculative_tokens=2)[0]
            for i in range(4)
        ]
        assert got == expected
        bad = cluster.servers[cluster.targets[1]][1]
        assert stack.metric("specdec_replica_up", {"role": "target", "replica": bad}) == 0
        assert stack.metric("specdec_replica_generations_total", {"role": "target", "replica": bad}) == 0
    finally:
        cluster.stop()
