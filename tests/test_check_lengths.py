"""tools/check_lengths.py: a function over 60 lines or a file over 450 fails; 60 and 450 pass."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "tools" / "check_lengths.py"


def function(name: str, lines: int) -> str:
    """A decorated function of exactly `lines` physical lines, decorator included."""
    return "@staticmethod\n" + f"def {name}():\n" + "    x = 1\n" * (lines - 2)


def check(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(root)], capture_output=True, text=True)


def test_a_61_line_function_and_a_451_line_file_fail(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "long_function.py").write_text(function("too_long", 61))
    (tmp_path / "long_file.py").write_text("x = 1\n" * 451)
    result = check(tmp_path)
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        "long_file.py:1 (file) 451 lines (max 450)",
        "pkg/long_function.py:1 too_long 61 lines (max 60)",
    ]


def test_a_60_line_function_and_a_450_line_file_pass(tmp_path):
    (tmp_path / "ok_function.py").write_text(function("just_right", 60))
    (tmp_path / "ok_file.py").write_text("x = 1\n" * 450)
    result = check(tmp_path)
    assert (result.returncode, result.stdout) == (0, "")


def test_tests_bench_and_generated_code_are_exempt(tmp_path):
    for rel in ("tests/test_x.py", "bench/run.py", "specdec/v1/target_pb2_grpc.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(function("long", 100))
    assert check(tmp_path).returncode == 0


def test_a_pending_entry_within_limits_is_reported_so_the_table_only_shrinks(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    from check_lengths import violations

    (tmp_path / "long.py").write_text(function("long", 61))
    (tmp_path / "short.py").write_text(function("short", 10))
    pending = {("long.py", "long"), ("short.py", "short")}
    assert violations(tmp_path, pending) == ["short.py short: within limits now; drop it from PENDING"]
