"""Run `nanokv calibrate` and write its output, trials and decision as Markdown.

    .venv/bin/python benchmarks/calibration_report.py --out docs/results/kvquant -- \\
        --model models/nanokv-tiny --bits 4 3 2 --block-size 128 --num-threads 1

Everything after `--` goes to `nanokv calibrate` unchanged, except --output, which this script
sets to OUT/kv_calibration.json. Writes OUT/calibration.md (the command, its verbatim output,
a table of every perplexity it measured with the delta against the 0.2 rule, the decision);
--append TITLE adds the run as a section to an existing calibration.md.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path


def _log(stderr: str) -> str:
    """The calibrate log without progress bars."""
    return "\n".join(line for line in stderr.replace("\r", "\n").splitlines()
                     if line.strip() and "it/s]" not in line and "Loading weights" not in line)


def trials_table(data: dict) -> str:
    limit = data["settings"].get("max_ppl_increase", 0.2)
    lines = ["| kv_cache_dtype | bits | layer_bits | perplexity | Δ vs full precision | "
             f"within +{limit:g} |", "|---|---|---|---|---|---|"]
    for t in data["perplexity"]["trials"]:
        layer_bits = "-" if t["layer_bits"] is None else str(t["layer_bits"]).replace(
            "None", "full")
        ok = "-" if t["kv_cache_dtype"] == "auto" else ("yes" if t["delta"] <= limit else "no")
        lines.append(f"| {t['kv_cache_dtype']} | {t['bits'] or '-'} | {layer_bits} | "
                     f"{t['perplexity']:.4f} | {t['delta']:+.4f} | {ok} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: calibration_report.py --out DIR -- <nanokv calibrate args>")
    split = argv.index("--")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/results/kvquant")
    p.add_argument("--name", default="kv_calibration.json", help="calibration file name")
    p.add_argument("--append", metavar="TITLE", default=None,
                   help="append this run to OUT/calibration.md as a section with this title")
    args = p.parse_args(argv[:split])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    output = str(out / args.name)
    cal_args = argv[split + 1:] + ["--output", output]
    nanokv = str(Path(sys.executable).parent / "nanokv")
    cmd = [nanokv, "calibrate", *cal_args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - t0
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    if proc.returncode != 0:
        return proc.returncode
    data = json.loads(Path(output).read_text())
    d = data["decision"]
    shown = ".venv/bin/nanokv calibrate " + " ".join(shlex.quote(a) for a in cal_args)
    head = (["", f"# {args.append}", ""] if args.append
            else ["# `nanokv calibrate` on the shipped model", ""])
    md = [*head,
          f"Model `{data['model']['path']}` ({data['model']['num_layers']} layers, "
          f"{data['model']['num_kv_heads']} KV heads of {data['model']['head_dim']}); "
          f"calibration {data['settings']['calib_tokens']} tokens, perplexity on "
          f"{data['settings']['eval_tokens']} other tokens of `{data['settings']['text']}`; "
          f"block size {data['settings']['block_size']}, outliers "
          f"{data['settings']['outlier_fraction']:g}, sinks "
          f"{data['settings']['num_sink_tokens']}, nuq {data['settings']['nuq']}. "
          "Perplexities are simulated by calibration (K/V quantized and dequantized inside the "
          "Hugging Face model as the store holds them; see nanokv/quant/calibration_file.py).",
          "", "The rule: the lowest candidate width whose perplexity rises by at most "
          f"{data['settings']['max_ppl_increase']:g} (widths tried from 4 down while they pass); "
          "else per-layer mixed precision (most sensitive layers at 8 bits); else int8; else "
          "full precision.", "",
          "## Decision", "",
          f"**kv_cache_dtype {d['kv_cache_dtype']}, bits {d['bits']}, layer_bits "
          f"{d['layer_bits']}**: perplexity {d['perplexity']:.4f} ({d['delta']:+.4f}). "
          f"Reason: {d['reason']}.", "",
          "## Every perplexity it measured", "", trials_table(data), "",
          f"Calibration file: `{args.name}` (load with `--kv-cache-dtype kvquant "
          f"--kv-quant-config {output}`).", "",
          "## Command and output", "", "```bash", shown, "```", "", "```",
          proc.stdout.rstrip(), "```", "", "Log (stderr):", "", "```",
          _log(proc.stderr), "```", "", f"{seconds:.0f} s.", ""]
    md_path = out / "calibration.md"
    before = md_path.read_text() if args.append and md_path.exists() else ""
    md_path.write_text(before + "\n".join(md))
    print(f"wrote {out / 'calibration.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
