"""Rank 0's end of a tensor-parallel group: starts ranks 1..N-1, sends them every command, and
turns a lost rank into an error instead of a hang.

    executor = TensorParallelExecutor(config)   # spawns the ranks; rank 0 joins the group
    load_model(..., tp=executor.tp)             # every rank loads its shard at the same time
    executor.wait_until_loaded()
    executor.profile(num_tokens)                # then rank 0's own profile forward
    kv = executor.build_caches(local_kv_cache, ...)   # -> ShardedKVCache for the block manager
    runner = executor.runner(local_model_runner)      # .execute(sched) on every rank

The ranks are processes started with `torch.multiprocessing`'s spawn context (as nano-vLLM
does): a script that builds a tensor-parallel engine needs an `if __name__ == "__main__":`
guard. Each rank reads commands from its own pipe; a rank that dies closes its pipe and its
sockets, so the next send or collective fails at once and `TensorParallelError` says which rank
died and how. A rank that is alive but stuck fails a collective after `COLLECTIVE_TIMEOUT_S`.
After an error the group is out of step: every later call raises the same error.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import signal
import tempfile
import time
import weakref

import torch

from nanokv.distributed.messages import BuildCache, Command, KVOp, Profile, Step, Stop
from nanokv.distributed.parallel_state import COLLECTIVE_TIMEOUT_S, init_rank, leave_group
from nanokv.distributed.worker_process import worker_main

logger = logging.getLogger("nanokv")


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died or failed; the engine cannot continue (start a new one)."""


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _stop_workers(workers: list, conns: list, tmpdir: str) -> None:
    """Finalizer (holds no reference to the executor): ask each rank to stop, then end it."""
    data = pickle.dumps(Stop())
    for conn in conns:
        with contextlib.suppress(OSError, ValueError):
            conn.send_bytes(data)
        with contextlib.suppress(OSError):
            conn.close()
    deadline = time.monotonic() + 5
    for proc in workers:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(1)
    leave_group()
    shutil.rmtree(tmpdir, ignore_errors=True)


class TensorParallelExecutor:
    def __init__(self, config) -> None:
        """Spawn ranks 1..N-1 of `config.tensor_parallel_size` and join the group as rank 0.
        `config` is resolved (block size, max_model_len) and checked (`support.py`)."""
        import torch.distributed as dist
        import torch.multiprocessing as mp

        from nanokv.worker.loader import resolve_device

        if dist.is_initialized():
            raise ValueError("this process already belongs to a torch.distributed group (another "
                             "tensor-parallel engine, or torchrun): one tensor-parallel engine "
                             "per process; close() the other engine first")
        self.size = config.tensor_parallel_size
        self.device_type = resolve_device(config.device).type
        self.threads = None
        if self.device_type == "cpu":  # the ranks share the host's cores
            self.threads = config.num_threads or max(1, _cpu_count() // self.size)
            torch.set_num_threads(self.threads)
        self._tmpdir = tempfile.mkdtemp(prefix="nanokv-tp-")
        store = os.path.join(self._tmpdir, "store")
        ctx = mp.get_context("spawn")
        self.workers, self.conns = [], []
        for rank in range(1, self.size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, name=f"nanokv-tp-rank{rank}", daemon=True,
                               args=(rank, self.size, config, store, self.device_type,
                                     self.threads, child))
            proc.start()
            child.close()  # the rank's end lives in the rank only: its death closes the pipe
            self.workers.append(proc)
            self.conns.append(parent)
        self._finalizer = weakref.finalize(self, _stop_workers, self.workers, self.conns,
                                           self._tmpdir)
        self._error: str | None = None
        self._pending: list[KVOp] = []
        self._wait_for("joining")  # a rank that fails to start is reported, not waited for
        self.tp = init_rank(0, self.size, store, self.device_type)

    # ---- sending -------------------------------------------------------------------------------
    def queue_kv_op(self, op: KVOp) -> None:
        """Repeat a KV cache call on every rank, before the next command runs there."""
        self._pending.append(op)

    def send(self, command: Command) -> None:
        self.send_each([command] * (self.size - 1))

    def send_each(self, commands: list[Command]) -> None:
        """commands[i] to rank i + 1, each with the KV operations queued since the last send."""
        self.check()
        ops, self._pending = self._pending, []
        try:
            for conn, command in zip(self.conns, commands, strict=True):
                command.kv_ops = ops
                conn.send_bytes(pickle.dumps(command))
        except (OSError, EOFError, ValueError) as e:
            raise self.lost(e) from e

    @contextlib.contextmanager
    def guard(self):
        """Around work with collectives: a failure there means the group is out of step."""
        self.check()
        try:
            yield
        except TensorParallelError:
            raise
        except Exception as e:
            raise self.lost(e) from e
        except BaseException as e:  # Ctrl-C: rank 0 left the step, the others wait in it
            self.lost(e)  # later calls say so; the interrupt itself goes on up
            raise

    def check(self) -> None:
        if self._error is not None:
            raise TensorParallelError(self._error)

    # ---- start-up ------------------------------------------------------------------------------
    def _wait_for(self, what: str, timeout: float = COLLECTIVE_TIMEOUT_S) -> None:
        """Each rank's `(what, rank)` message; raise when a rank reports an error or dies."""
        deadline = time.monotonic() + timeout
        for rank, (conn, proc) in enumerate(zip(self.conns, self.workers), start=1):
            while not conn.poll(0.05):
                if not proc.is_alive() or time.monotonic() > deadline:
                    raise self.lost(RuntimeError(f"rank {rank} sent no {what!r}"))
            try:
                message = conn.recv()
            except (EOFError, OSError) as e:
                raise self.lost(e) from e
            if message[0] != what:
                raise self.lost(RuntimeError(f"rank {rank}: {message[-1]}"), message=message)

    def wait_until_loaded(self) -> None:
        self._wait_for("loaded")

    def profile(self, num_tokens: int) -> None:
        """Make every other rank join rank 0's profile forward (before the pool is planned)."""
        self.send(Profile(num_tokens=num_tokens))

    def build_caches(self, local_kv_cache, kv_cache_dtype: str, settings: dict,
                     attention_backend: str):
        """Every other rank allocates its cache like rank 0's; the ShardedKVCache rank 0's
        block manager and KV policies use."""
        from nanokv.distributed.sharded_kv_cache import ShardedKVCache

        self.send(BuildCache(kv_cache_dtype=kv_cache_dtype, settings=settings,
                             num_blocks=local_kv_cache.num_blocks,
                             attention_backend=attention_backend,
                             sliding_windows=local_kv_cache.layout.sliding_windows))
        self._wait_for("ready")
        return ShardedKVCache(local_kv_cache, self)

    def runner(self, local_runner) -> TensorParallelRunner:
        return TensorParallelRunner(local_runner, self)

    def describe(self) -> str:
        backend = "nccl" if self.device_type == "cuda" else "gloo"
        threads = f", {self.threads} threads each" if self.threads else ""
        pids = ", ".join(str(p.pid) for p in self.workers)
        return (f"tensor parallel: {self.size} ranks over {backend} (rank 0 here, ranks 1.."
                f"{self.size - 1} pids {pids}){threads}; each holds 1/{self.size} of the heads, "
                f"the MLP and the vocabulary, and the KV cache of its KV heads (the KV cache "
                f"figures above are one rank's)")

    # ---- failure and shutdown ------------------------------------------------------------------
    def lost(self, cause: BaseException, message: tuple | None = None) -> TensorParallelError:
        """The group is broken: find out which rank went and how, stop the others, and return
        the error every later call raises."""
        if self._error is None:
            deadline = time.monotonic() + 2  # a dying rank's exit code may lag its sockets
            while time.monotonic() < deadline and all(p.is_alive() for p in self.workers):
                time.sleep(0.05)
            reports = [] if message is None else [message]
            for conn in self.conns:
                with contextlib.suppress(EOFError, OSError):
                    while conn.poll(0):
                        reports.append(conn.recv())
            dead = [(rank, p) for rank, p in enumerate(self.workers, start=1)
                    if not p.is_alive()]
            parts = [f"rank {rank} (pid {p.pid}) {_exit_text(p.exitcode)}" for rank, p in dead]
            parts += [f"rank {r[1]} failed:\n{r[2]}" for r in reports if r[0] == "error"]
            if parts:
                what = "; ".join(parts)
            elif not isinstance(cause, Exception):  # KeyboardInterrupt, SystemExit
                what = (f"rank 0 was interrupted ({type(cause).__name__}) in the middle of a "
                        f"step, so the ranks' collectives no longer pair up")
            else:
                what = f"rank 0 failed ({type(cause).__name__})"
            cause_text = f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
            self._error = (f"tensor-parallel group of {self.size} ranks lost: {what}; cause: "
                           f"{cause_text}. The engine cannot continue: start a new one")
            logger.error(self._error)
            self.close()
        return TensorParallelError(self._error)

    def close(self) -> None:
        """Stop every rank (idempotent); later calls raise."""
        if self._error is None:
            self._error = "the tensor-parallel engine was closed"
        self._finalizer()


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


class TensorParallelRunner:
    """Rank 0's model runner: sends each step to every rank, then runs its own share."""

    def __init__(self, local_runner, executor: TensorParallelExecutor) -> None:
        self.local = local_runner
        self.executor = executor

    @property
    def sampler(self):
        return self.local.sampler

    def execute(self, sched):
        with self.executor.guard():  # from the send on: an interrupt there breaks the step
            self.executor.send(Step(sched=sched))
            return self.local.execute(sched)
