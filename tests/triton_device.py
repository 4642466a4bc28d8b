"""The device the Triton kernels' tests run on: the GPU, else the CPU in Triton's interpreter
(tests/conftest.py turns it on before triton is first imported). A test module calls
`triton_device()` at import, before it imports the kernels: without Triton, or on a CPU without
the interpreter, the module is skipped."""

import pytest
import torch


def triton_device() -> torch.device:
    pytest.importorskip("triton")
    from nanokv.attention import triton_paged

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu" and not triton_paged.interpreter_on():
        pytest.skip("the Triton kernels need a GPU or TRITON_INTERPRET=1 before triton is "
                    "imported (tests/conftest.py sets it)", allow_module_level=True)
    return device


def triton_ready() -> bool:
    """Whether an engine's Triton backend runs on this CPU (Triton's interpreter, triton
    installed); the model tests' engines are CPU engines."""
    try:
        from nanokv.attention import triton_paged
    except ImportError:
        return False
    return triton_paged.interpreter_on() and not triton_paged.triton_unavailable()
