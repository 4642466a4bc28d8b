"""Engine API behaviour: validation, stop rules, seeds, streaming, abort, block accounting."""

import json
import os
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import nanokv.engine.llm as llm_module
from nanokv import LLM, SamplingParams
from nanokv.cli import main as cli_main
from tiny_models import hf_greedy, load_hf

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, block_size=16, max_model_len=128)


def assert_no_blocks_held(llm):
    bm = llm.engine.block_manager
    llm.engine.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("prompt,fragment", [
    ([5] * 128, "max_model_len"),
    ([], "empty"),
    ("", "empty"),
    ([1, 2, 100000], "token ids"),
    ([1.5], "token ids"),
    ([True, 2], "token ids"),
])
def test_bad_prompts_rejected_without_allocating(llm, prompt, fragment):
    with pytest.raises(ValueError, match=fragment):
        llm.generate([[3, 4, 5], prompt], GREEDY)
    assert_no_blocks_held(llm)
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate([[3, 4, 5]], GREEDY)[0].token_ids) == 8


def test_unknown_and_bad_options(tiny_llama):
    with pytest.raises(ValueError, match="unknown option.*max_num_seq"):
        LLM(tiny_llama, max_num_seq=4)
    for kwargs, fragment in [(dict(block_size=8), "block_size"),
                             (dict(dtype="int3"), "dtype"),
                             (dict(max_num_seqs=0), "max_num_seqs"),
                             (dict(kv_cache_memory="lots"), "memory size"),
                             (dict(kv_cache_memory_fraction=1.5), "fraction"),
                             (dict(tokenizer="/nonexistent/tok"),
                              "tokenizer directory /nonexistent/tok does not exist"),
                             (dict(kv_cache_memory=float("inf")), "memory size must be finite"),
                             (dict(kv_cache_memory=float("nan")), "memory size must be finite"),
                             (dict(seed=2**64), r"seed must be an integer in \[-2\*\*63"),
                             (dict(seed=-2**63 - 1), "seed must be an integer in"),
                             (dict(kv_policy="kvcrush", kv_budget=16),
                              "kvcrush's base policy 'snapkv'"),
                             (dict(max_model_len=4096), "max_position_embeddings"),
                             (dict(tokenizer=""), "tokenizer must be the path"),
                             (dict(kv_policy="full", kv_budget=16),
                              "need kv_policy .* got kv_policy='full'"),
                             (dict(kv_policy="full", kv_policy_options={"window": 4}),
                              "need kv_policy"),
                             (dict(kv_policy="streaming", kv_budget=0), "kv_budget"),
                             (dict(kv_policy="streaming", kv_compression_ratio=1.0),
                              "kv_compression_ratio"),
                             (dict(kv_policy="pyramidkv", kv_budget=64,
                                   kv_policy_options={"beta": float("nan")}),
                              "beta must be a finite number >= 1"),
                             (dict(kv_policy="pyramidkv", kv_budget=64,
                                   kv_policy_options={"beta": float("inf")}),
                              "beta must be a finite number >= 1")]:
        with pytest.raises(ValueError, match=fragment):
            LLM(tiny_llama, **kwargs)


def test_sampling_params_changed_after_construction_are_checked_again(llm):
    """A SamplingParams is a plain dataclass: a field set out of range after it was built is
    refused when the request is made (not mid-step, aborting the batch), and a generate call
    with something else than SamplingParams says so; nothing is allocated either way."""
    too_many = SamplingParams(logprobs=5)
    too_many.logprobs = 5000
    no_samples = SamplingParams(n=2)
    no_samples.n = 0
    for params, fragment in [(too_many, "logprobs must be None or an integer in"),
                             (no_samples, "n must be an integer >= 1"),
                             ({"max_tokens": 3}, "must be a SamplingParams or a list of them"),
                             ([GREEDY, 5], "got int")]:
        with pytest.raises(ValueError, match=fragment):
            llm.generate([[3, 4, 5], [6, 7]], params)
        assert_no_blocks_held(llm)
    with pytest.raises(ValueError, match="logprobs"):
        llm.engine.add_request([3, 4, 5], too_many)
    with pytest.raises(ValueError, match="kv_policy must be a PolicyConfig"):
        llm.engine.make_request([3, 4, 5], GREEDY, kv_policy="streaming")
    assert not llm.engine.has_unfinished_requests()
    assert_no_blocks_held(llm)
    assert len(llm.generate([[3, 4, 5]], GREEDY)[0].token_ids) == 8


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_broken_model_directories(tiny_llama, tmp_path):
    missing = _copy(tiny_llama, tmp_path / "missing")
    os.remove(missing / "model.safetensors")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        LLM(str(missing))

    corrupt = _copy(tiny_llama, tmp_path / "corrupt")
    (corrupt / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ValueError, match="corrupt"):
        LLM(str(corrupt))

    no_config = _copy(tiny_llama, tmp_path / "noconfig")
    os.remove(no_config / "config.json")
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(no_config))

    weights = load_file(os.path.join(tiny_llama, "model.safetensors"))
    for name, change, fragment in [
        ("lacks", lambda w: w.pop("model.layers.1.mlp.up_proj.weight"), "lacks"),
        ("extra", lambda w: w.__setitem__("model.layers.9.foo", torch.zeros(2)), "unexpected"),
        ("shape", lambda w: w.__setitem__("model.norm.weight", torch.zeros(3)), "shape"),
    ]:
        d = _copy(tiny_llama, tmp_path / name)
        w = dict(weights)
        change(w)
        save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(ValueError, match=fragment) as err:
            LLM(str(d))
        if name == "lacks":
            assert "up_proj" in str(err.value)
            # int8 weights: the layer whose tensor never came is left unallocated, refused alike
            with pytest.raises(ValueError, match="lacks .*up_proj"):
                LLM(str(d), quantization="int8")
    # a tensor in two files of one checkpoint (no index to say which holds it)
    twice = _copy(tiny_llama, tmp_path / "twice")
    save_file({"model.norm.weight": weights["model.norm.weight"]},
              str(twice / "model-extra.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="'model.norm.weight' appears twice in the checkpoint: in "
                                         ".*model-extra.safetensors and in .*/model.safetensors"):
        LLM(str(twice))


def test_stop_rules(llm):
    prompt = [7, 8, 9, 10]
    free_run = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12,
                                                     ignore_eos=True))[0]
    tokens = free_run.token_ids
    # a stop token id ends the output at its first occurrence (included in token ids)
    stop_tok = tokens[5]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12,
                                                stop_token_ids=[stop_tok], ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop_tok
    assert out.token_ids == tokens[:tokens.index(stop_tok) + 1]
    # EOS stops unless ignore_eos; before min_tokens it cannot be sampled (vLLM's min_tokens)
    eos = llm.engine.eos_token_ids
    llm.engine.eos_token_ids = (stop_tok,)
    try:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0]
        assert out.finish_reason == "stop" and out.token_ids[-1] == stop_tok
        first = tokens.index(stop_tok)
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12,
                                                    min_tokens=first + 2))[0]
        assert stop_tok not in out.token_ids[:first + 1]
        assert out.token_ids[:first] == tokens[:first] and out.token_ids[first] != stop_tok
    finally:
        llm.engine.eos_token_ids = eos
    # a stop string cuts the text before it
    text = free_run.text
    if len(text) >= 4:
        stop = text[2:4]
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop=[stop],
                                                    ignore_eos=True))[0]
        assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
        assert stop not in out.text and text.startswith(out.text)
    assert_no_blocks_held(llm)


def test_a_stop_string_completed_by_the_last_token_is_a_stop(llm):
    """The token that reaches max_tokens also completes a stop string: finish_reason "stop"
    with the stop string (as vLLM: the stop string wins), the text cut before it."""
    tok = llm.tokenizer
    prompt = "def add(a, b):"
    ids = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24,
                                                ignore_eos=True))[0].token_ids
    for k in range(2, len(ids) + 1):
        before, text = tok.decode(ids[:k - 1]), tok.decode(ids[:k])
        stop = text[-1]
        if stop not in before and stop != "\ufffd" and not stop.isspace():
            break
    else:
        pytest.fail("no token of the greedy run ends with a new character")
    for max_tokens in (k, k + 3):
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens,
                                                    stop=[stop], ignore_eos=True))[0]
        assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
        assert out.token_ids == ids[:k] and out.text == text[:text.index(stop)]
    assert_no_blocks_held(llm)


def test_stop_strings_need_a_tokenizer(tiny_llama):
    llm = LLM(tiny_llama, block_size=16, max_model_len=128, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="stop strings .* skip_tokenizer_init"):
        llm.generate([[3, 4, 5]], SamplingParams(max_tokens=4, stop=["a"]))
    assert_no_blocks_held(llm)
    out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=4, stop_token_ids=[1]))[0]
    assert 1 <= len(out.token_ids) <= 4


def test_max_model_len_ends_generation(llm):
    out = llm.generate([[3] * 120], SamplingParams(temperature=0, max_tokens=50,
                                                   ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 8


def test_seeded_sampling_reproducible_across_batches(llm):
    p = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)
    alone = llm.generate([[1, 2, 3]], p)[0].token_ids
    batched = llm.generate([[9, 9, 9, 9], [1, 2, 3], [4] * 30],
                           [SamplingParams(temperature=1.0, max_tokens=5), p, GREEDY])
    assert batched[1].token_ids == alone
    other_seed = SamplingParams(temperature=0.9, top_p=0.9, seed=8, max_tokens=10,
                                ignore_eos=True)
    assert llm.generate([[1, 2, 3]], other_seed)[0].token_ids != alone


def test_streaming_steps_and_abort(llm, tiny_llama):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    a = engine.add_request([5, 6, 7, 8], params)
    b = engine.add_request(list(range(10, 50)), SamplingParams(temperature=0, max_tokens=100,
                                                               ignore_eos=True))
    streamed, final = [], None
    aborted = False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == a:
                streamed += out.new_token_ids
                if out.finished:
                    final = out
        if not aborted and final is not None:
            assert engine.block_manager.num_used_blocks > 0  # b still holds blocks
            out = engine.abort(b)
            aborted = True
            assert out.finish_reason == "abort"
    assert streamed == final.token_ids and len(streamed) == 6
    assert engine.abort("no-such-request") is None
    assert_no_blocks_held(llm)
    hf = load_hf(tiny_llama)
    assert final.token_ids == hf_greedy(hf, [5, 6, 7, 8], 6)[0]


def test_failed_step_frees_blocks(llm, monkeypatch):
    engine = llm.engine
    engine.block_manager.reset_prefix_cache()

    def boom(*args, **kwargs):
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(engine.runner, "execute", boom)
    with pytest.raises(RuntimeError, match="simulated"):
        llm.generate([[1, 2, 3, 4] * 10], GREEDY)
    monkeypatch.undo()
    assert_no_blocks_held(llm)
    assert not engine.block_manager.cached  # half-written blocks are never served
    assert len(llm.generate([[1, 2, 3, 4] * 10], GREEDY)[0].token_ids) == 8


def test_a_progress_bar_that_raises_leaves_nothing_queued(llm):
    """use_tqdm's callable raising: no request of the call stays in the engine (the next
    generate would run them), and requests of the engine's other users are left alone."""
    engine = llm.engine
    other = engine.add_request([9, 9, 9], GREEDY)

    def bar(*args, **kwargs):
        raise RuntimeError("bar failed")

    with pytest.raises(RuntimeError, match="bar failed"):
        llm.generate([[1, 2, 3], [4, 5, 6]], GREEDY, use_tqdm=bar)
    assert list(engine.scheduler.requests) == [other]
    engine.abort(other)
    assert_no_blocks_held(llm)


def test_cli_generate_and_errors(tiny_llama, capsys):
    assert cli_main(["generate", "--model", tiny_llama, "--prompt", "def add", "--max-tokens",
                     "4", "--block-size", "16", "--max-model-len", "128", "--json"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["prompt"] == "def add" and len(line["token_ids"]) <= 4
    assert cli_main(["generate", "--model", tiny_llama, "--top-p", "2"]) == 2
    assert "top_p" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["generate", "--model", tiny_llama, "--no-such-flag"])
    # token-id prompts, also without a tokenizer: the same greedy tokens as the API's
    ref = LLM(tiny_llama, block_size=16, max_model_len=128).generate(
        [[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4))[0]
    for extra in ([], ["--skip-tokenizer-init"]):
        assert cli_main(["generate", "--model", tiny_llama, "--prompt-token-ids", "5,6,7,8",
                         "--max-tokens", "4", "--block-size", "16", "--max-model-len", "128",
                         "--json", *extra]) == 0
        line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert line["token_ids"] == ref.token_ids and line["prompt"] is None


def test_cli_generate_beam_search(tiny_llama, capsys):
    from nanokv import BeamSearchParams

    flags = ["generate", "--model", tiny_llama, "--prompt-token-ids", "5,6,7,8", "--max-tokens",
             "5", "--block-size", "16", "--max-model-len", "128", "--skip-tokenizer-init"]
    assert cli_main([*flags, "--beam-width", "3", "--length-penalty", "0.5", "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()[-3:]]
    want = LLM(tiny_llama, block_size=16, max_model_len=128).beam_search(
        [[5, 6, 7, 8]], BeamSearchParams(beam_width=3, max_tokens=5, length_penalty=0.5))[0]
    assert [x["beam"] for x in lines] == [0, 1, 2]
    assert [x["token_ids"] for x in lines] == [s.tokens[4:] for s in want.sequences]
    assert [x["cum_logprob"] for x in lines] == pytest.approx([s.cum_logprob
                                                               for s in want.sequences])
    for bad, says in ((["--beam-width", "3", "--temperature", "0.5"], "--temperature not "
                       "applied by beam search"), (["--length-penalty", "2"], "needs --beam-width"),
                      (["--beam-width", "11"], "beam_width must be in [1, 10]")):
        assert cli_main([*flags, *bad]) == 2
        assert says in capsys.readouterr().err


def test_reference_linear_backend_matches_hf(tiny_qwen3):
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    expected = hf_greedy(load_hf(tiny_qwen3), prompt, 8)[0]
    for backend in ("torch", "onednn"):
        llm = LLM(tiny_qwen3, block_size=16, max_model_len=128, linear_backend=backend)
        assert f"{backend} linear" in llm.engine.startup_lines[0]
        if sys.platform.startswith("linux"):  # the CPU memory settings' report
            assert any(line.startswith("transparent huge pages: ")
                       for line in llm.engine.startup_lines)
        assert llm.generate([prompt], GREEDY)[0].token_ids == expected


@pytest.mark.parametrize("min_tokens", [3, 6, 12])
def test_min_tokens_masks_stop_tokens_as_hf_does(llm, tiny_llama, min_tokens):
    """Before min_tokens outputs, EOS and stop_token_ids cannot be sampled; after, the first one
    stops. Oracle: HF generate with min_new_tokens (its processor masks the EOS ids) and the stop
    token as HF's EOS."""
    prompt = [7, 8, 9, 10]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12,
                                                 ignore_eos=True))[0].token_ids
    stop_tok = free[1]  # greedy would stop at the second token
    hf = load_hf(tiny_llama)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        seq = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=12, min_new_tokens=min_tokens, eos_token_id=[stop_tok],
                          pad_token_id=0)[0, len(prompt):].tolist()
    expected = seq[:seq.index(stop_tok) + 1] if stop_tok in seq else seq
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12,
                                                min_tokens=min_tokens, stop_token_ids=[stop_tok],
                                                ignore_eos=True))[0]
    assert out.token_ids == expected
    assert stop_tok not in out.token_ids[:min_tokens]
    # sampled rows too: with a seed, never a stop token before min_tokens
    for seed in range(8):
        out = llm.generate([prompt], SamplingParams(temperature=1.0, seed=seed, max_tokens=12,
                                                    min_tokens=min_tokens,
                                                    stop_token_ids=[stop_tok],
                                                    ignore_eos=True))[0]
        assert stop_tok not in out.token_ids[:min_tokens]
    assert_no_blocks_held(llm)


def test_stop_token_ids_outside_the_vocabulary_are_refused(llm):
    vocab = llm.engine.hf_config.vocab_size
    with pytest.raises(ValueError, match=rf"stop_token_ids must be in \[0, {vocab}\)"):
        llm.generate([[3, 4, 5]], SamplingParams(max_tokens=4, stop_token_ids=[2, vocab]))
    assert_no_blocks_held(llm)


def test_stop_token_text_is_left_out_unless_asked(llm):
    """A stop token id ends the output with the token in token_ids and, as vLLM, its text left
    out of text unless include_stop_str_in_output."""
    tok = llm.tokenizer
    prompt = "def fibonacci(n):"
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8,
                                                 ignore_eos=True))[0].token_ids
    k = next(i for i in range(1, len(free)) if tok.decode([free[i]]).strip()
             and free[i] not in free[:i])
    for include in (False, True):
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8,
                                                    stop_token_ids=[free[k]],
                                                    include_stop_str_in_output=include))[0]
        assert out.token_ids == free[:k + 1] and out.finish_reason == "stop"
        assert out.text == tok.decode(free[:k + 1] if include else free[:k],
                                      skip_special_tokens=True)


def test_a_stop_token_that_completes_a_stop_string_reports_the_string(llm):
    """include_stop_str_in_output keeps a stop token's text; when that text completes a stop
    string, the text is cut after the string and, as vLLM, the string is the stop_reason."""
    tok = llm.tokenizer
    prompt = "def fibonacci(n):"
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8,
                                                 ignore_eos=True))[0].token_ids
    k, stop = next((i, tok.decode([free[i]]).strip()[0]) for i in range(1, len(free))
                   if tok.decode([free[i]]).strip() and free[i] not in free[:i]
                   and tok.decode([free[i]]).strip()[0] not in tok.decode(free[:i]))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8,
                                                stop_token_ids=[free[k]], stop=[stop],
                                                include_stop_str_in_output=True))[0]
    assert out.token_ids == free[:k + 1] and out.finish_reason == "stop"
    assert out.outputs[0].stop_reason == stop and out.text.endswith(stop)


def test_generate_returns_every_tokens_logprobs(llm, tiny_llama):
    """outputs[0].logprobs holds one entry per output token: HF's raw log-softmax of it."""
    prompt = [7, 8, 9, 10]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, logprobs=3,
                                                ignore_eos=True))[0]
    lps = out.outputs[0].logprobs
    assert [lp.token_id for lp in lps] == out.token_ids
    _, logits = hf_greedy(load_hf(tiny_llama), prompt, 6)  # [6, vocab]
    ref = logits.log_softmax(-1)
    for lp, row in zip(lps, ref):
        assert lp.logprob == pytest.approx(float(row[lp.token_id]), abs=1e-4)
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()
    # vLLM's cumulative_logprob: the sum of the sampled tokens' log-probabilities
    hf_sum = float(ref.gather(1, torch.tensor(out.token_ids)[:, None]).sum())
    assert out.outputs[0].cumulative_logprob == pytest.approx(hf_sum, abs=1e-3)
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6,
                                                  ignore_eos=True))[0]
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None


def test_a_temperature_too_small_to_divide_by_is_greedy(llm):
    """As vLLM: temperatures below 1e-5 decode greedily (dividing float32 logits by 1e-40
    overflowed, and every row then picked the last token id)."""
    prompt = [7, 8, 9, 10]
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6,
                                                   ignore_eos=True))[0].token_ids
    for t in (1e-40, 1e-300, 9e-6):
        out = llm.generate([prompt], SamplingParams(temperature=t, seed=0, max_tokens=6,
                                                    ignore_eos=True))[0]
        assert out.token_ids == greedy


def test_n_samples_of_one_prompt(llm):
    """n > 1: one output per prompt whose outputs are the n samples, sample j equal to a single
    request seeded with seed + j; greedy samples agree; other prompts keep their order."""
    prompt = [7, 8, 9, 10]
    sp = SamplingParams(temperature=1.0, seed=21, n=3, max_tokens=6, ignore_eos=True)
    outs = llm.generate([[3, 4, 5], prompt, [11, 12]],
                        [GREEDY, sp, SamplingParams(temperature=0, n=2, max_tokens=5,
                                                    ignore_eos=True)])
    assert len(outs) == 3 and [len(o.outputs) for o in outs] == [1, 3, 2]
    assert outs[0].token_ids == llm.generate([[3, 4, 5]], GREEDY)[0].token_ids
    samples = outs[1].outputs
    assert [s.index for s in samples] == [0, 1, 2]
    for j, s in enumerate(samples):
        alone = llm.generate([prompt], SamplingParams(temperature=1.0, seed=21 + j, max_tokens=6,
                                                      ignore_eos=True))[0]
        assert s.token_ids == alone.token_ids and s.text == alone.text
    assert len({tuple(s.token_ids) for s in samples}) > 1  # seeds 21, 22, 23 differ
    assert outs[2].outputs[0].token_ids == outs[2].outputs[1].token_ids
    assert outs[1].prompt_token_ids == prompt
    assert_no_blocks_held(llm)
    # samples 1.. take the full blocks sample 0 computes in the same step from the prefix cache
    long_prompt = list(range(10, 60))  # 3 full blocks of 16 and 2 tokens
    seen = []
    real_merge = llm_module._merge

    def spy(request_id, samples):
        seen.extend(s.num_cached_tokens for s in samples)
        return real_merge(request_id, samples)

    llm_module._merge = spy
    try:
        llm.engine.block_manager.reset_prefix_cache()
        llm.generate([long_prompt], SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=3))
    finally:
        llm_module._merge = real_merge
    assert seen == [0, 48, 48]
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="an engine request is one sample"):
        llm.engine.add_request(prompt, SamplingParams(n=2))
    assert_no_blocks_held(llm)


def test_max_tokens_none_runs_to_the_model_length(llm):
    """As vLLM: max_tokens None generates until max_model_len (128 here) is reached."""
    out = llm.generate([[3, 4, 5, 6, 7]], SamplingParams(temperature=0, max_tokens=None,
                                                         ignore_eos=True))[0]
    assert len(out.token_ids) == 128 - 5 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="min_tokens 50 is more than the 28 output tokens a "
                                         "100-token prompt leaves in max_model_len 128"):
        llm.generate([[3] * 100], SamplingParams(max_tokens=None, min_tokens=50))
    assert_no_blocks_held(llm)



def test_detokenize_false_returns_token_ids_without_text(llm):
    """vLLM's detokenize=False: the same tokens, no text (and so no stop strings)."""
    prompt = [7, 8, 9, 10]
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                        use_tqdm=False)[0]
    bare = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                 detokenize=False), use_tqdm=False)[0]
    assert full.text and bare.text == "" and bare.token_ids == full.token_ids
    with pytest.raises(ValueError, match="stop strings are only supported when detokenize"):
        SamplingParams(stop=["x"], detokenize=False)
    with pytest.raises(ValueError, match="detokenize must be True or False"):
        SamplingParams(detokenize=0)
    assert_no_blocks_held(llm)
