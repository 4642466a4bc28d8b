"""Host -> device copies on the hot path."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A numpy array on `device` in one copy that does not wait for the device's queued work (a
    blocking copy would synchronise the stream); on CPU the array's own memory, no copy."""
    tensor = torch.from_numpy(array)
    if device.type == "cpu":
        return tensor
    return tensor.to(device, non_blocking=True)


def upload_parts(parts: Sequence[np.ndarray | Sequence[int]], device: torch.device,
                 dtype=np.int64) -> list[torch.Tensor]:
    """Several index lists or arrays on `device` in one `upload`: each part's flat view of it
    (in `dtype`), in order."""
    arrays = [np.asarray(part, dtype=dtype).reshape(-1) for part in parts]
    packed = upload(np.concatenate(arrays) if arrays else np.zeros(0, dtype), device)
    views, start = [], 0
    for array in arrays:
        views.append(packed[start:start + array.size])
        start += array.size
    return views
