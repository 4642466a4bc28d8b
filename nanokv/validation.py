"""Checks of user-given values: each raises ValueError saying what was wrong and what is allowed.

Used by the engine config, the KV policies, the KV caches and the sampling parameters alike, so
one kind of mistake reads the same wherever it is made.
"""

from __future__ import annotations

import math
from typing import Any


def check_choice(name: str, value: Any, allowed: tuple | list) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


def check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")


def check_fraction(name: str, value: Any, *, low_open: bool = True, high_open: bool = False,
                   meaning: str = "") -> None:
    """value in (0, 1] by default; `low_open` / `high_open` choose the interval's ends."""
    ok = (not isinstance(value, bool) and isinstance(value, (int, float))
          and (0 < value if low_open else 0 <= value) and (value < 1 if high_open else value <= 1))
    if not ok:
        interval = f"{'(' if low_open else '['}0, 1{')' if high_open else ']'}"
        raise ValueError(f"{name}{meaning} must be in {interval}, got {value!r}")


def check_finite(name: str, value: Any, above: float | None = None, unit: str = "") -> None:
    """value a finite int or float (not a bool), and > `above` when given."""
    ok = (not isinstance(value, bool) and isinstance(value, (int, float))
          and math.isfinite(value) and (above is None or value > above))
    if not ok:
        bound = "" if above is None else f" > {above:g}"
        raise ValueError(f"{name} must be a finite number{unit}{bound}, got {value!r}")

