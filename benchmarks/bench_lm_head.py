"""The LM head's panel kernel (`nanokv/layers/csrc/panel_linear.c`) against its peers:
y = x @ w.T for rows x [M, K] and a vocabulary matrix w [N, K] (default: Qwen3's 151,936 x
1,024, float32, 622 MB), w packed once into column panels.

Each row count M times the panel kernel, `F.linear` on the plain weight (its reference; MKL's
GEMM) and oneDNN's packed linear (what nanokv's other layers use, and the LM head before),
interleaved in three rounds in one process, and prints medians, the kernel's speed-up over each
peer and its weight-read rate. The kernel's output is checked against `F.linear` first.

    .venv/bin/python benchmarks/bench_lm_head.py --rows 1 3 8 16 64 --threads 2 [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics

import torch
from bench_host_step import median_ms  # a warm-up call, then the median of timed calls

from nanokv.layers.linear import onednn_available
from nanokv.layers.native_linear import pack_panels, panel_linear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 3, 8, 16],
                        help="row counts M of x (each at least 1)")
    parser.add_argument("--vocab", type=int, default=151936, help="rows N of the weight")
    parser.add_argument("--hidden", type=int, default=1024, help="columns K (the hidden size)")
    parser.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads")
    parser.add_argument("--repeats", type=int, default=9, help="timed calls per path and M")
    parser.add_argument("--out", default=None, help="also write the rows as JSON lines here")
    args = parser.parse_args()
    if not all(m >= 1 for m in args.rows):
        parser.error(f"--rows must be at least 1, got {args.rows}")
    if args.vocab < 1 or args.hidden < 1 or args.threads < 1 or args.repeats < 1:
        parser.error("--vocab, --hidden, --threads and --repeats must be positive")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(args.vocab, args.hidden, generator=gen)
    packed = (torch.ops.mkldnn._reorder_linear_weight(weight) if onednn_available() else None)
    panels = pack_panels(weight)
    n = args.vocab
    gib = weight.numel() * 4 / 1e9
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{args.threads} threads, w [{args.vocab}, {args.hidden}] float32 ({gib:.2f} GB)")
    print("| rows | panel kernel ms (GB/s) | F.linear ms (panel speed-up) | "
          "oneDNN packed ms (panel speed-up) |")
    print("|---|---|---|---|")
    rows_out = []
    for m in args.rows:
        x = torch.randn(m, args.hidden, generator=gen)
        torch.testing.assert_close(panel_linear(x, panels, n),
                                   torch.nn.functional.linear(x, weight), atol=1e-3, rtol=1e-4)
        paths = {"panels": lambda x=x: panel_linear(x, panels, n),
                 "f_linear": lambda x=x: torch.nn.functional.linear(x, weight)}
        if packed is not None:
            paths["onednn"] = lambda x=x: torch.ops.mkldnn._linear_pointwise(
                x, packed, None, "none", [], "")
        times: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(3):  # rounds, the paths interleaved
            for name, fn in paths.items():
                times[name].append(median_ms(fn, args.repeats))
        ms = {name: statistics.median(t) for name, t in times.items()}
        row = {"rows": m, "vocab": args.vocab, "hidden": args.hidden, "threads": args.threads,
               **{f"{name}_ms": round(t, 3) for name, t in ms.items()}}
        rows_out.append(row)
        onednn = (f"{ms['onednn']:.1f} ({ms['onednn'] / ms['panels']:.2f}x)"
                  if "onednn" in ms else "-")
        print(f"| {m} | {ms['panels']:.1f} ({gib / ms['panels'] * 1e3:.1f}) | "
              f"{ms['f_linear']:.1f} ({ms['f_linear'] / ms['panels']:.2f}x) | {onednn} |")
    if args.out:
        with open(args.out, "w") as f:
            for row in rows_out:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
