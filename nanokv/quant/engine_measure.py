"""Measure KV precision candidates through the engine's own store (`nanokv calibrate --measure
engine`, the default).

One nanokv engine per candidate (`LLM(model, kv_cache_dtype=..., kv_quant_config=...)`): the
full-precision float pool, int8, or kvquant with the calibration's codebooks and thresholds at the
candidate's widths (a calibration file whose decision is the candidate, written to a temporary
directory). Protocol, decode-like: each held-out window is one request whose prompt is prefilled
in chunks of `chunk_size` tokens (the engine's max_num_batched_tokens), one window at a time, so
every chunk reads all earlier chunks back from the candidate's store as decoding does: kvquant's
full blocks quantized, the partial block's keys in its full-precision staging, values and int8
quantized as written. The tokens of a chunk attend to each other with fresh K/V, so the smaller
the chunk, the closer to token-by-token decoding. The prompt's logits come back
(return_prompt_logits) and the scored part (nanokv/quant/scoring.py) gives perplexity, KL and
top-1 against the full-precision engine's distributions on the same tokens.

`nanokv eval --tasks perplexity,kl --max-num-batched-tokens CHUNK --context-fraction F` runs the
same protocol for one store (its prefill also stops a chunk at the context split, which is a chunk
boundary here too whenever the split is a multiple of the chunk size).
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from nanokv.quant.calibration_file import Calibration, Candidate, Decision
from nanokv.quant.precision_rule import Measurement
from nanokv.quant.scoring import ScoredWindows, log_probs, measurement

# engine options the measurement sets itself (the rest of the caller's pass through)
OWN_OPTIONS = frozenset({
    "block_size", "max_model_len", "max_num_batched_tokens", "enable_chunked_prefill",
    "skip_tokenizer_init", "kv_cache_dtype", "kv_quant_bits", "kv_quant_config", "kv_policy",
    "kv_budget", "kv_compression_ratio", "kv_policy_options"})


def check_chunk_size(value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"chunk_size (tokens per prefill step of the engine measurement) must "
                         f"be an integer >= 1, got {value!r}")


def candidate_file(calib: Calibration, candidate: Candidate, directory: str) -> str:
    """Write `calib` with the candidate as its decision (the widths the engine's kvquant store
    takes from a --kv-quant-config file) to directory/candidate.json; returns the path."""
    path = Path(directory) / "candidate.json"
    dataclasses.replace(calib, trials=[], decision=Decision(
        candidate, float("nan"), float("nan"), "candidate under measurement")).save(path)
    return str(path)


class EngineMeasure:
    """candidate -> Measurement, each measured on a fresh engine; the reference distributions
    are the full-precision engine's (measured first, on the first call)."""

    def __init__(self, model: str, calib: Calibration, windows: ScoredWindows,
                 chunk_size: int = 32, engine_options: dict | None = None,
                 on_window: Callable[[], None] = lambda: None) -> None:
        check_chunk_size(chunk_size)
        self.model, self.calib, self.windows = model, calib, windows
        self.chunk_size = chunk_size
        self.base_options = {k: v for k, v in (engine_options or {}).items()
                             if k not in OWN_OPTIONS and v is not None}
        self.on_window = on_window
        self.reference: list[torch.Tensor] | None = None

    def __call__(self, candidate: Candidate) -> Measurement:
        if self.reference is None:
            full = self.scored_logits(Candidate("auto"))
            self.reference = log_probs(full)
            if candidate == Candidate("auto"):
                return measurement(self.windows, full, self.reference)
        return measurement(self.windows, self.scored_logits(candidate), self.reference)

    def engine_options(self, candidate: Candidate, config_dir: str) -> dict:
        opts = {**self.base_options, "block_size": self.calib.settings["block_size"],
                "max_num_batched_tokens": self.chunk_size, "enable_chunked_prefill": True,
                "max_model_len": self.windows.length + 1, "skip_tokenizer_init": True,
                "kv_cache_dtype": candidate.kv_cache_dtype}
        if candidate.kv_cache_dtype == "kvquant":
            opts["kv_quant_config"] = candidate_file(self.calib, candidate, config_dir)
        return opts

    def scored_logits(self, candidate: Candidate) -> list[torch.Tensor]:
        """The scored rows of each window's prompt logits on the candidate's engine."""
        from nanokv import LLM, SamplingParams

        params = SamplingParams(temperature=0, max_tokens=1, return_prompt_logits=True)
        out = []
        with tempfile.TemporaryDirectory(prefix="nanokv-calibrate-") as config_dir:
            llm = LLM(self.model, **self.engine_options(candidate, config_dir))
            for window in self.windows.windows:  # one request at a time: the whole step budget
                (result,) = llm.generate([list(window)], params, use_tqdm=False)
                out.append(self.windows.scored_logits(result.prompt_logits).float())
                self.on_window()
            del llm
        return out
