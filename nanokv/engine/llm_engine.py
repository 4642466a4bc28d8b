"""The engine: requests in, one scheduled step at a time, outputs back.

    add_request -> step() [schedule -> run model -> update] -> RequestOutput ...
"""

from __future__ import annotations

import itertools
import logging

import torch

from nanokv.cache.block_manager import BlockManager
from nanokv.cache.kv_pool import KVLayout, KVPool
from nanokv.config import EngineConfig, auto_block_size
from nanokv.engine.detokenizer import update_text
from nanokv.engine.kv_policy import PolicyRunner
from nanokv.executor.loader import load_hf_config, load_model
from nanokv.executor.memory import (decode_dequant_bytes_per_block, estimate_activation_bytes,
                                    plan_kv_blocks)
from nanokv.executor.model_runner import ModelRunner
from nanokv.executor.cpu_memory import tune_glibc_malloc
from nanokv.executor.profiler import measure_activation_bytes
from nanokv.outputs import CompletionOutput, RequestOutput
from nanokv.quant.attention import rope_from_rotary
from nanokv.quant.registry import make_kv_store, store_memory
from nanokv.request import Request, RequestStatus
from nanokv.sampling_params import SamplingParams
from nanokv.scheduler.scheduler import Scheduler

logger = logging.getLogger("nanokv")


def _prompt_logits(request: Request):
    if not request.params.return_prompt_logits or not request.prompt_logits:
        return None
    return torch.cat(request.prompt_logits)[:request.num_prompt_tokens]


def kv_store_options(config: EngineConfig, num_layers: int, num_kv_heads: int,
                     head_dim: int, block_size: int) -> dict:
    """The `make_kv_store` options of the engine's kv_cache_dtype (validated; reads the
    calibration file of kv_quant_config). Raises ValueError before anything is allocated."""
    if config.kv_cache_dtype != "kvquant":
        return {}
    from nanokv.quant.calibration_file import load_calibration
    from nanokv.quant.kvquant import KVQuantConfig

    if config.kv_quant_config is None:
        quant = KVQuantConfig(bits=config.kv_quant_bits or 4)
    else:
        calib = load_calibration(config.kv_quant_config)
        calib.check_model(num_layers, num_kv_heads, head_dim)
        if config.kv_quant_bits is None and calib.kv_cache_dtype != "kvquant":
            raise ValueError(f"the calibration {config.kv_quant_config} chose kv_cache_dtype "
                             f"{calib.kv_cache_dtype!r}: run with --kv-cache-dtype "
                             f"{calib.kv_cache_dtype}, or pass kv_quant_bits for a kvquant "
                             f"config from its codebooks")
        quant = calib.kvquant_config(bits=config.kv_quant_bits)
        calib_block = calib.settings.get("block_size")
        if calib_block != block_size:
            logger.warning("the calibration %s was made with block_size %s, the engine uses %s: "
                           "per-channel key statistics (and outlier shares) differ from what "
                           "was calibrated", config.kv_quant_config, calib_block, block_size)
    # one staging block per running request (a request has at most one partial block)
    return {"kvquant_config": quant, "num_staging_blocks": config.max_num_seqs}


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        store_options = {}
        if config.kv_cache_dtype != "auto":  # validate before anything is loaded
            hf_cfg, _ = load_hf_config(config.model)
            block_size = config.block_size
            if block_size == "auto":
                block_size = auto_block_size(config.max_model_len
                                             or int(hf_cfg.max_position_embeddings))
            store_options = kv_store_options(
                config, hf_cfg.num_hidden_layers, hf_cfg.num_key_value_heads,
                getattr(hf_cfg, "head_dim", None)
                or hf_cfg.hidden_size // hf_cfg.num_attention_heads, block_size)
        loaded = load_model(config.model, config.dtype, config.device,
                            tokenizer_path=config.tokenizer,
                            skip_tokenizer_init=config.skip_tokenizer_init,
                            max_positions=config.max_model_len,
                            linear_backend=config.linear_backend)
        self.model, self.hf_config = loaded.model, loaded.hf_config
        self.tokenizer, self.eos_token_ids = loaded.tokenizer, loaded.eos_token_ids
        self.device, self.dtype = loaded.device, loaded.dtype
        if self.device.type == "cpu":  # reuse freed activation memory (cpu_memory.py)
            tune_glibc_malloc()
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
        self.kv_cache_dtype = config.kv_cache_dtype
        quantized = config.kv_cache_dtype != "auto"
        if quantized:  # the store's real cost: a fixed part + one per block
            fixed_bytes = store_memory(config.kv_cache_dtype, self.layout, 0,
                                       **store_options).total
            bytes_per_block = store_memory(config.kv_cache_dtype, self.layout, 1,
                                           **store_options).total - fixed_bytes
            scratch_per_block = decode_dequant_bytes_per_block(self.layout,
                                                               config.kv_cache_dtype)
        else:
            fixed_bytes, bytes_per_block = 0, self.layout.bytes_per_block
            scratch_per_block = 0
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
                bytes_per_block=bytes_per_block, device=self.device,
                kv_cache_memory=config.kv_cache_memory, fraction=config.kv_cache_memory_fraction,
                activation_bytes=activation[0],
                max_useful_blocks=config.max_num_seqs * blocks_per_seq,
                fixed_bytes=fixed_bytes, scratch_bytes_per_block=scratch_per_block)
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
        # with a quantized KV cache the pool keeps only the slot positions; the store shares them
        self.kv_pool = KVPool(self.layout, num_blocks, self.device, allocate_kv=not quantized)
        self.kv_store = make_kv_store(config.kv_cache_dtype, self.layout, num_blocks,
                                      self.device, slot_positions=self.kv_pool.slot_positions,
                                      **store_options)
        extra_keys = (("kv_dtype", str(self.dtype)),)
        if self.kv_store is not None:  # blocks are only shared between identical settings
            extra_keys += self.kv_store.extra_keys()
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching, extra_keys=extra_keys,
            on_block_freed=self.kv_store.release if self.kv_store is not None else None)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.max_model_len,
                                   config.enable_chunked_prefill)
        rope = rope_from_rotary(self.model.rotary) if self.kv_store is not None else None
        self.runner = ModelRunner(self.model, self.kv_pool, self.device, config.seed,
                                  kv_store=self.kv_store, rope=rope,
                                  attention_backend=config.attention_backend)
        self.policies = PolicyRunner(config.policy_config(), self.block_manager, self.kv_pool,
                                     self.model.attention_layers()[0].scale,
                                     kv_store=self.kv_store, rotary=self.model.rotary)
        self._ids = itertools.count()
        # what the KV cache really holds: codes, scales, outliers, sinks, staging, positions
        pool_slots = num_blocks * config.block_size
        if self.kv_store is None:
            self.kv_memory = None
            self.kv_cache_bytes = self.kv_pool.nbytes
            self.kv_bytes_per_block = self.layout.bytes_per_block
        else:
            self.kv_memory = self.kv_store.memory()  # without the pool's slot positions
            self.kv_cache_bytes = self.kv_memory.total + self.kv_pool.nbytes
            self.kv_bytes_per_block = bytes_per_block
        self.kv_bytes_per_token = self.kv_cache_bytes / pool_slots
        float_per_token = self.layout.bytes_per_block / config.block_size
        shown_per_token = (self.layout.bytes_per_token if self.kv_store is None
                           else self.kv_bytes_per_token)
        self.startup_lines = [
            f"model {config.model} ({type(self.model).__name__}) on {self.device}, "
            f"{loaded.dtype_note}",
            f"KV cache: {num_blocks} blocks x {config.block_size} tokens = "
            f"{pool_slots} tokens, "
            f"{self.kv_cache_bytes / 2**20:.1f} MiB ({source}); "
            f"{shown_per_token / 1024:.1f} KiB per token",
        ]
        if self.kv_memory is not None:
            m = self.kv_memory
            parts = ", ".join(f"{name} {getattr(m, name) / pool_slots:.1f}"
                              for name in ("codes", "scales", "outliers", "sinks", "staging",
                                           "bookkeeping") if getattr(m, name))
            self.startup_lines.append(
                f"KV cache dtype {self.kv_store.kv_cache_dtype}: "
                f"{self.kv_bytes_per_token:.1f} bytes per token held ({parts}, positions 4.0), "
                f"{self.kv_bytes_per_token / float_per_token:.3f}x the "
                f"{str(self.dtype).removeprefix('torch.')} pool's {float_per_token:.0f}")
        self.startup_lines.append(
            f"max concurrency at max_model_len {config.max_model_len}: "
            f"{num_blocks / blocks_per_seq:.2f} requests")
        if self.kv_store is None:
            self.startup_lines.append(
                "decode attention: " + ("C kernel (attention_backend native)"
                                        if self.runner.native_decode else "PyTorch"))
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
        # kv_policy: a PolicyConfig overriding the engine's default for this request
        self.policies.attach(request, kv_policy)
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
            logprobs = runner_out.logprobs.get(request.request_id)
            outputs.append(self._output(request, new,
                                        [logprobs] if logprobs is not None and new else None))
        return outputs

    def _output(self, request: Request, new_token_ids: list[int],
                new_logprobs: list | None = None) -> RequestOutput:
        finished = request.is_finished
        reason = request.status.value if finished else None
        return RequestOutput(
            request_id=request.request_id, prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[CompletionOutput(request.text, list(request.output_token_ids), reason,
                                      request.stop_reason)],
            finished=finished, num_cached_tokens=max(0, request.num_cached_tokens),
            metrics=request.metrics, new_token_ids=new_token_ids, new_logprobs=new_logprobs,
            prompt_logits=_prompt_logits(request) if finished else None,
            kv_blocks_at_finish=request.final_kv_blocks,
            kv_slots_at_finish=request.final_kv_slots,
            logical_tokens_at_finish=request.num_computed_tokens if finished else 0)

    # ---- observability -------------------------------------------------------------------------
    def stats(self):
        return self.scheduler.stats()

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()
