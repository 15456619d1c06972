"""CPU kernels compiled on first use for this machine (-O3 -march=native) and cached.

-fopenmp makes ATen's inline parallel_for split the work over torch's threads (without it the pragma is
ignored and the kernel runs on one); its OpenMP calls bind to the runtime torch has loaded, so the
process keeps one OpenMP team.

``few_rows()`` returns specdec's few-row product (``fewrow.cpp``), or None where it cannot be built: no
C++ compiler, no ninja, an unsupported platform. Callers fall back to torch's products then. The build
takes about 25 s once per machine, CPU and torch version; later loads take about a second.
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

SOURCE = Path(__file__).with_name("fewrow.cpp")


def _cpu_signature() -> str:
    """The CPU's model and instruction-set flags: -march=native code is valid for these only."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "|".join(next(l for l in lines if l.startswith(key)) for key in ("model name", "flags"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


@functools.cache
def few_rows():
    """The compiled `few_rows(x, w)` (x @ w.T for [M, K] x [N, K] float32 on CPU), or None."""
    try:
        import torch
        from filelock import FileLock
        from torch.utils.cpp_extension import load

        from specdec.models import cache_dir

        if shutil.which("ninja") is None:  # torch runs `ninja` from PATH; the pip package ships one
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), torch.__version__.encode(),
                                          _cpu_signature().encode()])).hexdigest()[:16]
        build = cache_dir() / "kernels" / f"fewrow-{key}"
        build.mkdir(parents=True, exist_ok=True)
        with FileLock(str(build) + ".lock"):  # the draft and target servers may start together
            module = load(name=f"specdec_fewrow_{key}", sources=[str(SOURCE)], build_directory=str(build),
                          extra_cflags=["-O3", "-march=native", "-fopenmp"], verbose=False)
        return module.few_rows
    except Exception as e:  # no compiler, no ninja, a failed build: torch's products remain
        last_line = (str(e).strip().splitlines() or [""])[-1][:200]
        log.warning("specdec's few-row CPU kernel is unavailable (%s: %s); using torch's products",
                    type(e).__name__, last_line)
        return None
