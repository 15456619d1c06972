"""The images and installs run what the tests run: one torch pin, the same versions on CPU and GPU."""

from __future__ import annotations

import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
REQUIREMENTS = ROOT / "requirements"
INSTALLS = {"Makefile": ROOT / "Makefile", "Dockerfile.cpu": ROOT / "deploy" / "Dockerfile.cpu",
            "Dockerfile.gpu": ROOT / "deploy" / "Dockerfile.gpu"}


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
