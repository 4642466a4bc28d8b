"""Ranks 1..N-1 of a tensor-parallel engine: a loop over the commands rank 0 sends.

Each rank loads its shard of the model, allocates the KV cache of its KV heads, and then, per
command, applies rank 0's KV operations and runs the command (a step through its own
`ModelRunner`, a profile forward, a policy view gathered on rank 0, a policy plan written).
It samples nothing and holds no scheduler. It ends on `Stop`, when rank 0's pipe closes (rank 0
is gone), or on an error, which it reports on the pipe before exiting (rank 0's next collective
then fails at once and raises with the report).
"""

from __future__ import annotations

import os
import pickle
import signal
import traceback

import torch

from nanokv.distributed import messages as msg
from nanokv.distributed.parallel_state import TensorParallel, init_rank, leave_group


class RankWorker:
    def __init__(self, config, tp: TensorParallel) -> None:
        from nanokv.worker.cpu_memory import request_huge_pages, tune_glibc_malloc
        from nanokv.worker.loader import load_model, resolve_device

        self.config = config
        self.tp = tp
        if resolve_device(config.device).type == "cpu":  # before the weights (cpu_memory.py)
            request_huge_pages()
        loaded = load_model(config.model, config.dtype, config.device,
                            skip_tokenizer_init=True, max_positions=config.max_model_len,
                            linear_backend=config.linear_backend, tp=tp,
                            quantization=config.quantization)
        self.model, self.device, self.dtype = loaded.model, loaded.device, loaded.dtype
        if self.device.type == "cpu":
            tune_glibc_malloc()
        self.kv_cache = None
        self.runner = None
        self.held = None  # (RequestRef, KVView) of the last GatherView

    def run(self, command: msg.Command) -> None:
        for op in command.kv_ops:
            getattr(self.kv_cache, op.method)(op.args)
        if isinstance(command, msg.Step):
            self.runner.execute(command.sched)
        elif isinstance(command, msg.GatherView):
            self.held = (command.request, self.kv_cache.policy_view(command.request))
        elif isinstance(command, msg.GatherLayer):
            _, view = self.held
            self.tp.gather(torch.stack(view.blocks(command.layer, command.indexes)), dim=3)
        elif isinstance(command, msg.ApplyPlan):
            ref, view = self.held
            self.held = None
            ref.block_table[:] = command.block_table  # a live view (the float pool) sees it
            self.kv_cache.apply_plan(ref, command.plan, view)
        elif isinstance(command, msg.Profile):
            from nanokv.worker.profiler import measure_activation_bytes

            measure_activation_bytes(self.model, command.num_tokens, self.device)
        elif isinstance(command, msg.BuildCache):
            self.build_cache(command)
        else:
            raise RuntimeError(f"unknown command {type(command).__name__}")

    def build_cache(self, command: msg.BuildCache) -> None:
        from nanokv.attention.selector import select_backend
        from nanokv.cache.layout import KVLayout
        from nanokv.cache.registry import kv_cache_class
        from nanokv.utils import head_dim_of
        from nanokv.worker.model_runner import ModelRunner

        cfg = self.model.config
        layout = KVLayout(cfg.num_hidden_layers, cfg.num_key_value_heads // self.tp.size,
                          head_dim_of(cfg), self.config.block_size, self.dtype,
                          tuple(command.sliding_windows))
        kind = kv_cache_class(command.kv_cache_dtype)
        settings = kind.shard_settings(command.settings, self.tp.rank, self.tp.size)
        self.kv_cache = kind.create(layout, command.num_blocks, self.device, settings,
                                    rotary=self.model.rotary)
        soft_cap = self.model.logits_soft_cap
        backend_class, _ = select_backend(command.attention_backend, self.kv_cache, self.device,
                                          soft_cap)
        backend = backend_class(self.kv_cache, self.device, soft_cap)
        self.runner = ModelRunner(self.model, self.kv_cache, backend, self.device,
                                  self.config.seed, tp=self.tp)


def worker_main(rank: int, size: int, config, store_path: str, device_type: str,
                threads: int | None, conn) -> None:
    """The process target (spawn). Replies on `conn`: ("joining" | "loaded" | "ready", rank), or
    ("error", rank, traceback)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the group stops
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        torch.manual_seed(config.seed)
        conn.send(("joining", rank))
        tp = init_rank(rank, size, store_path, device_type)
        worker = RankWorker(config, tp)
        conn.send(("loaded", rank))
        with torch.inference_mode():
            while True:
                try:
                    command = pickle.loads(conn.recv_bytes())
                except EOFError:  # rank 0 is gone
                    break
                if isinstance(command, msg.Stop):
                    break
                worker.run(command)
                if isinstance(command, msg.BuildCache):
                    conn.send(("ready", rank))
    except BaseException:
        try:
            conn.send(("error", rank, traceback.format_exc()))
        except OSError:
            pass
        os._exit(1)
    leave_group()
