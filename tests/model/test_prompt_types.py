"""vLLM's prompt types and `LLM.chat`: what reaches the model is checked against the Hugging
Face tokenizer (its encode and its own chat-template rendering) and the outputs against HF
transformers' greedy decoding of those ids."""

import pytest
from transformers import AutoTokenizer

from nanokv import LLM, SamplingParams
from nanokv.engine.chat import FALLBACK_CHAT_TEMPLATE
from tiny_models import hf_greedy, load_hf

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, block_size=16, max_model_len=256)


@pytest.fixture(scope="module")
def hf(tiny_llama):
    return load_hf(tiny_llama), AutoTokenizer.from_pretrained(tiny_llama)


def assert_no_blocks_held(llm):
    bm = llm.engine.block_manager
    llm.engine.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks


def test_prompt_dicts_reach_the_model_as_hf_tokenizes_them(llm, hf):
    model, tok = hf
    text = "def add(a, b):"
    outs = llm.generate([{"prompt": text}, {"prompt_token_ids": [5, 6, 7, 8]},
                         {"prompt_token_ids": [9, 10, 11], "prompt": "its text"}, text,
                         [5, 6, 7, 8]], GREEDY, use_tqdm=False)
    ids = tok.encode(text)
    assert outs[0].prompt == text and outs[0].prompt_token_ids == ids
    assert outs[1].prompt is None and outs[1].prompt_token_ids == [5, 6, 7, 8]
    assert outs[2].prompt == "its text" and outs[2].prompt_token_ids == [9, 10, 11]
    for out in outs:
        assert out.token_ids == hf_greedy(model, out.prompt_token_ids, 6)[0]
    assert outs[3].token_ids == outs[0].token_ids and outs[4].token_ids == outs[1].token_ids
    # a single dict is a batch of one, as a single string is
    single = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, GREEDY, use_tqdm=False)
    assert len(single) == 1 and single[0].token_ids == outs[1].token_ids
    # the engine's add_request takes them too (vLLM's LLMEngine.add_request)
    rid = llm.engine.add_request({"prompt": text}, GREEDY)
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.finished:
                assert out.request_id == rid and out.token_ids == outs[0].token_ids
    assert_no_blocks_held(llm)


def test_a_prompt_dicts_cache_salt_namespaces_its_prefix(llm):
    prompt = list(range(3, 3 + 40))  # two full blocks of 16 and a partial one
    salted = {"prompt_token_ids": prompt, "cache_salt": "tenant-a"}
    first = llm.generate([salted], GREEDY, use_tqdm=False)[0]
    again = llm.generate([dict(salted)], GREEDY, use_tqdm=False)[0]
    other = llm.generate([{"prompt_token_ids": prompt, "cache_salt": "tenant-b"}], GREEDY,
                         use_tqdm=False)[0]
    by_argument = llm.generate([{"prompt_token_ids": prompt}], GREEDY, cache_salt="tenant-a",
                               use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 32
    assert other.num_cached_tokens == 0 and by_argument.num_cached_tokens == 32
    assert first.token_ids == again.token_ids == other.token_ids
    assert_no_blocks_held(llm)


@pytest.mark.parametrize("prompt,fragment", [
    ({}, "needs 'prompt' \\(text\\) or 'prompt_token_ids'"),
    ({"prompt": 5}, "'prompt' must be a string"),
    ({"prompt_token_ids": "1 2"}, "'prompt_token_ids' must be a list"),
    ({"prompt_token_ids": [1, 2, 10**9]}, "token ids must be integers"),
    ({"prompt_token_ids": []}, "empty"),
    ({"prompt": "x", "prompt_tokens": [1]}, "unknown prompt key 'prompt_tokens'.*prompt_token_ids"),
    ({"prompt": "x", "multi_modal_data": {"image": None}}, "multi-modal inputs are not supported"),
    ({"prompt_embeds": [[0.0]]}, "prompt embeddings are not supported"),
    ({"prompt": "x", "cache_salt": ""}, "cache_salt must be a non-empty string"),
    (3.5, "a prompt must be a string, a list of token ids, or a dict"),
])
def test_bad_prompt_dicts_are_refused_before_anything_is_queued(llm, prompt, fragment):
    with pytest.raises(ValueError, match=fragment):
        llm.generate([[3, 4, 5], prompt], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert_no_blocks_held(llm)


def test_cache_salt_given_twice_is_refused(llm):
    with pytest.raises(ValueError, match="cache_salt was given twice"):
        llm.generate([{"prompt": "x", "cache_salt": "a"}], GREEDY, cache_salt="b",
                     use_tqdm=False)
    assert_no_blocks_held(llm)


CONVERSATION = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": [{"type": "text", "text": "Hel"},
                                             {"type": "text", "text": "lo"}]}]
PLAIN = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello"}]


def test_chat_renders_as_hf_and_generates_as_hf(llm, hf):
    model, tok = hf
    assert llm.get_tokenizer() is llm.tokenizer
    # the tiny tokenizer has no template: the fallback, rendered here by HF itself
    expected = tok.apply_chat_template(PLAIN, chat_template=FALLBACK_CHAT_TEMPLATE,
                                       tokenize=False, add_generation_prompt=True)
    expected_ids = tok.encode(expected, add_special_tokens=False)
    outs = llm.chat([CONVERSATION, PLAIN[1:]], GREEDY, use_tqdm=False)
    assert outs[0].prompt == expected and outs[0].prompt_token_ids == expected_ids
    assert outs[0].token_ids == hf_greedy(model, expected_ids, 6)[0]
    assert outs[1].prompt == "<|user|>\nHello\n<|assistant|>\n"
    # one conversation is a batch of one
    single = llm.chat(CONVERSATION, GREEDY, use_tqdm=False)
    assert len(single) == 1 and single[0].token_ids == outs[0].token_ids
    # a template of the caller's, its variables, and the last message continued
    template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ tail }}\n"
                "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")
    custom = llm.chat(PLAIN, GREEDY, chat_template=template,
                      chat_template_kwargs={"tail": "."}, use_tqdm=False)[0]
    assert custom.prompt == "[system] You are terse..\n[user] Hello.\n[assistant] "
    open_ended = PLAIN + [{"role": "assistant", "content": "Hi, I"}]
    cont = llm.chat(open_ended, GREEDY, add_generation_prompt=False,
                    continue_final_message=True, use_tqdm=False)[0]
    assert cont.prompt == tok.apply_chat_template(
        open_ended, chat_template=FALLBACK_CHAT_TEMPLATE, tokenize=False,
        continue_final_message=True)
    assert cont.prompt.endswith("<|assistant|>\nHi, I")
    assert cont.token_ids == hf_greedy(model, cont.prompt_token_ids, 6)[0]
    assert_no_blocks_held(llm)


@pytest.mark.parametrize("messages,kwargs,fragment", [
    (PLAIN, dict(continue_final_message=True), "cannot both be True"),
    ([], {}, "messages must be a conversation"),
    ([PLAIN, []], {}, "conversation 1: a conversation is a non-empty list"),
    ([{"role": "robot", "content": "x"}], {}, "role must be one of"),
    ([{"role": "user", "content": 5}], {}, "content must be a string or a list of text parts"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], {},
     "content parts must be"),
    ([["not a dict"]], {}, "a message is a dict"),
    (PLAIN, dict(chat_template_kwargs={"messages": []}), "must not set"),
])
def test_bad_chat_input_is_refused_before_anything_is_queued(llm, messages, kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        llm.chat(messages, GREEDY, use_tqdm=False, **kwargs)
    assert not llm.engine.has_unfinished_requests()
    assert_no_blocks_held(llm)


def test_chat_needs_a_tokenizer(tiny_llama):
    llm = LLM(tiny_llama, block_size=16, max_model_len=64, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="chat needs a tokenizer"):
        llm.chat(PLAIN, GREEDY)
    assert llm.get_tokenizer() is None
