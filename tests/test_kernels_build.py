"""Building specdec's CPU kernels: a build interrupted by a killed process does not hold up later starts."""

from __future__ import annotations

import torch.utils.cpp_extension

from specdec.runners import kernels


def test_a_build_mark_left_by_a_killed_builder_does_not_hold_up_the_next_load(tmp_path, monkeypatch):
    # torch's builder waits while its "lock" file exists; a server killed mid-build leaves it behind.
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    seen = []

    def load(name, sources, build_directory, **kw):
        seen.append(build_directory)
        assert not (tmp_path / "kernels" / build_directory.split("/")[-1] / "lock").exists()
        return "module"

    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)
    kernels.cpu_kernels.cache_clear()
    try:
        key_dir = None
        for _ in range(2):  # first to learn the build folder, then with a stale mark left in it
            assert kernels.cpu_kernels() == "module"
            key_dir = tmp_path / "kernels" / seen[-1].split("/")[-1]
            (key_dir / "lock").write_text("")
            kernels.cpu_kernels.cache_clear()
        assert len(seen) == 2 and key_dir.exists()
    finally:
        kernels.cpu_kernels.cache_clear()
