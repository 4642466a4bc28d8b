"""The panel kernel for CPU linear layers (`csrc/panel_linear.c`): y = x @ w.T (+ bias) over
the float32 weight packed once into column panels [ceil(N / 32), K, 32] (`pack_panels`), at any
row count; or over int8 codes in the same panels with a scale per output column (weight-only
int8, `quantization="int8"`: `int8_weights.py`). A decode step reads every weight for a few
rows (the LM head alone: 622 MB for Qwen3); in panels a weight is read once, front to back,
and each row of x costs a broadcast and two FMAs per weight vector, no horizontal sums. Each
float32 layer keeps the faster of its panels and oneDNN's packed copy, measured once per weight
shape at load (`Linear.keep_faster_path`, `panels_win`), so the memory is what it was. AVX-512
and AVX2 vector paths, plain C elsewhere. `F.linear` on the unpacked (or dequantized) weight is
the reference (tests/unit/test_panel_linear.py); `benchmarks/bench_lm_head.py` times it against
F.linear and oneDNN. Built on first use like the decode kernels
(`native_build.build_library`)."""

from __future__ import annotations

import ctypes
import math
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from nanokv.layers.native_build import LazyLibrary

SOURCE = Path(__file__).with_name("csrc") / "panel_linear.c"
PANEL = 32  # output columns per panel (csrc/panel_linear.c's PANEL)


def _setup(lib: ctypes.CDLL) -> None:
    lib.panel_width.argtypes = []
    lib.panel_width.restype = ctypes.c_int
    lib.pack_panels.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
    lib.pack_panels.restype = None
    lib.panel_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
    lib.panel_linear.restype = ctypes.c_int
    lib.panel_linear_int8.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3
    lib.panel_linear_int8.restype = ctypes.c_int
    if lib.panel_width() != PANEL:
        raise OSError(f"panel_linear.c packs {lib.panel_width()} columns a panel, "
                      f"native_linear.py expects {PANEL}")


_LIBRARY = LazyLibrary(SOURCE, _setup)


def load_panel_linear() -> ctypes.CDLL:
    """The library; raises NativeKernelUnavailable (with the reason) when it cannot be built."""
    return _LIBRARY.get()


def panel_linear_available() -> bool:
    return _LIBRARY.available()


def num_panels(out_features: int) -> int:
    return -(-out_features // PANEL)


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] float32 CPU -> panels [ceil(N / 32), K, 32]: panels[p, k, j] =
    weight[32 p + j, k], zero past row N - 1."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(f"pack_panels takes a float32 CPU weight [N, K], got "
                         f"{tuple(weight.shape)} {weight.dtype} {weight.device}")
    weight = weight.detach().contiguous()
    n, k = weight.shape
    panels = torch.empty(num_panels(n), k, PANEL)
    load_panel_linear().pack_panels(weight.data_ptr(), panels.data_ptr(), n, k)
    return panels


def panels_of(weight: torch.Tensor) -> torch.Tensor:
    """pack_panels in PyTorch ops, for a weight of any dtype: the reference of the C packing, and
    how int8 codes are packed (once, at load: `Linear.quantize_int8`)."""
    n, k = weight.shape
    padded = torch.nn.functional.pad(weight, (0, 0, 0, num_panels(n) * PANEL - n))
    return padded.view(num_panels(n), PANEL, k).transpose(1, 2).contiguous()  # [P, K, 32]


def panel_linear(x: torch.Tensor, panels: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None = None, trusted: bool = False,
                 scale: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) from weight's panels (`pack_panels`): x [..., K] float32 CPU
    -> [..., out_features] float32. With `scale` [out_features] float32, the panels hold int8
    codes (`panels_of` the codes) of weight = code * scale[:, None] (weight-only int8). `trusted`:
    panels, scale and bias are a layer's own, checked when it packed them (`Linear.pack_panels`,
    `Linear.quantize_int8`), so only x is checked (a decode step's hot path)."""
    k = panels.shape[1] if panels.dim() == 3 else -1
    if not trusted:
        dtype = torch.float32 if scale is None else torch.int8
        if (panels.dim() != 3 or panels.shape[2] != PANEL or panels.dtype != dtype
                or not panels.is_contiguous() or panels.shape[0] != num_panels(out_features)):
            raise ValueError(f"panels must be {dtype} [{num_panels(out_features)}, K, {PANEL}] "
                             f"(packed from a [{out_features}, K] weight), got "
                             f"{tuple(panels.shape)} {panels.dtype}")
        for name, t in (("bias", bias), ("scale", scale)):
            if t is not None and (t.dtype != torch.float32 or t.shape != (out_features,)
                                  or not t.is_contiguous()):
                raise ValueError(f"{name} must be float32 [{out_features}], got "
                                 f"{tuple(t.shape)} {t.dtype}")
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"panel_linear takes float32 CPU x [..., {k}], got {tuple(x.shape)} "
                         f"{x.dtype} {x.device}")
    rows = x.reshape(-1, k).contiguous()  # [M, K]
    bias = None if bias is None else bias.contiguous()
    y = torch.empty(rows.shape[0], out_features)
    lib, bias_ptr = load_panel_linear(), None if bias is None else bias.data_ptr()
    if scale is None:
        status = lib.panel_linear(rows.data_ptr(), panels.data_ptr(), bias_ptr, y.data_ptr(),
                                  rows.shape[0], out_features, k)
    else:
        status = lib.panel_linear_int8(rows.data_ptr(), panels.data_ptr(), scale.data_ptr(),
                                       bias_ptr, y.data_ptr(), rows.shape[0], out_features, k)
    if status != 0:
        raise MemoryError(f"panel_linear could not allocate its scratch (a copy of x "
                          f"{tuple(rows.shape)}, a widened int8 panel a thread)")
    return y.view(*x.shape[:-1], out_features)


HEAD_ROWS = (1, 8, 64)  # an LM head's rows: decode steps, a batch's first tokens after prefill
LAYER_ROWS = (1, 8, 64, 512)  # a decoder layer's: decode steps and prefill chunks


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


def panels_win(time_paths: Callable[[int], tuple[float, float]],
               rows: Sequence[int] = HEAD_ROWS, margin: float = 0.9) -> bool:
    """Whether a linear layer should keep the panels rather than oneDNN's packed copy: each of
    `rows` timed on both (`time_paths(r)` -> (panel seconds, oneDNN seconds),
    `Linear.keep_faster_path`); oneDNN wins only when the geometric mean over `rows` of its
    time / the panels' is under `margin` (so noise keeps the panels). Each row count weighs
    alike: by totals, the head's 64-row call (5-6x a decode step's 1 or 8 rows, where the two
    paths are close) decided alone, and a noisy measurement of it flipped the head of a run.
    On a Zen 4 EPYC the panels took 0.75x and 0.87x oneDNN's time at 1 and 8 rows of Qwen3's
    151,936 x 1,024 head and 1.0x at 64, 0.55-0.75x at 1-8 rows of its decoder layers'
    weights, 0.90-1.13x at 4,096 (docs/results/linear/README.md); measured at load because CPUs
    and shapes differ (as cudnn.benchmark picks convolution algorithms)."""
    if not rows or min(rows) < 1:
        raise ValueError(f"rows must be positive row counts, got {list(rows)}")
    log_ratio = 0.0
    for r in rows:
        p, o = time_paths(r)
        log_ratio += math.log(max(o, 1e-12) / max(p, 1e-12))
    return not log_ratio / len(rows) < math.log(margin)
