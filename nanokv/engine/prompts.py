"""A prompt as callers give it: vLLM's prompt types.

    "text"                                   a string (tokenized by the engine)
    [1, 2, 3]                                token ids
    {"prompt": "text"}                       vLLM's TextPrompt
    {"prompt_token_ids": [1, 2, 3]}          vLLM's TokensPrompt ("prompt": its text, optional)

A dict may also carry "cache_salt" (vLLM's per-prompt salt of its prefix-cache hashes). Keys
of vLLM's that nanokv does not serve (multi-modal data, prompt embeddings, encoder-decoder
prompts) are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass

PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")
UNSERVED_KEYS = {
    "multi_modal_data": "multi-modal inputs are not supported (text models only)",
    "mm_processor_kwargs": "multi-modal inputs are not supported (text models only)",
    "multi_modal_uuids": "multi-modal inputs are not supported (text models only)",
    "prompt_embeds": "prompt embeddings are not supported: pass text or token ids",
    "encoder_prompt": "encoder-decoder prompts are not supported (decoder-only models)",
    "decoder_prompt": "encoder-decoder prompts are not supported (decoder-only models)",
    "token_type_ids": "token type ids are not supported (generation only)",
}


@dataclass
class ParsedPrompt:
    text: str | None  # the prompt's text, when given (tokenized when token_ids is None)
    token_ids: list[int] | None  # given ids (validated by the engine), else None
    cache_salt: str | None


def parse_prompt(prompt, cache_salt: str | None = None) -> ParsedPrompt:
    """One prompt of any accepted type; `cache_salt`: the caller's salt (a dict may carry its
    own, but not both). Raises ValueError saying what is accepted."""
    if isinstance(prompt, str):
        return ParsedPrompt(prompt, None, cache_salt)
    if isinstance(prompt, (list, tuple)):
        return ParsedPrompt(None, list(prompt), cache_salt)
    if not isinstance(prompt, dict):
        raise ValueError(f"a prompt must be a string, a list of token ids, or a dict with "
                         f"'prompt' (text) or 'prompt_token_ids'; got {type(prompt).__name__}")
    for key in prompt:
        if key in UNSERVED_KEYS:
            raise ValueError(f"prompt key {key!r}: {UNSERVED_KEYS[key]}")
        if key not in PROMPT_KEYS:
            raise ValueError(f"unknown prompt key {key!r}; a prompt dict takes {list(PROMPT_KEYS)}")
    text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
    if text is not None and not isinstance(text, str):
        raise ValueError(f"a prompt dict's 'prompt' must be a string, got {type(text).__name__}")
    if ids is None and text is None:
        raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
    if ids is not None and not isinstance(ids, (list, tuple)):
        raise ValueError(f"'prompt_token_ids' must be a list of token ids, got "
                         f"{type(ids).__name__}")
    salt = prompt.get("cache_salt")
    if salt is not None and cache_salt is not None:
        raise ValueError("cache_salt was given twice (in the prompt dict and as an argument); "
                         "give it once")
    return ParsedPrompt(text, None if ids is None else list(ids),
                        salt if salt is not None else cache_salt)


def truncate_prompt(token_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (None: all of them; -1:
    max_model_len - 1, the most that leave room for an output token). Raises ValueError for a
    `keep` above max_model_len, as vLLM does whatever the prompt's length."""
    if keep is None:
        return token_ids
    if not (keep == -1 or 1 <= keep <= max_model_len):
        raise ValueError(f"truncate_prompt_tokens must be -1 (keep max_model_len - 1 tokens) "
                         f"or an integer in [1, max_model_len={max_model_len}], got {keep}")
    keep = max_model_len - 1 if keep == -1 else keep
    return token_ids[-keep:]
