"""Offline KVQuant calibration on a Hugging Face model (float32, transformers).

1. Run calibration sequences with the LM loss; forward hooks capture each layer's pre-RoPE keys
   (the k_proj output, or k_norm's for Qwen3) and values (v_proj), backward hooks their
   gradients: Fisher information F = grad ** 2 per element.
2. Key outlier thresholds per channel: the fraction / 2 and 1 - fraction / 2 quantiles over all
   calibration tokens (sinks excluded).
3. Per-layer codebooks for keys and values at each width (2, 3, 4 bits): Fisher-weighted k-means
   on the values normalised exactly as the store normalises them (blocks of `block_size` tokens,
   keys per channel, values per token, outliers and sinks left out).
4. Perplexity on separate evaluation sequences, the K/V quantized and dequantized inside the
   model by hooks (`fake_quantize_sequence`, the store's own code), then the precision rule
   (`choose_precision`; 4 bits first, more bits only where quality suffers, since 4 bits is
   where KVQuant's published quality holds and each step up costs memory): the lowest
   candidate width (default: 4 bits only) whose perplexity rises
   by at most `max_ppl_increase`; else per-layer mixed precision (the most sensitive layers at 8
   bits, one by one); else int8; else full precision.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from nanokv.quant.calibration_file import Calibration, Candidate, Decision, Trial
from nanokv.quant.codebook import fisher_kmeans
from nanokv.quant.codec import LayerCodec, fake_quantize_sequence
from nanokv.quant.int8 import dequantize_int8, quantize_int8
from nanokv.quant.kvquant import KVQUANT_BITS, SPARSE_DTYPES, normalized_values
from nanokv.utils import head_dim_of


@dataclass
class CalibrationSettings:
    candidate_bits: tuple[int, ...] = (4,)  # 4 bits first: KVQuant's quality point
    codebook_bits: tuple[int, ...] = (2, 3, 4)
    block_size: int = 128
    outlier_fraction: float = 0.01
    num_sink_tokens: int = 1
    per_channel_keys: bool = True
    nuq: bool = True
    max_ppl_increase: float = 0.2
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
        if self.max_ppl_increase < 0:
            raise ValueError("max_ppl_increase must be >= 0")


def kv_modules(model) -> list[tuple[torch.nn.Module, torch.nn.Module]]:
    """(module whose output is the cached pre-RoPE key, v_proj) per decoder layer."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: expected model.model.layers[i].self_attn")
    out = []
    for layer in layers:
        attn = layer.self_attn
        out.append((getattr(attn, "k_norm", None) or attn.k_proj, attn.v_proj))
    return out


def _heads(model) -> tuple[int, int]:
    cfg = model.config
    dim = head_dim_of(cfg)
    return cfg.num_key_value_heads, dim


def _as_heads(x: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    return x.reshape(x.shape[0], x.shape[1], heads, dim)  # [b, s, H, D]


def collect_activations(model, ids: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """Per layer: 'key', 'value' [N, S, H, D] and their Fisher 'key_fisher', 'value_fisher'."""
    heads, dim = _heads(model)
    mods = kv_modules(model)
    acts = [{"key": [], "value": [], "key_fisher": [], "value_fisher": []} for _ in mods]
    handles = []

    def capture(layer: int, kind: str):
        def hook(_module, _inputs, output):
            acts[layer][kind].append(_as_heads(output.detach(), heads, dim).cpu())
            output.register_hook(lambda g: acts[layer][kind + "_fisher"].append(
                _as_heads(g.detach().float() ** 2, heads, dim).cpu()))
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


def simulate(model, candidate: Candidate, calib: Calibration, settings: CalibrationSettings):
    """Install hooks that quantize-dequantize K (pre-RoPE) and V as the candidate stores them.
    Returns the hook handles (remove them when done)."""
    heads, dim = _heads(model)
    handles = []
    if candidate.kv_cache_dtype == "auto":
        return handles
    widths = candidate.layer_bits or (candidate.bits,) * calib.num_layers
    sparse = SPARSE_DTYPES["float16"]
    for layer, (k_mod, v_mod) in enumerate(kv_modules(model)):
        bits = widths[layer]
        if candidate.kv_cache_dtype == "int8":
            fn = _int8_fn
        elif bits is None:
            continue
        else:
            books = calib.codebooks.get(bits) if settings.nuq else None
            codec = LayerCodec(
                bits=bits, per_channel_keys=settings.per_channel_keys,
                outlier_fraction=settings.outlier_fraction, sparse_dtype=sparse,
                key_codebook=None if books is None else torch.tensor(books[0][layer]),
                value_codebook=None if books is None else torch.tensor(books[1][layer]),
                key_thresholds=None if calib.key_thresholds is None
                else calib.key_thresholds[layer])
            fn = _kvquant_fn(codec, settings)
        for kind, mod in (("key", k_mod), ("value", v_mod)):
            def hook(_m, _i, out, fn=fn, kind=kind):
                x = _as_heads(out, heads, dim)
                return fn(x.float(), kind).to(out.dtype).reshape(out.shape)
            handles.append(mod.register_forward_hook(hook))
    return handles


def _int8_fn(x: torch.Tensor, kind: str) -> torch.Tensor:
    return dequantize_int8(*quantize_int8(x))


def _kvquant_fn(codec: LayerCodec, settings: CalibrationSettings):
    def fn(x: torch.Tensor, kind: str) -> torch.Tensor:
        return fake_quantize_sequence(x, codec, kind, settings.block_size,
                                      settings.num_sink_tokens)
    return fn


@torch.no_grad()
def perplexity(model, ids: torch.Tensor) -> float:
    """exp(mean next-token NLL) over the rows of ids [N, S]."""
    total, count = 0.0, 0
    for row in ids:
        x = row.unsqueeze(0)
        n = x.shape[1] - 1
        total += float(model(input_ids=x, labels=x).loss) * n
        count += n
    return math.exp(total / max(1, count))


def choose_precision(evaluate: Callable[[Candidate], float], num_layers: int,
                     candidate_bits: tuple[int, ...], max_increase: float
                     ) -> tuple[Decision, list[Trial], float]:
    """The precision rule of the module docstring (the cheapest precision whose perplexity stays
    within `max_increase`). Returns (decision, trials, baseline perplexity)."""
    trials: list[Trial] = []

    def run(c: Candidate) -> float:
        ppl = evaluate(c)
        base = trials[0].perplexity if trials else ppl
        trials.append(Trial(c, ppl, ppl - base))
        return ppl - base

    run(Candidate("auto"))
    base = trials[0].perplexity
    passed = None
    for bits in sorted(candidate_bits, reverse=True):  # 4 first; lower widths while they pass
        if run(Candidate("kvquant", bits)) > max_increase:
            break
        passed = trials[-1]
    if passed is not None:
        return (Decision(passed.candidate, passed.perplexity, passed.delta,
                         f"{passed.candidate.bits}-bit raises perplexity by {passed.delta:.4f} "
                         f"<= {max_increase}"), trials, base)
    low = max(candidate_bits)
    failed = trials[1]
    sensitivity = []
    for layer in range(num_layers):
        probe = tuple(low if i == layer else None for i in range(num_layers))
        sensitivity.append(run(Candidate("kvquant", low, probe)))
    widths = [low] * num_layers
    order = sorted(range(num_layers), key=lambda i: -sensitivity[i])
    for layer in order[:-1]:  # all layers at 8 bits is the int8 fallback below
        widths[layer] = 8
        if run(Candidate("kvquant", low, tuple(widths))) <= max_increase:
            t = trials[-1]
            return (Decision(t.candidate, t.perplexity, t.delta,
                             f"{low}-bit raises perplexity by {failed.delta:.4f} > "
                             f"{max_increase}; mixed: layers "
                             f"{sorted(order[:order.index(layer) + 1])}"
                             f" at 8 bits raise it by {t.delta:.4f}"), trials, base)
    if run(Candidate("int8")) <= max_increase:
        t = trials[-1]
        return (Decision(t.candidate, t.perplexity, t.delta,
                         f"{low}-bit raises perplexity by {failed.delta:.4f} > {max_increase} "
                         f"and no per-layer mix passes; int8 raises it by {t.delta:.4f}"),
                trials, base)
    t = trials[0]
    return (Decision(t.candidate, t.perplexity, 0.0,
                     f"no quantized setting stays within {max_increase}: full precision"),
            trials, base)


def calibrate(model, calib_ids: torch.Tensor, eval_ids: torch.Tensor,
              settings: CalibrationSettings | None = None, model_path: str = "",
              text_name: str = "", log: Callable[[str], None] = lambda s: None) -> Calibration:
    """Calibrate `model` (HF, float32, eval mode) on calib_ids [N, S]; decide on eval_ids."""
    settings = settings or CalibrationSettings()
    heads, dim = _heads(model)
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
                 eval_tokens=eval_ids.numel(), text=text_name)
    calib = Calibration(model_path, len(kv_modules(model)), heads, dim, saved, books,
                        thresholds, math.nan)

    def evaluate(candidate: Candidate) -> float:
        handles = simulate(model, candidate, calib, settings)
        try:
            ppl = perplexity(model, eval_ids)
        finally:
            for h in handles:
                h.remove()
        log(f"perplexity {ppl:.4f}: {candidate}")
        return ppl

    decision, trials, base = choose_precision(evaluate, calib.num_layers,
                                              settings.candidate_bits, settings.max_ppl_increase)
    calib.baseline_perplexity, calib.trials, calib.decision = base, trials, decision
    return calib
