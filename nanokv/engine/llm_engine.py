"""The engine: requests in, one scheduled step at a time, outputs back.

    add_request -> step() [schedule -> run model -> update] -> RequestOutput ...
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading

import torch

from nanokv.cache.block_manager import BlockManager
from nanokv.cache.layout import KVLayout
from nanokv.config import EngineConfig
from nanokv.engine.assembly import (
    build_kv_cache,
    hybrid_layer_windows,
    measure_kv_budget,
    resolve_parts,
    scaled_spec,
    startup_report,
)
from nanokv.engine.detokenizer import update_text
from nanokv.engine.policy_runner import PolicyRunner, ScoringPass
from nanokv.bad_words import tokenize_bad_words
from nanokv.engine.prompts import parse_prompt, truncate_prompt
from nanokv.lora.manager import LoRAManager
from nanokv.lora.request import LoRARequest
from nanokv.worker.cpu_memory import huge_page_share, request_huge_pages, tune_glibc_malloc
from nanokv.worker.loader import load_hf_config, load_model, resolve_device
from nanokv.worker.model_runner import ModelRunner
from nanokv.outputs import CompletionOutput, RequestOutput
from nanokv.request import Request, RequestStatus
from nanokv.sampling_params import SamplingParams
from nanokv.scheduler.scheduler import Scheduler
from nanokv.spec.draft_model import DraftModelProposer
from nanokv.utils import head_dim_of

logger = logging.getLogger("nanokv")


def _prompt_logits(request: Request):
    if not request.params.return_prompt_logits or not request.prompt_logits:
        return None
    return torch.cat(request.prompt_logits)[:request.num_prompt_tokens]


def _prompt_logprobs(request: Request) -> list | None:
    """The request's prompt log-probabilities once all are computed, else None."""
    if (request.params.prompt_logprobs is None
            or len(request.prompt_logprobs) < request.num_prompt_tokens):
        return None
    return request.prompt_logprobs


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        """Resolve the config and check the parts against each other (nothing loaded yet),
        load the model, plan the KV cache from its kind's spec, build, report.

        With tensor_parallel_size N > 1 this process is rank 0 of N (nanokv/distributed): the
        other ranks are started before the model loads, each loads its shard and holds the KV
        cache of its KV heads; the scheduler, block manager, policies and sampler stay here."""
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        hf_config, architecture = load_hf_config(config.model)
        parts = resolve_parts(config, hf_config, architecture)
        tp_size = config.tensor_parallel_size
        self.executor = None  # rank 0's end of the tensor-parallel group
        if tp_size > 1:
            from nanokv.distributed.executor import TensorParallelExecutor

            self.executor = TensorParallelExecutor(config)
        try:
            self._build(config, parts)
        except BaseException:
            self.close()  # the other ranks must not outlive a failed start
            raise

    def _build(self, config: EngineConfig, parts) -> None:
        """Load the model (this rank's shard), plan and build the KV cache, the block manager,
        scheduler, runner and policies; report."""
        tp_size = config.tensor_parallel_size
        # before the weights: PyTorch reads the setting at its first CPU allocation
        if resolve_device(config.device).type == "cpu":
            request_huge_pages()
        loaded = load_model(config.model, config.dtype, config.device,
                            tokenizer_path=config.tokenizer,
                            skip_tokenizer_init=config.skip_tokenizer_init,
                            max_positions=config.max_model_len,
                            linear_backend=config.linear_backend,
                            tp=None if self.executor is None else self.executor.tp,
                            quantization=config.quantization)
        self.model, self.hf_config = loaded.model, loaded.hf_config
        self.tokenizer, self.eos_token_ids = loaded.tokenizer, loaded.eos_token_ids
        self.device, self.dtype = loaded.device, loaded.dtype
        if self.device.type == "cpu":  # reuse freed activation memory (cpu_memory.py)
            tune_glibc_malloc()
        self.lora = None  # LoRA adapters: the model's projections wrapped, their slots
        if config.enable_lora:
            self.lora = LoRAManager(self.model, config.max_loras, config.max_lora_rank,
                                    config.max_cpu_loras)

        self.draft_model = None  # draft-model speculation: its layers follow the model's
        if parts.draft_layers:
            self.draft_model = load_model(config.speculative.model,
                                          str(self.dtype).removeprefix("torch."), config.device,
                                          skip_tokenizer_init=True,
                                          max_positions=config.max_model_len,
                                          linear_backend=config.linear_backend,
                                          quantization=config.quantization).model
        cfg = self.hf_config
        self.layout = KVLayout(cfg.num_hidden_layers + parts.draft_layers,
                               cfg.num_key_value_heads // tp_size,
                               head_dim_of(cfg), config.block_size, self.dtype,
                               parts.sliding_windows)
        # rank 0's share of per-head settings (the other ranks take theirs in build_caches)
        settings = (parts.kv_cache_settings if self.executor is None else
                    parts.kv_cache_class.shard_settings(parts.kv_cache_settings, 0, tp_size))
        spec = parts.kv_cache_class.spec(self.layout, settings)
        plan_spec = spec
        if self.executor is not None:
            self.executor.wait_until_loaded()
            if config.num_kv_blocks is None:
                self.executor.profile(config.max_num_batched_tokens)
            if self.device.type == "cpu":  # the ranks' pools share the host's memory budget
                plan_spec = scaled_spec(spec, tp_size)
        budget = measure_kv_budget(config, self.model, cfg, self.device, self.dtype)

        def create(num_blocks: int):
            return parts.kv_cache_class.create(self.layout, num_blocks, self.device, settings,
                                               rotary=self.model.rotary)

        layer_windows = hybrid_layer_windows(config, self.layout, parts.kv_cache_class)
        self.kv_cache_plan, self.kv_cache, backend_class, backend_why = build_kv_cache(
            config, plan_spec, self.layout, budget, parts.max_model_len_given, create, self.device,
            layer_windows, self.model.logits_soft_cap)
        config.max_model_len = self.kv_cache_plan.max_model_len
        if self.kv_cache.pre_rope_keys and len(self.model.rotaries()) > 1:
            raise ValueError(f"kv_cache_dtype {config.kv_cache_dtype!r} keeps keys before RoPE "
                             f"and rotates them with one RoPE; {type(self.model).__name__}'s "
                             f"layers have {len(self.model.rotaries())} (one per kind of "
                             f"layer). Keep keys after RoPE (kvquant: pre_rope_keys false in "
                             f"its calibration) or use another kv_cache_dtype")
        self.attention_backend = backend_class(self.kv_cache, self.device,
                                               self.model.logits_soft_cap)
        kv_cache = self.kv_cache  # what the block manager and the policies act on
        if self.executor is not None:  # every rank's, through rank 0's
            kv_cache = self.executor.build_caches(self.kv_cache, config.kv_cache_dtype,
                                                  parts.kv_cache_settings, backend_class.name)
        extra_keys = (("kv_dtype", str(self.dtype)),) + self.kv_cache.extra_keys()
        self.block_manager = BlockManager(
            self.kv_cache_plan.num_blocks, config.block_size, config.enable_prefix_caching,
            extra_keys=extra_keys, on_block_freed=kv_cache.release,
            on_slices_moved=kv_cache.copy_slices)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.max_model_len,
                                   config.enable_chunked_prefill, config.scheduling_policy,
                                   config.speculative, self.kv_cache.quantizes_full_blocks,
                                   max_loras=config.max_loras if config.enable_lora else 0,
                                   sliding_window=self.layout.common_window,
                                   layer_windows=layer_windows)
        self.runner = ModelRunner(self.model, self.kv_cache, self.attention_backend, self.device,
                                  config.seed, tp=None if self.executor is None
                                  else self.executor.tp, enforce_eager=config.enforce_eager,
                                  max_num_seqs=config.max_num_seqs,
                                  max_model_len=config.max_model_len)
        self.runner.lora = self.lora
        if self.executor is not None:
            self.runner = self.executor.runner(self.runner)
        self.drafter = None
        if self.draft_model is not None:
            self.drafter = DraftModelProposer(self.draft_model, self.runner,
                                              layer_offset=cfg.num_hidden_layers,
                                              constraints=self.scheduler.draft_constraints)
        scoring = None  # a policy's extra forward pass (KVzip): one process only
        if self.executor is None:
            scoring = ScoringPass(self.runner.score_forward, self._encode_plain,
                                  config.max_num_batched_tokens)
        self.policies = PolicyRunner(parts.default_policy, self.block_manager, kv_cache,
                                     self.model.attention_layers()[0].scale, scoring,
                                     self.model.logits_soft_cap)
        self._ids = itertools.count()
        self._grammars = None  # the structured-output backend, made on first use
        self._grammars_lock = threading.Lock()
        self.startup_lines = startup_report(config, self.model, self.device, loaded.dtype_note,
                                            self.kv_cache_plan, self.kv_cache,
                                            self.attention_backend, backend_why)
        if self.executor is not None:
            self.startup_lines.append(self.executor.describe())
        share = huge_page_share() if self.device.type == "cpu" else None
        if share is not None:
            self.startup_lines.append(
                f"transparent huge pages: {share[0] / 2**20:.0f} of {share[1] / 2**20:.0f} MiB "
                f"resident (THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', '')})")
        if self.lora is not None:
            self.startup_lines.append(
                f"LoRA: up to {config.max_loras} adapters at once of rank <= "
                f"{config.max_lora_rank}, {self.lora.max_cpu_loras} kept in memory")
        for line in self.startup_lines:
            logger.info(line)

    @property
    def _encode_plain(self):
        """text -> token ids without special tokens (None without a tokenizer)."""
        if self.tokenizer is None:
            return None
        return lambda text: self.tokenizer.encode(text, add_special_tokens=False)

    def structured_backend(self, tokenizer=None):
        """The xgrammar backend over this engine's tokenizer and vocabulary (built on the first
        structured request: xgrammar is imported then; from `tokenizer`, a copy of the engine's
        for a caller in another thread); ValueError without a tokenizer, MissingExtraError
        without xgrammar."""
        if self.tokenizer is None:
            raise ValueError("structured_outputs need a tokenizer (the grammar is matched "
                             "against token texts); this engine was started with "
                             "skip_tokenizer_init=True")
        with self._grammars_lock:
            if self._grammars is None:
                from nanokv.structured.xgrammar_backend import GrammarBackend

                self._grammars = GrammarBackend(tokenizer or self.tokenizer,
                                                self.hf_config.vocab_size)
            return self._grammars

    @property
    def kv_cache_dtype(self) -> str:
        """The KV cache's storage, resolved ("float32" for the float pool, "fp8_e4m3" ...)."""
        return self.kv_cache.kv_cache_dtype

    @property
    def kv_bytes_per_block(self) -> int:
        """What each block of the pool really costs (codes, scales, positions ...)."""
        return self.kv_cache_plan.spec.bytes_per_block

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.nbytes

    @property
    def kv_bytes_per_token(self) -> float:
        """Every byte the KV cache holds over its slots (fixed costs included)."""
        return self.kv_cache.nbytes / self.kv_cache_plan.num_slots

    # ---- requests ------------------------------------------------------------------------------
    def make_request(self, prompt: str | list[int] | dict, params: SamplingParams | None = None,
                     request_id: str | None = None, cache_salt: str | None = None,
                     kv_policy=None, compress_after: int | None = None,
                     bad_words_token_ids: tuple[tuple[int, ...], ...] | None = None,
                     priority: int = 0, lora_request: LoRARequest | None = None) -> Request:
        """Validate and tokenize; raises ValueError without touching the engine's state.
        `prompt`: text, token ids, or vLLM's prompt dicts (`nanokv.engine.prompts`).
        `priority`: lower is served first under scheduling_policy "priority"; ignored under
        "fcfs" (as vLLM's engine does).
        `bad_words_token_ids`: params.bad_words tokenized by the caller in its own thread
        (`tokenize_bad_words`; the server's), else the engine tokenizes them.
        `lora_request`: the LoRA adapter it runs with (enable_lora), read and checked here."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got "
                             f"{type(params).__name__}")
        params.validate()  # its fields may have changed since it was built
        if params.n != 1:
            raise ValueError(f"an engine request is one sample (n=1), got n={params.n}: "
                             f"LLM.generate and the server fan n out into n requests")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings are matched in the output text, which needs a "
                             "tokenizer; this engine was started with skip_tokenizer_init=True: "
                             "use stop_token_ids")
        vocab = self.hf_config.vocab_size
        if params.bad_words and bad_words_token_ids is None:
            if self.tokenizer is None:
                raise ValueError("bad_words are tokenized, which needs a tokenizer; this engine "
                                 "was started with skip_tokenizer_init=True")
            bad_words_token_ids = tokenize_bad_words(params.bad_words, self._encode_plain, vocab)
        parsed = parse_prompt(prompt, cache_salt)
        text, token_ids, cache_salt = parsed.text, parsed.token_ids, parsed.cache_salt
        if token_ids is None:
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; this engine was started with "
                                 "skip_tokenizer_init=True, so pass token ids")
            token_ids = self.tokenizer.encode(text)
        token_ids = truncate_prompt(token_ids, params.truncate_prompt_tokens,
                                    self.config.max_model_len)
        if not token_ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        bad = [t for t in token_ids
               if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        for what, ids in (("stop_token_ids", params.stop_token_ids),
                          ("logit_bias keys (token ids)", params.logit_bias or ()),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ValueError(f"{what} must be in [0, {vocab}) (the vocabulary); got "
                                 f"{bad[:5]}")
        if len(token_ids) >= self.config.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; max_model_len "
                             f"{self.config.max_model_len} allows at most "
                             f"{self.config.max_model_len - 1}")
        if params.max_tokens is None:  # vLLM's None: up to the model length
            room = self.config.max_model_len - len(token_ids)
            if params.min_tokens > room:
                raise ValueError(f"min_tokens {params.min_tokens} is more than the {room} output "
                                 f"tokens a {len(token_ids)}-token prompt leaves in max_model_len "
                                 f"{self.config.max_model_len}")
            params = dataclasses.replace(params, max_tokens=room)
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt must be a non-empty string")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer (lower is served first), "
                             f"got {priority!r}")
        rid = request_id if request_id is not None else self.new_request_id()
        if rid in self.scheduler.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if compress_after is not None and not 1 <= compress_after <= len(token_ids):
            raise ValueError(f"compress_after must be in [1, {len(token_ids)}] (the prompt "
                             f"length), got {compress_after}")
        if lora_request is not None:
            if self.lora is None:
                raise ValueError("lora_request needs an engine started with enable_lora=True "
                                 "(the server's --enable-lora)")
            self.lora.register(lora_request)
        request = Request(rid, token_ids, params, prompt=text,
                          eos_token_ids=self.eos_token_ids, cache_salt=cache_salt,
                          priority=priority, lora_request=lora_request)
        request.compress_after = compress_after
        request.bad_words_token_ids = bad_words_token_ids or ()
        if params.structured_outputs is not None:  # a matcher of its own (each of n samples)
            stops = (*self.eos_token_ids, *params.stop_token_ids)
            request.grammar = self.structured_backend().request_grammar(
                params.structured_outputs, tuple(dict.fromkeys(stops)), self._decode_kept)
        # kv_policy: a PolicyConfig overriding the engine's default for this request
        self.policies.attach(request, kv_policy)
        return request

    def _decode_kept(self, token_ids: list[int]) -> str:
        """Token ids' text with special tokens kept (a grammar's starts_after; engine thread)."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def new_request_id(self) -> str:
        """An id no request of this engine was given by default."""
        return str(next(self._ids))

    def add_request(self, prompt: str | list[int] | dict, params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: str | None = None,
                    kv_policy=None, priority: int = 0,
                    lora_request: LoRARequest | None = None) -> str:
        request = self.make_request(prompt, params, request_id, cache_salt, kv_policy,
                                    priority=priority, lora_request=lora_request)
        self.scheduler.add_request(request)
        return request.request_id

    def add_prepared(self, request: Request) -> str:
        self.scheduler.add_request(request)
        return request.request_id

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check a LoRA adapter ahead of its requests (vLLM's); ValueError if bad."""
        if self.lora is None:
            raise ValueError("add_lora needs an engine started with enable_lora=True")
        self.lora.register(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unregister a LoRA adapter (vLLM's): its name may name another id then; requests
        already queued under it still run with it. False if it was not registered."""
        return self.lora is not None and self.lora.remove(lora_int_id)

    def list_loras(self) -> set[int]:
        """The ids of the registered LoRA adapters (vLLM's)."""
        return set() if self.lora is None else set(self.lora.list_loras())

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.abort(request_id)
        return None if request is None else self._output(request, [])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        running = self.scheduler.running  # pool pressure frees blocks, never running requests
        try:
            self.policies.relieve_pressure(running, self.scheduler.blocks_to_admit)
            failed = []
        except Exception as e:  # noqa: BLE001 - the requests it was evicting from fail, not all
            failed = self._fail(self.policies.pressure_candidates(running), e)
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return [self._output(request, []) for request in failed]
        try:
            if self.drafter is not None:
                drafts = self.drafter.propose(sched, self.scheduler.requests)
                for s in sched.scheduled:
                    if s.request_id in drafts:
                        self.scheduler.fill_drafts(s, drafts[s.request_id])
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
        stepped = self.scheduler.policy_order(sched)
        progressed = self.scheduler.update_from_output(sched, runner_out)
        for request, error in self.policies.after_step(stepped):
            failed += self._fail([request], error)
        # each failed request's final output (one that sampled this step: in the loop below)
        outputs = []
        if failed:
            sampled = {request.request_id for request in progressed}
            outputs = [self._output(request, []) for request in failed
                       if request.request_id not in sampled]
        for request in progressed:
            first = before[request.request_id]
            stop = self._update_text(request, first)
            if stop is not None and not request.is_finished:
                request.stop_reason = stop
                self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
            elif stop is not None and request.status in (RequestStatus.FINISHED_LENGTH,
                                                         RequestStatus.FINISHED_STOPPED):
                # its last token (the last allowed, or a stop token kept in the text) completed
                request.stop_reason = stop  # a stop string: as vLLM,
                request.status = RequestStatus.FINISHED_STOPPED  # the stop string wins
            new = request.output_token_ids[first:]
            logprobs = None
            if request.request_id in runner_out.logprobs and new:
                logprobs = [runner_out.logprobs[request.request_id],
                            *runner_out.draft_logprobs.get(request.request_id, [])][:len(new)]
                request.output_logprobs += logprobs
            outputs.append(self._output(request, new, logprobs))
        return outputs

    def _update_text(self, request: Request, first: int) -> str | None:
        """`update_text` of the step's new tokens (from output `first` on); several (accepted
        speculative drafts) with stop strings go one at a time, so a stop string ends the
        output at the token that completes it (those after it dropped), as decoding them one
        a step does."""
        tokens = request.output_token_ids
        if len(tokens) - first < 2 or not request.params.stop:
            return update_text(request, self.tokenizer)
        for end in range(first + 1, len(tokens)):
            stop = update_text(request, self.tokenizer, end)
            if stop is not None:
                request.num_computed_tokens -= len(tokens) - end  # not outputs, nor computed
                del tokens[end:]
                return stop
        return update_text(request, self.tokenizer)

    def _fail(self, requests: list[Request], error: Exception) -> list[Request]:
        """Abort requests a KV policy failed on (their caches may be half compacted: the blocks
        are freed and their hashes forgotten); each output carries the error. The engine goes
        on with the others."""
        failed = [r for r in requests if not r.is_finished]
        for request in failed:
            logger.error("KV policy failed on request %s", request.request_id, exc_info=error)
            request.error = f"KV policy failed: {type(error).__name__}: {error}"
            self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED, drop_cache=True)
        return failed

    def _output(self, request: Request, new_token_ids: list[int],
                new_logprobs: list | None = None) -> RequestOutput:
        finished = request.is_finished
        reason = request.status.value if finished else None
        return RequestOutput(
            request_id=request.request_id, prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[CompletionOutput(request.text, list(request.output_token_ids), reason,
                                      request.stop_reason,
                                      list(request.output_logprobs)
                                      if request.params.logprobs is not None else None)],
            finished=finished, num_cached_tokens=max(0, request.num_cached_tokens),
            metrics=request.metrics, new_token_ids=new_token_ids, new_logprobs=new_logprobs,
            prompt_logits=_prompt_logits(request) if finished else None,
            prompt_logprobs=_prompt_logprobs(request),
            kv_blocks_at_finish=request.final_kv_blocks,
            kv_slots_at_finish=request.final_kv_slots,
            logical_tokens_at_finish=request.num_computed_tokens if finished else 0,
            error=request.error)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do in one process); idempotent."""
        if self.executor is not None:
            self.executor.close()

    # ---- observability -------------------------------------------------------------------------
    def stats(self):
        return self.scheduler.stats()

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()
