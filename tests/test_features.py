"""A target's features (its final-norm rows, specdec.features): what Verify returns and GetFeatures streams are the
rows the target's output layer multiplies, for the session's current history (after rollbacks, across prefill
pieces and prefix-cache blocks), bit for bit what a lone pass computes, and nothing is computed without asking."""

from __future__ import annotations

import grpc
import pytest
import torch

from conftest import KERNEL_FORMS, kernel_runner
from specdec import features
from specdec.config import ModelServerConfig
from specdec.errors import ServiceError
from specdec.model_server import ModelServer, start_model_server
from specdec.prefix_cache import BLOCK
from specdec.runners.lean_llama import LeanLlamaRunner
from specdec.v1 import model_server_pb2 as ms, target_pb2, target_pb2_grpc

GREEDY = ms.SamplingParams(temperature=0.0, top_p=1.0)


# -- the wire format ------------------------------------------------------------------------------------------------
def test_encoded_features_are_little_endian_bfloat16_rows_and_decode_back_exactly():
    t = torch.tensor([[1.0, -2.0, 0.5], [3.140625, 0.0, -1e-3]])
    b = features.encode(t)
    assert len(b) == 2 * 6 and b[:2] == b"\x80\x3f"  # 1.0 in bfloat16 is 0x3f80, low byte first
    assert torch.equal(features.decode(b, 3), t.to(torch.bfloat16).float())
    with pytest.raises(ValueError, match="whole rows"):
        features.decode(b[:-2], 3)


def test_chunks_cover_the_rows_in_order_within_the_byte_limit():
    rows = torch.randn(11, 4)
    parts = list(features.chunks(rows, 100, limit=3 * 2 * 4))
    assert [(s, n) for s, n, _ in parts] == [(100, 3), (103, 3), (106, 3), (109, 2)]
    assert all(len(b) <= 3 * 2 * 4 for _, _, b in parts)
    assert torch.equal(torch.cat([features.decode(b, 4) for _, _, b in parts]), rows.to(torch.bfloat16).float())


def test_the_fingerprint_is_the_sha256_of_the_weight_rounded_to_bf16_whatever_its_dtype_and_size():
    import hashlib

    w = torch.randn(9000, 24)  # more rows than one block of the digest
    whole = lambda t: hashlib.sha256(t.bfloat16().float().numpy().astype("<f4").tobytes()).hexdigest()[:16]
    assert features.fingerprint(w) == whole(w) == features.fingerprint(w.to(torch.bfloat16))
    assert features.fingerprint(w) != hashlib.sha256(w.numpy().astype("<f4").tobytes()).hexdigest()[:16]
    assert features.fingerprint(w) != features.fingerprint(w * 1.01)


# -- the runner -----------------------------------------------------------------------------------------------------
def test_the_lean_runners_features_are_the_final_norm_output_of_transformers_for_the_embedded_target(
    target_model, tokenizer
):
    runner = LeanLlamaRunner(target_model, len(tokenizer), max_len=256)
    ids = tokenizer("The capital of France is Paris, and the capital of Italy is", return_tensors="pt")["input_ids"]
    logits, (feats,) = runner.forward_batch([runner.new_cache()], [ids[0].tolist()], [1], norm_rows=[ids.shape[1]])
    with torch.inference_mode():
        expected = target_model.model(input_ids=ids).last_hidden_state[0].float()  # after the final norm
        head = target_model.lm_head(expected[-1:])[0]
    assert feats.shape == expected.shape == (ids.shape[1], runner.feature_size)
    torch.testing.assert_close(feats.float(), expected, atol=2e-3, rtol=2e-3)
    # and they are what the output layer multiplies: the last row gives the last logits
    torch.testing.assert_close(logits[0][0], head, atol=2e-3, rtol=2e-3)


FEEDS = [list(range(100, 141)), [7], list(range(300, 304)), list(range(500, 600))]


@pytest.mark.parametrize("form", list(KERNEL_FORMS))
def test_a_sessions_features_are_the_same_bit_for_bit_alone_batched_or_cut_into_passes(
    tiny_draft, tiny_gguf, tokenizer, form
):
    runner = kernel_runner(form, tiny_draft, tiny_gguf, tokenizer)
    want = [len(FEEDS[0]), 0, len(FEEDS[2]), len(FEEDS[3])]  # every row fed, as a target that keeps features asks
    alone = [
        runner.forward_batch([runner.new_cache()], [f], [2 if len(f) > 1 else 1], norm_rows=[len(f)]) for f in FEEDS
    ]
    caches = [runner.new_cache() for _ in FEEDS]
    logits, feats = runner.forward_batch(caches, FEEDS, [2, 1, 2, 2], norm_rows=want)
    for i, (w, (a_logits, (a_feats,))) in enumerate(zip(want, alone)):
        assert torch.equal(logits[i], a_logits[0])  # asking for features changes no logits
        assert torch.equal(feats[i], a_feats) if w else feats[i] is None
    cut = runner.new_cache()
    parts = [runner.forward_batch([cut], [FEEDS[3][a:b]], [1], norm_rows=[b - a])[1][0] for a, b in ((0, 7), (7, 57))]
    parts.append(runner.forward_batch([cut], [FEEDS[3][57:]], [2], norm_rows=[len(FEEDS[3]) - 57])[1][0])
    assert torch.equal(torch.cat(parts), alone[3][1][0])
    # a head's ask, the last row alone, is the last row of them all
    last = runner.forward_batch([runner.new_cache()], [FEEDS[3]], [1], norm_rows=[1])[1][0]
    assert torch.equal(last, alone[3][1][0][-1:])


def test_a_pass_without_features_returns_the_logits_alone_as_before(tiny_draft, tokenizer):
    runner = kernel_runner("fewrow", tiny_draft, None, tokenizer)
    plain = runner.forward_batch([runner.new_cache(), runner.new_cache()], [[1, 2, 3], [4]], [2, 1])
    with_none = runner.forward_batch(
        [runner.new_cache(), runner.new_cache()], [[1, 2, 3], [4]], [2, 1], norm_rows=[0, 0]
    )
    assert isinstance(plain, list) and with_none[1] == [None, None]
    assert all(torch.equal(a, b) for a, b in zip(plain, with_none[0]))


# -- the target service ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def feature_target(event_loop_thread, tokenizer, tiny_draft):
    """A target server on tiny_draft, in specdec's kernels (batch-invariant), whose passes take at most 16 rows:
    a prompt of more is prefilled in several pieces."""
    from target_service.app import SERVICE_NAME
    from target_service.servicer import TargetServicer

    kernel_runner("fewrow", tiny_draft, None, tokenizer)  # skips where the kernels cannot build

    async def start():
        cfg = ModelServerConfig(
            role="target", model="t", port=0, metrics_port=0, matmul="fewrow", max_batch_tokens=16, max_draft_tokens=8
        )
        core = ModelServer(cfg, tiny_draft, tokenizer)
        server, port, *_ = await start_model_server(
            core,
            [(target_pb2_grpc.add_TargetServiceServicer_to_server, TargetServicer(core), SERVICE_NAME)],
            "127.0.0.1",
            0,
        )
        return core, server, port

    core, server, port = event_loop_thread.run(start())
    assert core.runner.batch_invariant and core.prefix is not None
    yield core, target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}")), event_loop_thread
    event_loop_thread.run(server.stop(0))


def _verify(stub, sid, expected, keep, tokens, drafts=(), want=True):
    cursor = ms.SessionCursor(session_id=sid, expected_length=expected, keep_length=keep, tokens=tokens)
    return stub.Verify(
        target_pb2.VerifyRequest(cursor=cursor, draft_tokens=list(drafts), sampling=GREEDY, return_features=want)
    )


def _get(stub, sid, expected, start, end):
    req = target_pb2.GetFeaturesRequest(session_id=sid, expected_length=expected, start=start, end=end)
    return list(stub.GetFeatures(req))


def _reference(target, tokens) -> torch.Tensor:
    """The features of a history in one lone pass of the server's runner: [len(tokens), hidden] as sent."""
    core, _, lt = target

    def run():
        runner = core.runner
        return runner.forward_batch([runner.new_cache()], [tokens], [1], norm_rows=[len(tokens)])[1][0]

    return lt.call(run).to(torch.bfloat16).float()


def _decoded(core, chunks) -> torch.Tensor:
    return torch.cat([features.decode(c.features, core.feature_size) for c in chunks])


def test_the_target_reports_its_feature_size_and_the_fingerprint_of_its_output_layer(feature_target, tiny_draft):
    core, stub, _ = feature_target
    info = stub.GetModelInfo(ms.GetModelInfoRequest())
    assert info.feature_size == core.feature_size == tiny_draft.config.hidden_size
    assert info.feature_fingerprint == features.fingerprint(tiny_draft.lm_head.weight)
    assert len(info.feature_fingerprint) == 16


def test_verify_returns_the_features_of_every_row_it_fed_as_a_lone_pass_computes_them(feature_target):
    core, stub, _ = feature_target
    prompt, drafts = list(range(1000, 1037)), [5, 6, 7]  # 37 + 3 rows: prefilled in pieces of at most 16
    r = _verify(stub, "verify", 0, 0, prompt, drafts)
    assert r.features_start == 0 and r.length == 40
    assert torch.equal(features.decode(r.features, core.feature_size), _reference(feature_target, prompt + drafts))
    r2 = _verify(stub, "verify", 40, 38, [9], [11, 12])  # two drafts rejected: the rows fed start at 38
    got = features.decode(r2.features, core.feature_size)
    assert r2.features_start == 38 and got.shape[0] == 3
    history = prompt + drafts[:1] + [9, 11, 12]
    assert torch.equal(got, _reference(feature_target, history)[38:])


def test_after_a_rollback_get_features_returns_the_new_history_not_the_drafted_rows(feature_target):
    core, stub, _ = feature_target
    prompt = list(range(2000, 2020))
    _verify(stub, "rollback", 0, 0, prompt, [1, 2, 3, 4])
    _verify(stub, "rollback", 24, 21, [8], [9])  # keeps one draft, then 8 and a new draft
    history = prompt + [1, 8, 9]
    got = _decoded(core, _get(stub, "rollback", 23, 0, 23))
    assert torch.equal(got, _reference(feature_target, history))
    stale = _reference(feature_target, prompt + [1, 2, 3, 4])
    assert not torch.equal(got[21], stale[21])  # the row at 21 is 8's now, not the rejected draft's


def test_get_features_streams_the_whole_history_in_chunks_under_the_limit(feature_target, monkeypatch):
    core, stub, _ = feature_target
    prompt = list(range(3000, 3045))  # three pieces of prefill
    _verify(stub, "chunks", 0, 0, prompt)
    _verify(stub, "chunks", 45, 45, [77], [78])
    limit = 2 * core.feature_size * 7
    monkeypatch.setattr(features, "CHUNK_BYTES", limit)
    chunks = _get(stub, "chunks", 47, 0, 47)
    assert [(c.start, c.count) for c in chunks] == [(i, min(7, 47 - i)) for i in range(0, 47, 7)]
    assert all(len(c.features) <= limit for c in chunks)
    assert torch.equal(_decoded(core, chunks), _reference(feature_target, prompt + [77, 78]))
    part = _get(stub, "chunks", 47, 10, 12)
    assert [(c.start, c.count) for c in part] == [(10, 2)]
    assert torch.equal(_decoded(core, part), _reference(feature_target, prompt + [77, 78])[10:12])


def test_a_session_takes_prefix_blocks_only_with_their_features_and_gets_those_a_lone_pass_computes(feature_target):
    core, stub, _ = feature_target
    hits = lambda: core.metrics.prefix_hits._value.get()
    opening = list(range(4000, 4000 + 3 * BLOCK))
    _verify(stub, "plain", 0, 0, opening + [1], want=False)  # its blocks hold no features
    before = hits()
    r = _verify(stub, "first", 0, 0, opening + [2])
    assert hits() == before  # not taken from blocks without features: computed, and given to them
    assert torch.equal(features.decode(r.features, core.feature_size), _reference(feature_target, opening + [2]))
    r = _verify(stub, "second", 0, 0, opening + [3])
    assert hits() == before + 3 * BLOCK  # the blocks have features now
    expected = _reference(feature_target, opening + [3])
    assert torch.equal(features.decode(r.features, core.feature_size), expected)
    assert torch.equal(_decoded(core, _get(stub, "second", len(expected), 0, len(expected))), expected)


def test_without_return_features_nothing_is_computed_nor_sent(feature_target):
    core, stub, lt = feature_target
    asked = []
    forward_batch = core.runner.forward_batch

    def recording(*args, **kw):
        asked.append(kw.get("norm_rows"))
        return forward_batch(*args, **kw)

    lt.call(setattr, core.runner, "forward_batch", recording)
    try:
        r = _verify(stub, "none", 0, 0, list(range(20)), [1, 2], want=False)
        r = _verify(stub, "none", 22, 22, [3], [4], want=False)
    finally:
        lt.call(delattr, core.runner, "forward_batch")
    assert r.features == b"" and r.features_start == 0
    assert asked and all(a is None for a in asked)
    assert lt.call(lambda: core.pool.lookup("none").features) is None


def _status(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code()


def test_feature_requests_that_cannot_be_served_get_the_status_that_says_why(feature_target):
    _, stub, _ = feature_target
    _verify(stub, "errs", 0, 0, list(range(10)), [1])
    _verify(stub, "plain-errs", 0, 0, list(range(10)), want=False)
    assert _status(lambda: _get(stub, "nobody", 11, 0, 5)) == grpc.StatusCode.NOT_FOUND
    assert _status(lambda: _get(stub, "errs", 10, 0, 5)) == grpc.StatusCode.FAILED_PRECONDITION  # it holds 11
    for start, end in ((5, 5), (6, 5), (0, 12)):
        assert _status(lambda a=start, b=end: _get(stub, "errs", 11, a, b)) == grpc.StatusCode.INVALID_ARGUMENT
    # a session created without features keeps none: neither GetFeatures nor a later Verify can have them
    assert _status(lambda: _get(stub, "plain-errs", 10, 0, 5)) == grpc.StatusCode.FAILED_PRECONDITION
    assert _status(lambda: _verify(stub, "plain-errs", 10, 10, [1])) == grpc.StatusCode.FAILED_PRECONDITION
    assert len(_get(stub, "errs", 11, 0, 11)) == 1  # the refused calls changed nothing


def test_the_stock_runner_reports_no_features_and_refuses_to_return_them(tokenizer, tiny_draft):
    import asyncio

    from target_service.servicer import TargetServicer

    core = ModelServer(ModelServerConfig(role="target", model="t", metrics_port=0, runner="hf"), tiny_draft, tokenizer)
    assert core.info.feature_size == 0 and core.info.feature_fingerprint == ""
    cursor = ms.SessionCursor(session_id="s", tokens=[1, 2, 3])
    req = target_pb2.VerifyRequest(cursor=cursor, sampling=GREEDY, return_features=True)
    with pytest.raises(ServiceError) as err:
        asyncio.run(TargetServicer(core)._verify(req))
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and "feature_size 0" in err.value.message
    assert len(core.pool) == 0
