"""KVQuant (arXiv 2401.18079): the configuration and the pure quantize / dequantize of blocks.

Everything here works on a batch of n groups of tokens, x: [n, B, Hkv, D] (a full KV block, or
B = 1 for one token), with `valid` [n, B] marking the slots that take part (False for
attention-sink slots, which the store keeps in full precision). Two layouts of the statistics:

  per channel (keys):  one offset / half-range per (group, head, channel), over the B tokens
  per token (values):  one offset / half-range per (group, slot, head), over the D channels

Normalisation (paper, section 3.4): offset = (max + min) / 2, half = (max - min) / 2, both kept in
fp16; xn = (x - offset) / half in [-1, 1]. A code is the nearest of 2**bits centroids: the
layer's codebook (nuq), or the uniform grid linspace(-1, 1, 2**bits) without one. Dequantized:
centroid * half + offset. Uniform error bound for a non-outlier element:
|x - x_hat| <= half / (2**bits - 1) (+ the fp16 rounding of offset and half).

Dense-and-sparse outliers. A group [B, D] per head lists at most
`capacity` = 2 * ceil(fraction / 2 * B * D) elements (index slot * D + channel, and the sparse
dtype's delta: the element minus its dense decoding, x - (centroid * half + offset); unused
entries have index -1 and delta 0; a per-channel group's list in index order,
unused entries last, so that a slot's entries lie next to each other for a decode kernel):
  - keys with calibrated thresholds (lower, upper) per channel: the elements outside them, the
    most extreme first (distance beyond the threshold / threshold range), up to half the capacity
    on each side;
  - otherwise: per-vector thresholds of the form mean +- t * std, mean and std along the
    statistics axis (a key channel over the block's tokens, a token over its channels), with t
    chosen per group-head so that exactly capacity / 2 elements lie beyond each side.
The store quantizes values (and keys without per-channel statistics) token by token, as groups
of B = 1: that is the paper's online per-token percentile, with capacity 2 * ceil(fraction / 2 *
D) (at least one each side: 2 of 128 channels = 1.6% at fraction 1%). Per-channel keys use the
whole block (B tokens), where fraction / 2 of B * D is a whole number of elements.
The statistics are then taken over the remaining (clipped) elements. Dequantized, an outlier is
its dense decoding plus its delta: dense plus sparse, as KVQuant's kernels sum the two products.
It comes back to within the sparse dtype's rounding of the delta (fp16: |delta| * 2^-11; an
outlier decodes to the edge of its group's range, so |delta| is its distance beyond that range,
mostly below |x|). A kernel adds the delta's correction to what it decoded: no gather of the
outlier's code and statistics (`nanokv/layers/csrc/kvquant_block_avx512.h`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass

import torch

KVQUANT_BITS = (2, 3, 4)
LAYER_BITS = (2, 3, 4, 8)  # per-layer overrides may use 8 bits (the mixed-precision fallback)
SPARSE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
MAX_OUTLIER_FRACTION = 0.2
_TINY = torch.finfo(torch.float32).tiny
_EPS = 1e-6


@dataclass(eq=False)
class KVQuantConfig:
    """KVQuant settings; every part can be switched off for ablations.

    bits: default code width (2, 3, 4); layer_bits: optional per-layer widths (2, 3, 4, 8).
    per_channel_keys: keys per channel over a block's tokens (False: per token, like values).
    pre_rope_keys: the store holds keys before RoPE and rotates them after dequantizing.
    key_codebooks / value_codebooks: per layer, 2**bits sorted centroids in [-1, 1] (nuq), or
        None for that layer (uniform); None altogether = uniform everywhere.
    outlier_fraction: share of elements per block kept in full precision (0 disables).
    key_outlier_thresholds: [L, 2, Hkv, D] (lower, upper) per key channel, calibrated offline;
        None = per-block thresholds.
    num_sink_tokens: the first N positions of a sequence stay in full precision (0 disables).
    sparse_dtype: dtype of the outliers' deltas and of the sink rows ('float16' as in the paper).
    """

    bits: int = 4
    per_channel_keys: bool = True
    pre_rope_keys: bool = True
    key_codebooks: tuple | None = None
    value_codebooks: tuple | None = None
    outlier_fraction: float = 0.01
    key_outlier_thresholds: torch.Tensor | None = None
    num_sink_tokens: int = 1
    layer_bits: tuple[int, ...] | None = None
    sparse_dtype: str = "float16"

    def __post_init__(self) -> None:
        if self.bits not in KVQUANT_BITS or isinstance(self.bits, bool):
            raise ValueError(f"kvquant bits must be one of {list(KVQUANT_BITS)}, got {self.bits!r}")
        for name in ("per_channel_keys", "pre_rope_keys"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(  # noqa: TRY004 - STYLE: bad option values raise ValueError
                    f"{name} must be true or false, got {getattr(self, name)!r}")
        if (isinstance(self.outlier_fraction, bool)
                or not isinstance(self.outlier_fraction, (int, float))
                or not 0 <= self.outlier_fraction <= MAX_OUTLIER_FRACTION):
            raise ValueError(f"outlier_fraction must be in [0, {MAX_OUTLIER_FRACTION}], "
                             f"got {self.outlier_fraction!r}")
        if (not isinstance(self.num_sink_tokens, int) or isinstance(self.num_sink_tokens, bool)
                or self.num_sink_tokens < 0):
            raise ValueError(f"num_sink_tokens must be an integer >= 0, "
                             f"got {self.num_sink_tokens!r}")
        if self.sparse_dtype not in SPARSE_DTYPES:
            raise ValueError(f"sparse_dtype must be one of {sorted(SPARSE_DTYPES)}, "
                             f"got {self.sparse_dtype!r}")
        if self.layer_bits is not None:
            if not isinstance(self.layer_bits, (list, tuple)):
                raise ValueError(f"layer_bits must be a list of per-layer widths in "
                                 f"{list(LAYER_BITS)}, got {self.layer_bits!r}")
            self.layer_bits = tuple(self.layer_bits)
            bad = [b for b in self.layer_bits if b not in LAYER_BITS or isinstance(b, bool)]
            if not self.layer_bits or bad:
                raise ValueError(f"layer_bits must be a non-empty list of widths in "
                                 f"{list(LAYER_BITS)}, got {self.layer_bits!r}")
        for name in ("key_codebooks", "value_codebooks"):
            books = getattr(self, name)
            if books is not None:
                setattr(self, name, tuple(None if b is None else tuple(float(c) for c in b)
                                          for b in books))
                for layer, book in enumerate(getattr(self, name)):
                    if book is not None and not all(math.isfinite(c) for c in book):
                        raise ValueError(f"{name}[{layer}] must hold finite centroids in "
                                         f"[-1, 1], got {book!r}")
        if self.key_outlier_thresholds is not None:
            t = torch.as_tensor(self.key_outlier_thresholds, dtype=torch.float32)
            if t.dim() != 4 or t.shape[1] != 2 or not bool((t[:, 0] <= t[:, 1]).all()):
                raise ValueError("key_outlier_thresholds must be [num_layers, 2, num_kv_heads, "
                                 "head_dim] with lower <= upper")
            self.key_outlier_thresholds = t
        if self.key_outlier_thresholds is not None and not self.per_channel_keys:
            raise ValueError("key_outlier_thresholds are per channel: they need "
                             "per_channel_keys=True")

    @property
    def nuq(self) -> bool:
        return self.key_codebooks is not None or self.value_codebooks is not None

    def bits_of(self, layer: int) -> int:
        return self.bits if self.layer_bits is None else self.layer_bits[layer]

    def codebook(self, layer: int, kind: str) -> torch.Tensor | None:
        """The layer's centroids for 'key' or 'value' (float32 [2**bits]) or None (uniform)."""
        books = self.key_codebooks if kind == "key" else self.value_codebooks
        if books is None or books[layer] is None:
            return None
        return torch.tensor(books[layer], dtype=torch.float32)

    def thresholds(self, layer: int) -> torch.Tensor | None:
        t = self.key_outlier_thresholds
        return None if t is None else t[layer]

    def validate_for(self, num_layers: int, num_kv_heads: int, head_dim: int,
                     block_size: int) -> None:
        """Check the per-layer parts against a model and block size (ValueError if wrong)."""
        if self.layer_bits is not None and len(self.layer_bits) != num_layers:
            raise ValueError(f"layer_bits has {len(self.layer_bits)} entries; the model has "
                             f"{num_layers} layers")
        for name in ("key_codebooks", "value_codebooks"):
            books = getattr(self, name)
            if books is None:
                continue
            if len(books) != num_layers:
                raise ValueError(f"{name} has {len(books)} entries; the model has {num_layers} "
                                 f"layers")
            for layer, book in enumerate(books):
                if book is None:
                    continue
                want = 2 ** self.bits_of(layer)
                if len(book) != want:
                    raise ValueError(f"{name}[{layer}] has {len(book)} centroids; "
                                     f"{self.bits_of(layer)}-bit needs {want}")
                if list(book) != sorted(book) or min(book) < -1 or max(book) > 1:
                    raise ValueError(f"{name}[{layer}] must be sorted and within [-1, 1]")
        t = self.key_outlier_thresholds
        if t is not None and tuple(t.shape) != (num_layers, 2, num_kv_heads, head_dim):
            raise ValueError(f"key_outlier_thresholds shape {tuple(t.shape)} != "
                             f"{(num_layers, 2, num_kv_heads, head_dim)}")
        if self.num_sink_tokens > block_size:
            raise ValueError(f"num_sink_tokens ({self.num_sink_tokens}) must be <= block_size "
                             f"({block_size})")
        if outlier_capacity(block_size, head_dim, self.outlier_fraction) > block_size * head_dim:
            raise ValueError("outlier_fraction too large for the block")

    def replace(self, **changes) -> KVQuantConfig:
        return dataclasses.replace(self, **changes)

    def fingerprint(self) -> str:
        """A stable digest of everything that changes the stored K/V (prefix-cache extra key)."""
        h = hashlib.sha256()
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name != "key_outlier_thresholds"}
        h.update(json.dumps(fields, sort_keys=True, default=list).encode())
        if self.key_outlier_thresholds is not None:
            h.update(self.key_outlier_thresholds.contiguous().numpy().tobytes())
        return h.hexdigest()[:16]


def outlier_capacity(block_size: int, head_dim: int, fraction: float) -> int:
    """Sparse entries per (block, head): fraction / 2 of the block's elements on each side."""
    if fraction <= 0:
        return 0
    return 2 * math.ceil(fraction / 2 * block_size * head_dim)


@dataclass
class QuantizedBlocks:
    """n quantized blocks of one kind (keys or values); codes are not yet bit-packed."""

    codes: torch.Tensor  # uint8 [n, B, H, D]
    offset: torch.Tensor  # float16: [n, H, D] per channel, [n, B, H] per token
    half_range: torch.Tensor  # same shape as offset
    outlier_index: torch.Tensor  # int64 [n, H, capacity]: slot * D + channel, -1 = unused
    outlier_delta: torch.Tensor  # sparse dtype [n, H, capacity]: x minus its dense decoding


def _to_fp16(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-65504.0, 65504.0).to(torch.float16)


def _select_outliers(x: torch.Tensor, valid: torch.Tensor, per_channel: bool, capacity: int,
                     thresholds: torch.Tensor | None) -> torch.Tensor:
    """Indices [n, H, capacity] (slot * D + channel, -1 unused) of the outlier elements."""
    n, bsz, heads, dim = x.shape
    side = capacity // 2
    vmask = valid[:, :, None, None].expand_as(x)
    if thresholds is not None:  # calibrated per-channel (lower, upper): [2, H, D]
        lo, hi = thresholds[0].to(x), thresholds[1].to(x)
        span = (hi - lo).clamp_min(_EPS)
        up = torch.where(vmask & (x > hi), (x - hi) / span, float("-inf"))
        down = torch.where(vmask & (x < lo), (lo - x) / span, float("-inf"))
    else:
        dim_stat = 1 if per_channel else 3
        w = vmask.to(x.dtype)
        count = w.sum(dim_stat, keepdim=True).clamp_min(1)
        mean = (x * w).sum(dim_stat, keepdim=True) / count
        var = (((x - mean) ** 2) * w).sum(dim_stat, keepdim=True) / count
        z = (x - mean) / (var.sqrt() + _EPS)
        up = torch.where(vmask, z, float("-inf"))
        down = torch.where(vmask, -z, float("-inf"))
    picks = []
    for score in (up, down):
        flat = score.permute(0, 2, 1, 3).reshape(n, heads, bsz * dim)  # [n, H, B * D]
        # the highest first, ties to the lower index (a stable sort: topk's order of ties
        # differs between devices; the C and Triton kernels pick the same way)
        val, idx = flat.sort(dim=-1, descending=True, stable=True)
        val, idx = val[..., :min(side, bsz * dim)], idx[..., :min(side, bsz * dim)]
        picks.append(torch.where(torch.isinf(val), -1, idx))
    # an element picked from both ends (ties, as in a constant row) is listed once: every entry
    # is unique, so a kernel may add each entry's correction without checking for repeats
    top, bottom = picks
    listed = _flat_mask(top, bsz * dim)  # [n, H, B * D]
    again = listed.gather(-1, bottom.clamp_min(0)) & (bottom >= 0)
    index = torch.cat([top, bottom.masked_fill(again, -1)], dim=-1)  # [n, H, capacity]
    if per_channel:  # in index order (slot-major), unused entries (-1) last
        order = torch.where(index < 0, bsz * dim, index).argsort(dim=-1)
        index = index.gather(-1, order)
    return index


def _flat_mask(index: torch.Tensor, size: int) -> torch.Tensor:
    """Indices [n, H, cap] (< 0 unused) -> bool [n, H, size], True where listed."""
    n, heads, _ = index.shape
    flat = torch.zeros(n, heads, size + 1, dtype=torch.bool, device=index.device)
    flat.scatter_(-1, torch.where(index < 0, size, index), True)  # unused: the dump column
    return flat[..., :-1]


def _index_mask(index: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Outlier indices [n, H, cap] -> bool mask [n, B, H, D]."""
    n, bsz, heads, dim = shape
    return _flat_mask(index, bsz * dim).view(n, heads, bsz, dim).permute(0, 2, 1, 3)


def quantize_blocks(x: torch.Tensor, valid: torch.Tensor, *, bits: int, per_channel: bool,
                    codebook: torch.Tensor | None = None, outlier_fraction: float = 0.0,
                    thresholds: torch.Tensor | None = None,
                    sparse_dtype: torch.dtype = torch.float16) -> QuantizedBlocks:
    """x: [n, B, H, D] float, valid: [n, B] bool -> QuantizedBlocks (codes unpacked)."""
    x = x.float()
    n, bsz, heads, dim = x.shape
    capacity = outlier_capacity(bsz, dim, outlier_fraction)
    if capacity:
        index = _select_outliers(x, valid, per_channel, capacity,
                                 thresholds if per_channel else None)
        is_outlier = _index_mask(index, x.shape)
    else:
        index = torch.empty(n, heads, 0, dtype=torch.long, device=x.device)
        is_outlier = torch.zeros_like(x, dtype=torch.bool)
    keep = ~is_outlier
    if per_channel:  # the statistics skip sink slots; a per-token statistic is its own
        keep &= valid[:, :, None, None]
    dim_stat = 1 if per_channel else 3
    lo = torch.where(keep, x, float("inf")).amin(dim_stat, keepdim=True)
    hi = torch.where(keep, x, float("-inf")).amax(dim_stat, keepdim=True)
    empty = torch.isinf(lo)
    lo, hi = lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)
    offset, half = _to_fp16((hi + lo) / 2), _to_fp16((hi - lo) / 2)
    xn = ((x - offset.float()) / half.float().clamp_min(_TINY)).clamp_(-1.0, 1.0)
    codes = encode(xn, bits, codebook)
    # the outliers' deltas to their dense decoding (the reader's float32 operations)
    delta = x - dense_decoding(codes, offset, half, bits, codebook)  # [n, B, H, D]
    delta = delta.permute(0, 2, 1, 3).reshape(n, heads, bsz * dim)  # [n, H, B * D]
    delta = delta.gather(-1, index.clamp_min(0)).masked_fill(index < 0, 0.0).to(sparse_dtype)
    squeeze = 1 if per_channel else 3
    return QuantizedBlocks(codes, offset.squeeze(squeeze), half.squeeze(squeeze), index, delta)


def encode(xn: torch.Tensor, bits: int, codebook: torch.Tensor | None) -> torch.Tensor:
    """Normalised values in [-1, 1] -> nearest centroid's code (uint8)."""
    if codebook is None:
        levels = 2 ** bits - 1
        return torch.round((xn + 1) * (levels / 2)).clamp_(0, levels).to(torch.uint8)
    cb = codebook.to(xn.device, torch.float32)
    mids = (cb[1:] + cb[:-1]) / 2
    return torch.bucketize(xn.contiguous(), mids).to(torch.uint8)


def uniform_grid(bits: int) -> tuple[float, float]:
    """(step, base) of the uniform codebook: code c decodes to c * step + base, -1 to 1."""
    return 2.0 / (2 ** bits - 1), -1.0


def decode(codes: torch.Tensor, bits: int, codebook: torch.Tensor | None) -> torch.Tensor:
    """Codes -> centroids in [-1, 1] (float32)."""
    if codebook is None:
        step, base = uniform_grid(bits)
        return codes.float() * step + base
    return codebook.to(codes.device, torch.float32)[codes.long()]


def centroid_table(bits: int, codebook: torch.Tensor | None) -> torch.Tensor:
    """The centroid of every code, [2^bits] float32 on CPU: the lookup table the kernels read
    (`decode` of each code)."""
    return decode(torch.arange(2 ** bits, dtype=torch.uint8), bits,
                  None if codebook is None else codebook.cpu())


def dequantize_blocks(q: QuantizedBlocks, *, bits: int, per_channel: bool,
                      codebook: torch.Tensor | None = None) -> torch.Tensor:
    """QuantizedBlocks -> float32 [n, B, H, D]: the dense decoding plus the outliers' deltas."""
    unsq = 1 if per_channel else 3
    x = dense_decoding(q.codes, q.offset.unsqueeze(unsq), q.half_range.unsqueeze(unsq), bits,
                       codebook)
    if q.outlier_index.shape[-1] == 0:
        return x
    return add_outliers(x, q.outlier_index, q.outlier_delta)


def dense_decoding(codes: torch.Tensor, offset: torch.Tensor, half: torch.Tensor, bits: int,
                   codebook: torch.Tensor | None) -> torch.Tensor:
    """Codes [n, B, H, D] -> centroid * half + offset in float32, the fp16 statistics broadcast
    over the slots (per channel: [n, 1, H, D]) or the channels (per token: [n, B, H, 1])."""
    return decode(codes, bits, codebook) * half.float() + offset.float()


def add_outliers(x: torch.Tensor, index: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """Add sparse deltas [n, H, cap] at indices (slot * D + channel; < 0 unused) to x. A
    group's indices are distinct, so each element gets at most one delta."""
    n, bsz, heads, dim = x.shape
    flat = x.permute(0, 2, 1, 3).reshape(n, heads, bsz * dim)  # [n, H, B * D] (a copy)
    flat = torch.cat([flat, flat.new_zeros(n, heads, 1)], dim=-1)  # + a dump column
    index = index.long()  # unused: -1, or any value >= B * D (255 in a uint8 store)
    idx = torch.where((index < 0) | (index >= bsz * dim), bsz * dim, index)
    flat.scatter_add_(-1, idx, delta.to(flat.dtype))  # [n, H, cap] deltas at their elements
    return flat[..., :-1].view(n, heads, bsz, dim).permute(0, 2, 1, 3)


def normalized_values(x: torch.Tensor, valid: torch.Tensor, *, per_channel: bool,
                      outlier_fraction: float, thresholds: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """What the codebook is learned on: (xn [n, B, H, D] in [-1, 1], mask of the elements that
    are quantized: valid and not outliers). Same normalisation as `quantize_blocks`."""
    q = quantize_blocks(x, valid, bits=8, per_channel=per_channel,
                        outlier_fraction=outlier_fraction, thresholds=thresholds)
    unsq = 1 if per_channel else 3
    off, half = q.offset.float().unsqueeze(unsq), q.half_range.float().unsqueeze(unsq)
    xn = ((x.float() - off) / half.clamp_min(_TINY)).clamp(-1.0, 1.0)
    mask = valid[:, :, None, None].expand_as(xn).clone()
    if q.outlier_index.shape[-1]:
        mask &= ~_index_mask(q.outlier_index, x.shape)
    return xn, mask
