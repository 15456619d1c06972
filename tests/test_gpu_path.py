"""The GPU path, checked on the CPU: what would fail, wait or run out of memory on a CUDA device shows up here.

Seen only on a device, and left to tools/gpu_smoke.py: which attention kernel CUDA picks in the end, the
real allocator's peak, and the time of a pass."""

from __future__ import annotations

import asyncio
import copy
import re
import time
from pathlib import Path

import pytest
import torch
from torch.nn.attention.bias import CausalBias
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from specdec import memory, models
from specdec.config import ConfigError, ModelServerConfig
from specdec.engine import Engine
from specdec.kv_pool import SessionPool
from specdec.runners import CausalLMRunner, LeanLlamaRunner, to_host
from specdec.v1 import model_server_pb2 as ms_pb
from tests.conftest import make_stack, stop_stack

ROOT = Path(__file__).resolve().parent.parent
READS = {
    torch.Tensor.numpy,
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__bool__,
    torch.Tensor.__index__,
    torch.Tensor.__array__,
}


class DeviceTensor(torch.Tensor):
    """A runner's output behaving as a CUDA tensor does: what is computed from it stays on the device; reading
    its values into Python or numpy, or mixing it with a CPU tensor, raises; .cpu() gives a CPU tensor."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in READS:
            raise AssertionError(f"{func.__name__} of a runner's output before the host boundary")
        with torch._C.DisableTorchFunctionSubclass():
            if func is torch.Tensor.cpu or (
                func is torch.Tensor.to and "cpu" in map(str, [*args[1:], *kwargs.values()])
            ):
                return func(*args, **kwargs).as_subclass(torch.Tensor)
        if any(type(t) is torch.Tensor and t.dim() > 0 for t in tree_flatten((args, kwargs))[0]):
            raise AssertionError(f"{func.__name__} mixes a runner's output (on the device) with a CPU tensor")
        return super().__torch_function__(func, types, args, kwargs)


def on_device(runner):
    """The runner, its outputs made DeviceTensors."""
    inner = runner.forward_batch

    def forward_batch(*a, **k):
        """Logits, and with norm_rows the final-norm rows beside them, all on the "device"."""
        out = inner(*a, **k)
        logits, norms = out if "norm_rows" in k else (out, None)
        logits = [t.as_subclass(DeviceTensor) for t in logits]
        return logits if norms is None else (logits, [n if n is None else n.as_subclass(DeviceTensor) for n in norms])

    runner.forward_batch = forward_batch
    return runner


@pytest.mark.parametrize("runner", ["lean", "hf"])
def test_runner_outputs_reach_python_and_numpy_only_through_the_host_boundary(
    runner, event_loop_thread, tokenizer, tiny_draft, target_model, monkeypatch
):
    import specdec.model_server as model_server
    import specdec.sampling as sampling

    make, kernels_for = model_server.make_runner, sampling.kernels_for
    monkeypatch.setattr(model_server, "make_runner", lambda *a, **k: on_device(make(*a, **k)))
    # specdec's CPU kernels take no device tensor, so sampling takes torch's ops on one
    monkeypatch.setattr(sampling, "kernels_for", lambda t: None if isinstance(t, DeviceTensor) else kernels_for(t))
    stack = make_stack(
        event_loop_thread,
        tokenizer,
        tiny_draft,
        target_model,
        draft_cfg={"runner": runner},
        target_cfg={"runner": runner},
    )
    try:
        chat = [("user", "Name three colours.")]
        alone, _, _ = stack.generate(messages=chat, max_tokens=10, temperature=0, num_speculative_tokens=0)
        greedy, _, _ = stack.generate(messages=chat, max_tokens=10, temperature=0, num_speculative_tokens=3)
        sampled, _, stats = stack.generate(
            messages=chat, max_tokens=10, temperature=0.8, seed=5, num_speculative_tokens=3
        )
        ruled = [  # output rules on both servers: a grammar's masks, penalties, a bias and min_tokens
            stack.generate(messages=chat, max_tokens=10, temperature=t, seed=5, num_speculative_tokens=k, **RULES)[0]
            for t, k in ((0, 0), (0, 3), (0.8, 3))
        ]
    finally:
        stop_stack(stack)
    assert greedy == alone and len(sampled) == stats.completion_tokens > 0
    assert ruled[0] == ruled[1] and all(ruled)


RULES = dict(
    grammar=ms_pb.Grammar(regex="[a-z ,]+"),
    logit_bias={11: -5.0},
    presence_penalty=0.5,
    frequency_penalty=0.2,
    repetition_penalty=1.1,
    min_tokens=5,
)


def test_a_targets_features_reach_the_wire_only_through_the_host_boundary(tiny_draft, tokenizer, monkeypatch):
    """A session that keeps features: its rows come off the "device" into the store and the Verify's bytes, and
    they are those of the runner on the CPU."""
    import specdec.model_server as model_server
    import specdec.sampling as sampling
    from specdec import features
    from specdec.v1 import model_server_pb2 as ms, target_pb2
    from target_service.servicer import TargetServicer

    make, kernels_for = model_server.make_runner, sampling.kernels_for
    monkeypatch.setattr(model_server, "make_runner", lambda *a, **k: on_device(make(*a, **k)))
    monkeypatch.setattr(sampling, "kernels_for", lambda t: None if isinstance(t, DeviceTensor) else kernels_for(t))
    cfg = ModelServerConfig(role="target", model="t", metrics_port=0, runner="lean", prefix_cache_tokens=0)
    core = model_server.ModelServer(cfg, tiny_draft, tokenizer)
    tokens, greedy = list(range(40, 60)), ms.SamplingParams(temperature=0.0, top_p=1.0)
    req = target_pb2.VerifyRequest(
        cursor=ms.SessionCursor(session_id="s", tokens=tokens),
        draft_tokens=[3, 4],
        sampling=greedy,
        return_features=True,
    )
    resp = asyncio.run(TargetServicer(core)._verify(req))
    runner = core.runner  # a lone pass on a fresh cache: batch-invariant, so the same rows
    _, (expected,) = runner.forward_batch([runner.new_cache()], [tokens + [3, 4]], [3], norm_rows=[22])
    assert isinstance(expected, DeviceTensor)
    expected = expected.cpu()
    got = features.decode(resp.features, core.feature_size)
    assert torch.equal(got, expected.to(torch.bfloat16).float()) and resp.features_start == 0
    assert torch.equal(core.pool.lookup("s").features.read(0, 22).float(), got)


class SdpaCalls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            self.calls.append((args[0].shape[-2], kwargs.get("attn_mask"), kwargs.get("enable_gqa", False)))
        return func(*args, **kwargs)


def test_several_row_attention_is_a_call_cudas_fast_kernels_take(target_model, tokenizer):
    # CUDA's flash kernel takes no dense mask and the memory-efficient one no grouped KV heads: a dense mask
    # with enable_gqa leaves only the float32 math kernel, gigabytes at a long prefill piece.
    runner = LeanLlamaRunner(copy.deepcopy(target_model).to(torch.bfloat16), len(tokenizer), 256)  # torch's ops
    cache = runner.new_cache()
    with SdpaCalls() as mode:
        runner.forward(cache, list(range(1, 40)), 1)
        runner.forward(cache, [5, 6, 7, 8, 9], 5)
        runner.forward(cache, [10], 1)
    assert {rows for rows, _, _ in mode.calls} == {39, 5, 1}
    for rows, mask, gqa in mode.calls:
        assert mask is None or isinstance(mask, CausalBias) or not gqa, (rows, type(mask), gqa)
        assert rows == 1 or mask is not None


def test_a_runner_built_for_a_device_puts_each_weight_there_once_and_moves_nothing_of_the_model(tiny_draft, tokenizer):
    model = copy.deepcopy(tiny_draft)
    runner = LeanLlamaRunner(model, len(tokenizer), 64, device="meta")  # meta: a device that holds no bytes
    held = [runner.embed, runner.norm, runner.cos, runner.sin, *[w for layer in runner.layers for w in layer]]
    assert all(t.device.type == "meta" for t in [*held, runner.lm_head])
    assert runner.lm_head._base is runner.embed  # tied: a view of the embedding, not a second copy
    params = sum(p.numel() for p in model.parameters())
    assert sum(t.numel() for t in held) == params + runner.cos.numel() + runner.sin.numel()
    assert all(p.device.type == "cpu" for p in model.parameters())  # fused where it was loaded, then moved


def test_a_server_loads_on_the_cpu_and_hands_the_device_to_its_runner(tiny_draft, tokenizer, tmp_path, monkeypatch):
    import specdec.model_server as model_server

    tiny_draft.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loads, runners = [], []
    load, make = models.load_model, model_server.make_runner
    monkeypatch.setattr(models, "load_model", lambda *a, **k: loads.append(a[1:]) or load(*a, **k))
    monkeypatch.setattr(model_server, "make_runner", lambda *a, **k: runners.append(k["device"]) or make(*a, **k))
    model_server.ModelServer.load(ModelServerConfig(model=str(tmp_path), port=0, metrics_port=0, max_draft_tokens=4))
    assert loads == [("float32", "cpu")] and runners == ["cpu"]


def test_a_padded_batch_computes_logits_only_where_a_call_needs_them_and_a_long_feed_runs_alone(tiny_draft, tokenizer):
    runner = CausalLMRunner(copy.deepcopy(tiny_draft), len(tokenizer))
    head_rows, widths = [], []
    runner.model.lm_head.register_forward_pre_hook(lambda m, a: head_rows.append(a[0].shape[:2]))
    runner.model.model.register_forward_pre_hook(
        lambda m, a, k: widths.append(tuple(k["input_ids"].shape)), with_kwargs=True
    )
    caches = [runner.new_cache() for _ in range(3)]
    feeds = [list(range(1, 21)), list(range(30, 48)), list(range(50, 90))]  # 20, 18 and 40 tokens
    out = runner.forward_batch(caches, feeds, [1, 3, 1])
    assert sorted(widths) == [(1, 40), (2, 20)]  # the 40-token feed alone; the others padded to 20
    assert sorted(head_rows) == [(1, 1), (2, 5)]  # positions 15..19 cover both calls' logits, not all 20
    lone = [runner.forward(runner.new_cache(), f, k) for f, k in zip(feeds, [1, 3, 1])]
    for got, want in zip(out, lone):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


class SlowToFetch(torch.Tensor):
    """A device's output whose values come only once the device is done: the copy to the host waits."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.cpu:
            time.sleep(0.05)
            return torch.zeros(args[0].shape)
        return super().__torch_function__(func, types, args, kwargs)


class DeviceRunner:
    """A runner on a 'device' whose passes return at once and finish when their logits are fetched."""

    device = torch.device("meta")

    def new_cache(self):
        return []

    @staticmethod
    def crop(cache, length):
        del cache[length:]

    def forward_batch(self, caches, token_ids, num_logits, scored_only=False):
        for c, t in zip(caches, token_ids):
            c.extend(t)
        return [torch.zeros(k, 4, device="meta").as_subclass(SlowToFetch) for k in num_logits]


def test_a_pass_is_timed_until_its_logits_reach_the_host():
    runner = DeviceRunner()
    pool = SessionPool(runner.new_cache, runner.crop, max_sessions=4, max_tokens=100, max_model_len=100, idle_ttl_s=60)
    engine = Engine(runner, pool, 64)
    engine.measure(widths=(1, 2))
    assert min(seconds for _, seconds in engine.costs.curve()) >= 0.05

    async def call():
        return await engine.forward(pool.open("s", 0, 0), [1, 2], 1)

    feed = asyncio.run(call())
    assert feed.compute_s >= 0.05 and type(feed.logits) is torch.Tensor


def test_the_host_boundary_copies_a_devices_logits_once_and_leaves_cpu_ones_alone():
    cpu = [torch.ones(2, 3), torch.zeros(1, 3)]
    assert all(a is b for a, b in zip(to_host(cpu), cpu))
    moved = to_host([t.as_subclass(DeviceTensor) for t in cpu])
    assert [type(t) for t in moved] == [torch.Tensor] * 2 and [t.shape[0] for t in moved] == [2, 1]
    norms = to_host([None, cpu[0].as_subclass(DeviceTensor), None, cpu[1].as_subclass(DeviceTensor)])  # some asked none
    assert norms[0] is None and norms[2] is None and [type(t) for t in norms[1::2]] == [torch.Tensor] * 2
    assert torch.equal(norms[1], cpu[0]) and torch.equal(norms[3], cpu[1]) and to_host([None, None]) == [None, None]


def test_strict_attention_leaves_a_gpu_pass_only_the_fused_kernels_and_changes_nothing_on_cpu():
    from specdec.runners import attention_kernels

    with attention_kernels("cuda", True):
        assert not torch.backends.cuda.math_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()
    assert torch.backends.cuda.math_sdp_enabled()
    for device, strict in (("cuda", False), ("cpu", True)):
        with attention_kernels(device, strict):
            assert torch.backends.cuda.math_sdp_enabled()


@pytest.mark.parametrize("capability, dtype", [((7, 5), "float16"), ((8, 0), "bfloat16"), ((9, 0), "bfloat16")])
def test_auto_dtype_is_bfloat16_only_where_the_gpu_computes_in_it(capability, dtype, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert models.resolve_dtype("auto", "cuda") == dtype
    assert models.resolve_dtype("auto", "cpu") == "float32"
    assert models.resolve_dtype("bfloat16", "cuda") == "bfloat16"  # asked for: kept


# -- KV pools sized from the device's memory ---------------------------------------------------------------


class FakeCuda:
    """torch.cuda's memory queries for a card of `total` bytes on which the warm-up reserves `peak` bytes."""

    def __init__(self, monkeypatch, total: int, peak: int):
        self.events = []
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d=None: self.events.append("reset"))
        monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: self.events.append("sync"))
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (total // 2, total))
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d=None: self.events.append("peak") or peak)


class WarmUpRunner(DeviceRunner):
    device, dtype, cache_step = torch.device("cuda"), torch.bfloat16, 256

    def __init__(self, events):
        self.events = events

    def forward_batch(self, caches, token_ids, num_logits, scored_only=False):
        self.events.append(("pass", sum(map(len, token_ids))))
        return []


def llama_config(name: str):
    from transformers import LlamaConfig

    from bench.production import CONFIGS

    return LlamaConfig(**CONFIGS[name])


def test_a_gpu_servers_pool_is_what_its_share_leaves_after_a_warm_up_at_the_widest_pass(monkeypatch):
    from specdec.memory import kv_capacity

    cuda = FakeCuda(monkeypatch, total=16 * memory.GiB, peak=7 * memory.GiB)
    runner = WarmUpRunner(cuda.events)
    cfg = ModelServerConfig(role="target", device="cuda", max_sessions=6)
    tokens, longest = kv_capacity(cfg, runner, llama_config("Llama-3.2-3B"), 2048, 131072)
    assert cuda.events == ["reset", ("pass", 2048), "sync", "peak"]
    assert longest == tokens < 131072  # the longest session is what the pool holds
    per_token = 28 * 8 * 128 * 2 * 2
    share = int(memory.ROLE_FRACTIONS["target"] * 16 * memory.GiB)
    assert tokens == (share - 7 * memory.GiB - memory.CUDA_CONTEXT_BYTES) // per_token - 6 * 256
    explicit = ModelServerConfig(role="target", device="cuda", max_sessions=6, max_tokens=tokens)
    assert kv_capacity(explicit, runner, llama_config("Llama-3.2-3B"), 2048, 4096) == (tokens, 4096)
    with pytest.raises(ConfigError, match="memory-fraction"):
        kv_capacity(
            ModelServerConfig(role="target", device="cuda", max_tokens=tokens + 1),
            runner,
            llama_config("Llama-3.2-3B"),
            2048,
            4096,
        )


def _compose_default(name: str) -> str:
    found = re.search(r"\$\{" + name + r":-([^}]*)\}", (ROOT / "docker-compose.yml").read_text())
    assert found, f"docker-compose.yml sets no default for {name}"
    return found.group(1)


def _budget(name: str, role: str, fraction: float, sessions: int, max_len: int, rows: int, total: int):
    from transformers import LlamaForCausalLM

    config = llama_config(name)
    with torch.device("meta"):
        weights = memory.weight_bytes(LlamaForCausalLM(config).to(torch.bfloat16))
    used = weights + memory.activation_bytes(config, rows, max_len, 2)
    per_token = memory.kv_bytes_per_token(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, 2)
    return memory.pool_budget(total, fraction or memory.ROLE_FRACTIONS[role], used, per_token, sessions, 256)


def test_the_compose_defaults_fit_a_16_gb_gpu_with_a_gigabyte_to_spare():
    total = 16 * memory.GiB
    sessions, max_len = int(_compose_default("MAX_SESSIONS")), int(_compose_default("MAX_MODEL_LEN"))
    rows = int(_compose_default("MAX_BATCH_TOKENS")) or 2048
    target = _budget(
        "Llama-3.2-3B", "target", float(_compose_default("TARGET_MEMORY_FRACTION")), sessions, max_len, rows, total
    )
    draft = _budget(
        "Llama-3.2-1B", "draft", float(_compose_default("DRAFT_MEMORY_FRACTION")), sessions, max_len, rows, total
    )
    assert target.share + draft.share <= total - memory.GiB
    for budget in (target, draft):  # every session can reach the longest length at once
        assert budget.tokens >= sessions * max_len, budget.describe()


def test_specdec_up_on_a_gpu_fits_a_16_gb_card_and_holds_a_long_session():
    defaults = ModelServerConfig()
    total = 16 * memory.GiB
    target = _budget("Llama-3.2-3B", "target", defaults.memory_fraction, defaults.max_sessions, 8192, 2048, total)
    draft = _budget("Llama-3.2-1B", "draft", defaults.memory_fraction, defaults.max_sessions, 8192, 2048, total)
    assert target.share + draft.share <= total - memory.GiB
    assert min(target.tokens, draft.tokens) >= 16_384, (target.describe(), draft.describe())


# -- bfloat16, the GPU's dtype, on the CPU: torch's ops, as on a GPU -------------------------------------------

BF16_PROMPTS = ["Name three colours.", "What is the capital of France?", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def bf16_target(target_model):
    return copy.deepcopy(target_model).to(torch.bfloat16)


def _prompt_ids(tokenizer, text):
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=True
    )["input_ids"]


def _steps(runner, ids, n):
    """Greedy decoding a token a pass (one-row steps), after a prefill of the prompt."""
    cache, out = runner.new_cache(), []
    logits = runner.forward(cache, ids, 1)
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = runner.forward(cache, [out[-1]], 1)
    return out


@pytest.mark.parametrize("kind", ["lean", "hf"])
def test_in_bfloat16_a_runners_one_row_steps_give_transformers_greedy_output(kind, bf16_target, tokenizer):
    from specdec.runners import make_runner

    runner = make_runner(bf16_target, len(tokenizer), 512, kind)
    assert runner.dtype == torch.bfloat16
    for text in BF16_PROMPTS:
        ids = _prompt_ids(tokenizer, text)
        want = bf16_target.generate(
            torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(ids) :].tolist()
        assert _steps(runner, ids, 24) == want, text


def test_in_bfloat16_the_padded_batch_agrees_with_the_lone_steps_but_at_near_ties(bf16_target, target_model, tokenizer):
    # Teacher-forced along each session's lone greedy path: the batch's shapes choose other GEMMs, so its
    # logits are the lone ones to bfloat16 rounding, and its greedy choice differs only where the lone pass's
    # two best logits lie closer than that rounding (a near-tie). That rounding is the CPU's (its bfloat16 GEMMs:
    # AVX-512 BF16, AMX), so it is measured here: the lone rows' distance from float32's. On a Zen 4 the batch's
    # rows stayed under 1.0 of the lone ones; on a Xeon with AMX (2026-11-26) they reached 1.0, where bfloat16 moved
    # the lone rows up to 0.82 from float32. A wrong row (another session's, another position's) is off by 10-30.
    runner = CausalLMRunner(bf16_target, len(tokenizer))
    prompts = [_prompt_ids(tokenizer, text) for text in BF16_PROMPTS]
    paths = [_steps(runner, ids, 12) for ids in prompts]
    lone = [runner.forward(runner.new_cache(), ids + path[:11], 12) for ids, path in zip(prompts, paths)]
    fp32 = CausalLMRunner(target_model, len(tokenizer))
    rounding = max(
        float((fp32.forward(fp32.new_cache(), ids + path[:11], 12) - want.float()).abs().max())
        for ids, path, want in zip(prompts, paths, lone)
    )
    caches = [runner.new_cache() for _ in prompts]
    rows = [[runner.forward(c, ids, 1)[-1]] for c, ids in zip(caches, prompts)]
    for step in range(11):
        for got, row in zip(rows, runner.forward_batch(caches, [[p[step]] for p in paths], [1] * len(paths))):
            got.append(row[-1])
    for got, want in zip(rows, lone):
        got = torch.stack(got)  # [12, vocab]
        err = (got - want).abs().amax(dim=-1)  # [12]
        assert float(err.max()) <= 2 * rounding
        top2 = want.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * err
        assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
