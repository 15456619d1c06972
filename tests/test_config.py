"""Configuration: flags over environment over defaults, validated with a clear error."""

import argparse

import pytest

from specdec.config import ConfigError, ModelServerConfig, OrchestratorConfig, add_arguments, from_args


def parse(cls, argv, role=None):
    p = argparse.ArgumentParser()
    add_arguments(p, cls)
    return from_args(cls, p.parse_args(argv), role=role)


def test_flag_beats_environment_beats_default(monkeypatch):
    monkeypatch.setenv("SPECDEC_TARGET_MAX_SESSIONS", "7")
    assert parse(ModelServerConfig, [], role="target").max_sessions == 7
    assert parse(ModelServerConfig, ["--max-sessions", "3"], role="target").max_sessions == 3
    assert parse(ModelServerConfig, [], role="draft").max_sessions == 16


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--port", "70000"], "outside"),
        (["--num-speculative-tokens", "9"], "num-speculative-tokens"),
        (["--top-p", "0"], "top-p"),
        (["--prompt-lookup-min", "5"], "prompt-lookup-min"),
        (["--prompt-lookup-max", "0"], "prompt-lookup-max"),
    ],
)
def test_bad_orchestrator_settings_are_refused(argv, match):
    with pytest.raises(ConfigError, match=match):
        parse(OrchestratorConfig, argv)


def test_unknown_product_form_is_refused_at_start_up():
    with pytest.raises(ConfigError, match="--matmul must be auto, linear, weights-first, onednn, fewrow or gguf"):
        parse(ModelServerConfig, ["--matmul", "fast"], role="target")


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--quantize", "int2"], "--quantize must be auto, none, int8 or int4"),
        (["--quantize", "int8", "--device", "cuda"], "runs on CPU from float32 weights"),
        (["--quantize", "int8", "--dtype", "bfloat16"], "runs on CPU from float32 weights"),
        (["--quantize", "int4", "--device", "cuda"], "runs on CPU from float32 weights"),
        (["--quantize", "int4", "--activations", "float32"], "multiplies with quantized activations"),
    ],
)
def test_quantized_weights_are_refused_where_they_cannot_run(argv, match):
    with pytest.raises(ConfigError, match=match):
        parse(ModelServerConfig, argv, role="draft")


@pytest.mark.parametrize("lanes, match", [("0", "at least 1"), ("9", "at most 8, not 9")])
def test_cuda_graph_lanes_are_refused_outside_what_a_card_runs_at_once(lanes, match):
    with pytest.raises(ConfigError, match=match):
        parse(ModelServerConfig, ["--cuda-graph-lanes", lanes], role="target")
    assert parse(ModelServerConfig, ["--cuda-graph-lanes", "8"], role="target").cuda_graph_lanes == 8


def test_cuda_graph_rows_are_refused_past_the_widest_pass_graphs_take():
    with pytest.raises(ConfigError, match="--cuda-graph-rows must be 0 to 16, not 17"):
        parse(ModelServerConfig, ["--cuda-graph-rows", "17"], role="target")
    cfg = parse(ModelServerConfig, ["--cuda-graph-rows", "9", "--cuda-graph-lanes", "2"], role="target")
    assert cfg.graph_options() == {"cuda_graphs": 2, "graph_rows": 9}
    assert parse(ModelServerConfig, ["--cuda-graphs", "false"], role="target").graph_options()["cuda_graphs"] == 0


def test_bad_environment_value_is_named(monkeypatch):
    monkeypatch.setenv("SPECDEC_ORCHESTRATOR_PORT", "fifty")
    with pytest.raises(ConfigError, match="SPECDEC_ORCHESTRATOR_PORT"):
        parse(OrchestratorConfig, [])


def test_draft_server_defaults_to_one_cpu_thread_and_the_environment_can_change_it(monkeypatch):
    from specdec.config import ROLE_DEFAULTS

    def threads(role, argv=()):
        p = argparse.ArgumentParser()
        add_arguments(p, ModelServerConfig, ROLE_DEFAULTS[role])
        return from_args(ModelServerConfig, p.parse_args(list(argv)), role=role, defaults=ROLE_DEFAULTS[role]).threads

    assert threads("draft") == 1
    assert threads("target") == 0  # torch's default: every core for the verify pass
    monkeypatch.setenv("SPECDEC_DRAFT_THREADS", "2")
    assert threads("draft") == 2
    assert threads("draft", ["--threads", "3"]) == 3


def test_switches_read_true_and_false_from_flags_and_environment(monkeypatch):
    assert parse(OrchestratorConfig, []).rpc_streams is True
    assert parse(OrchestratorConfig, ["--rpc-streams", "false"]).rpc_streams is False
    monkeypatch.setenv("SPECDEC_ORCHESTRATOR_RPC_STREAMS", "0")
    assert parse(OrchestratorConfig, []).rpc_streams is False
    monkeypatch.setenv("SPECDEC_ORCHESTRATOR_RPC_STREAMS", "maybe")
    with pytest.raises(ConfigError, match="RPC_STREAMS='maybe' is not a valid bool"):
        parse(OrchestratorConfig, [])


def test_the_configuration_page_lists_every_setting_as_the_code_defines_it():
    """docs/configuration.md is written from specdec/config.py; `make docs` rewrites it."""
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root / "tools"))
    import gen_config_doc

    assert (root / "docs" / "configuration.md").read_text() == gen_config_doc.render(), (
        "docs/configuration.md is stale: run `make docs`"
    )
