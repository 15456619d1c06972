"""The images and installs run what the tests run (one torch pin, the same versions on CPU and GPU), and the GPU
profile of docker-compose.yml stops at once on a missing token."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
REQUIREMENTS = ROOT / "requirements"
INSTALLS = {
    "Makefile": ROOT / "Makefile",
    "Dockerfile.cpu": ROOT / "deploy" / "Dockerfile.cpu",
    "Dockerfile.gpu": ROOT / "deploy" / "Dockerfile.gpu",
}


def pins(path: Path) -> dict[str, str]:
    """{package: version} of a requirements file's own lines (an included file, `-r x.txt`, is not read)."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-r "):
            continue
        name, sep, version = line.partition("==")
        assert sep, f"{path.name}: {line!r} is not pinned with =="
        out[name.strip().lower()] = version.strip()
    return out


def test_the_tests_run_the_pinned_torch():
    assert pins(REQUIREMENTS / "torch.txt") == {"torch": torch.__version__.split("+")[0]}


def test_every_install_takes_torch_from_the_one_pin():
    """The Makefile and both images install requirements/torch.txt first, and nothing else names a torch version:
    a base image with its own torch (pytorch/pytorch) would run a release the tests never ran."""
    for name, path in INSTALLS.items():
        text = path.read_text()
        assert "-r requirements/torch.txt" in text, f"{name} does not install requirements/torch.txt"
        assert not re.search(r"torch[=<>~]=", text), f"{name} pins torch itself"
    for name in ("cpu.txt", "gpu.txt"):
        lines = (REQUIREMENTS / name).read_text().splitlines()
        assert "-r torch.txt" in lines and "torch" not in pins(REQUIREMENTS / name), name
    images = [re.findall(r"^FROM (\S+)", INSTALLS[n].read_text(), re.M) for n in ("Dockerfile.cpu", "Dockerfile.gpu")]
    assert images[0] == images[1] and "pytorch" not in images[1][0], images  # one Python, no torch but the pin's


def test_gpu_requirements_pin_the_cpu_versions():
    cpu, gpu = pins(REQUIREMENTS / "cpu.txt"), pins(REQUIREMENTS / "gpu.txt")
    assert "transformers" in gpu
    differ = {name: (cpu[name], version) for name, version in gpu.items() if cpu.get(name, version) != version}
    assert not differ, f"cpu.txt and gpu.txt pin different versions: {differ}"
    # what the GPU image needs at run time is what the tests install, tools and test runners aside
    assert set(gpu) <= set(cpu), set(gpu) - set(cpu)


def compose_config(profile: str) -> dict:
    """docker-compose.yml as compose reads it, with no variable set but the profile (no HF_TOKEN)."""
    out = subprocess.run(
        ["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "config"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"COMPOSE_PROFILES": profile, "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)["services"]


def _minutes(duration: str) -> float:
    return sum(float(n) * {"h": 60, "m": 1, "s": 1 / 60}[unit] for n, unit in re.findall(r"([\d.]+)(h|m|s)", duration))


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose is not installed (make system-deps)")
def test_gpu_model_servers_start_after_a_one_shot_fetch_of_their_models():
    """`models` (specdec fetch) exits 2 without a token for the gated pair, is not restarted, and the model servers
    wait for its success; so their health checks wait for a load from the cache, not for a download."""
    services = compose_config("gpu")
    fetch = services["models"]
    assert fetch["command"][0] == "fetch" and fetch["restart"] == "no" and "healthcheck" not in fetch
    served = [services[role]["environment"][f"SPECDEC_{role.upper()}_MODEL"] for role in ("target", "draft")]
    assert fetch["command"][1:] == served, (fetch["command"], served)
    for role in ("target", "draft"):
        assert services[role]["depends_on"] == {"models": {"condition": "service_completed_successfully"}}
        assert _minutes(services[role]["healthcheck"]["start_period"]) <= 10
    assert services["orchestrator"]["environment"]["SPECDEC_ORCHESTRATOR_TOKENIZER"] == served[0]
