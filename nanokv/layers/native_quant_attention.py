"""The quantized CPU decode kernels (`csrc/quant_decode_attention.c`), loaded with ctypes.

Built like the float kernel (`native_build.build_library`: `$CC -O3 -march=native -fopenmp`,
cached in `$NANOKV_CACHE_DIR`), once per process. Two entry points, each reading a store's
buffers in place:

  pertoken_decode   int8 / fp8 codes with a float32 scale per token and KV head
                    (`nanokv.quant.pertoken_store`), slots as runs of consecutive pool slots
  kvquant_decode    KVQuant's packed codes, statistics, codebooks, outliers, sinks, staged keys
                    (`nanokv.quant.kvquant_store`), by block table; KIVI's
                    (`nanokv.quant.kivi_store`) through the same descriptor

Both attend each request's cached slots (not the new token) and then the step's own token with
its fresh float32 K/V, so the result is `reference_quantized_attention`'s.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from nanokv.layers.native_attention import DecodeRuns
from nanokv.layers.native_build import LazyLibrary

SOURCE = Path(__file__).with_name("csrc") / "quant_decode_attention.c"
PERTOKEN_FORMATS = {"int8": 0, "fp8_e4m3": 1, "fp8_e5m2": 2}
# element kinds of sparse values and staged keys
ELEMENT_KINDS = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
INDEX_BYTES = {torch.uint8: 1, torch.int16: 2, torch.int32: 4}


_p, _i64 = ctypes.c_void_p, ctypes.c_int64


class KVQuantSide(ctypes.Structure):
    """Keys or values of one KVQuant layer (mirrors the C struct)."""

    _fields_ = [("codes", _p), ("offset", _p), ("half", _p), ("oidx", _p), ("oval", _p),
                ("lut", _p), ("sink", _p), ("per_channel", _i64), ("bits", _i64),
                ("packed", _i64), ("cap", _i64), ("idx_bytes", _i64), ("groups", _i64)]


class KVQuantLayer(ctypes.Structure):
    """One KVQuant (or KIVI) layer's buffers and shape (mirrors the C struct)."""

    _fields_ = [("k", KVQuantSide), ("v", KVQuantSide), ("sink_slot", _p), ("staging", _p),
                ("staging_v", _p), ("staging_index", _p), ("slot_positions", _p), ("cos", _p),
                ("sin", _p),
                ("num_sinks", _i64), ("sparse_kind", _i64), ("staging_kind", _i64),
                ("rot_dim", _i64), ("block_size", _i64), ("num_q_heads", _i64),
                ("num_kv_heads", _i64), ("head_dim", _i64), ("rope_halves_equal", _i64),
                ("rope_tiles", _p), ("rope_rows", _p)]


def type_kernels(lib: ctypes.CDLL) -> None:
    """The library's kernels typed (what any build of this file has: `benchmarks/
    ab_kvquant_decode.py` loads an older checkout's through it, without its later switches)."""
    lib.pertoken_decode_attention.argtypes = [_p] * 14 + [_i64] * 6
    lib.pertoken_decode_attention.restype = ctypes.c_int
    lib.kvquant_decode_attention.argtypes = [ctypes.POINTER(KVQuantLayer)] + [_p] * 8 + [_i64]
    lib.kvquant_decode_attention.restype = ctypes.c_int
    lib.kvquant_read_blocks.argtypes = [ctypes.POINTER(KVQuantLayer), _p, _i64, _i64, _p, _p]
    lib.kvquant_read_blocks.restype = ctypes.c_int


def _setup(lib: ctypes.CDLL) -> None:
    type_kernels(lib)
    for switch in (lib.pertoken_set_int8_fused, lib.pertoken_set_int8_prefetch,
                   lib.pertoken_set_int8_stage, lib.kvquant_set_slot_keys,
                   lib.kvquant_set_rope_tiles, lib.kvquant_set_fixed_head_dims):
        switch.argtypes = [ctypes.c_int]
        switch.restype = None
    lib.kvquant_rope_layout.argtypes = []
    lib.kvquant_rope_layout.restype = ctypes.c_int
    lib.pertoken_int8_stage.restype = ctypes.c_int
    lib.pertoken_int8_stage_fits.argtypes = [_i64, _i64]
    lib.pertoken_int8_stage_fits.restype = ctypes.c_int


_LIBRARY = LazyLibrary(SOURCE, _setup)


def load_quant_kernels() -> ctypes.CDLL:
    """The library; raises NativeKernelUnavailable (with the reason) when it cannot be built."""
    return _LIBRARY.get()


def set_int8_fused(on: bool) -> None:
    """int8 and fp8 codes widened in the kernel's FMA loops (True, the default on AVX-512 and
    AVX2 builds, keys after RoPE, head_dim % 32 == 0) or decoded into the tile buffer first (False):
    an A/B switch for benchmarks and tests; the process's setting, for every later call. (The
    name is the int8 path's, which came first; the stage and prefetch switches below apply to
    fp8 the same way.)"""
    load_quant_kernels().pertoken_set_int8_fused(int(bool(on)))


def set_slot_keys(on: bool) -> None:
    """KVQuant's key pass with a tile's slots in the vector lanes (True, the default where it
    fits: 2 or 4-bit keys; AVX-512 builds with RoPE over the whole head or none, AVX2 builds
    with rotate-half RoPE over the whole head (repeating halves), head_dim a multiple of 64 at 4
    bits or 128 at 2, blocks a multiple of 8 slots) or with channels in the lanes (False:
    AVX-512's planar pass, AVX2's channel-lanes pass): an A/B switch for benchmarks and tests,
    as set_int8_fused."""
    load_quant_kernels().kvquant_set_slot_keys(int(bool(on)))


def set_rope_tiles(on: bool) -> None:
    """Whether the block path reads a layer's compact RoPE table where the layer has one (True,
    the default): the AVX-512 slot-lanes key pass its transposed tiles (`rope_tiles`; off: it
    transposes each tile's rows itself), the AVX2 key passes their half rows (`rope_rows`; off:
    the full tables' rows). An A/B switch for benchmarks and tests."""
    load_quant_kernels().kvquant_set_rope_tiles(int(bool(on)))


def set_fixed_head_dims(on: bool) -> None:
    """Whether the AVX2 KVQuant key pass runs heads of 32 channels (2- and 4-bit keys) in
    instances with the head size a constant (True, the default) or reads it at run time (False).
    An A/B switch for benchmarks and tests; AVX-512 builds ignore it."""
    load_quant_kernels().kvquant_set_fixed_head_dims(int(bool(on)))


ROPE_TILES, ROPE_ROWS = 1, 2  # kvquant_rope_layout(): the compact RoPE table a build reads


def rope_layout() -> int:
    """Which compact RoPE table this CPU's build of the block path reads where the tables'
    halves repeat: ROPE_TILES (AVX-512: `rope_tiles`), ROPE_ROWS (AVX2: `rope_rows`), or 0."""
    return int(load_quant_kernels().kvquant_rope_layout())


def rope_rows(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half cos / sin tables [positions, rot_dim] whose halves repeat, their first halves
    side by side: [positions, 2 (cos, sin), rot_dim / 2] (what `KVQuantLayer.rope_rows` points
    at). The AVX2 key pass reads a slot's rows as one stream of rot_dim floats, where the full
    tables are two of 2 * rot_dim, half of which it never uses."""
    half = cos.shape[-1] // 2
    return torch.stack([cos[:, :half], sin[:, :half]], dim=1).contiguous()


def rope_tiles(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half cos / sin tables [positions, rot_dim] whose halves repeat, their first halves
    by tiles of 16 positions, each transposed: [ceil(positions / 16), 2 (cos, sin), rot_dim / 2,
    16], 0 past the last position (what `KVQuantLayer.rope_tiles` points at). A tile of 16
    consecutive positions from a multiple of 16 is then one contiguous [channel, slot] block, the
    slot-lanes key pass's operand, where it would otherwise transpose 16 rows of each table."""
    positions, half = cos.shape[0], cos.shape[-1] // 2
    tiles = -(-positions // 16)
    padded = cos.new_zeros(tiles * 16, 2, half)  # [positions rounded up, (cos, sin), channel]
    padded[:positions, 0] = cos[:, :half]
    padded[:positions, 1] = sin[:, :half]
    # [tiles, 16 positions, 2, half] -> [tiles, 2, half, 16 positions]
    return padded.view(tiles, 16, 2, half).permute(0, 2, 3, 1).contiguous()


def set_int8_prefetch(on: bool) -> None:
    """Whether the in-register int8 path prefetches the next tile's rows (default True): read
    in place, a KV head's rows at a time; with the copy (set_int8_stage), in address order. An
    A/B switch, as set_int8_fused."""
    load_quant_kernels().pertoken_set_int8_prefetch(int(bool(on)))


def set_int8_stage(on: bool | None) -> None:
    """Whether the in-register int8 path first copies each tile's rows in address order into a
    buffer (True), reads them in place a KV head at a time (False), or decides by the layer's
    shape (None: the copy where a slot's row of every KV head is >= 512 bytes and head_dim >=
    128, whose rows a KV head apart this EPYC's prefetchers do not follow): an A/B switch, as
    set_int8_fused. The default is the build's: None on AVX2 builds (measured on an EPYC),
    False on AVX-512 ones (measured on a Xeon); `int8_stage()` tells."""
    load_quant_kernels().pertoken_set_int8_stage(-1 if on is None else int(bool(on)))


def int8_stage() -> bool | None:
    """The in-register int8 path's current setting (set_int8_stage): True, False or None."""
    mode = load_quant_kernels().pertoken_int8_stage()
    return None if mode < 0 else bool(mode)


def int8_stages(num_kv_heads: int, head_dim: int) -> bool:
    """Whether the in-register int8 path copies the tiles of a layer of this shape, under the
    current setting (set_int8_stage)."""
    return bool(load_quant_kernels().pertoken_int8_stage_fits(num_kv_heads, head_dim))


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _check(status: int) -> None:
    if status != 0:
        raise MemoryError("quantized decode attention could not allocate its scratch buffers")


def pertoken_decode(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, fmt: str,
                    k_codes: torch.Tensor, v_codes: torch.Tensor, k_scales: torch.Tensor,
                    v_scales: torch.Tensor, runs: DecodeRuns, scale: float,
                    rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                    ) -> torch.Tensor:
    """q: [B, Hq, D]; k_new, v_new: [B, Hkv, D] float32 (the step's own tokens, keys after RoPE);
    one layer's codes [num_blocks, block_size, Hkv, D] uint8 and scales [num_blocks,
    block_size, Hkv] float32, contiguous; runs: each request's cached slots without the new
    token; rope: (slot_positions [num_blocks, block_size] int32, cos, sin [positions, rot_dim])
    when the keys are stored before RoPE. Returns [B, Hq, D]."""
    num_requests, num_q_heads, head_dim = q.shape
    num_kv_heads = k_codes.shape[-2]
    qs = (q.float() * scale).contiguous()  # [B, Hq, D]
    kn, vn = k_new.float().contiguous(), v_new.float().contiguous()  # [B, Hkv, D]
    out = torch.empty_like(qs)
    pos, cos, sin = rope if rope is not None else (None, None, None)
    _check(load_quant_kernels().pertoken_decode_attention(
        qs.data_ptr(), k_codes.data_ptr(), v_codes.data_ptr(), k_scales.data_ptr(),
        v_scales.data_ptr(), kn.data_ptr(), vn.data_ptr(), out.data_ptr(),
        runs.run_ptr.data_ptr(), runs.run_start.data_ptr(), runs.run_len.data_ptr(),
        _ptr(pos), _ptr(cos), _ptr(sin), 0 if cos is None else cos.shape[-1],
        num_requests, num_q_heads, num_kv_heads, head_dim, PERTOKEN_FORMATS[fmt]))
    return out


def kvquant_decode(layer: KVQuantLayer, q: torch.Tensor, k_new: torch.Tensor,
                   v_new: torch.Tensor, blk_ptr: torch.Tensor, blk_ids: torch.Tensor,
                   past: torch.Tensor, scale: float, skip: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """q: [B, Hq, D]; k_new, v_new: [B, Hkv, D]; request i's cached slots are the first past[i]
    slots of blocks blk_ids[blk_ptr[i]:blk_ptr[i + 1]] (int64 tensors), less the first skip[i]
    slots of its first block (a sliding window's start, < the block size; None: none). Returns
    [B, Hq, D]."""
    qs = (q.float() * scale).contiguous()  # [B, Hq, D]
    kn, vn = k_new.float().contiguous(), v_new.float().contiguous()  # [B, Hkv, D]
    out = torch.empty_like(qs)
    _check(load_quant_kernels().kvquant_decode_attention(
        ctypes.byref(layer), qs.data_ptr(), kn.data_ptr(), vn.data_ptr(), out.data_ptr(),
        blk_ptr.data_ptr(), blk_ids.data_ptr(), past.data_ptr(),
        None if skip is None else skip.data_ptr(), q.shape[0]))
    return out


def kvquant_read(layer: KVQuantLayer, blk_ids: torch.Tensor, num_slots: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The first num_slots slots of blocks blk_ids (int64) decoded: (keys, values), each
    [num_slots, Hkv, D] float32, keys after RoPE (what `store.read_blocks` gives, in C)."""
    shape = (num_slots, layer.num_kv_heads, layer.head_dim)
    k_out, v_out = torch.empty(shape), torch.empty(shape)
    _check(load_quant_kernels().kvquant_read_blocks(
        ctypes.byref(layer), blk_ids.data_ptr(), blk_ids.numel(), num_slots, k_out.data_ptr(),
        v_out.data_ptr()))
    return k_out, v_out
