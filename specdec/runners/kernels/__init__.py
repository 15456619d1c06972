"""CPU kernels compiled on first use for this machine (-O3 -march=native) and cached.

-fopenmp makes ATen's inline parallel_for split the work over torch's threads (without it the pragma is
ignored and the kernel runs on one); its OpenMP calls bind to the runtime torch has loaded, so the
process keeps one OpenMP team.

``cpu_kernels()`` returns one module, built from every source here: the few-row products
(``products.cpp``: ``few_rows``, ``few_rows_int8``, ``few_rows_gguf``), the work between the products
(``layer.cpp``: ``rms_norm``, ``attend``, ``silu_mul``; and ``LayerStack``, a pass's layers in one call),
and the work on the logits (``sampling.cpp``: ``sampling_probs``, ``argmax_rows``); ``kernels_for(t)``
returns it for a tensor it can take. It returns None where the module cannot be built: no C++ compiler, no
ninja, an unsupported platform. Callers fall back to torch's functions then. The build takes about 45 s once
per machine, CPU and torch version; later loads take about a second.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = ("module.cpp", "products.cpp", "q8_products.cpp", "layer.cpp", "sampling.cpp")
HEADERS = ("vec.h", "layer.h")
CFLAGS = ("-O3", "-march=native", "-fopenmp")


def cpu_flags() -> frozenset[str]:
    """The CPU's instruction-set flags as /proc/cpuinfo names them (avx2, avx512f...); empty where it cannot be read."""
    try:
        line = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags"))
    except (OSError, StopIteration):
        return frozenset()
    return frozenset(line.split(":", 1)[1].split())


def _cpu_signature() -> str:
    """The CPU's model and instruction-set flags: -march=native code is valid for these only."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "|".join(next(line for line in lines if line.startswith(key)) for key in ("model name", "flags"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


@functools.cache
def cpu_kernels():
    """The compiled module (float32 tensors on CPU), or None where it cannot be built."""
    try:
        import torch
        from filelock import FileLock
        from torch.utils.cpp_extension import load

        from specdec.models import cache_dir

        if shutil.which("ninja") is None:  # torch runs `ninja` from PATH; the pip package ships one
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        code = [(HERE / name).read_bytes() for name in SOURCES + HEADERS]
        # The folder too: torch's ninja file names the sources by path, so two checkouts sharing one cache
        # would each rebuild over the other's build (45 s) on every switch.
        key = hashlib.sha256(
            b"\0".join(
                [
                    *code,
                    " ".join(CFLAGS).encode(),
                    str(HERE).encode(),
                    torch.__version__.encode(),
                    _cpu_signature().encode(),
                ]
            )
        ).hexdigest()[:16]
        build = cache_dir() / "kernels" / f"cpu-{key}"
        build.mkdir(parents=True, exist_ok=True)
        with FileLock(str(build) + ".lock"):  # the draft and target servers may start together
            # torch's builder marks a build in progress with a file it deletes when done; a process killed while
            # building leaves it, and every later load would wait for it forever. Whoever holds the lock above is
            # the only builder, so a mark found here is stale.
            (build / "lock").unlink(missing_ok=True)
            return load(
                name=f"specdec_cpu_{key}",
                sources=[str(HERE / name) for name in SOURCES],
                build_directory=str(build),
                extra_cflags=list(CFLAGS),
                verbose=False,
            )
    except Exception as e:  # no compiler, no ninja, a failed build: torch's functions remain
        last_line = (str(e).strip().splitlines() or [""])[-1][:200]
        log.warning(
            "specdec's CPU kernels are unavailable (%s: %s); using torch's functions", type(e).__name__, last_line
        )
        return None


def kernels_for(t):
    """cpu_kernels() for a float32 tensor on CPU, the only kind they take; None for any other tensor, or where
    they cannot be built."""
    import torch

    return cpu_kernels() if t.device.type == "cpu" and t.dtype == torch.float32 else None
