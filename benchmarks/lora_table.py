#!/usr/bin/env python
"""The table of benchmarks/run_lora_results.sh: per scenario each engine's output tok/s (the
median over rounds of each run's median), nanokv / vLLM, each engine's LoRA scenarios / its
base model without LoRA, and whether both engines gave the same tokens.

    python benchmarks/lora_table.py docs/results/lora/runs.jsonl
"""

from __future__ import annotations

import json
import statistics
import sys


def main() -> None:
    runs = [json.loads(line) for path in sys.argv[1:] for line in open(path) if line.strip()]
    if not runs:
        raise SystemExit("no runs given")
    tok_s: dict[tuple[str, str], list[float]] = {}  # (engine, scenario) -> tok/s per run
    tokens: dict[tuple[str, str], list] = {}
    for run in runs:
        for name, scenario in run["scenarios"].items():
            key = "base, LoRA off" if run["lora"] == "off" else name
            tok_s.setdefault((run["engine"], key), []).append(scenario["tok_s"])
            tokens[(run["engine"], key)] = scenario["token_ids"]
    first = runs[0]
    print(f"{first['requests']} requests x {first['prompt_len']} prompt + "
          f"{first['output_len']} output tokens, {first['adapters']} adapters; "
          f"{len(runs)} runs\n")
    print("| scenario | nanokv tok/s | vLLM tok/s | nanokv / vLLM | nanokv / its base | "
          "vLLM / its base | same tokens |")
    print("|---|---|---|---|---|---|---|")
    scenarios = list(dict.fromkeys(s for _, s in tok_s))
    base = {e: statistics.median(tok_s[(e, "base, LoRA off")]) for e in ("nanokv", "vllm")
            if (e, "base, LoRA off") in tok_s}
    for s in scenarios:
        n, v = (statistics.median(tok_s[(e, s)]) if (e, s) in tok_s else None
                for e in ("nanokv", "vllm"))
        same = tokens.get(("nanokv", s)) == tokens.get(("vllm", s)) if v and n else None
        cells = [f"{n:.1f}" if n else "-", f"{v:.1f}" if v else "-",
                 f"{n / v:.2f}x" if n and v else "-",
                 f"{n / base['nanokv']:.2f}x" if n and "nanokv" in base else "-",
                 f"{v / base['vllm']:.2f}x" if v and "vllm" in base else "-",
                 "-" if same is None else "yes" if same else "no"]
        print(f"| {s} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
