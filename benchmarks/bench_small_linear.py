"""The few-rows linear kernel (`nanokv/layers/csrc/small_linear.c`) against its peers for a
decode step's LM head: y = x @ w.T for a few rows x [M, K] and a vocabulary matrix w [N, K]
(default: Qwen3's 151,936 x 1,024, float32, 622 MB).

Each row count M times the kernel, `F.linear` (its reference; a GEMM) and oneDNN's packed linear
(what nanokv's other layers use), interleaved in one process, and prints medians, the kernel's
speed-up over each peer and its weight-read rate. The kernel's output is checked against
`F.linear` first.

    .venv/bin/python benchmarks/bench_small_linear.py --rows 1 3 8 16 --threads 2 [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics

import torch
from bench_host_step import median_ms  # a warm-up call, then the median of timed calls

from nanokv.layers.linear import onednn_available
from nanokv.layers.native_linear import MAX_ROWS, small_m_linear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 3, 8, 16],
                        help=f"row counts M of x (1-{MAX_ROWS})")
    parser.add_argument("--vocab", type=int, default=151936, help="rows N of the weight")
    parser.add_argument("--hidden", type=int, default=1024, help="columns K (the hidden size)")
    parser.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads")
    parser.add_argument("--repeats", type=int, default=9, help="timed calls per path and M")
    parser.add_argument("--out", default=None, help="also write the rows as JSON lines here")
    args = parser.parse_args()
    if not all(1 <= m <= MAX_ROWS for m in args.rows):
        parser.error(f"--rows must be between 1 and {MAX_ROWS}, got {args.rows}")
    if args.vocab < 1 or args.hidden < 1 or args.threads < 1 or args.repeats < 1:
        parser.error("--vocab, --hidden, --threads and --repeats must be positive")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(args.vocab, args.hidden, generator=gen)
    packed = (torch.ops.mkldnn._reorder_linear_weight(weight) if onednn_available() else None)
    gib = weight.numel() * 4 / 1e9
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{args.threads} threads, w [{args.vocab}, {args.hidden}] float32 ({gib:.2f} GB)")
    print("| rows | few-rows ms (GB/s) | F.linear ms (few-rows speed-up) | "
          "oneDNN packed ms (few-rows speed-up) |")
    print("|---|---|---|---|")
    rows_out = []
    for m in args.rows:
        x = torch.randn(m, args.hidden, generator=gen)
        torch.testing.assert_close(small_m_linear(x, weight),
                                   torch.nn.functional.linear(x, weight), atol=1e-3, rtol=1e-4)
        paths = {"few_rows": lambda x=x: small_m_linear(x, weight),
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
        onednn = (f"{ms['onednn']:.1f} ({ms['onednn'] / ms['few_rows']:.2f}x)"
                  if "onednn" in ms else "-")
        print(f"| {m} | {ms['few_rows']:.1f} ({gib / ms['few_rows'] * 1e3:.1f}) | "
              f"{ms['f_linear']:.1f} ({ms['f_linear'] / ms['few_rows']:.2f}x) | {onednn} |")
    if args.out:
        with open(args.out, "w") as f:
            for row in rows_out:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
