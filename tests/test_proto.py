"""The generated code is what tools/gen_proto.py makes from proto/ today."""

import filecmp
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import gen_proto  # noqa: E402


def test_generated_code_is_up_to_date(tmp_path):
    fresh = {p.name: p for p in gen_proto.generate(tmp_path)}
    committed = {p.name: p for p in (ROOT / "specdec" / "v1").iterdir() if p.is_file() and p.suffix in (".py", ".pyi")}
    assert fresh.keys() == committed.keys()
    stale = [name for name in fresh if not filecmp.cmp(fresh[name], committed[name], shallow=False)]
    assert not stale, f"run `make proto`: {stale} differ from proto/"


def test_every_field_has_a_doc_comment():
    for proto in (ROOT / "proto" / "specdec" / "v1").glob("*.proto"):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            s = line.strip()
            if (
                s.endswith(";")
                and "=" in s
                and not s.startswith(("option", "syntax", "package", "import", "//"))
                and not s.split()[0].startswith("FINISH_REASON")
                and not s.startswith("rpc")
            ):
                assert lines[i - 1].strip().startswith("///"), f"{proto.name}:{i + 1} `{s}` has no /// comment"
