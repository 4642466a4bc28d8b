"""scripts/train_tiny.py end to end on a toy shape: tokenizer training, a few steps, export, card.

The exported directory must load in both transformers and nanokv and give the same logits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("train_tiny")
    out = work / "out"
    cmd = [sys.executable, str(ROOT / "scripts" / "train_tiny.py"), "--workdir", str(work),
           "--out", str(out), "--steps", "3", "--max-minutes", "2", "--lengths", "512",
           "--tokens-per-step", "1024", "--induction-warmup", "1", "--induction-len", "32",
           "--early-needle-frac", "0.5", "--passkey-format", "trained",
           "--eval-formats", "held_out,story/pass_key", "--eval-every", "100000",
           "--final-samples", "1",
           "--threads", "2", "--vocab", "512", "--hidden", "32", "--intermediate", "64",
           "--layers", "2", "--heads", "2", "--kv-heads", "1", "--head-dim", "16"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_export_has_weights_tokenizer_results_and_card(trained):
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "eval_results.json", "README.md"):
        assert (trained / name).is_file(), name
    results = json.loads((trained / "eval_results.json").read_text())
    assert results["steps"] == 3
    assert set(results["passkey_accuracy"]) == {"512", "1024", "2048"}
    assert results["heldout_perplexity"] > 1 and results["heldout_tokens"] > 10_000
    assert results["args"]["early_needle_frac"] == 0.5
    assert results["args"]["passkey_format"] == "trained"
    assert set(results["passkey_2k_by_format"]) == {"held_out", "story/pass_key"}
    card = (trained / "README.md").read_text()
    assert "Passkey target (>= 0.95 at 2048 tokens) NOT met" in card
    assert "in 0.5 of passkey rows uniformly in the first 0.25 of the prompt" in card
    config = json.loads((trained / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["num_hidden_layers"] == 2


def test_export_loads_in_transformers_and_nanokv_with_equal_logits(trained):
    from transformers import AutoModelForCausalLM

    from nanokv import LLM, SamplingParams

    llm = LLM(str(trained), block_size=16)
    prompt = "def add(a, b):\n    return a + b\n"
    ids = list(llm.tokenizer.encode(prompt))
    params = SamplingParams(temperature=0, max_tokens=1, return_prompt_logits=True)
    (out,) = llm.generate([ids], params)
    hf = AutoModelForCausalLM.from_pretrained(str(trained), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]  # [len(ids), vocab]
    got = torch.as_tensor(out.prompt_logits, dtype=torch.float32)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
