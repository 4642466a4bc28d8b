"""A fixed piece of work whose CPU time measures how fast the machine runs at the moment.

On a shared virtual machine the same engine step takes 5-30% more or less CPU time from one
few seconds to the next: other tenants of the host share its caches, memory bandwidth and
clock, and CPU time cannot show it (the thread is not waiting, each instruction just takes
longer). Timing the same work again and again beside the engine measures that drift, so that
a replay can scale a step model fitted at another moment (`speed_profile`).

The work is the engine's in small: a matrix product of the shipped model's layer sizes (a
decode batch of 8 rows, hidden 256, intermediate 768), a pass over 4 MiB (weights that no
longer sit in the core's own caches) and a Python loop of the scheduler's kind. About 0.2 ms.
"""

from __future__ import annotations

from collections.abc import Callable


def speed_work() -> Callable[[], float]:
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 256, generator=g)
    w = torch.randn(256, 768, generator=g)
    buf = torch.randn(1 << 20, generator=g)  # 4 MiB of float32

    def work() -> float:
        s = float((x @ w).sum()) + float(buf.sum())
        table: dict[int, int] = {}
        for i in range(300):
            table[i & 31] = i
        return s + len(table)

    work()  # first-call paths
    return work
