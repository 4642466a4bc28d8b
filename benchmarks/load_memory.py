#!/usr/bin/env python
"""Memory to load and run a model: nanokv's float weights, its weight-only int8, transformers.

Each setting runs in a process of its own: it loads the model, then generates 8 tokens after a
16-token prompt (nanokv: `LLM(...).generate` with a 64 MiB KV pool; transformers:
`generate`), while a thread samples the process's memory every 2 ms from /proc/self/status:

- `peak_anon_gib`: the largest anonymous resident memory (RssAnon) while loading: the weights
  and whatever the loader holds beside them (memory the system cannot drop);
- `run_rss_gib`: all resident memory (VmRSS) after the run: the weights as they are used,
  anonymous or mapped from the checkpoint's files (transformers maps a checkpoint saved in the
  model's dtype instead of copying it: its weights are file pages, resident once read);
- `peak_rss_gib`: the largest VmRSS, loading and running: with the checkpoint's mapped pages
  the loader read (nanokv copies each tensor out of them; the system may drop them);
- `load_s`: the load's seconds (nanokv: the engine's start, its profiling run included).

    python benchmarks/load_memory.py /tmp/qwen3-1.7b-std08 --settings float32 int8 hf

One JSON line per setting, memory in GiB above the process's own before loading. Another
tree's nanokv is measured with PYTHONPATH pointing at it (the command is the same).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

SETTINGS = ("float32", "int8", "hf")  # nanokv float32, nanokv int8 weights, transformers
PROMPT, NEW_TOKENS = list(range(100, 116)), 8


def status_kib(field: str) -> int:
    """nanokv.worker.cpu_memory.proc_status_kib, kept here: the nanokv this measures may be
    another checkout's (PYTHONPATH), one from before that function."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure(model: str, setting: str) -> dict:
    """Load and run `model` as `setting` in this process; the memory it took."""
    import torch

    torch.set_num_threads(1)
    base_anon, base_rss = status_kib("RssAnon"), status_kib("VmRSS")  # libraries, no weight
    peak, loading, done = [base_anon, base_rss], threading.Event(), threading.Event()
    loading.set()

    def sample() -> None:  # (VmHWM, the kernel's own peak, is updated lazily: not used)
        while not done.is_set():
            if loading.is_set():
                peak[0] = max(peak[0], status_kib("RssAnon"))
            peak[1] = max(peak[1], status_kib("VmRSS"))
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    if setting == "hf":
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        note, load_s = "transformers, float32", time.perf_counter() - t0
        loading.clear()
        with torch.inference_mode():
            hf.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False)
    else:
        from nanokv import LLM, SamplingParams

        llm = LLM(model, skip_tokenizer_init=True, max_model_len=256, kv_cache_memory="64MiB",
                  quantization="int8" if setting == "int8" else None)
        note, load_s = llm.engine.startup_lines[0], time.perf_counter() - t0
        loading.clear()
        llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                              ignore_eos=True), use_tqdm=False)
    done.set()
    sampler.join()
    gib = 1 / 2**20
    return {"model": model, "setting": setting, "load_s": round(load_s, 2),
            "peak_anon_gib": round((peak[0] - base_anon) * gib, 3),
            "run_rss_gib": round((status_kib("VmRSS") - base_rss) * gib, 3),
            "peak_rss_gib": round((peak[1] - base_rss) * gib, 3), "note": note}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a local Hugging Face checkpoint directory")
    ap.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS),
                    help="each in its own process: nanokv float32, nanokv int8 weights, "
                    "transformers float32 (default: all three)")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child process
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.model, args.settings[0])), flush=True)
        return
    for setting in args.settings:
        out = subprocess.run([sys.executable, __file__, args.model, "--settings", setting,
                              "--one"], capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"{setting}: the run failed:\n{out.stderr}")
        print(out.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
