"""Run `nanokv calibrate` and write its output, trials and decision as Markdown.

    .venv/bin/python benchmarks/calibration_report.py --out docs/results/kvquant -- \\
        --model models/nanokv-tiny --bits 4 3 2 --block-size 128 --num-threads 1 --measure both

Everything after `--` goes to `nanokv calibrate` unchanged, except --output, which this script
sets to OUT/kv_calibration.json. Writes OUT/calibration.md (the command, its verbatim output,
a table of every candidate measured: perplexity, increase over full precision in percent, KL and
top-1, the simulated estimate beside the engine's with --measure both, and whether it is within
the bound; the decision); --append TITLE adds the run as a section to an existing calibration.md.
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
                     if line.strip() and not line.startswith("calibrate")
                     and "it/s]" not in line and "Loading weights" not in line)


def _fmt(t: dict) -> str:
    return f"{t['perplexity']:.4f} | {t['increase_percent']:+.3f}% | {t['kl']:.5f}"


def trials_table(data: dict) -> str:
    settings = data["settings"]
    limit = settings["max_ppl_increase"]
    max_kl = settings.get("max_kl")
    bound = f"+{limit:g}%" + ("" if max_kl is None else f", KL <= {max_kl:g}")
    trials = data["perplexity"]["trials"]
    both = any("simulated" in t for t in trials)
    measure = "engine" if settings["measure"] == "both" else settings["measure"]
    head = "| kv_cache_dtype | bits | layer_bits | "
    sep = "|---|---|---|"
    if both:
        head += "simulated perplexity | simulated increase | simulated KL | "
        sep += "---|---|---|"
    head += (f"{measure} perplexity | {measure} increase | {measure} KL | {measure} top-1 | "
             f"within {bound} ({measure}) |")
    sep += "---|---|---|---|---|"
    lines = [head, sep]
    for t in trials:
        layer_bits = "-" if t["layer_bits"] is None else str(t["layer_bits"])
        ok = "-"
        if t["kv_cache_dtype"] != "auto":
            ok = "yes" if (t["increase_percent"] <= limit
                           and (max_kl is None or t["kl"] <= max_kl)) else "no"
        sim = f"{_fmt(t['simulated'])} | " if both else ""
        lines.append(f"| {t['kv_cache_dtype']} | {t['bits'] or '-'} | {layer_bits} | {sim}"
                     f"{_fmt(t)} | {t['top1']:.3f} | {ok} |")
    return "\n".join(lines)


def protocol(settings: dict) -> str:
    engine = ("Engine: one nanokv engine per candidate with its real KV store; each window is "
              f"prefilled in chunks of {settings['chunk_size']} tokens (max_num_batched_tokens), "
              "one window at a time, so every chunk reads the earlier chunks back from the store "
              "as decoding does (kvquant: full blocks quantized, the partial block's keys in "
              "full-precision staging). ")
    simulated = ("Simulated: K/V quantized and dequantized inside the Hugging Face model by "
                 "hooks (the store's codec), each window in one forward pass, so every token "
                 "also reads its own block quantized. ")
    text = {"engine": engine, "simulated": simulated, "both": engine + simulated}
    return (text[settings["measure"]] + "Scored: the tokens after the first "
            f"{settings['context_fraction']:.0%} of each window; KL(full precision || "
            "candidate) and top-1 agreement against the same measure's full-precision "
            "distributions on those tokens.")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                usage="calibration_report.py [--out DIR] [--name NAME] "
                                      "[--append TITLE] -- <nanokv calibrate args>")
    p.add_argument("--out", default="docs/results/kvquant")
    p.add_argument("--name", default="kv_calibration.json", help="calibration file name")
    p.add_argument("--append", metavar="TITLE", default=None,
                   help="append this run to OUT/calibration.md as a section with this title")
    if "--" not in argv:
        if {"-h", "--help"} & set(argv):
            p.print_help()
            return 0
        p.error("give the nanokv calibrate arguments after '--'")
    split = argv.index("--")
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
    st = data["settings"]
    windows = st["eval_tokens"] // st.get("eval_seq_len", st["eval_tokens"])
    md = [*head,
          f"Model `{data['model']['path']}` ({data['model']['num_layers']} layers, "
          f"{data['model']['num_kv_heads']} KV heads of {data['model']['head_dim']}); "
          f"calibration {st['calib_tokens']} tokens; candidates measured on "
          f"{st['eval_tokens']} other tokens of `{st['text']}`"
          + (f" ({windows} windows of {st['eval_seq_len']})" if "eval_seq_len" in st else "")
          + f"; block size {st['block_size']}, outliers {st['outlier_fraction']:g}, sinks "
          f"{st['num_sink_tokens']}, nuq {st['nuq']}. Measure `{st['measure']}`"
          + (" (the decision uses the engine's numbers)" if st["measure"] == "both" else "")
          + f". {protocol(st)}", "",
          "The rule (nanokv/quant/precision_rule.py): the lowest candidate width whose "
          f"perplexity rises by at most {st['max_ppl_increase']:g}% of the full-precision "
          "baseline" + ("" if st.get("max_kl") is None else f" and whose KL is at most "
                        f"{st['max_kl']:g}") + " (widths tried from the highest down while "
          "they pass); else per-layer mixed precision (each layer's sensitivity: its "
          + ("perplexity increase" if st.get("max_kl") is None else "KL")
          + " alone at the highest width, the others at 8 bits; the most sensitive layers to 8 "
          "bits one by one); else int8; else full precision.", "",
          "## Decision", "",
          f"**kv_cache_dtype {d['kv_cache_dtype']}, bits {d['bits']}, layer_bits "
          f"{d['layer_bits']}**: perplexity {d['perplexity']:.4f} "
          f"({d['increase_percent']:+.3f}%, {d['delta']:+.4f}), KL {d['kl']:.5f}. "
          f"Reason: {d['reason']}.", "",
          "## Every candidate it measured", "", trials_table(data), "",
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
