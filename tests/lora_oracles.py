"""An oracle of LoRA serving that needs no PEFT (the GPU machine has none): the model with the
adapter merged into its weights."""

from __future__ import annotations

from nanokv import LLM, SamplingParams
from nanokv.lora import LoRARequest
from policy_oracles import prompt_of
from tiny_models import merge_lora, write_lora_adapter


def check_against_merged(model: str, tmp_path, **options) -> None:
    """Two adapters written in PEFT's format (without PEFT) and the base model in one batch:
    each request's tokens are those of the model with its adapter merged into the weights
    (plain weights, no LoRA code). tests/cuda/test_lora_cuda.py runs it on a GPU,
    tests/model/test_lora.py on CPU."""
    adapters = [write_lora_adapter(model, str(tmp_path / f"a{i}"), rank=4 + 4 * i, seed=i + 1)
                for i in range(2)]
    prompts = [prompt_of(n, seed=n) for n in (5, 18, 33)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    options = dict(dtype="float32", block_size=16, max_model_len=256, skip_tokenizer_init=True,
                   **options)
    want = {None: [o.outputs[0].token_ids for o in
                   LLM(model, **options).generate(prompts, params, use_tqdm=False)]}
    for i, a in enumerate(adapters):
        merged = merge_lora(model, a, str(tmp_path / f"merged{i}"))
        want[i] = [o.outputs[0].token_ids for o in
                   LLM(merged, **options).generate(prompts, params, use_tqdm=False)]
    assert len({str(v) for v in want.values()}) == 3  # the adapters matter
    llm = LLM(model, enable_lora=True, max_loras=2, **options)
    by_key = {None: None, **{i: LoRARequest(f"a{i}", i + 1, a) for i, a in enumerate(adapters)}}
    outs = llm.generate([p for p in prompts for _ in by_key], params,
                        lora_request=[lora for _ in prompts for lora in by_key.values()],
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [want[k][j] for j in range(len(prompts))
                                                      for k in by_key]
    llm.engine.check_invariants()

