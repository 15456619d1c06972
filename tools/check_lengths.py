"""Fail when a function or a source file is too long to read in one sitting.

No function (def or async def) over 60 physical lines, counted from its first decorator or ``def`` line to its
last line, and no file over 450 lines. Tests, benchmarks and the generated protobuf code are exempt. Ruff has
no such rule; `make test` runs this script beside it, before pytest.

Usage: python tools/check_lengths.py [ROOT]   (prints path:line name N lines per violation; exit 1 on any)
"""

from __future__ import annotations

import ast
import fnmatch
import sys
from collections.abc import Iterator
from pathlib import Path

MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 450
EXEMPT_DIRS = {"tests", "bench", ".venv", ".git", "build", "dist", "__pycache__", ".cache"}
GENERATED = "specdec/v1/*_pb2*.py"
# Known violations, to fix: (path, function or "(file)"). An entry that no longer violates is reported too,
# so that this table only shrinks.
PENDING: set[tuple[str, str]] = set()


def source_files(root: Path) -> Iterator[Path]:
    """Every checked *.py under root, in a stable order."""
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if EXEMPT_DIRS.intersection(rel.parts[:-1]) or fnmatch.fnmatch(rel.as_posix(), GENERATED):
            continue
        yield path


def function_lengths(tree: ast.AST) -> Iterator[tuple[int, str, int]]:
    """(first line, qualified name, physical lines) for every function in tree, nested ones included."""

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[int, str, int]]:
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                yield from walk(child, prefix)
                continue
            name = f"{prefix}{child.name}"
            if not isinstance(child, ast.ClassDef):
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                yield first, name, child.end_lineno - first + 1
            yield from walk(child, f"{name}.")

    yield from walk(tree, "")


def lengths(root: Path) -> Iterator[tuple[str, int, str, int, int]]:
    """(path, line, name, physical lines, limit) for every checked file, as "(file)", and function."""
    for path in source_files(root):
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(root).as_posix()
        yield rel, 1, "(file)", len(text.splitlines()), MAX_FILE_LINES
        for line, name, length in function_lengths(ast.parse(text, filename=rel)):
            yield rel, line, name, length, MAX_FUNCTION_LINES


def violations(root: Path, pending: set[tuple[str, str]] = frozenset()) -> list[str]:
    """One line per violation, as path:line name N lines, and one per pending entry that no longer violates."""
    found, waived = [], set()
    for rel, line, name, length, limit in lengths(root):
        if length <= limit:
            continue
        if (rel, name) in pending:
            waived.add((rel, name))
        else:
            found.append(f"{rel}:{line} {name} {length} lines (max {limit})")
    found += [
        f"{rel} {name}: within limits now; drop it from PENDING"
        for rel, name in sorted(pending - waived)
        if (root / rel).exists()
    ]
    return found


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else Path(__file__).resolve().parent.parent)
    found = violations(root, PENDING)
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
