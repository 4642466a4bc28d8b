"""Greedy parity of nanokv on CUDA with Hugging Face transformers (on CPU, float32), on the tiny
test models, through the paths only CUDA runs: the PyTorch backend's padded decode batch and the
quantized store's PyTorch attention on the device. Scenarios: plain, shared prefix (prefix hits),
a small step budget (chunked prefill), a small pool (preemption), int8 KV (compared with
nanokv's own float run: quantization may change tokens against HF). Decode steps go through CUDA
graphs where the attention backend supports them (each row records how many), or eagerly with
--enforce-eager.

    PYTHONPATH=. python scripts/cuda_parity.py --out OUT_DIR [--enforce-eager]

Writes OUT_DIR/cuda_parity.json (cuda_parity_eager.json with --enforce-eager); exits 1 on any
mismatch, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from tiny_models import VOCAB, build_tiny_model, hf_greedy, load_hf  # noqa: E402

from nanokv import LLM, SamplingParams  # noqa: E402

MAX_NEW = 12
SCENARIOS = {
    "plain": dict(),
    "prefix_cache": dict(),
    "chunked_prefill": dict(max_num_batched_tokens=9),
    "preemption": dict(num_kv_blocks=9, max_model_len=128),
}


def prompts(shared_prefix: bool) -> list[list[int]]:
    rng = random.Random(0)
    prefix = [rng.randrange(2, VOCAB - 30) for _ in range(37)] if shared_prefix else []
    return [prefix + [rng.randrange(2, VOCAB - 30) for _ in range(n)] for n in (3, 17, 40, 25)]


def graph_steps(llm: LLM) -> int:
    """Decode steps that ran through CUDA graphs (0: eager)."""
    graphs = llm.engine.runner.graphs
    return 0 if graphs is None else graphs.num_graph_steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: a dry run of this script's own logic where there is no GPU")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    results, ok = [], True
    for arch in ("llama", "qwen3"):
        model = build_tiny_model(tempfile.mkdtemp(), arch, seed=0 if arch == "llama" else 1)
        hf = load_hf(model)
        for name, options in SCENARIOS.items():
            ps = prompts(shared_prefix=name == "prefix_cache")
            expected = [hf_greedy(hf, p, MAX_NEW)[0] for p in ps]
            llm = LLM(model, device=args.device, dtype="float32", block_size=16,
                      skip_tokenizer_init=True, enforce_eager=args.enforce_eager,
                      **{"max_model_len": 256, **options})
            got = [o.token_ids for o in llm.generate(ps, params, use_tqdm=False)]
            if name == "prefix_cache":  # again: served from the prefix cache
                got = [o.token_ids for o in llm.generate(ps, params, use_tqdm=False)]
            int8 = LLM(model, device=args.device, dtype="float32", block_size=16,
                       skip_tokenizer_init=True, kv_cache_dtype="int8",
                       enforce_eager=args.enforce_eager,
                       **{"max_model_len": 256, **options})
            got_int8 = [o.token_ids for o in int8.generate(ps, params, use_tqdm=False)]
            row = {"arch": arch, "scenario": name, "hf_equal": got == expected,
                   "int8_equal_float": got_int8 == got,
                   "backend": llm.engine.attention_backend.name,
                   "preemptions": llm.engine.scheduler.num_preemptions,
                   "graph_steps": graph_steps(llm), "int8_graph_steps": graph_steps(int8)}
            ok &= row["hf_equal"]
            results.append(row)
            print(json.dumps(row))
    name = "cuda_parity_eager.json" if args.enforce_eager else "cuda_parity.json"
    (out / name).write_text(json.dumps(
        {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
         "torch": torch.__version__,
         "results": results}, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
