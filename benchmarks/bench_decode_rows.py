"""Short prefill chunks after a cached past through the decode kernels ("decode rows",
`Scheduler._as_decode_rows`) or the prefill path: requests that share a cached prefix of
--context tokens, each adding --rows tokens of its own (n > 1 samples, beam search, a
conversation's next turn), one step of all of them, timed both ways in turn in one process.
Prints one JSON line: per (context, rows) the median step time of each path and their ratio
(the engine takes decode rows up to `DECODE_ROW_CHUNK`; here each size is timed both ways).

    .venv/bin/python benchmarks/bench_decode_rows.py --model /tmp/qwen3-0.6b-4l-random
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/nanokv-tiny")
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--requests", type=int, default=8, help="requests in the step")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    for name in ("requests", "repeats", "num_threads", "block_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.contexts) < 1 or min(args.rows) < 2:
        ap.error("--contexts must be >= 1 and --rows >= 2 (one row is a decode)")

    import torch

    import nanokv.scheduler.scheduler as scheduler_module
    from nanokv import LLM, SamplingParams

    torch.set_num_threads(args.num_threads)
    longest = max(args.contexts) + max(args.rows) + 1
    llm = LLM(args.model, num_threads=args.num_threads, block_size=args.block_size,
              max_model_len=-(-longest // 256) * 256, max_num_seqs=args.requests,
              max_num_batched_tokens=max(2048, args.requests * max(args.rows)))
    vocab = llm.engine.hf_config.vocab_size
    rng = random.Random(0)
    one = SamplingParams(max_tokens=1, temperature=0)
    limit = scheduler_module.DECODE_ROW_CHUNK
    rows_out = []
    for context in args.contexts:
        prefix = [rng.randrange(10, vocab) for _ in range(context)]
        llm.generate([prefix], one, use_tqdm=False)  # cached from here on
        for rows in args.rows:
            times = {"decode rows": [], "prefill": []}
            for _ in range(args.repeats):
                for path in times:  # in turn, each with suffixes of its own
                    # every chunk of this size as decode rows (whatever the engine's limit), or
                    # none
                    scheduler_module.DECODE_ROW_CHUNK = rows if path == "decode rows" else 0
                    prompts = [prefix + [rng.randrange(10, vocab) for _ in range(rows)]
                               for _ in range(args.requests)]
                    requests = [llm.engine.make_request(p, one) for p in prompts]
                    for r in requests:
                        llm.engine.add_prepared(r)
                    start = time.perf_counter()
                    while llm.engine.has_unfinished_requests():
                        llm.engine.step()
                    times[path].append(time.perf_counter() - start)
            scheduler_module.DECODE_ROW_CHUNK = limit
            medians = {k: statistics.median(v) for k, v in times.items()}
            rows_out.append({"context": context, "rows": rows, "median_s": medians,
                             "decode_rows_over_prefill": medians["decode rows"]
                             / medians["prefill"]})
    print(json.dumps({"model": args.model, "requests": args.requests,
                      "num_threads": args.num_threads, "block_size": args.block_size,
                      "engine_decode_row_chunk": limit, "results": rows_out}))


if __name__ == "__main__":
    main()
