"""benchmarks/make_draft_pair.py and bench_speculative.py's --draft-model: the pair's weights
(the draft the base's first layers, the target the base with its later layers' output
projections scaled), a damping of 0 making the target's function the draft's (every draft
accepted), and the benchmark's draft-model run, whose transformers' assisted outputs must be
nanokv's."""

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from benchmark_scripts import BENCHMARKS, load_benchmark
from nanokv import LLM, SamplingParams
from tiny_models import build_tiny_model


def test_the_pair_is_cut_from_the_base(tmp_path):
    base = Path(build_tiny_model(str(tmp_path / "base"), "qwen3", seed=2, num_hidden_layers=3))
    load_benchmark("make_draft_pair").build(base, tmp_path / "pair", 1, 0.5)
    weights = load_file(str(base / "model.safetensors"))
    target = load_file(str(tmp_path / "pair/target/model.safetensors"))
    draft = load_file(str(tmp_path / "pair/draft/model.safetensors"))
    assert target.keys() == weights.keys()
    damped = [n for n in weights if n.startswith(("model.layers.1.", "model.layers.2."))
              and n.endswith(("o_proj.weight", "down_proj.weight"))]
    assert len(damped) == 4
    for name, w in weights.items():
        assert torch.equal(target[name], w * 0.5 if name in damped else w), name
    assert sorted(draft) == sorted(n for n in weights if not n.startswith(
        ("model.layers.1.", "model.layers.2.")))
    assert all(torch.equal(draft[n], weights[n]) for n in draft)
    config = json.loads((tmp_path / "pair/draft/config.json").read_text())
    assert config["num_hidden_layers"] == 1
    assert len(config.get("layer_types") or [None]) == 1
    assert (tmp_path / "pair/draft/tokenizer.json").exists()


def test_no_damping_makes_every_draft_accepted(tmp_path):
    base = build_tiny_model(str(tmp_path / "base"), "llama", seed=3, num_hidden_layers=3)
    load_benchmark("make_draft_pair").build(Path(base), tmp_path / "pair", 1, 0.0)
    llm = LLM(str(tmp_path / "pair/target"), block_size=16, max_model_len=128,
              speculative_config={"model": str(tmp_path / "pair/draft"),
                                  "num_speculative_tokens": 3})
    llm.generate([[5, 6, 7, 8], [40, 41, 42]], SamplingParams(temperature=0, max_tokens=16,
                                                              ignore_eos=True), use_tqdm=False)
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens


def test_the_benchmark_runs_a_draft_model(tmp_path):
    base = build_tiny_model(str(tmp_path / "base"), "llama", seed=4, num_hidden_layers=3)
    load_benchmark("make_draft_pair").build(Path(base), tmp_path / "pair", 2, 0.1)
    r = subprocess.run([sys.executable, str(BENCHMARKS / "bench_speculative.py"),
                        "--model", str(tmp_path / "pair/target"),
                        "--draft-model", str(tmp_path / "pair/draft"), "--prompts", "2",
                        "--segment", "12", "--repeats-in-prompt", "1", "--output-len", "8",
                        "--k", "2", "--repeats", "1", "--kv-cache-memory", "4MiB",
                        "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    table = (tmp_path / "out/speculative.md").read_text()
    assert "| nanokv draft k=2 |" in table and "HF transformers assisted k=2" in table
    assert "tokens differ" not in table  # transformers' assisted tokens are nanokv's
    results = json.loads((tmp_path / "out/speculative.json").read_text())
    assert results["draft_model"] == str(tmp_path / "pair/draft")
