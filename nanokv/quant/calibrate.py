"""Offline KVQuant calibration on a Hugging Face model (float32, transformers).

1. Run calibration sequences with the LM loss; forward hooks capture each layer's pre-RoPE keys
   (the k_proj output, or k_norm's for Qwen3) and values (v_proj), backward hooks their
   gradients: Fisher information F = grad ** 2 per element.
2. Key outlier thresholds per channel: the fraction / 2 and 1 - fraction / 2 quantiles over all
   calibration tokens (sinks excluded).
3. Per-layer codebooks for keys and values at each width (2, 3, 4 bits): Fisher-weighted k-means
   on the values normalised exactly as the store normalises them (blocks of `block_size` tokens,
   keys per channel, values per token, outliers and sinks left out).
4. Each precision candidate measured on held-out windows other than the calibration's, then the
   precision rule (nanokv/quant/precision_rule.py: the cheapest candidate within a relative
   perplexity bound and, optionally, a KL bound). `measure`: "engine" runs the nanokv engine with
   the candidate's real store in the decode-like protocol (nanokv/quant/engine_measure.py);
   "simulated" is the fast estimate: K/V quantized and dequantized inside the Hugging Face model
   by hooks (`fake_quantize_sequence`, the store's own code), every position of a window in one
   forward pass, so each token also reads its own block quantized; "both" decides on the engine's
   numbers and records the simulated estimate beside each.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from nanokv.quant.calibration_file import Calibration, Candidate
from nanokv.quant.codebook import fisher_kmeans
from nanokv.quant.engine_measure import EngineMeasure, check_chunk_size
from nanokv.quant.kvquant import KVQUANT_BITS, normalized_values
from nanokv.quant.precision_rule import (Acceptance, Measurement, check_max_kl,
                                         check_max_ppl_increase, choose_precision, make_trial)
from nanokv.quant.scoring import ScoredWindows, check_context_fraction
from nanokv.quant.simulated_measure import SimulatedMeasure, as_heads, kv_heads, kv_modules

MEASURES = ("engine", "simulated", "both")


@dataclass
class CalibrationSettings:
    candidate_bits: tuple[int, ...] = (4,)  # 4 bits first: KVQuant's quality point
    codebook_bits: tuple[int, ...] = (2, 3, 4)
    block_size: int = 128
    outlier_fraction: float = 0.01
    num_sink_tokens: int = 1
    per_channel_keys: bool = True
    nuq: bool = True
    max_ppl_increase: float = 3.0  # percent of the baseline perplexity
    max_kl: float | None = None  # nats per scored token; None: no KL bound
    measure: str = "engine"  # engine | simulated | both (decided on the engine's)
    chunk_size: int = 32  # engine measure: tokens per prefill step
    context_fraction: float = 0.75  # of each evaluation window: context before scored tokens
    kmeans_iters: int = 50
    max_kmeans_samples: int = 1_000_000
    seed: int = 0

    def __post_init__(self) -> None:
        self.candidate_bits = tuple(self.candidate_bits)
        self.codebook_bits = tuple(self.codebook_bits)
        for name in ("candidate_bits", "codebook_bits"):
            bits = getattr(self, name)
            if not bits or any(b not in KVQUANT_BITS for b in bits):
                raise ValueError(f"{name} must be widths in {list(KVQUANT_BITS)}, got {bits}")
        if self.nuq and not set(self.candidate_bits) <= set(self.codebook_bits):
            raise ValueError("with nuq every candidate width needs a codebook width")
        if self.block_size < 1 or self.kmeans_iters < 1 or self.num_sink_tokens < 0:
            raise ValueError("block_size and kmeans_iters must be >= 1, num_sink_tokens >= 0")
        if not 0 <= self.outlier_fraction <= 0.2:
            raise ValueError(f"outlier_fraction must be in [0, 0.2], got {self.outlier_fraction}")
        check_max_ppl_increase(self.max_ppl_increase)
        check_max_kl(self.max_kl)
        if self.measure not in MEASURES:
            raise ValueError(f"measure must be one of {list(MEASURES)}, got {self.measure!r}")
        check_chunk_size(self.chunk_size)
        check_context_fraction(self.context_fraction)

    @property
    def acceptance(self) -> Acceptance:
        return Acceptance(self.max_ppl_increase, self.max_kl)


def collect_activations(model, ids: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """Per layer: 'key', 'value' [N, S, H, D] and their Fisher 'key_fisher', 'value_fisher'."""
    heads, dim = kv_heads(model)
    mods = kv_modules(model)
    acts = [{"key": [], "value": [], "key_fisher": [], "value_fisher": []} for _ in mods]
    handles = []

    def capture(layer: int, kind: str):
        def hook(_module, _inputs, output):
            acts[layer][kind].append(as_heads(output.detach(), heads, dim).cpu())
            output.register_hook(lambda g: acts[layer][kind + "_fisher"].append(
                as_heads(g.detach().float() ** 2, heads, dim).cpu()))
        return hook

    for layer, (k_mod, v_mod) in enumerate(mods):
        handles.append(k_mod.register_forward_hook(capture(layer, "key")))
        handles.append(v_mod.register_forward_hook(capture(layer, "value")))
    handles.append(model.get_input_embeddings().register_forward_hook(
        lambda _m, _i, out: out.requires_grad_(True)))
    grads = [p.requires_grad for p in model.parameters()]
    model.requires_grad_(False)
    try:
        with torch.enable_grad():
            for row in ids:
                x = row.unsqueeze(0)
                model(input_ids=x, labels=x).loss.backward()
    finally:
        for h in handles:
            h.remove()
        for p, g in zip(model.parameters(), grads):
            p.requires_grad_(g)
    return [{k: torch.cat(v) for k, v in layer.items()} for layer in acts]


def key_thresholds(acts: list[dict], fraction: float, num_sink_tokens: int) -> torch.Tensor:
    """Per-channel (lower, upper) key quantiles -> [L, 2, H, D]."""
    out = []
    for layer in acts:
        keys = layer["key"][:, num_sink_tokens:].flatten(0, 1).float()  # [tokens, H, D]
        ordered, _ = keys.sort(dim=0)
        n = ordered.shape[0]
        lo = ordered[min(n - 1, math.floor(fraction / 2 * (n - 1)))]
        hi = ordered[max(0, math.ceil((1 - fraction / 2) * (n - 1)))]
        out.append(torch.stack([lo, hi]))
    return torch.stack(out)


def _blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """[N, S, H, D] -> full blocks [N * (S // B), B, H, D]."""
    _, s, h, d = x.shape
    full = s // block_size * block_size
    return x[:, :full].reshape(-1, block_size, h, d)


def learn_codebooks(acts: list[dict], thresholds: torch.Tensor | None,
                    settings: CalibrationSettings) -> dict[int, tuple[tuple, tuple]]:
    """bits -> (key codebooks, value codebooks), one tuple of centroids per layer."""
    bsz, n_sink = settings.block_size, settings.num_sink_tokens
    seq_len = acts[0]["key"].shape[1]
    if seq_len < bsz:
        raise ValueError(f"calibration sequences ({seq_len} tokens) are shorter than one block "
                         f"({bsz}): raise seq_len or lower block_size")
    pos = torch.arange(seq_len // bsz * bsz).view(-1, bsz)
    samples = {"key": [], "value": []}
    for layer, a in enumerate(acts):
        for kind in ("key", "value"):
            x = _blocks(a[kind], bsz)
            valid = (pos >= n_sink).repeat(x.shape[0] // pos.shape[0], 1)
            per_channel = settings.per_channel_keys and kind == "key"
            thr = thresholds[layer] if (thresholds is not None and per_channel) else None
            xn, mask = normalized_values(x, valid, per_channel=per_channel,
                                         outlier_fraction=settings.outlier_fraction,
                                         thresholds=thr)
            samples[kind].append((xn[mask], _blocks(a[kind + "_fisher"], bsz)[mask]))
    books = {}
    for bits in settings.codebook_bits:
        books[bits] = tuple(
            tuple(tuple(fisher_kmeans(xs, ws, 2 ** bits, settings.kmeans_iters,
                                      settings.max_kmeans_samples, settings.seed).tolist())
                  for xs, ws in samples[kind])
            for kind in ("key", "value"))
    return books


def fit(model, calib_ids: torch.Tensor, settings: CalibrationSettings, model_path: str = "",
        text_name: str = "", eval_tokens: int = 0,
        log: Callable[[str], None] = lambda s: None) -> Calibration:
    """Steps 1-3: thresholds and codebooks from calib_ids [N, S]; no decision yet."""
    heads, dim = kv_heads(model)
    log(f"collecting activations and Fisher information on {calib_ids.numel()} tokens")
    acts = collect_activations(model, calib_ids)
    thresholds = None
    if settings.outlier_fraction > 0 and settings.per_channel_keys:
        thresholds = key_thresholds(acts, settings.outlier_fraction, settings.num_sink_tokens)
    log(f"learning codebooks for {list(settings.codebook_bits)} bits")
    books = learn_codebooks(acts, thresholds, settings) if settings.nuq else {}
    del acts
    saved = asdict(settings)
    saved.update(candidate_bits=list(settings.candidate_bits),
                 codebook_bits=list(settings.codebook_bits), calib_tokens=calib_ids.numel(),
                 eval_tokens=eval_tokens, text=text_name)
    return Calibration(model_path, len(kv_modules(model)), heads, dim, saved, books, thresholds,
                       math.nan)


def calibrate(model, calib_ids: torch.Tensor, eval_windows, settings: CalibrationSettings |
              None = None, model_path: str = "", text_name: str = "",
              engine_options: dict | None = None, log: Callable[[str], None] = lambda s: None,
              on_window: Callable[[], None] = lambda: None) -> Calibration:
    """Calibrate `model` (HF, float32, eval mode) on calib_ids [N, S]; decide on eval_windows
    (token lists of one length, other tokens than the calibration's). `model_path`: the model
    directory the engine measure starts its engines from; `engine_options`: passed to them
    (nanokv/quant/engine_measure.py sets the ones the protocol needs)."""
    settings = settings or CalibrationSettings()
    windows = ScoredWindows.of(eval_windows, settings.context_fraction)
    calib = fit(model, calib_ids, settings, model_path, text_name,
                len(windows.windows) * windows.length, log)
    calib.settings.update(eval_windows=len(windows.windows), eval_seq_len=windows.length)
    simulated = SimulatedMeasure(model, calib, settings, windows, on_window)
    measure = simulated
    if settings.measure != "simulated":
        if not model_path:
            raise ValueError("the engine measure needs model_path (the model directory)")
        measure = EngineMeasure(model_path, calib, windows, settings.chunk_size, engine_options,
                                on_window)

    def evaluate(candidate: Candidate) -> Measurement:
        m = measure(candidate)
        log(f"{settings.measure if settings.measure != 'both' else 'engine'}: perplexity "
            f"{m.perplexity:.4f} KL {m.kl:.5f}: {candidate}")
        return m

    decision, trials, base = choose_precision(evaluate, calib.num_layers,
                                              settings.candidate_bits, settings.acceptance)
    if settings.measure == "both":
        sim_base = simulated(Candidate("auto")).perplexity
        for t in trials:
            t.simulated = make_trial(t.candidate, simulated(t.candidate), sim_base)
            log(f"simulated: perplexity {t.simulated.perplexity:.4f} KL "
                f"{t.simulated.kl:.5f}: {t.candidate}")
    calib.baseline_perplexity, calib.trials, calib.decision = base, trials, decision
    return calib
