"""In-process A/B of the panel kernel for linear layers: `panel_linear` built from two
checkouts' csrc/ (`--before`, `--after`) called in turn on the same weight panels and rows.

Whole-process timings of a linear layer move by tens of percent on a shared VM, and in one
process the second of two back-to-back calls is favoured (measured here: 5-40% at 8 rows for
the same code), so the sides alternate ABAB, then BABA, and the figure is the median of the
per-pair ratios after / before. Default shapes: Qwen3-0.6B's decoder layer weights (q/k/v
fused 4,096 x 1,024; o 1,024 x 2,048; gate/up fused 6,144 x 1,024; down 1,024 x 3,072),
`--head` adds its LM head (151,936 x 1,024, 622 MB).

    .venv/bin/python benchmarks/ab_panel_linear.py --before /tmp/base --rows 8 64 512 4096

where /tmp/base holds the earlier commit's tree (`git worktree add /tmp/base <commit>`).
Prints one line per (weight, rows): each side's median milliseconds, the ratio's median and
quartiles, and the largest difference between the two outputs; --out writes them as JSON.

Called alone over and over, a layer's weight (16-24 MB) stays in a 32 MB L3 and reads faster
than in an engine, whose decode step streams every layer's weights and the head from memory.
`--decode-step LAYERS` times that instead: LAYERS layers of the four weights (each its own
tensor) and the LM head at each row count, one call of each in order per side and round (874 MB
of panels at 4 layers).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from ab_timing import ratio_summary, time_in_turn  # noqa: E402
from nanokv.layers import native_linear  # noqa: E402
from nanokv.layers.native_build import LazyLibrary  # noqa: E402

KERNEL = Path("nanokv/layers/csrc/panel_linear.c")
LAYER_WEIGHTS = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024),
                 "down": (1024, 3072)}
HEAD_WEIGHT = {"lm_head": (151936, 1024)}


def multiply(lib, x: torch.Tensor, panels: torch.Tensor, y: torch.Tensor) -> None:
    """y = x @ w.T through one side's `panel_linear` (x [M, K], y [M, N])."""
    (rows, k), n = x.shape, y.shape[1]
    if lib.panel_linear(x.data_ptr(), panels.data_ptr(), None, y.data_ptr(), rows, n, k) != 0:
        raise MemoryError("panel_linear could not allocate its copy of x")


def report(label: str, row: dict) -> None:
    print(f"{label}: before {row['before_ms']:.2f} ms, after {row['after_ms']:.2f}; after / "
          f"before {row['ratio_median']:.3f} (quartiles {row['ratio_q1']:.3f}-"
          f"{row['ratio_q3']:.3f}); max |after - before| {row['max_abs_diff']:.1e}", flush=True)


def ab_pair(libs: dict, panels: torch.Tensor, n: int, k: int, rows: int, rounds: int,
            gen: torch.Generator) -> dict:
    x = torch.randn(rows, k, generator=gen)  # [M, K]
    outs = {side: torch.empty(rows, n) for side in libs}  # [M, N] each

    def call(side: str) -> None:
        multiply(libs[side], x, panels, outs[side])

    for side in libs:  # a warm-up each
        call(side)
    times = time_in_turn(call, rounds)
    return {"rows": rows, "n": n, "k": k,
            "before_ms": statistics.median(times["before"]) * 1e3,
            "after_ms": statistics.median(times["after"]) * 1e3, **ratio_summary(times),
            "max_abs_diff": (outs["after"] - outs["before"]).abs().max().item()}


def ab_decode_step(libs: dict, layers: int, rows: int, rounds: int,
                   gen: torch.Generator) -> dict:
    """A decode step's linear layers, every weight its own: `layers` x (q/k/v, o, gate/up,
    down) and the LM head, in order, at `rows` rows (their inputs random: timing only)."""
    shapes = [shape for _ in range(layers) for shape in LAYER_WEIGHTS.values()]
    shapes.append(HEAD_WEIGHT["lm_head"])
    panels = [native_linear.pack_panels(torch.randn(n, k, generator=gen) * 0.02)
              for n, k in shapes]  # [ceil(N / 32), K, 32] each
    xs = [torch.randn(rows, k, generator=gen) for _, k in shapes]  # [M, K] each
    outs = {side: [torch.empty(rows, n) for n, _ in shapes] for side in libs}  # [M, N] each

    def call(side: str) -> None:
        for w, x, y in zip(panels, xs, outs[side]):
            multiply(libs[side], x, w, y)

    for side in libs:  # a warm-up each
        call(side)
    times = time_in_turn(call, rounds)
    diff = max((a - b).abs().max().item() for a, b in zip(outs["after"], outs["before"]))
    return {"rows": rows, "layers": layers,
            "before_ms": statistics.median(times["before"]) * 1e3,
            "after_ms": statistics.median(times["after"]) * 1e3, **ratio_summary(times),
            "max_abs_diff": diff}


def setup_float(lib) -> None:
    """The float32 entry points only (what this A/B calls): checkouts from before the int8
    panels (`panel_linear_int8`) load too."""
    lib.pack_panels.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
    lib.pack_panels.restype = None
    lib.panel_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
    lib.panel_linear.restype = ctypes.c_int


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="checkout whose csrc/ is the baseline")
    p.add_argument("--after", default=str(ROOT), help="checkout under test (default: this one)")
    p.add_argument("--rows", type=int, nargs="+", default=[8, 64, 512, 4096],
                   help="row counts M of x")
    p.add_argument("--head", action="store_true", help="also the LM head (rows up to 64)")
    p.add_argument("--decode-step", type=int, default=0, metavar="LAYERS",
                   help="time a decode step's linear layers instead: LAYERS layers' weights "
                        "and the LM head, streamed from memory as in the engine")
    p.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads")
    p.add_argument("--rounds", type=int, default=12, help="calls of each side (>= 4)")
    p.add_argument("--out", default=None, help="JSON file for the rows")
    args = p.parse_args(argv)
    if min(args.rows) < 1:
        p.error("--rows must be positive integers")
    if args.rounds < 4:
        p.error("--rounds must be at least 4 (the ratio's quartiles)")
    if args.threads < 1:
        p.error("--threads must be at least 1")
    if args.decode_step < 0:
        p.error("--decode-step must be a number of layers >= 1 (0: off)")
    sources = {side: Path(getattr(args, side)) / KERNEL for side in ("before", "after")}
    for side, src in sources.items():
        if not src.is_file():
            p.error(f"--{side}: {src} not found (give a checkout of this repository)")
    torch.set_num_threads(args.threads)
    libs = {side: LazyLibrary(src, setup_float).get() for side, src in sources.items()}
    gen = torch.Generator().manual_seed(0)
    results = []
    if args.decode_step:
        for rows in args.rows:
            row = ab_decode_step(libs, args.decode_step, rows, args.rounds, gen)
            results.append(row)
            report(f"decode step, {args.decode_step} layers + head, {rows} rows", row)
    weights = {} if args.decode_step else dict(LAYER_WEIGHTS,
                                               **(HEAD_WEIGHT if args.head else {}))
    for name, (n, k) in weights.items():
        w = torch.randn(n, k, generator=gen) * 0.02  # [N, K]
        panels = native_linear.pack_panels(w)  # [ceil(N / 32), K, 32]
        for rows in args.rows:
            if name == "lm_head" and rows > 64:
                continue  # a decode step's or a batch's last positions, not a prefill's
            row = dict(ab_pair(libs, panels, n, k, rows, args.rounds, gen), weight=name)
            results.append(row)
            report(f"{name} {n} x {k}, {rows} rows", row)
    if args.out:
        meta = {"argv": sys.argv[1:] if argv is None else list(argv), "before": args.before,
                "after": args.after}
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
