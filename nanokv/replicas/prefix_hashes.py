"""A prompt's prefix-cache block hashes, computed outside the engine exactly as its block
manager computes them, so that the router's predicted hit is the hit the replica serves.

The block manager looks a prompt up block by block: block i's hash is
`hash_block(hash of block i-1, token ids of block i, extra keys)` (nanokv/cache/hashing.py),
where the extra keys are the engine's (KV dtype, KV cache kind) plus `("salt", cache_salt)` when
the request has one and `("lora", id)` when it runs under a LoRA adapter (`body_lora_id`), and
it looks up at most `(num_tokens - 1) // block_size` blocks (the last prompt token is always
computed). `HashSpec` is what a replica's engine says about those rules;
`prompt_block_hashes` applies them. `PromptTokenizer` turns an OpenAI request body into the token
ids the server would compute (same tokenizer, chat template and defaults).
"""

from __future__ import annotations

import copy
import json
import threading
from dataclasses import dataclass

from nanokv.cache.hashing import ROOT_HASH, hash_block, request_extra_keys


@dataclass(frozen=True)
class HashSpec:
    """How one engine hashes prompt blocks (every replica of a deployment has the same)."""

    block_size: int
    extra_keys: tuple  # the engine-wide extra keys (BlockManager.extra_keys)
    enabled: bool  # enable_prefix_caching

    @classmethod
    def from_engine(cls, engine) -> HashSpec:
        bm = engine.block_manager
        return cls(bm.block_size, tuple(bm.extra_keys), bm.enable_prefix_caching)


def prompt_block_hashes(token_ids: list[int], spec: HashSpec, cache_salt: str | None = None,
                        lora_int_id: int = 0) -> list[int]:
    """The chained hashes of the prompt's blocks the block manager would look up, in order
    (lora_int_id: the request's LoRA adapter, 0 for none)."""
    if not spec.enabled or not token_ids:
        return []
    bs = spec.block_size
    extra = request_extra_keys(spec.extra_keys, cache_salt, lora_int_id)
    hashes: list[int] = []
    parent = ROOT_HASH
    for i in range((len(token_ids) - 1) // bs):
        parent = hash_block(parent, tuple(token_ids[i * bs:(i + 1) * bs]), extra)
        hashes.append(parent)
    return hashes


def body_lora_id(body: bytes, lora_ids: dict[str, int]) -> int:
    """The LoRA adapter id a request body's `model` names (`lora_ids`: the server's
    --lora-modules, name -> id), 0 for the served model or a body that names none."""
    if not lora_ids:
        return 0
    try:
        data = json.loads(body)
    except ValueError:
        return 0
    model = data.get("model") if isinstance(data, dict) else None
    return lora_ids.get(model, 0) if isinstance(model, str) else 0


def matched_blocks(hashes: list[int], cached) -> int:
    """How many leading blocks of a chain `cached` (a set of hashes) holds: a chained hash
    stands for its whole prefix, so the first miss ends the match."""
    n = 0
    for h in hashes:
        if h not in cached:
            break
        n += 1
    return n


class PromptTokenizer:
    """OpenAI request bodies -> the prompt token ids the server computes for them.

    Uses the server's own request models (their defaults: add_special_tokens true for
    completions, false for chat) and its chat renderer. A body the server would reject, or a
    route without a prompt, gives None: the request is routed by load alone and the replica
    answers it (with the same 400 it would give without replicas)."""

    def __init__(self, tokenizer, chat_template: str | None = None,
                 max_prompt_chars: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.max_prompt_chars = max_prompt_chars
        self._local = threading.local()

    def _thread_tools(self):
        """This thread's own tokenizer copy (a Rust tokenizer shared by threads can fail with
        'Already borrowed') and chat renderer."""
        from nanokv.engine.chat import ChatRenderer

        if not hasattr(self._local, "tokenizer"):
            self._local.tokenizer = copy.deepcopy(self.tokenizer)
            self._local.chat = ChatRenderer(self._local.tokenizer, self.chat_template)
        return self._local.tokenizer, self._local.chat

    def token_ids(self, path: str, body: bytes) -> tuple[list[int], str | None] | None:
        """(prompt token ids, cache_salt) of a completions, chat or responses body, else
        None."""
        from pydantic import ValidationError

        from nanokv.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                            template_tools)
        from nanokv.server.responses_api import ResponsesRequest

        try:
            data = json.loads(body)
            if path.endswith("/v1/completions"):
                req = CompletionRequest.model_validate(data)
                prompt = req.prompt
                if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                    prompt = prompt[0]  # several prompts: route by the first
                if isinstance(prompt, list):
                    return [int(t) for t in prompt], req.cache_salt
                if self.tokenizer is None or self._too_long(len(prompt)):
                    return None
                tok, _ = self._thread_tools()
                return list(tok.encode(prompt, add_special_tokens=req.add_special_tokens)), \
                    req.cache_salt
            if path.endswith("/v1/chat/completions"):
                req = ChatCompletionRequest.model_validate(data)
                if self.tokenizer is None:
                    return None
                plain = [m.for_template() for m in req.messages]  # as the server renders
                if self._too_long(sum(len(m["content"]) for m in plain)):
                    return None
                tok, chat = self._thread_tools()
                text = chat.render(plain, req.add_generation_prompt, req.chat_template_kwargs,
                                   req.continue_final_message, tools=template_tools(req.tools))
                return list(tok.encode(text, add_special_tokens=req.add_special_tokens)), \
                    req.cache_salt
            if path.endswith("/v1/responses"):  # a chat, as the server makes it
                req = ResponsesRequest.model_validate(data)
                if self.tokenizer is None:
                    return None
                plain = [m.for_template() for m in req.messages()]
                if self._too_long(sum(len(m["content"]) for m in plain)):
                    return None
                tok, chat = self._thread_tools()
                text = chat.render(plain, True, req.chat_template_kwargs, False,
                                   tools=template_tools(req.chat_tools()))
                return list(tok.encode(text, add_special_tokens=False)), req.cache_salt
        except (ValueError, ValidationError, TypeError, APIError):  # the replica's error
            return None
        return None

    def _too_long(self, chars: int) -> bool:
        return self.max_prompt_chars is not None and chars > self.max_prompt_chars
