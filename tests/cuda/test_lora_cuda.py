"""On a CUDA GPU (skipped elsewhere): LoRA adapters (enable_lora) give, request by request in
one batch with the base model, the tokens of the model with that adapter merged into its
weights, with CUDA graphs on (steps with adapter rows run eagerly, base-model decode steps
through the graphs). The same check runs on CPU in tests/model/test_lora.py, next to the
PEFT-checked tests (PEFT is not installed on the GPU machine)."""

from __future__ import annotations

import pytest
import torch

from lora_oracles import check_against_merged

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_adapters_match_merged_weights_on_cuda(tiny_model, tmp_path):
    check_against_merged(tiny_model, tmp_path, device="cuda", enforce_eager=False)
