"""Host-side cost of one step on CPU: building the step's inputs (ids, positions, slot mapping,
block tables, the backend's metadata) and sampling, for the nano-vLLM benchmark's shapes.

Runs against whichever nanokv is first on PYTHONPATH, so an older checkout can be timed by the
same script (`--label`):

    git archive <commit> | tar -x -C /tmp/before
    PYTHONPATH=/tmp/before python benchmarks/bench_host_step.py --label before
    PYTHONPATH=. python benchmarks/bench_host_step.py --label after

Prints one JSON line of median milliseconds per case:
  decode_inputs   256 decodes, contexts 100-2048, block size 256 (the engine's auto size)
  prefill_inputs  16 prefill chunks of 1024 tokens (16384 batched tokens)
  sample_greedy   256 greedy rows of a 151,936-token vocabulary
  sample_mixed    256 rows: a quarter greedy, the rest tempered with top-k / top-p / min-p,
                  half of them seeded
  sample_top_p    256 rows all at temperature 0.6 with top-p 0.95 (one setting for everyone)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from nanokv.attention.torch_paged import TorchPagedBackend
from nanokv.cache.kv_pool import KVLayout, KVPool
from nanokv.layers.sampler import Sampler
from nanokv.sampling_params import SamplingParams
from nanokv.scheduler.output import ScheduledRequest, SchedulerOutput
from nanokv.worker.model_runner import ModelRunner

BLOCK, NUM_BLOCKS, VOCAB = 256, 4096, 151936


def decode_step(rng: random.Random) -> SchedulerOutput:
    out = []
    for i in range(256):
        context = rng.randrange(100, 2048)
        table = rng.sample(range(NUM_BLOCKS), context // BLOCK + 1)
        out.append(ScheduledRequest(f"d{i}", [rng.randrange(VOCAB)], context, context, table,
                                    True, SamplingParams(temperature=0), 1))
    return SchedulerOutput(out)


def prefill_step(rng: random.Random) -> SchedulerOutput:
    out = []
    for i in range(16):
        start = rng.choice([0, 1024])
        table = rng.sample(range(NUM_BLOCKS), (start + 1024) // BLOCK)
        out.append(ScheduledRequest(f"p{i}", [rng.randrange(VOCAB) for _ in range(1024)],
                                    start, start, table, True, SamplingParams(temperature=0), 0))
    return SchedulerOutput(out)


def prepare(runner: ModelRunner, sched: SchedulerOutput) -> None:
    """The step's inputs and the backend's metadata, in whichever form this checkout has."""
    if hasattr(runner, "inputs"):
        inputs = runner.inputs(sched)
        runner.backend.build(inputs.common)
    else:
        runner.prepare(sched)


def median_ms(fn, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e3, 3)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rng = random.Random(0)
    layout = KVLayout(2, 1, 8, BLOCK, torch.float32)  # the pool's size does not matter here
    pool = KVPool(layout, NUM_BLOCKS, "cpu")
    runner = ModelRunner(None, pool, TorchPagedBackend(pool, torch.device("cpu")),
                         torch.device("cpu"), 0)
    decode, prefill = decode_step(rng), prefill_step(rng)
    torch.manual_seed(0)
    logits = torch.randn(256, VOCAB)  # [N, vocab]
    greedy = [SamplingParams(temperature=0)] * 256
    mixed = []
    for i in range(256):
        if i % 4 == 0:
            mixed.append(SamplingParams(temperature=0))
        else:
            mixed.append(SamplingParams(temperature=0.8, top_k=rng.choice([-1, 50]),
                                        top_p=rng.choice([1.0, 0.9]),
                                        min_p=rng.choice([0.0, 0.05]),
                                        seed=rng.choice([None, i])))
    top_p = [SamplingParams(temperature=0.6, top_p=0.95)] * 256
    indices = list(range(256))
    sampler = Sampler(0)
    result = {"label": args.label,
              "decode_inputs": median_ms(lambda: prepare(runner, decode), args.repeats),
              "prefill_inputs": median_ms(lambda: prepare(runner, prefill), args.repeats),
              "sample_greedy": median_ms(lambda: sampler(logits, greedy, indices),
                                         args.repeats),
              "sample_mixed": median_ms(lambda: sampler(logits, mixed, indices),
                                        max(3, args.repeats // 3)),
              "sample_top_p": median_ms(lambda: sampler(logits, top_p, indices),
                                        max(3, args.repeats // 3))}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
