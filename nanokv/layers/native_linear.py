"""The few-rows linear kernel (`csrc/small_linear.c`): y = x @ w.T (+ bias) for at most
MAX_ROWS rows of x, each row of the float32 weight read once. Used by the LM head of a decode
step on CPU (`Linear.few_rows`), where a GEMM library's blocking for a few rows reads a 600 MB
vocabulary matrix well under the memory's speed. Where the layer holds oneDNN's packed weight
too, which path is faster at a row count depends on the CPU (`Linear.measure_few_rows` times
both once, `onednn_crossover` picks). AVX-512 and AVX2 vector paths, plain C elsewhere.
`F.linear` is the reference (tests/unit/test_small_linear.py); `benchmarks/bench_small_linear.py`
times both. Built on first use like the decode kernels (`native_attention.build_library`)."""

from __future__ import annotations

import ctypes
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from nanokv.layers.native_attention import LazyLibrary

SOURCE = Path(__file__).with_name("csrc") / "small_linear.c"
MAX_ROWS = 16

def _setup(lib: ctypes.CDLL) -> None:
    lib.small_m_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
    lib.small_m_linear.restype = ctypes.c_int


_LIBRARY = LazyLibrary(SOURCE, _setup)


def load_small_linear() -> ctypes.CDLL:
    """The library; raises NativeKernelUnavailable (with the reason) when it cannot be built."""
    return _LIBRARY.get()


def small_linear_available() -> bool:
    return _LIBRARY.available()


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Can the kernel take F.linear(x, weight): float32 CPU tensors, x [1..MAX_ROWS, K],
    weight [N, K] contiguous."""
    return (x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.dtype == torch.float32
            and weight.dtype == torch.float32 and x.device.type == "cpu"
            and weight.device.type == "cpu" and weight.dim() == 2
            and weight.shape[1] == x.shape[1] and weight.is_contiguous())


def small_m_linear(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for `fits` inputs -> [M, N] float32."""
    if not fits(x, weight):
        raise ValueError(f"small_m_linear takes float32 CPU x [1..{MAX_ROWS}, K] and a contiguous "
                         f"weight [N, K], got x {tuple(x.shape)} {x.dtype} {x.device} and weight "
                         f"{tuple(weight.shape)} {weight.dtype}")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (weight.shape[0],)):
        raise ValueError(f"bias must be float32 [{weight.shape[0]}], got {tuple(bias.shape)} "
                         f"{bias.dtype}")
    x = x.contiguous()
    bias = None if bias is None else bias.contiguous()
    y = torch.empty(x.shape[0], weight.shape[0])
    status = load_small_linear().small_m_linear(
        x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
        x.shape[0], weight.shape[0], weight.shape[1])
    if status != 0:  # fits() checked the row count
        raise RuntimeError("small_m_linear refused its inputs")
    return y


CROSSOVER_ROWS = (1, 2, 4, 8, MAX_ROWS)


def median_seconds(fns: Sequence[Callable[[], object]], repeats: int) -> list[float]:
    """Median seconds of each of `fns`, called in turn `repeats` times after one warm-up call
    each (load from elsewhere falls on all alike)."""
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def onednn_crossover(time_paths: Callable[[int], tuple[float, float]],
                     rows: Sequence[int] = CROSSOVER_ROWS, margin: float = 0.9) -> int:
    """The row count from which a few-rows layer that holds oneDNN's packed weight too should
    take oneDNN (as cudnn.benchmark picks convolution algorithms): each of `rows` is timed on
    both paths (`time_paths(r)` -> (kernel seconds, oneDNN seconds), `Linear.measure_few_rows`);
    oneDNN wins a row count when it takes under `margin` of the kernel's time (so noise keeps the
    kernel). Returns the smallest measured row count from which oneDNN wins at every larger one,
    or MAX_ROWS + 1 (never). Which is faster depends on the CPU: for Qwen3's 151,936 x 1,024 LM
    head at 8 rows the kernel took 24 ms against oneDNN's 29 on an AVX-512 Xeon, 33 against 27
    on a Zen 4 EPYC (docs/results/linear/README.md)."""
    rows = sorted(set(rows))
    if not rows or rows[0] < 1 or rows[-1] > MAX_ROWS:
        raise ValueError(f"rows must lie in [1, {MAX_ROWS}], got {list(rows)}")
    wins = []
    for r in rows:
        kernel_s, onednn_s = time_paths(r)
        wins.append(onednn_s < margin * kernel_s)
    crossover = MAX_ROWS + 1
    for r, win in zip(reversed(rows), reversed(wins)):
        if not win:
            break
        crossover = r
    return crossover
