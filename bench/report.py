"""The benchmark's outputs: report.json (every figure), report.md (a table to read at a glance), speedup.png."""

from __future__ import annotations

import json
from pathlib import Path


def _fmt(q: dict, digits: int = 2) -> str:
    if q.get("median") is None:
        return "-"
    return f"{q['median']:.{digits}f} [{q['p25']:.{digits}f}, {q['p75']:.{digits}f}]"


def _best_lookup(res: dict) -> str:
    name = res.get("best_lookup")
    return f"{_fmt(res['per_k'][name]['speedup'])} (K = {res['per_k'][name]['k']})" if name else "-"


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [
        f"# specdec bench ({m['date']})",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, GPU: {m['gpu'] or 'none'}; torch {m['torch']}, "
        f"transformers {m['transformers']}.",
        f"Draft `{report['draft_model']}`, target `{report['target_model']}`; {report['prompts']} prompts x "
        f"{report['reps']} repetition(s), {report['max_tokens']} tokens each; batch 1, three services on loopback. "
        "Speedup = tokens/s over the same prompt's K = 0 runs (target alone, same path), median [p25, p75]: "
        "end to end (the prompt's prefill included, as a client sees it) and decoding (after the first streamed "
        "message, the part speculative decoding speeds up). The bound is Leviathan's for the decoding speedup, "
        "from alpha and c = the draft's one-token step over the target's; efficiency = decoding speedup / bound. "
        "Round times are of decoding rounds; TTFT is the median time to the first token, as the orchestrator "
        "measures it.",
    ]
    if report.get("draft_confidence_threshold"):
        lines.append(
            f"Draft confidence threshold {report['draft_confidence_threshold']:g}: K is the most a round "
            "drafts, and a round stops early once the draft's confidence falls below it; the bound and the "
            "efficiency assume K drafts every round, so they do not apply."
        )
    if report.get("lookup_ks"):
        lines.append(
            f"Arms K+lookup run K with prompt lookup (prompt_lookup_min {report['prompt_lookup_min']}): a round "
            "whose last tokens occurred earlier in the prompt or answer proposes the tokens that followed "
            "them instead of calling the draft. Their proposals come from two sources, so no bound is given."
        )
    if any(row.get("adaptive") for res in report["services"].values() for row in res["per_k"].values()):
        lines.append(
            "Arm auto: requests leave K unset, and a second orchestrator on the same model servers, with "
            "adaptive speculation, chooses K round by round from the round costs and the request's "
            "acceptance it measured so far (the K column gives the mean K of its decoding rounds); its K "
            "varies, so no bound is given."
        )
    if report.get("forward"):
        lines.append(
            f"Forward passes, as each server chose at start-up: draft `{report['forward']['draft']}`, "
            f"target `{report['forward']['target']}`."
        )
    lines.append("")
    for name, res in report["services"].items():
        lines += [
            f"## {name}" + (f", top_p {res['top_p']}" if res["temperature"] else " (greedy)"),
            "",
            "| K | speedup | decoding speedup | tokens/s | TTFT ms | alpha | accepted/drafted | tokens/round | c | "
            "bound | efficiency | draft / verify / accept / rpc ms per round | bytes/round (mean) | RPCs/round |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for k, row in res["per_k"].items():
            ms = row["round_ms"]
            eff = "-" if row.get("efficiency") is None else f"{row['efficiency']:.2f}"
            bound = "-" if k != "0" and row.get("bound") is None else f"{row.get('bound', 1.0):.2f}"
            label = f"auto (mean K {row['k']:.2f})" if row.get("adaptive") else k
            lines.append(
                f"| {label} | {_fmt(row['speedup']) if 'speedup' in row else '1 (baseline)'} | "
                f"{_fmt(row['decode_speedup']) if 'decode_speedup' in row else '1'} | {_fmt(row['tokens_per_s'], 1)} | "
                f"{1e3 * row['ttft_s']['median']:.0f} | "
                f"{row['alpha']:.3f} | {row['accepted_over_drafted']:.3f} | {row['tokens_per_round']:.2f} | {row['c']:.3f} | "
                f"{bound} | {eff} | "
                f"{ms['draft']:.1f} / {ms['verify']:.1f} / {ms['accept']:.2f} / {ms['rpc']:.2f} | "
                f"{row['wire_bytes_per_round_mean']:.0f} | {row['rpcs_per_round_mean']:.2f} |"
            )
        lines += [
            "",
            f"Best K (end to end): {res['best_k']}; the target's one-token step {res['target_step_ms']:.1f} ms "
            "at K = 0.",
        ]
        for k, row in res["per_k"].items():
            if row.get("adaptive"):
                shares = ", ".join(f"K = {kk}: {100 * share:.0f}%" for kk, share in row["k_share"].items())
                lines.append(f"auto: {_fmt(row['decode_speedup'])} decoding, rounds at {shares}.")
            if "lookup_share" in row:
                lines.append(
                    f"K = {k}: prompt lookup proposed {100 * row['lookup_share']:.0f}% of the tokens, "
                    f"{100 * row['lookup_accepted_over_proposed']:.0f}% of them accepted"
                    + (
                        f"; tokens/s {_fmt(row['over_plain_k'])}× those of K = {row['k']} without it, prompt by prompt."
                        if "over_plain_k" in row
                        else "."
                    )
                )
        lines.append("")
    if "transformers_assisted" in report:
        peer = report["transformers_assisted"]
        lines += [
            "## In-process peer: transformers assisted generation",
            "",
            f"`generate(assistant_model=draft)` against plain `generate()`, same models, {peer['prompts']} prompts, alternated.",
            "",
            "| | speedup | decoding speedup | plain tokens/s | assisted tokens/s | specdec speedup at its best K "
            "(decoding) | with prompt lookup |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, res in peer.items():
            if name == "prompts":
                continue
            ours = report["services"][name]
            best = ours["per_k"][str(ours["best_k"])]
            lines.append(
                f"| {name} | {_fmt(res['speedup'])} | {_fmt(res['decode_speedup'])} | "
                f"{_fmt(res['plain_tokens_per_s'], 1)} | {_fmt(res['assisted_tokens_per_s'], 1)} | "
                f"{_fmt(best['speedup'])} ({_fmt(best['decode_speedup'])}) (K = {ours['best_k']}) | "
                f"{_best_lookup(ours)} |"
            )
        lines.append("")
    lines.append(f"Wall time: {report['wall_seconds'] / 60:.1f} min.")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, res in report["services"].items():
        rows = [row for row in res["per_k"].values() if row["k"] and not row["lookup"] and not row.get("adaptive")]
        ks = [row["k"] for row in rows]
        looked = [row for row in res["per_k"].values() if row["lookup"]]
        med = [r["speedup"]["median"] for r in rows]
        err = [
            [m - r["speedup"]["p25"] for m, r in zip(med, rows)],
            [r["speedup"]["p75"] - m for m, r in zip(med, rows)],
        ]
        line = axes[0].errorbar(ks, med, yerr=err, marker="o", capsize=3, label=f"measured, {name}")
        if looked:
            axes[0].plot(
                [row["k"] for row in looked],
                [row["speedup"]["median"] for row in looked],
                marker="*",
                markersize=10,
                linestyle="none",
                color=line[0].get_color(),
                label=f"with prompt lookup, {name}",
            )
        auto = [row for row in res["per_k"].values() if row.get("adaptive")]
        if auto:  # drawn at its mean K
            axes[0].plot(
                [row["k"] for row in auto],
                [row["speedup"]["median"] for row in auto],
                marker="D",
                linestyle="none",
                color=line[0].get_color(),
                label=f"auto (adaptive K, at its mean K), {name}",
            )
        axes[0].plot(
            ks, [r["bound"] for r in rows], linestyle="--", color=line[0].get_color(), label=f"Leviathan bound, {name}"
        )
        axes[1].plot(ks, [r["alpha"] for r in rows], marker="o", label=f"alpha, {name}")
        axes[1].plot(
            ks, [r["accepted_over_drafted"] for r in rows], marker="x", linestyle=":", label=f"accepted/drafted, {name}"
        )
    axes[0].axhline(1.0, color="grey", linewidth=0.8)
    axes[0].set(xlabel="K (draft tokens per round)", ylabel="speedup over the target alone", title="Speedup")
    axes[1].set(xlabel="K (draft tokens per round)", ylabel="rate", ylim=(0, 1.05), title="Acceptance")
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"specdec: {report['draft_model']} drafting for {report['target_model']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(report: dict, out: Path) -> None:
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(markdown(report))
    plot(report, out / "speedup.png")
