"""Host -> device copies on the hot path."""

from __future__ import annotations

import numpy as np
import torch


def upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A numpy array on `device` in one copy that does not wait for the device's queued work (a
    blocking copy would synchronise the stream); on CPU the array's own memory, no copy."""
    tensor = torch.from_numpy(array)
    if device.type == "cpu":
        return tensor
    return tensor.to(device, non_blocking=True)
