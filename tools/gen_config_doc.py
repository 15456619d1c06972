"""Write docs/configuration.md, every setting of every service, from specdec/config.py's dataclasses.

Usage: python tools/gen_config_doc.py   (make docs)
tests/test_config.py fails when the committed page differs from what this writes.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "configuration.md"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

HEADER = """# Configuration: every setting

Written by `tools/gen_config_doc.py` from `specdec/config.py`; do not edit by hand. Each setting is a flag
(`specdec orchestrator --max-tokens 512`) and an environment variable (`SPECDEC_ORCHESTRATOR_MAX_TOKENS=512`); a
flag wins over the environment, which wins over the default, and every service checks its settings at start-up.
`specdec up` passes the environment on to all three services. The README lists the ones most deployments set.
"""


def render() -> str:
    from specdec.config import ROLE_DEFAULTS, ModelServerConfig, OrchestratorConfig, env_prefix

    out = [HEADER]
    per_role = {
        name: " / ".join(
            str(ROLE_DEFAULTS[role].get(name, getattr(ModelServerConfig, name))) for role in ("draft", "target")
        )
        for name in {n for d in ROLE_DEFAULTS.values() for n in d}
    }
    sections = (
        ("Orchestrator", OrchestratorConfig, "orchestrator", {}),
        (
            "Draft and target model servers (defaults: draft / target where they differ)",
            ModelServerConfig,
            "target",
            per_role,
        ),
    )
    for title, cls, role, defaults in sections:
        prefix = "SPECDEC_ORCHESTRATOR_" if role == "orchestrator" else "SPECDEC_DRAFT_ / SPECDEC_TARGET_"
        out += [
            f"## {title}",
            "",
            f"Environment prefix: `{prefix}`.",
            "",
            "| flag | environment | default | what it does |",
            "|---|---|---|---|",
        ]
        for f in dataclasses.fields(cls):
            if not f.metadata.get("flag", True):
                continue
            default = defaults.get(f.name, f.default)
            shown = "(empty)" if default == "" else str(default).lower() if isinstance(default, bool) else str(default)
            env = (env_prefix(role) if role == "orchestrator" else "…_") + f.name.upper()
            help_ = f.metadata.get("help", "").replace("|", "\\|")
            out.append(f"| `--{f.name.replace('_', '-')}` | `{env}` | {shown} | {help_} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    PAGE.write_text(render())
    print(f"wrote {PAGE.relative_to(ROOT)}")
