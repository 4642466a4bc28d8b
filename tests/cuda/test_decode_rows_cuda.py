"""On a CUDA GPU (skipped elsewhere): short prefill chunks after a cached past attended as
decode rows (`Scheduler._as_decode_rows`, through the CUDA decode kernels, eagerly: steps with
several rows of a request skip the decode graphs) give the tokens the prefill path gives (the
same engine with the rows off), over the float pool, int8, KVQuant and KIVI; the rows are
asserted taken. The same checks run on CPU in tests/model/test_decode_rows.py."""

from __future__ import annotations

import random

import pytest
import torch

import nanokv.scheduler.scheduler as scheduler_module
from nanokv import LLM, SamplingParams
from schedule_spy import record_decode_rows
from tiny_models import VOCAB

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, VOCAB - 30) for _ in range(n)]


@pytest.mark.parametrize("options", [
    dict(), dict(kv_cache_dtype="int8"), dict(kv_cache_dtype="kvquant", kv_quant_bits=4),
    dict(kv_cache_dtype="kivi", kv_quant_bits=2)], ids=["float", "int8", "kvquant", "kivi"])
def test_decode_rows_equal_the_prefill_path_on_cuda(tiny_model, options, monkeypatch):
    shared = tokens(37, 0)
    prompts = [shared] + [shared + tokens(n, i + 1) for i, n in enumerate((1, 2, 5, 9, 13))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2)
    outs, routed = {}, []
    for limit in (0, 8):
        monkeypatch.setattr(scheduler_module, "DECODE_ROW_CHUNK", limit)
        llm = LLM(tiny_model, device="cuda", dtype="float32", block_size=16, max_model_len=128,
                  max_num_seqs=8, max_num_batched_tokens=44, skip_tokenizer_init=True,
                  enforce_eager=False, **options)
        routed = record_decode_rows(llm.engine, monkeypatch)
        llm.generate(prompts[:1], params, use_tqdm=False)
        outs[limit] = [[c.token_ids for c in o.outputs]
                       for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.engine.check_invariants()
    assert routed and outs[8] == outs[0]
