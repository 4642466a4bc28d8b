"""Eval results as Markdown, JSON and plots (score vs compression; score vs KV bytes held)."""

from __future__ import annotations

import json
import os

from nanokv.eval.harness import EvalRow

LOWER_IS_BETTER = {"perplexity", "kl_nats"}


def to_markdown(rows: list[EvalRow]) -> str:
    lines = ["| task | policy | compression | metric | score | kept | KV KiB/request | notes |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        notes = ""
        if "top1_agreement" in r.extra:
            notes = f"top-1 agreement {r.extra['top1_agreement']:.3f}"
        elif "accuracy_by_depth" in r.extra:
            notes = "by depth " + " ".join("-" if a is None else f"{a:.2f}"
                                           for a in r.extra["accuracy_by_depth"])
        lines.append(f"| {r.task} | {r.policy} | {r.compression:g}x | {r.metric} | "
                     f"{r.score:.4f} | {r.kept_fraction:.3f} | {r.kv_bytes / 1024:.0f} | "
                     f"{notes} |")
    return "\n".join(lines) + "\n"


def write_results(rows: list[EvalRow], out_dir: str, command: str) -> list[str]:
    """Write results.md, results.json and the two plots; returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    md = os.path.join(out_dir, "results.md")
    with open(md, "w") as f:
        f.write(f"Command:\n\n```\n{command}\n```\n\n")
        f.write(to_markdown(rows))
    js = os.path.join(out_dir, "results.json")
    with open(js, "w") as f:
        json.dump({"command": command, "rows": [r.to_dict() for r in rows]}, f, indent=1)
    paths += [md, js]
    paths += plot(rows, out_dir)
    return paths


def plot(rows: list[EvalRow], out_dir: str) -> list[str]:
    from nanokv.extras import require

    require("eval", "the evaluation plots")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    task_names = list(dict.fromkeys(r.task for r in rows))
    written = []
    for x_axis, fname in (("compression", "score_vs_compression.png"),
                          ("kv_bytes", "score_vs_kv_bytes.png")):
        fig, axes = plt.subplots(1, len(task_names), figsize=(4.2 * len(task_names), 3.6),
                                 squeeze=False)
        for ax, task in zip(axes[0], task_names):
            task_rows = [r for r in rows if r.task == task]
            full = [r for r in task_rows if r.policy == "full"]
            for policy in dict.fromkeys(r.policy for r in task_rows if r.policy != "full"):
                pts = sorted(((r.compression if x_axis == "compression" else r.kv_bytes / 1024,
                               r.score) for r in task_rows if r.policy == policy))
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy)
            if full:
                if x_axis == "compression":
                    ax.axhline(full[0].score, color="black", linestyle="--", label="full cache")
                else:
                    ax.plot([full[0].kv_bytes / 1024], [full[0].score], "k*", markersize=10,
                            label="full cache")
            ax.set_title(f"{task} ({task_rows[0].metric})")
            ax.set_xlabel("compression (x)" if x_axis == "compression" else "KV KiB / request")
            if x_axis == "compression":
                ax.set_xscale("log", base=2)
            if task_rows[0].metric in LOWER_IS_BETTER:
                ax.set_ylabel("lower is better")
            ax.grid(alpha=0.3)
        axes[0][-1].legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out_dir, fname)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
