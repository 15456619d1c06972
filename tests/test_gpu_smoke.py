"""tools/gpu_smoke.py, the first thing a GPU runs, works before there is one: its flags, its comparison, and the
whole run on CPU with the embedded pair."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import gpu_smoke  # noqa: E402


def test_defaults_are_the_embedded_pair_on_cuda_in_bf16_with_strict_attention():
    args = gpu_smoke.parse_args([])
    assert (args.device, args.dtype, args.target, args.draft) == ("cuda", "bfloat16", None, None)
    assert args.sdpa_strict
    assert not gpu_smoke.parse_args(["--device", "cpu"]).sdpa_strict
    assert gpu_smoke.parse_args(["--device", "cpu", "--sdpa-strict"]).sdpa_strict


def test_services_start_as_specdec_up_on_the_chosen_device_pair_and_ports():
    args = gpu_smoke.parse_args(["--target", "meta-llama/Llama-3.2-3B-Instruct", "--draft", "/models/draft", "-k", "9"])
    argv, env = gpu_smoke.launch(args, [1, 2, 3, 4, 5, 6, 7], {"HF_TOKEN": "t"})
    assert argv[1:] == [
        "-m",
        "cli.main",
        "up",
        "--device",
        "cuda",
        "--dtype",
        "bfloat16",
        "--target-model",
        "meta-llama/Llama-3.2-3B-Instruct",
        "--draft-model",
        "/models/draft",
    ]
    assert env["SPECDEC_TARGET_STRICT_ATTENTION"] == env["SPECDEC_DRAFT_STRICT_ATTENTION"] == "true"
    assert env["HF_TOKEN"] == "t"
    assert env["SPECDEC_ORCHESTRATOR_DRAFT_ADDRESS"] == "127.0.0.1:2" and env["SPECDEC_TARGET_PORT"] == "3"
    assert env["SPECDEC_ORCHESTRATOR_MAX_SPECULATIVE_TOKENS"] == "9"  # a K the orchestrator accepts
    assert "SPECDEC_TARGET_CUDA_GRAPH_LANES" not in env  # the servers' own default
    _, env = gpu_smoke.launch(gpu_smoke.parse_args(["--device", "cpu", "--lanes", "1"]), [1, 2, 3, 4, 5, 6, 7], {})
    assert "SPECDEC_TARGET_STRICT_ATTENTION" not in env
    assert env["SPECDEC_TARGET_CUDA_GRAPH_LANES"] == env["SPECDEC_DRAFT_CUDA_GRAPH_LANES"] == "1"


def test_first_divergence_is_the_first_differing_token():
    assert gpu_smoke.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert gpu_smoke.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert gpu_smoke.first_divergence([1, 2], [1, 2, 3]) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cuda_without_a_device_exits_2_before_starting_anything(capsys):
    assert gpu_smoke.main(["--device", "cuda"]) == 2
    assert "sees no CUDA device" in capsys.readouterr().err


def test_the_smoke_passes_end_to_end_on_cpu(tmp_path):
    """The real services through `specdec up`, a few tokens a request: every check runs and passes on CPU."""
    env = dict(os.environ, SPECDEC_DRAFT_THREADS="1", SPECDEC_TARGET_THREADS="1")
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "gpu_smoke.py"),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--max-tokens",
            "6",
            "--concurrency",
            "8",
            "--startup-timeout",
            "300",
            "--log",
            str(tmp_path / "services.log"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=420,
    )
    assert out.returncode == 0, out.stdout + out.stderr + (tmp_path / "services.log").read_text()[-3000:]
    lines = out.stdout.splitlines()
    assert sum(line.startswith("ok   8 at once") for line in lines) == 8
    assert "ok   the same seed samples the same tokens" in lines and "gpu_smoke: all checks passed" in lines
    assert "pass ms by rows" in out.stdout and "round ms" in out.stdout and "FAIL" not in out.stdout


def test_greedy_differences_fail_where_the_kernels_are_batch_invariant_and_are_counted_elsewhere():
    exact, counted = gpu_smoke.Checks(exact=True), gpu_smoke.Checks(exact=False)
    for check in (exact, counted):
        gpu_smoke.compare_greedy(check, "same", [1, 2, 3], [1, 2, 3], ("abc", "abc"))
        gpu_smoke.compare_greedy(check, "near-tie", [1, 5, 3], [1, 2, 3], ("aec", "abc"))
    assert exact.failed == ["near-tie"] and counted.failed == []
    assert (counted.greedy, counted.differ) == (2, 1)
    gpu_smoke.compare_greedy(counted, "empty", [], [1], ("", "a"))
    assert counted.failed == ["empty"]  # no answer fails everywhere
