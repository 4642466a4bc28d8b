"""`LLM.beam_search` (nanokv/beam_search.py) against Hugging Face: its `generate(num_beams=...)`
where no beam ends (ignore_eos; the same search then), and a brute-force beam search of vLLM's
rules over the HF model's full forward passes where beams end at EOS tokens (two of them, both
likely); the steps read their earlier blocks from the prefix cache; bad input is refused
before anything is queued."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from beam_reference import reference_beam_search

from nanokv import LLM, BeamSearchParams

PROMPTS = [[5, 17, 33, 90, 12, 7, 40, 41, 42, 100, 3, 9, 250, 11, 60, 61, 62, 63],
           [8, 9, 10, 11, 200, 201], [77] * 33]
BLOCK = 16


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, block_size=BLOCK, num_kv_blocks=256, max_model_len=256)


def test_no_eos_equals_hugging_face_beam_search(llm, hf_model):
    width, steps = 4, 20
    outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=width, max_tokens=steps,
                                                     ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        hf = hf_model.generate(torch.tensor([prompt]), num_beams=width,
                               num_return_sequences=width, max_new_tokens=steps,
                               do_sample=False, eos_token_id=None, pad_token_id=0,
                               length_penalty=1.0, early_stopping=False, output_scores=True,
                               return_dict_in_generate=True)
        assert len(out.sequences) == width
        for seq, want, score in zip(out.sequences, hf.sequences, hf.sequences_scores):
            assert seq.tokens == want.tolist()  # the prompt's, then the beam's
            # HF divides by the generated length; the cumulative log-probability is the same
            assert seq.cum_logprob == pytest.approx(float(score) * steps, abs=2e-3)
            assert seq.finish_reason == "length" and len(seq.logprobs) == steps
            assert math.isclose(sum(lp.logprob for lp in seq.logprobs), seq.cum_logprob,
                                abs_tol=1e-6)
            assert seq.text == llm.tokenizer.decode(seq.tokens, skip_special_tokens=True)


@pytest.fixture(scope="module")
def eos_model(tiny_llama, hf_model, tmp_path_factory):
    """The tiny model with two likely tokens as its EOS ids (generation_config.json): the 2nd
    likeliest first token of PROMPTS[0] and the 3rd of PROMPTS[1]."""
    path = tmp_path_factory.mktemp("eos-model")
    shutil.copytree(tiny_llama, path, dirs_exist_ok=True)
    eos = []
    for prompt, rank in ((PROMPTS[0], 1), (PROMPTS[1], 2)):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt])).logits[0, -1]
        order = [t for t in logits.argsort(descending=True).tolist() if t not in eos]
        eos.append(order[rank])
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return str(path), eos


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.5])
def test_eos_beams_equal_the_reference(eos_model, hf_model, length_penalty):
    path, eos = eos_model
    llm = LLM(path, block_size=BLOCK, num_kv_blocks=256, max_model_len=256)
    width, steps = 3, 12
    outs = llm.beam_search(PROMPTS[:2], BeamSearchParams(beam_width=width, max_tokens=steps,
                                                         length_penalty=length_penalty))
    stopped = 0
    for prompt, out in zip(PROMPTS, outs):
        want = reference_beam_search(hf_model, prompt, width, steps, set(eos), False,
                                     length_penalty)
        assert [s.tokens for s in out.sequences] == [w[0] for w in want]
        for seq, (tokens, cum) in zip(out.sequences, want):
            assert seq.cum_logprob == pytest.approx(cum, abs=2e-3)
            if tokens[-1] in eos:
                stopped += 1
                assert (seq.finish_reason, seq.stop_reason) == ("stop", tokens[-1])
            else:
                assert seq.finish_reason == "length" and len(tokens) == len(prompt) + steps
    # both kinds of sequences ranked (6 ended ones of 6 at penalties 0 and 1 here, 3 at 2.5)
    assert 0 < stopped
    if length_penalty == 2.5:
        assert stopped < 2 * width
    assert llm.engine.scheduler.block_manager.num_used_blocks == 0


def test_ignore_eos_keeps_eos_tokens_as_continuations(eos_model, hf_model):
    path, eos = eos_model
    llm = LLM(path, block_size=BLOCK, num_kv_blocks=256, max_model_len=256)
    out = llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=3, max_tokens=6,
                                                       ignore_eos=True))[0]
    want = reference_beam_search(hf_model, PROMPTS[0], 3, 6, set(eos), True, 1.0)
    assert [s.tokens for s in out.sequences] == [w[0] for w in want]
    assert all(s.finish_reason == "length" for s in out.sequences)
    # one step: the likely EOS id is a live beam's token with ignore_eos, a finished sequence
    # without it (the same tokens either way)
    one = llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=3, max_tokens=1,
                                                       ignore_eos=True))[0]
    assert sum(s.tokens[-1] in eos for s in one.sequences) == 1
    assert {s.finish_reason for s in one.sequences} == {"length"}
    ended = llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=3, max_tokens=1))[0]
    assert [s.tokens for s in ended.sequences] == [s.tokens for s in one.sequences]
    assert [s.finish_reason for s in ended.sequences] == [
        "stop" if s.tokens[-1] in eos else "length" for s in one.sequences]


def test_steps_read_earlier_blocks_from_the_prefix_cache(llm, monkeypatch):
    seen = []
    run = llm.generate_requests

    def recording(requests, use_tqdm=True):
        outs = run(requests, use_tqdm=use_tqdm)
        seen.append(outs)
        return outs

    monkeypatch.setattr(llm, "generate_requests", recording)
    llm.engine.scheduler.block_manager.reset_prefix_cache()
    prompt = PROMPTS[2]  # 33 tokens: two full blocks from the first step on
    llm.beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=18, ignore_eos=True))
    assert len(seen) == 18 and len(seen[0]) == 1 and all(len(s) == 3 for s in seen[1:])
    assert seen[0][0].num_cached_tokens == 0
    for step in seen[1:]:  # each beam computes its last partial block and its new token alone
        for out in step:
            n = len(out.prompt_token_ids)
            assert out.num_cached_tokens == (n - 1) // BLOCK * BLOCK
    assert llm.engine.scheduler.block_manager.num_used_blocks == 0


def test_concurrency_limit_and_no_prefix_caching_give_the_same_beams(tiny_llama, llm):
    params = BeamSearchParams(beam_width=2, max_tokens=10, ignore_eos=True)
    want = [[s.tokens for s in o.sequences] for o in llm.beam_search(PROMPTS, params)]
    limited = llm.beam_search(PROMPTS, params, concurrency_limit=1)
    assert [[s.tokens for s in o.sequences] for o in limited] == want
    plain = LLM(tiny_llama, block_size=BLOCK, num_kv_blocks=256, max_model_len=256,
                enable_prefix_caching=False)
    assert [[s.tokens for s in o.sequences] for o in plain.beam_search(PROMPTS, params)] == want


@pytest.mark.parametrize("kwargs,match", [
    (dict(beam_width=0, max_tokens=4), "beam_width must be in"),
    (dict(beam_width=11, max_tokens=4), "beam_width must be in"),
    (dict(beam_width=2.0, max_tokens=4), "beam_width must be an integer"),
    (dict(beam_width=2, max_tokens=0), "max_tokens must be at least 1"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty must be"),
    (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature must be >= 0"),
    (dict(beam_width=2, max_tokens=4, ignore_eos=1), "ignore_eos must be a bool"),
])
def test_bad_params_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BeamSearchParams(**kwargs)


def test_bad_input_queues_nothing(llm):
    params = BeamSearchParams(beam_width=2, max_tokens=250)
    with pytest.raises(ValueError, match="exceed max_model_len 256"):
        llm.beam_search([PROMPTS[1], PROMPTS[0]], params)  # the second is too long for it
    with pytest.raises(ValueError, match="prompt token ids must be integers"):
        llm.beam_search([[1, 2], [10_000]], BeamSearchParams(beam_width=2, max_tokens=2))
    with pytest.raises(ValueError, match="params must be a BeamSearchParams"):
        llm.beam_search([1, 2], {"beam_width": 2})
    with pytest.raises(ValueError, match="concurrency_limit must be"):
        llm.beam_search([1, 2], BeamSearchParams(beam_width=2, max_tokens=2),
                        concurrency_limit=0)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.block_manager.num_used_blocks == 0


def test_every_step_keeps_its_prompts_cache_salt(llm, monkeypatch):
    seen = []
    run = llm.generate_requests

    def recording(requests, use_tqdm=True):
        seen.extend((r.prompt_token_ids[:len(PROMPTS[1])], r.cache_salt) for r in requests)
        return run(requests, use_tqdm=use_tqdm)

    monkeypatch.setattr(llm, "generate_requests", recording)
    params = BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True)
    llm.beam_search([{"prompt_token_ids": PROMPTS[1], "cache_salt": "tenant-a"}, PROMPTS[0]],
                    params)
    salts = {(tuple(ids) == tuple(PROMPTS[1]), salt) for ids, salt in seen}
    assert salts == {(True, "tenant-a"), (False, None)} and len(seen) == 2 + 2 * 4
    seen.clear()
    llm.beam_search(PROMPTS[0], params, cache_salt="tenant-b")  # the call's, for its prompts
    assert {salt for _, salt in seen} == {"tenant-b"}
