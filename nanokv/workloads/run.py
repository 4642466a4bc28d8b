"""`nanokv bench`: the engine on the shared random workload, with per-request latencies."""

from __future__ import annotations

import sys
import time

from tqdm.auto import tqdm

from nanokv.workloads.workload import BenchResult, make_workload, summarize


def run_bench(model: str, options: dict, num_requests: int, prompt_len: tuple[int, int],
              output_len: tuple[int, int], seed: int, verbose: bool = True,
              temperature: float = 0.0, progress: bool = True,
              on_engine_ready=None) -> BenchResult:
    """on_engine_ready(engine): called after the warm-up, before the timed run (e.g. to attach
    a `nanokv.sim.step_model.StepRecorder`)."""
    from nanokv import LLM, SamplingParams

    SamplingParams(temperature=temperature)  # validate before the model loads
    options = {**options, "skip_tokenizer_init": True}
    llm = LLM(model, **options)
    engine = llm.engine
    if verbose:
        for line in engine.startup_lines:
            print(f"[nanokv] {line}", file=sys.stderr)
    workload = make_workload(num_requests, prompt_len, output_len,
                             engine.hf_config.vocab_size, seed)
    # warm-up (not timed): one short request
    llm.generate([workload[0].prompt_token_ids[:16]],
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    engine.block_manager.reset_prefix_cache()
    if on_engine_ready is not None:
        on_engine_ready(engine)

    requests = [engine.make_request(r.prompt_token_ids,
                                    SamplingParams(temperature=temperature,
                                                   max_tokens=r.output_len, ignore_eos=True))
                for r in workload]
    peak = peak_running = 0
    preemptions_before = engine.scheduler.num_preemptions
    spec = engine.scheduler.spec_stats
    spec_before = spec.copy() if spec is not None else None
    bar = tqdm(total=len(requests), desc="bench", unit="req", dynamic_ncols=True,
               disable=not progress)
    output_tokens = 0
    t0 = time.perf_counter()
    for request in requests:
        engine.add_prepared(request)
    while engine.has_unfinished_requests():
        outs = engine.step()
        peak = max(peak, engine.block_manager.num_used_blocks)
        peak_running = max(peak_running, len(engine.scheduler.running))
        if progress:
            output_tokens += sum(len(o.new_token_ids or ()) for o in outs)
            bar.set_postfix_str(f"output {output_tokens / (time.perf_counter() - t0):.1f} "
                                f"tok/s, KV blocks {peak}", refresh=False)
            bar.update(sum(o.finished for o in outs))
    elapsed = time.perf_counter() - t0
    bar.close()
    ttfts = [r.metrics.ttft for r in requests]
    tpots = [r.metrics.tpot(r.num_output_tokens) for r in requests]
    return summarize("nanokv", workload, elapsed, ttfts, [t for t in tpots if t is not None],
                     peak_kv_blocks=peak, peak_running=peak_running,
                     num_preemptions=engine.scheduler.num_preemptions - preemptions_before,
                     spec_acceptance_rate=spec.since(spec_before).acceptance_rate
                     if spec is not None else None)
