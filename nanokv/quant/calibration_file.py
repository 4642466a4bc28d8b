"""The calibration JSON written by `nanokv calibrate` and loaded with `--kv-quant-config`.

Schema (format "nanokv-kv-calibration", version 1); every list is per layer:

{
  "format": "nanokv-kv-calibration", "version": 1,
  "model": {"path": str, "num_layers": L, "num_kv_heads": H, "head_dim": D},
  "settings": {"block_size": int, "outlier_fraction": float, "num_sink_tokens": int,
               "per_channel_keys": bool, "pre_rope_keys": bool (optional, default true: the
               ablation switch; false stores keys after RoPE), "nuq": bool,
               "max_ppl_increase": float (percent), "max_kl": float | null,
               "measure": "engine" | "simulated" | "both", "chunk_size": int,
               "context_fraction": float, "candidate_bits": [int], "calib_tokens": int,
               "eval_tokens": int, "eval_windows": int, "eval_seq_len": int,
               "text": str},
  "codebooks": {"2": {"keys": [[4 floats] x L], "values": [[4 floats] x L]},
                "3": {... 8 floats ...}, "4": {... 16 floats ...}},     (sorted, in [-1, 1])
  "key_outlier_thresholds": {"lower": [[[D floats] x H] x L], "upper": same} | null,
  "perplexity": {"baseline": float,
                 "trials": [{"kv_cache_dtype": str, "bits": int | null,
                             "layer_bits": [int | null] | null, "perplexity": float,
                             "delta": float, "increase_percent": float, "kl": float,
                             "top1": float,
                             "simulated": {"perplexity", "delta", "increase_percent", "kl",
                                           "top1"} (optional: --measure both)}]},
  "decision": {"kv_cache_dtype": "kvquant" | "int8" | "auto", "bits": int | null,
               "layer_bits": [int] | null, "perplexity": float, "delta": float,
               "increase_percent": float, "kl": float, "reason": str}
}

How the perplexities were measured is settings.measure: "engine" runs the nanokv engine with each
candidate's KV store (nanokv/quant/engine_measure.py); "simulated" quantizes and dequantizes keys
(before RoPE) and values inside the Hugging Face model as the store would hold them (full blocks
quantized, the trailing partial block and the sinks in full precision; int8 simulated before RoPE
as well); "both" decides on the engine's and records the simulated estimate beside each trial.
Files written before these fields existed (max_ppl_increase absolute, no KL) still load.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nanokv.quant.kvquant import KVQUANT_BITS, LAYER_BITS, KVQuantConfig

FORMAT, VERSION = "nanokv-kv-calibration", 1
DECISION_DTYPES = ("kvquant", "int8", "auto")


@dataclass(frozen=True)
class Candidate:
    """A precision setting tried by calibration. layer_bits entries of None (sensitivity probes
    only) keep that layer in full precision."""

    kv_cache_dtype: str  # "kvquant" | "int8" | "auto"
    bits: int | None = None
    layer_bits: tuple[int | None, ...] | None = None

    def to_dict(self) -> dict:
        return {"kv_cache_dtype": self.kv_cache_dtype, "bits": self.bits,
                "layer_bits": None if self.layer_bits is None else list(self.layer_bits)}


@dataclass
class Trial:
    candidate: Candidate
    perplexity: float
    delta: float  # perplexity - the baseline's
    increase: float = math.nan  # delta in percent of the baseline
    kl: float = math.nan  # mean KL(full precision || candidate) per scored token, nats
    top1: float = math.nan  # share of scored tokens with full precision's argmax
    simulated: Trial | None = None  # with measure "both": the simulated estimate beside it

    def to_dict(self) -> dict:
        out = {"perplexity": self.perplexity, "delta": self.delta,
               "increase_percent": self.increase, "kl": self.kl, "top1": self.top1}
        if self.simulated is not None:
            out["simulated"] = self.simulated.to_dict()
        return out


@dataclass
class Decision:
    candidate: Candidate
    perplexity: float
    delta: float
    reason: str
    increase: float = math.nan  # percent of the baseline perplexity
    kl: float = math.nan


@dataclass
class Calibration:
    model_path: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    settings: dict
    codebooks: dict[int, tuple[tuple, tuple]]  # bits -> (key books, value books), per layer
    key_thresholds: torch.Tensor | None  # [L, 2, H, D]
    baseline_perplexity: float
    trials: list[Trial] = field(default_factory=list)
    decision: Decision | None = None

    @property
    def kv_cache_dtype(self) -> str:
        return self.decision.candidate.kv_cache_dtype if self.decision else "kvquant"

    def kvquant_config(self, bits: int | None = None, nuq: bool | None = None) -> KVQuantConfig:
        """The KVQuantConfig of the decision (or of `bits` for every layer)."""
        cand = self.decision.candidate if self.decision else None
        layer_bits = None
        if bits is None:
            if cand is None or cand.kv_cache_dtype != "kvquant":
                raise ValueError(f"the calibration file holds no kvquant decision (its "
                                 f"kv_cache_dtype: {self.kv_cache_dtype!r}): give the bits "
                                 f"(kv_quant_bits, --kv-quant-bits) for a kvquant config")
            bits, layer_bits = cand.bits, cand.layer_bits
        use_nuq = self.settings.get("nuq", True) if nuq is None else nuq
        widths = layer_bits or (bits,) * self.num_layers
        key_books = value_books = None
        if use_nuq:
            key_books = tuple(self.codebooks[b][0][i] if b in self.codebooks else None
                              for i, b in enumerate(widths))
            value_books = tuple(self.codebooks[b][1][i] if b in self.codebooks else None
                                for i, b in enumerate(widths))
        return KVQuantConfig(bits=bits, layer_bits=layer_bits,
                             per_channel_keys=self.settings["per_channel_keys"],
                             key_codebooks=key_books, value_codebooks=value_books,
                             outlier_fraction=self.settings["outlier_fraction"],
                             key_outlier_thresholds=self.key_thresholds,
                             num_sink_tokens=self.settings["num_sink_tokens"],
                             pre_rope_keys=self.settings.get("pre_rope_keys", True))

    def check_model(self, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        got = (self.num_layers, self.num_kv_heads, self.head_dim)
        if got != (num_layers, num_kv_heads, head_dim):
            raise ValueError(f"the calibration is for (layers, kv heads, head dim) {got}, the "
                             f"model has {(num_layers, num_kv_heads, head_dim)}")

    # ---- JSON --------------------------------------------------------------------------------
    def to_json(self) -> dict:
        t = self.key_thresholds
        d = self.decision
        return {
            "format": FORMAT, "version": VERSION,
            "model": {"path": self.model_path, "num_layers": self.num_layers,
                      "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim},
            "settings": self.settings,
            "codebooks": {str(b): {"keys": [list(c) for c in kb], "values": [list(c) for c in vb]}
                          for b, (kb, vb) in sorted(self.codebooks.items())},
            "key_outlier_thresholds": None if t is None else {
                "lower": t[:, 0].tolist(), "upper": t[:, 1].tolist()},
            "perplexity": {"baseline": self.baseline_perplexity,
                           "trials": [{**tr.candidate.to_dict(), **tr.to_dict()}
                                      for tr in self.trials]},
            "decision": None if d is None else {**d.candidate.to_dict(),
                                                "perplexity": d.perplexity, "delta": d.delta,
                                                "increase_percent": d.increase, "kl": d.kl,
                                                "reason": d.reason},
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")


def load_calibration(path: str | Path) -> Calibration:
    """Read and validate a calibration file (ValueError naming what is wrong)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:  # JSON and UTF-8 decode errors are ValueErrors
        raise ValueError(f"cannot read calibration file {path}: {e}") from None
    return from_json(data, str(path))


def from_json(data: dict, where: str = "calibration") -> Calibration:
    def need(cond: bool, what: str) -> None:
        if not cond:
            raise ValueError(f"{where}: {what}")

    need(isinstance(data, dict) and data.get("format") == FORMAT,
         f"not a calibration file (format must be {FORMAT!r})")
    need(data.get("version") == VERSION, f"version must be {VERSION}, got {data.get('version')}")
    model = data.get("model") or {}
    dims = [model.get(k) for k in ("num_layers", "num_kv_heads", "head_dim")]
    need(all(isinstance(x, int) and x > 0 for x in dims), "model.num_layers / num_kv_heads / "
         "head_dim must be positive integers")
    layers, heads, dim = dims
    settings = data.get("settings") or {}
    for key, typ in (("block_size", int), ("outlier_fraction", (int, float)),
                     ("num_sink_tokens", int), ("per_channel_keys", bool)):
        need(isinstance(settings.get(key), typ), f"settings.{key} missing or of the wrong type")
    for key in ("pre_rope_keys", "nuq"):  # optional switches (default true)
        need(isinstance(settings.get(key, True), bool), f"settings.{key} must be true or false")
    books = {}
    for b_str, kinds in (data.get("codebooks") or {}).items():
        need(b_str.isdigit() and int(b_str) in KVQUANT_BITS,
             f"codebook width {b_str!r} not in {list(KVQUANT_BITS)}")
        bits = int(b_str)
        pair = []
        for kind in ("keys", "values"):
            per_layer = kinds.get(kind)
            need(isinstance(per_layer, list) and len(per_layer) == layers,
                 f"codebooks.{bits}.{kind} must list {layers} layers")
            for c in per_layer:
                need(isinstance(c, list) and len(c) == 2 ** bits
                     and all(isinstance(x, (int, float)) and -1 <= x <= 1 for x in c)
                     and c == sorted(c),
                     f"codebooks.{bits}.{kind}: each entry must be {2 ** bits} sorted numbers "
                     f"in [-1, 1]")
            pair.append(tuple(tuple(float(x) for x in c) for c in per_layer))
        books[bits] = tuple(pair)
    thresholds = None
    t = data.get("key_outlier_thresholds")
    if t is not None:
        try:
            lo = torch.tensor(t["lower"], dtype=torch.float32)
            hi = torch.tensor(t["upper"], dtype=torch.float32)
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{where}: key_outlier_thresholds needs 'lower' and 'upper' "
                             f"[L][H][D] number lists") from None
        need(tuple(lo.shape) == (layers, heads, dim) == tuple(hi.shape),
             f"key_outlier_thresholds must be [{layers}][{heads}][{dim}]")
        need(bool((lo <= hi).all()), "key_outlier_thresholds: lower must be <= upper")
        thresholds = torch.stack([lo, hi], dim=1)  # [L, 2, H, D]
    ppl = data.get("perplexity") or {}
    need(isinstance(ppl.get("baseline"), (int, float)), "perplexity.baseline missing")
    trials = []
    for tr in ppl.get("trials", []):
        cand = _candidate(tr, layers, where)
        sim = tr.get("simulated")
        trials.append(_trial(cand, tr, where, None if sim is None else _trial(cand, sim, where)))
    decision = None
    d = data.get("decision")
    if d is not None:
        cand = _candidate(d, layers, where)
        need(cand.layer_bits is None or None not in cand.layer_bits,
             "decision.layer_bits must not keep layers in full precision")
        need(cand.kv_cache_dtype != "kvquant" or cand.bits in books or not settings.get("nuq"),
             f"decision bits {cand.bits} has no codebook")
        decision = Decision(cand, _number(d, "perplexity"), _number(d, "delta"),
                            str(d.get("reason", "")), _number(d, "increase_percent"),
                            _number(d, "kl"))
    return Calibration(str(model.get("path", "")), layers, heads, dim, settings, books,
                       thresholds, float(ppl["baseline"]), trials, decision)


def _number(d: dict, key: str, where: str = "calibration") -> float:
    """d[key] as a float (NaN when absent: files from before the field)."""
    value = d.get(key, math.nan)
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: {key} must be a number, got {value!r}")
    return float(value)


def _trial(cand: Candidate, tr: dict, where: str, simulated: Trial | None = None) -> Trial:
    if not isinstance(tr, dict) or "perplexity" not in tr or "delta" not in tr:
        raise ValueError(f"{where}: each trial needs perplexity and delta")
    return Trial(cand, _number(tr, "perplexity", where), _number(tr, "delta", where),
                 _number(tr, "increase_percent", where), _number(tr, "kl", where),
                 _number(tr, "top1", where), simulated)


def _candidate(d: dict, layers: int, where: str) -> Candidate:
    dtype = d.get("kv_cache_dtype")
    if dtype not in DECISION_DTYPES:
        raise ValueError(f"{where}: kv_cache_dtype {dtype!r} not in {list(DECISION_DTYPES)}")
    bits, layer_bits = d.get("bits"), d.get("layer_bits")
    if dtype == "kvquant" and layer_bits is None and bits not in KVQUANT_BITS:
        raise ValueError(f"{where}: kvquant bits must be in {list(KVQUANT_BITS)}, got {bits!r}")
    if layer_bits is not None:
        if (not isinstance(layer_bits, list) or len(layer_bits) != layers
                or any(b is not None and b not in LAYER_BITS for b in layer_bits)):
            raise ValueError(f"{where}: layer_bits must list {layers} widths in "
                             f"{list(LAYER_BITS)} (or null)")
        layer_bits = tuple(layer_bits)
    return Candidate(dtype, bits, layer_bits)
