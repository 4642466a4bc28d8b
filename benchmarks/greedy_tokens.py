#!/usr/bin/env python
"""Greedy tokens of one engine on seeded random token-id prompts, for comparing engines on one
model (e.g. a sliding-window model: nanokv, vLLM and Hugging Face's forward must agree).

    .venv/bin/python benchmarks/greedy_tokens.py --engine nanokv --model M --out /tmp/nanokv.json
    $VLLM_VENV/bin/python benchmarks/greedy_tokens.py --engine vllm --model M --out /tmp/vllm.json
    .venv/bin/python benchmarks/greedy_tokens.py --engine hf --model M --tokens /tmp/nanokv.json
    .venv/bin/python benchmarks/greedy_tokens.py --compare /tmp/nanokv.json /tmp/vllm.json

--engine hf checks given tokens instead of generating: each must be the argmax of Hugging Face's
forward over the prompt and the tokens before it (teacher-forced, one forward per prompt).
--engine logits compares nanokv's prompt logits of each prompt with Hugging Face's forward
(the largest absolute difference): the stronger check where random weights make every greedy
token of a prompt the same.

    .venv/bin/python benchmarks/greedy_tokens.py --engine logits --model M --prompt-lens 700
"""

from __future__ import annotations

import argparse
import json
import random


def make_prompts(lengths: list[int], seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(n)] for n in lengths]


def run_nanokv(model: str, prompts, max_tokens: int, max_model_len: int) -> list[list[int]]:
    from nanokv import LLM, SamplingParams

    llm = LLM(model, skip_tokenizer_init=True, max_model_len=max_model_len, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def run_vllm(model: str, prompts, max_tokens: int, max_model_len: int) -> list[list[int]]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, dtype="float32", max_model_len=max_model_len, enforce_eager=True,
              skip_tokenizer_init=True, max_num_seqs=len(prompts))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    return [list(o.outputs[0].token_ids) for o in outs]


def check_hf(model: str, prompts, tokens: list[list[int]]) -> list[int]:
    """How many of each prompt's tokens are HF's teacher-forced argmax."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    agree = []
    for prompt, toks in zip(prompts, tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + toks])).logits[0]  # [len, vocab]
        best = logits[len(prompt) - 1:-1].argmax(-1).tolist()
        agree.append(sum(a == b for a, b in zip(best, toks)))
    return agree


def prompt_logits_vs_hf(model: str, prompts, max_model_len: int) -> list[float]:
    """The largest |nanokv - HF| of each prompt's logits (both float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    from nanokv import LLM, SamplingParams

    llm = LLM(model, skip_tokenizer_init=True, max_model_len=max_model_len, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=1, return_prompt_logits=True)
    ours = [o.prompt_logits.float() for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    worst = []
    for prompt, mine in zip(prompts, ours):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()  # [len, vocab]
        worst.append(float((mine - ref).abs().max()))
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=["nanokv", "vllm", "hf", "logits"])
    ap.add_argument("--model")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[1500, 900])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=150000, help="prompt ids in [100, vocab)")
    ap.add_argument("--out", help="where the tokens go (JSON), --engine nanokv / vllm")
    ap.add_argument("--tokens", help="the tokens --engine hf checks (JSON)")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = ap.parse_args()
    if args.compare:
        a, b = (json.load(open(p)) for p in args.compare)
        same = [sum(x == y for x, y in zip(ta, tb)) for ta, tb in zip(a, b)]
        print(json.dumps({"identical": a == b, "same_tokens": same,
                          "tokens": [len(t) for t in a]}))
        return
    if args.engine is None or args.model is None:
        ap.error("--engine and --model are needed (or --compare A B)")
    if min(args.prompt_lens) < 1 or args.max_tokens < 1:
        ap.error("--prompt-lens and --max-tokens must be >= 1")
    prompts = make_prompts(args.prompt_lens, args.seed, args.vocab)
    if args.engine == "logits":
        print(json.dumps({"max_abs_diff_vs_hf": prompt_logits_vs_hf(
            args.model, prompts, args.max_model_len), "prompt_lens": args.prompt_lens}))
        return
    if args.engine == "hf":
        if not args.tokens:
            ap.error("--engine hf checks --tokens FILE")
        tokens = json.load(open(args.tokens))
        print(json.dumps({"hf_argmax_agrees": check_hf(args.model, prompts, tokens),
                          "tokens": [len(t) for t in tokens]}))
        return
    if not args.out:
        ap.error("--out FILE is needed with --engine nanokv / vllm")
    run = run_nanokv if args.engine == "nanokv" else run_vllm
    tokens = run(args.model, prompts, args.max_tokens, args.max_model_len)
    with open(args.out, "w") as f:
        json.dump(tokens, f)
    print(json.dumps({"engine": args.engine, "tokens": [len(t) for t in tokens]}))


if __name__ == "__main__":
    main()
