import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from tiny_models import build_tiny_model  # noqa: E402

# tiny models gain nothing from a second thread, and OpenMP threads spin badly on a busy machine
torch.set_num_threads(1)

# Without a GPU the Triton kernels' tests (tests/unit/test_triton_attention.py) run in Triton's
# interpreter, which must be on before triton is first imported: so here. With a GPU they compile.
# Nothing else changes: "auto" never picks the Triton backend off CUDA.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny-llama")), "llama")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny-qwen3")), "qwen3", seed=1)


@pytest.fixture(scope="session", params=["llama", "qwen3"])
def tiny_model(request, tiny_llama, tiny_qwen3) -> str:
    return {"llama": tiny_llama, "qwen3": tiny_qwen3}[request.param]


@pytest.fixture
def keep_torch_threads():
    """The process's torch thread count put back after the test (the benchmark tools set it)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
