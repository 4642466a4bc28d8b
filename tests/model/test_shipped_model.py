"""The trained model the repo ships (models/nanokv-tiny) loads in nanokv and in transformers,
and the two agree greedily on it."""

from pathlib import Path

import pytest
import torch

from nanokv import LLM, SamplingParams
from tiny_models import load_hf

SHIPPED = str(Path(__file__).resolve().parents[2] / "models" / "nanokv-tiny")


@pytest.fixture(scope="module")
def shipped():
    if not (Path(SHIPPED) / "model.safetensors").is_file():
        raise FileNotFoundError(f"the shipped model is missing from {SHIPPED}")
    return SHIPPED


def test_greedy_matches_transformers(shipped):
    llm = LLM(shipped, max_model_len=1024, block_size=64)
    tok = llm.tokenizer
    prompts = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Block:\n    def"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    hf = load_hf(shipped)
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=24, min_new_tokens=24,
                              pad_token_id=tok.eos_token_id)[0, ids.shape[1]:].tolist()
        assert out.token_ids == ref
