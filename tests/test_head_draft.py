"""A head draft (EAGLE-1 style) through the real services: its file, its runner, the features it reads, and the
target's output unchanged whatever it proposes. The head is random, built in memory for the embedded target."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from conftest import make_stack, stop_stack
from draft_service.servicer import DraftServicer
from orchestrator import head_draft
from specdec import features, head, models
from specdec.config import ConfigError
from specdec.runners.lean_llama import LeanLlamaRunner, TorchLayerOps
from specdec.v1 import draft_pb2, draft_pb2_grpc, generation_pb2 as gen_pb, model_server_pb2 as ms
from target_service.servicer import TargetServicer
from test_exactness import PROMPTS, chat_ids

MAX_TOKENS = 32


@pytest.fixture(scope="module")
def head_model(target_model):
    return head.random_head(target_model, models.DEFAULT_TARGET, seed=0, intermediate_size=512)


class RecordingTarget(TargetServicer):
    """The target servicer, counting GetFeatures calls and keeping each session's features after every Verify."""

    def __init__(self, core):
        super().__init__(core)
        self.get_features = 0
        self.kept = {}
        self.verifies = []  # (expected_length, rows fed, return_features) of each Verify

    async def GetFeatures(self, request, context):
        self.get_features += 1
        async for chunk in super().GetFeatures(request, context):
            yield chunk

    async def _verify(self, req):
        self.verifies.append(
            (req.cursor.expected_length, len(req.cursor.tokens) + len(req.draft_tokens), req.return_features)
        )
        resp = await super()._verify(req)
        s = self.core.pool.lookup(req.cursor.session_id)
        if s.features is not None:
            self.kept[s.id] = (list(s.tokens), s.features.read(0, len(s.tokens)).clone())
        return resp


class RecordingDraft(DraftServicer):
    """The draft servicer, keeping each head session's tokens and keys after every ProposeTokens, and what each
    call asked (expected_length, num_tokens, tokens)."""

    def __init__(self, core):
        super().__init__(core)
        self.kept, self.requests = {}, []

    async def _propose(self, req):
        self.requests.append((req.cursor.expected_length, req.num_tokens, len(req.cursor.tokens)))
        resp = await super()._propose(req)
        s = self.core.pool.lookup(req.cursor.session_id)
        n = len(s.tokens)
        self.kept[s.id] = (list(s.tokens), s.cache.k[:, :, :n].clone(), s.cache.v[:, :, :n].clone())
        return resp


@pytest.fixture(scope="module")
def head_stack(event_loop_thread, tokenizer, head_model, target_model):
    stack = make_stack(
        event_loop_thread,
        tokenizer,
        head_model,
        target_model,
        draft_servicer=RecordingDraft,
        target_servicer=RecordingTarget,
        draft_cfg={"matmul": "fewrow", "quantize": "none"},
    )
    yield stack
    stop_stack(stack)


@pytest.fixture(scope="module")
def reference(tokenizer, target_model):
    """The target alone, greedy, with transformers' generate()."""
    out = []
    for text in PROMPTS[:3]:
        ids = torch.tensor([chat_ids(tokenizer, text)])
        gen = target_model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)[0, ids.shape[1] :].tolist()
        out.append([t for t in gen if t != tokenizer.eos_token_id])
    return out


# -- the file and the runner ---------------------------------------------------------------------------------
def test_a_saved_head_loads_with_the_same_weights_config_and_fingerprint(tmp_path, head_model, target_model):
    folder = head.save_head(tmp_path / "head", head_model, dtype=torch.float32)
    assert head.is_head(str(folder)) and not head.is_head(models.resolve(models.DEFAULT_TARGET))
    loaded = models.load_model(str(folder))  # a head's folder is a model spec like any other
    for name, w in head.head_weights(head_model).items():
        assert torch.equal(head.head_weights(loaded)[name], w), name
    info = loaded.specdec_head
    assert info.target == models.DEFAULT_TARGET and info.feature_size == target_model.config.hidden_size
    assert info.feature_fingerprint == features.fingerprint(target_model.get_output_embeddings().weight)
    assert torch.equal(loaded.model.embed_tokens.weight, target_model.model.embed_tokens.weight)
    assert len(models.load_tokenizer(str(folder))) == target_model.config.vocab_size  # the target's tokenizer
    with pytest.raises(ValueError, match=r"fc\.weight must be"):
        w = head.head_weights(head_model)
        head.build(head_model.config, {**w, "fc.weight": w["fc.weight"][:, :10]}, target_model, "t")


def test_the_head_runner_computes_fc_then_one_llama_layer_then_its_norm(head_model, target_model):
    """Against transformers' own layer: x0 = fc . [E(t_p) ; f_{p-1}], the decoder layer, the head's norm (g), the
    target's lm_head; and g is returned for the rows asked."""
    runner = LeanLlamaRunner(head_model, target_model.config.vocab_size, 256, matmul="linear")
    ids, feats = [5, 17, 300, 42, 9], torch.randn(5, head_model.config.hidden_size)
    logits, norms = runner.forward_batch([runner.new_cache()], [ids], [2], features_in=[feats], norm_rows=[3])
    with torch.no_grad():
        x0 = torch.cat([target_model.model.embed_tokens.weight[ids], feats], 1) @ head_model.specdec_head.fc.T
        g = head_model.model(inputs_embeds=x0[None], position_ids=torch.arange(5)[None]).last_hidden_state[0]
    torch.testing.assert_close(norms[0], g[-3:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[0], head_model.lm_head(g[-2:]), atol=1e-3, rtol=1e-4)


def test_a_head_on_int8_products_mixes_its_input_on_fc_s_int8_rows_row_by_row(head_model, target_model):
    """With the draft's int8 products, fc runs on int8 rows too (one scale per output row, as the layer's): the mix
    is [E(t) ; f] times the dequantized rows, and a row's mix is the same alone as among others, bit for bit."""
    runner = LeanLlamaRunner(head_model, target_model.config.vocab_size, 256, matmul="fewrow", quantize="int8")
    if runner.layer_ops is TorchLayerOps:
        pytest.skip("specdec's CPU kernels are not built here")
    q, scale = runner.mix
    assert q.dtype == torch.int8 and scale.shape == (head_model.config.hidden_size,)
    ids, feats = [5, 17, 300], torch.randn(3, head_model.config.hidden_size)
    mixed = runner._mixed(runner.embed[ids], [feats], [3])
    x = torch.cat([target_model.model.embed_tokens.weight[ids], feats], 1)
    torch.testing.assert_close(mixed, x @ (q[:, : x.shape[1]].float() * scale[:, None]).T, atol=1e-4, rtol=1e-4)
    for i in range(3):
        assert torch.equal(runner._mixed(runner.embed[ids[i : i + 1]], [feats[i : i + 1]], [1])[0], mixed[i])


def test_a_head_on_int4_weights_mixes_its_input_on_fc_s_q4_1_blocks_row_by_row(head_model, target_model):
    """With --quantize int4, fc takes the layer's form too: Q4_1 blocks with x quantized per row (few_rows_q8), the
    mix is their reference product, and a row's mix is the same alone as among others, bit for bit."""
    from specdec.runners import q8_blocks

    try:
        runner = LeanLlamaRunner(head_model, target_model.config.vocab_size, 256, quantize="int4", activations="int8")
    except ValueError as e:  # no specdec kernels, or a CPU without AVX2
        pytest.skip(str(e))
    assert runner.mix.format == "Q4_1" and runner.plan.long.name == "q4_1-q8"
    ids, feats = [5, 17, 300], torch.randn(3, head_model.config.hidden_size)
    mixed = runner._mixed(runner.embed[ids], [feats], [3])
    x = torch.cat([target_model.model.embed_tokens.weight[ids], feats], 1)
    torch.testing.assert_close(mixed, q8_blocks.reference(x, runner.mix), atol=1e-4, rtol=1e-4)
    for i in range(3):
        assert torch.equal(runner._mixed(runner.embed[ids[i : i + 1]], [feats[i : i + 1]], [1])[0], mixed[i])


def test_features_round_trip_as_bf16_rows():
    t = torch.randn(3, 8)
    data = features.encode(t)
    assert len(data) == 3 * 8 * 2
    assert torch.equal(features.decode(data, 8), t.to(torch.bfloat16).float())


def test_the_feature_log_sends_zeros_before_position_0_and_asks_for_what_it_lacks():
    log = head_draft.FeatureLog(2)
    rows = lambda *vals: features.encode(torch.tensor([[v, v] for v in vals], dtype=torch.float32))
    log.absorb(0, rows(1, 2, 3, 4))
    assert features.decode(log.span(-1, 2), 2)[:, 0].tolist() == [0, 1, 2]
    log.absorb(2, rows(7, 8))  # a later Verify replaces what follows its first row
    assert features.decode(log.span(1, 4), 2)[:, 0].tolist() == [2, 7, 8]
    log.trim(2)
    with pytest.raises(head_draft.MissingFeatures) as e:
        log.span(0, 3)
    assert (e.value.start, e.value.end) == (0, 3)
    log.prepend(0, rows(1, 2))
    assert features.decode(log.span(-1, 4), 2)[:, 0].tolist() == [0, 1, 2, 7, 8]


# -- the draft service's contract ------------------------------------------------------------------------------
def _propose(address, tokens, k=2, data=b"", sid="x"):
    stub = draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(address))
    return stub.ProposeTokens(
        draft_pb2.ProposeTokensRequest(
            cursor=ms.SessionCursor(session_id=sid, expected_length=0, tokens=tokens),
            num_tokens=k,
            sampling=ms.SamplingParams(temperature=0.0, top_p=1.0),
            features=data,
        ),
        timeout=60,
    )


def test_a_head_draft_refuses_missing_or_wrong_size_features(head_stack):
    size = head_stack.draft.feature_size
    for data in (b"", bytes(2 * size * 2)):  # none; two rows for three tokens
        with pytest.raises(grpc.RpcError) as e:
            _propose(head_stack.draft_address, [1, 2, 3], data=data)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "feature row" in e.value.details()
    resp = _propose(head_stack.draft_address, [1, 2, 3], data=bytes(3 * size * 2))
    assert len(resp.token_ids) == 2 and resp.length == 3  # the head keeps no drafted token
    resp = _propose(head_stack.draft_address, [1, 2, 3], k=0, data=bytes(3 * size * 2))
    assert not resp.token_ids and resp.length == 3
    info = draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(head_stack.draft_address)).GetModelInfo(
        ms.GetModelInfoRequest()
    )
    assert info.reads_features and info.feature_size == size and info.forward.startswith("EAGLE-1 head over embedded:")


def test_a_standalone_draft_refuses_features(tiny_stack):
    with pytest.raises(grpc.RpcError) as e:
        _propose(tiny_stack.draft_address, [1, 2, 3], data=bytes(3 * 64 * 2))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "standalone draft" in e.value.details()
    assert not _propose(tiny_stack.draft_address, [1, 2, 3], k=0).token_ids  # num_tokens 0: append only


def test_start_up_refuses_a_head_of_another_target(event_loop_thread, tokenizer, target_model):
    other = head.random_head(target_model, models.DEFAULT_TARGET, seed=1, intermediate_size=64)
    other.specdec_head.feature_fingerprint = "0123456789abcdef"
    with pytest.raises(ConfigError, match="reads the features of a target with lm_head fingerprint 0123456789abcdef"):
        make_stack(event_loop_thread, tokenizer, other, target_model)


# -- through the services --------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_output_with_a_head_draft_equals_the_target_alone(head_stack, reference, k):
    for text, expected in zip(PROMPTS[:3], reference):
        ids, _, stats = head_stack.generate(
            messages=[("user", text)], max_tokens=MAX_TOKENS, temperature=0.0, num_speculative_tokens=k
        )
        assert ids == expected[:MAX_TOKENS]
        assert stats.draft_tokens > 0  # the head drafted (from the second round on)


def test_the_head_session_after_a_round_is_a_fresh_head_fed_the_history_with_the_targets_features(
    head_stack, target_model, tokenizer
):
    """The proposals use the true features: after every round the head's session holds what a new session fed the
    whole history, each token with the target's feature at the position before it, holds, bit for bit."""
    draft_kept, target_kept = head_stack.servicers_draft.kept, head_stack.servicers_target.kept
    draft_kept.clear()
    prompt = chat_ids(tokenizer, PROMPTS[3])
    ids, _, _ = head_stack.generate(
        messages=[("user", PROMPTS[3])], max_tokens=20, temperature=0.0, num_speculative_tokens=3
    )
    (sid,) = draft_kept
    tokens, k, v = draft_kept[sid]
    target_tokens, target_rows = target_kept[sid]
    assert tokens == (prompt + ids)[: len(tokens)] == target_tokens[: len(tokens)]
    with torch.no_grad():  # the target's features are its final-norm output (hidden_states[-1] is after the norm)
        hf = target_model(torch.tensor([target_tokens]), output_hidden_states=True).hidden_states[-1][0]
    torch.testing.assert_close(target_rows.float(), hf, atol=0.05, rtol=0.02)
    rows = torch.cat([torch.zeros(1, target_rows.shape[1]), target_rows[: len(tokens) - 1].float()])

    def fresh():
        runner = head_stack.draft.runner
        cache = runner.new_cache()
        runner.forward_batch([cache], [tokens], [1], features_in=[rows])
        return cache.k[:, :, : len(tokens)].clone(), cache.v[:, :, : len(tokens)].clone()

    k_fresh, v_fresh = head_stack.lt.call(fresh)
    assert torch.equal(k_fresh, k) and torch.equal(v_fresh, v)


def test_a_verify_whose_features_would_pass_the_bound_goes_in_pieces_each_returning_features(
    head_stack, reference, head_model, monkeypatch
):
    """A long history's first Verify would answer with every row's features in one message: past VERIFY_BYTES it
    is cut into pieces, each a Verify with return_features (the first creates the session that keeps them), and
    the output is the target's."""
    rows = 7
    monkeypatch.setattr(head_draft, "VERIFY_BYTES", rows * 2 * head_model.config.hidden_size)
    verifies = head_stack.servicers_target.verifies
    verifies.clear()
    ids, _, stats = head_stack.generate(
        messages=[("user", PROMPTS[0])], max_tokens=MAX_TOKENS, temperature=0.0, num_speculative_tokens=3
    )
    assert ids == reference[0][:MAX_TOKENS] and stats.draft_tokens > 0
    assert all(want for _, _, want in verifies)  # every Verify asks, the first included
    assert verifies[0][0] == 0 and verifies[0][1] == rows  # the session is created by the first piece
    assert sum(n == rows for _, n, _ in verifies[:3]) == 3, verifies  # the prompt went in pieces of `rows`
    assert all(n <= max(rows, 1 + 3) for _, n, _ in verifies)


def test_a_seeded_sampled_request_with_a_head_draft_replays(head_stack):
    kw = dict(prompt="Name three rivers:", max_tokens=24, temperature=0.8, top_p=0.95, seed=7, num_speculative_tokens=3)
    first, _, stats = head_stack.generate(**kw)
    assert head_stack.generate(**kw)[0] == first and stats.draft_tokens > 0


def test_concurrent_generations_with_a_head_draft_keep_their_outputs(head_stack):
    prompts = [f"Write a list of {i + 3} animals:" for i in range(4)]
    kw = dict(max_tokens=24, temperature=0.0, num_speculative_tokens=3)
    alone = [head_stack.generate(prompt=p, **kw)[0] for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: head_stack.generate(prompt=p, **kw)[0], prompts))
    assert together == alone


def test_a_head_draft_killed_mid_stream_is_rebuilt_in_pieces_from_the_targets_features(
    event_loop_thread, tokenizer, head_model, target_model, head_stack, monkeypatch
):
    """The draft server dies mid-stream and a fresh one starts on its port: the target carries the rounds alone
    meanwhile, then the new head session is built from GetFeatures, in pieces (num_tokens 0), and the output is the
    target's."""
    from specdec.model_server import ModelServer, start_model_server

    monkeypatch.setattr(head_draft, "PIECE_BYTES", 16 * 2 * head_model.config.hidden_size)  # 16 rows a piece
    kw = dict(max_tokens=40, temperature=0.0, num_speculative_tokens=3)
    expected, _, _ = head_stack.generate(messages=[("user", PROMPTS[1])], **kw)
    stack = make_stack(event_loop_thread, tokenizer, head_model, target_model, target_servicer=RecordingTarget)
    try:
        port = int(stack.draft_address.rsplit(":", 1)[1])
        fetched = stack.servicers_target.get_features
        restarted = {}

        async def kill_draft():
            await stack.servers[1].stop(0)

        async def restart_draft():
            core = ModelServer(stack.draft.cfg, head_model, tokenizer)
            restarted["draft"] = RecordingDraft(core)
            server, *_ = await start_model_server(
                core,
                [(draft_pb2_grpc.add_DraftServiceServicer_to_server, restarted["draft"], "specdec.v1.DraftService")],
                "127.0.0.1",
                port,
            )
            stack.servers[1] = server
            await stack.servicer.refresh()

        request = gen_pb.GenerateRequest(messages=[gen_pb.ChatMessage(role="user", content=PROMPTS[1])], **kw)
        call = stack.stub().Generate(request)
        ids = list(next(call).token_ids) + list(next(call).token_ids)
        event_loop_thread.run(kill_draft())
        ids += list(next(call).token_ids)
        event_loop_thread.run(restart_draft())
        for msg in call:
            ids += msg.token_ids
        assert ids == expected
        assert stack.metric("specdec_draft_fallback_rounds_total") >= 1
        assert stack.servicers_target.get_features > fetched  # the old rows came from the target
        calls = restarted["draft"].requests
        assert calls[0][0] == 0 and calls[0][1] == 0 and calls[0][2] == 16, calls  # built in pieces from the start
        assert any(k for _, k, _ in calls)  # then it drafted
    finally:
        stop_stack(stack)


def test_a_target_loaded_in_bf16_has_the_feature_fingerprint_of_its_float32_load():
    """A head trained against the float32 target must serve beside the same target loaded in bf16 on a GPU."""
    import torch

    from specdec.features import fingerprint

    w = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    assert fingerprint(w) == fingerprint(w.to(torch.bfloat16))
    assert fingerprint(w) != fingerprint(w * 1.01)


def test_the_shipped_head_reads_the_embedded_target_s_features(target_model):
    """models/smollm2-head loads as a draft model spec and records the embedded target's feature fingerprint, so the
    orchestrator accepts it beside the default target; it scores some of the tokens the embedded draft scores."""
    folder = str(models.REPO_MODELS["smollm2-135m-draft"].parent / "smollm2-head")
    loaded = models.load_model(folder)
    assert loaded.specdec_head.target == models.DEFAULT_TARGET
    assert loaded.specdec_head.feature_fingerprint == features.fingerprint(target_model.get_output_embeddings().weight)
    scored = loaded.config.specdec_output_token_ids
    draft = json.loads((models.REPO_MODELS["smollm2-135m-draft"] / "config.json").read_text())
    assert scored == sorted(set(scored)) and len(scored) > 0 and set(scored) <= set(draft["specdec_output_token_ids"])
