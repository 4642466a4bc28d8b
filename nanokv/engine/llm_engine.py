"""The engine: requests in, one scheduled step at a time, outputs back.

    add_request -> step() [schedule -> run model -> update] -> RequestOutput ...
"""

from __future__ import annotations

import itertools
import logging

import torch

from nanokv.cache.block_manager import BlockManager
from nanokv.cache.kv_pool import KVLayout, KVPool
from nanokv.config import EngineConfig
from nanokv.engine.detokenizer import update_text
from nanokv.engine.kv_policy import PolicyRunner
from nanokv.executor.loader import load_model
from nanokv.executor.memory import estimate_activation_bytes, plan_kv_blocks
from nanokv.executor.model_runner import ModelRunner
from nanokv.executor.profiler import measure_activation_bytes
from nanokv.outputs import CompletionOutput, RequestOutput
from nanokv.request import Request, RequestStatus
from nanokv.sampling_params import SamplingParams
from nanokv.scheduler.scheduler import Scheduler

logger = logging.getLogger("nanokv")


def _prompt_logits(request: Request):
    if not request.params.return_prompt_logits or not request.prompt_logits:
        return None
    return torch.cat(request.prompt_logits)[:request.num_prompt_tokens]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        loaded = load_model(config.model, config.dtype, config.device,
                            tokenizer_path=config.tokenizer,
                            skip_tokenizer_init=config.skip_tokenizer_init,
                            max_positions=config.max_model_len,
                            linear_backend=config.linear_backend)
        self.model, self.hf_config = loaded.model, loaded.hf_config
        self.tokenizer, self.eos_token_ids = loaded.tokenizer, loaded.eos_token_ids
        self.device, self.dtype = loaded.device, loaded.dtype
        model_max = int(self.hf_config.max_position_embeddings)
        if config.max_model_len is not None and config.max_model_len > model_max:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's "
                             f"max_position_embeddings {model_max}")
        explicit_len = config.max_model_len is not None
        config.resolve(model_max)

        cfg = self.hf_config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.layout = KVLayout(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim,
                               config.block_size, self.dtype)
        blocks_per_seq = -(-config.max_model_len // config.block_size)
        if config.num_kv_blocks is not None:
            num_blocks, source = config.num_kv_blocks, "num_kv_blocks"
        else:
            activation = measure_activation_bytes(self.model, config.max_num_batched_tokens,
                                                  self.device)
            if activation is None:
                activation = (estimate_activation_bytes(cfg, config.max_num_batched_tokens,
                                                        config.max_num_seqs, self.dtype),
                              "estimated")
            plan = plan_kv_blocks(
                bytes_per_block=self.layout.bytes_per_block, device=self.device,
                kv_cache_memory=config.kv_cache_memory, fraction=config.kv_cache_memory_fraction,
                activation_bytes=activation[0],
                max_useful_blocks=config.max_num_seqs * blocks_per_seq)
            num_blocks = plan.num_blocks
            source = (f"{plan.source}; peak activations {activation[0] / 2**20:.0f} MiB, "
                      f"{activation[1]}")
        if num_blocks < blocks_per_seq:
            fit = num_blocks * config.block_size
            if explicit_len:
                raise ValueError(f"the KV pool ({num_blocks} blocks = {fit} tokens) cannot hold "
                                 f"one request of max_model_len {config.max_model_len}; lower "
                                 f"max_model_len or raise kv_cache_memory")
            logger.warning("max_model_len lowered from %d to %d to fit the KV pool",
                           config.max_model_len, fit)
            config.max_model_len = fit
        self.kv_pool = KVPool(self.layout, num_blocks, self.device)
        self.block_manager = BlockManager(num_blocks, config.block_size,
                                          config.enable_prefix_caching,
                                          extra_keys=(("kv_dtype", str(self.dtype)),))
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.max_model_len,
                                   config.enable_chunked_prefill)
        self.runner = ModelRunner(self.model, self.kv_pool, self.device, config.seed)
        self.policies = PolicyRunner(config.policy_config(), self.block_manager, self.kv_pool,
                                     self.model.attention_layers()[0].scale)
        self._ids = itertools.count()
        self.startup_lines = [
            f"model {config.model} ({type(self.model).__name__}) on {self.device}, "
            f"{loaded.dtype_note}",
            f"KV cache: {num_blocks} blocks x {config.block_size} tokens = "
            f"{num_blocks * config.block_size} tokens, "
            f"{self.kv_pool.nbytes / 2**20:.1f} MiB ({source}); "
            f"{self.layout.bytes_per_token / 1024:.1f} KiB per token",
            f"max concurrency at max_model_len {config.max_model_len}: "
            f"{num_blocks / blocks_per_seq:.2f} requests",
        ]
        for line in self.startup_lines:
            logger.info(line)

    # ---- requests ------------------------------------------------------------------------------
    def make_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                     request_id: str | None = None, cache_salt: str | None = None,
                     kv_policy=None, compress_after: int | None = None) -> Request:
        """Validate and tokenize; raises ValueError without touching the engine's state."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params)}")
        text = None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; this engine was started with "
                                 "skip_tokenizer_init=True, so pass token ids")
            text = prompt
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            token_ids = list(prompt)
        else:
            raise ValueError(f"a prompt must be a string or a list of token ids, "
                             f"got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        vocab = self.hf_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        if len(token_ids) >= self.config.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; max_model_len "
                             f"{self.config.max_model_len} allows at most "
                             f"{self.config.max_model_len - 1}")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt must be a non-empty string")
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self.scheduler.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if compress_after is not None and not 1 <= compress_after <= len(token_ids):
            raise ValueError(f"compress_after must be in [1, {len(token_ids)}] (the prompt "
                             f"length), got {compress_after}")
        request = Request(rid, token_ids, params, prompt=text,
                          eos_token_ids=self.eos_token_ids, cache_salt=cache_salt)
        request.compress_after = compress_after
        self.policies.attach(request, kv_policy)  # kv_policy: a PolicyConfig overriding the engine's
        return request

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: str | None = None,
                    kv_policy=None) -> str:
        request = self.make_request(prompt, params, request_id, cache_salt, kv_policy)
        self.scheduler.add_request(request)
        return request.request_id

    def add_prepared(self, request: Request) -> str:
        self.scheduler.add_request(request)
        return request.request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.abort(request_id)
        return None if request is None else self._output(request, [])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self.policies.relieve_pressure(self.scheduler.running)
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        try:
            runner_out = self.runner.execute(sched)
        except Exception:
            # the step's K/V may be half written: free its requests and forget their hashes
            for s in sched.scheduled:
                request = self.scheduler.requests.get(s.request_id)
                if request is not None:
                    self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED,
                                          drop_cache=True)
            raise
        before = {s.request_id: self.scheduler.requests[s.request_id].num_output_tokens
                  for s in sched.scheduled if s.sample}
        self.policies.collect(runner_out.captured_queries, self.scheduler.requests)
        stepped = [self.scheduler.requests[s.request_id] for s in sched.scheduled
                   if s.request_id in self.scheduler.requests]
        progressed = self.scheduler.update_from_output(sched, runner_out)
        self.policies.after_step(stepped)
        outputs = []
        for request in progressed:
            stop = update_text(request, self.tokenizer)
            if stop is not None and not request.is_finished:
                request.stop_reason = stop
                self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
            new = request.output_token_ids[before[request.request_id]:]
            outputs.append(self._output(request, new))
        return outputs

    def _output(self, request: Request, new_token_ids: list[int]) -> RequestOutput:
        finished = request.is_finished
        reason = request.status.value if finished else None
        return RequestOutput(
            request_id=request.request_id, prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[CompletionOutput(request.text, list(request.output_token_ids), reason,
                                      request.stop_reason)],
            finished=finished, num_cached_tokens=max(0, request.num_cached_tokens),
            metrics=request.metrics, new_token_ids=new_token_ids,
            prompt_logits=_prompt_logits(request) if finished else None,
            kv_blocks_at_finish=request.final_kv_blocks,
            kv_slots_at_finish=request.final_kv_slots,
            logical_tokens_at_finish=request.num_computed_tokens if finished else 0)

    # ---- observability -------------------------------------------------------------------------
    def stats(self):
        return self.scheduler.stats()

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()
