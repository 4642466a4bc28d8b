"""Compile every Triton kernel variant the `triton` attention backend launches, for a CUDA GPU
target, on a machine without one (Triton's compiler and its bundled ptxas need no driver).

The interpreter (how the tests run the kernels on CPU) checks their logic but not what only the
compiler sees: types across branches and loops, tl.dot's shapes and operand types, constexpr
use, register and shared-memory limits. This runs the backend's launchers on CPU tensors with the
kernels replaced by recorders, then compiles each recorded launch to a cubin.

    .venv/bin/python scripts/compile_triton_kernels.py [--arch 90] [--quick]

Shapes: Qwen3-0.6B's attention (16 query heads, 8 KV heads, head dim 128, block size 16) in
bfloat16 over the float pool and the int8 / fp8 stores and the KVQuant decode kernel over a
4-bit store with keys before RoPE (with --quick: one split; else also 2-bit with outliers and
sinks, and KIVI), every prefill view also with a sliding window, the read of their blocks into
a prefill's scratch cache (and of partial blocks from given staging rows) and the prefill over it
in decode's view, KVQuant's
quantize-on-write (4-bit; else also 2-, 3- and 8-bit) and KIVI's (2-bit keys and values; else
also 4-bit), plus a
float32 pool with GQA 8 and head dim 64 (the dot in IEEE float32); the float pool's decode and
prefill also with an attention logit soft-cap (Gemma 2's).
Exits non-zero on the first failure, naming the variant.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("unset TRITON_INTERPRET: this compiles the kernels, it does not interpret them")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from nanokv.kernels.triton import (  # noqa: E402
    decode,
    kivi_write,
    kv_write,
    kvquant_decode,
    kvquant_read,
    kvquant_write,
    prefill,
)
from nanokv.kernels.triton.paged_kv import FORMATS, PagedKV  # noqa: E402

_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
          torch.uint8: "u8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64"}


class Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` records the launch."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.launches: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


def signature(kernel, args: tuple, kwargs: dict) -> tuple[dict, dict, dict, dict]:
    """(signature, constexprs, attributes, options) of one recorded launch, specialised as
    Triton's launcher does: pointers 16-byte aligned and integers divisible by 16 marked so
    (unless the kernel opts out for that argument)."""
    names = kernel.arg_names
    constexprs = {p.name: kwargs[p.name] for p in kernel.params if p.is_constexpr}
    sig, attrs = {}, {}
    for i, (name, value) in enumerate(zip(names, args)):
        aligned, param = False, kernel.params[i]
        if isinstance(value, torch.Tensor):
            sig[name] = "*" + _TYPES[value.dtype]
            aligned = value.data_ptr() % 16 == 0 and not param.do_not_specialize_on_alignment
        elif isinstance(value, bool):
            sig[name] = "i1"
        elif isinstance(value, int):
            sig[name] = "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
            aligned = value % 16 == 0 and not param.do_not_specialize
        elif isinstance(value, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{name}: {type(value).__name__}")
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    for name in constexprs:
        sig[name] = "constexpr"
    options = {k: v for k, v in kwargs.items()
               if k in ("num_warps", "num_stages", "enable_fp_fusion")}
    return sig, constexprs, attrs, options


def resource_usage(cubin: bytes) -> str:
    """Registers, stack and local memory (spills) per thread, from the bundled cuobjdump."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True,
                                  check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return "resources ?"
    found = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", text))
    return f"regs {found.get('REG', '?')} stack {found.get('STACK', '?')} " \
           f"local {found.get('LOCAL', '?')}"


def caches(dtype: torch.dtype, heads: int, dim: int, block_size: int, num_blocks: int = 8):
    """The float pool's layer view and each code format's, as the backend builds them."""
    shape = (num_blocks, block_size, heads, dim)
    out = {"float": PagedKV(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))}
    for name, fmt in FORMATS.items():
        codes = torch.zeros(shape, dtype=torch.uint8)
        scales = torch.zeros(shape[:3])
        out[name] = PagedKV(codes, codes.clone(), scales, scales.clone(), fmt)
    return out


def record(dtype, hq, hkv, dim, block_size, quick: bool) -> None:
    """Run the launchers as the backend does (its tile sizes), on CPU tensors."""
    from nanokv.attention.triton_paged import TritonPagedBackend as B

    t, rows = 40, 4
    tile_n, block_rows = B.tiles_for(dtype)
    q = torch.zeros(t, hq, dim, dtype=dtype)
    k = torch.zeros(t, hkv, dim, dtype=dtype)
    i32 = torch.zeros(8, dtype=torch.int32)
    tables = torch.zeros(rows, 4, dtype=torch.int32)
    for name, kv in caches(dtype, hkv, dim, block_size).items():
        if quick and name not in ("float", "int8"):
            continue
        kv_write.write_kv(k, k, torch.zeros(t, dtype=torch.long), kv)
        out = torch.empty_like(q)
        decode_tile_n = B.decode_launch(dtype, kv.kv_format)[0]
        for splits in (1, 4):
            decode.decode_attention(q[:rows], k[:rows], k[:rows], kv, tables, i32[:rows],
                                    out[:rows], 0.1, splits, decode_tile_n, B.num_warps,
                                    B.num_stages)
        prefill.prefill_attention(q, k, k, kv, i32[:2], i32[:2], i32[:2], tables[:2], 20, out,
                                  0.1, block_rows, tile_n, B.num_warps)
        # a sliding window's prefill variant (the decode kernel takes the window at run time)
        prefill.prefill_attention(q, k, k, kv, i32[:2], i32[:2], i32[:2], tables[:2], 20, out,
                                  0.1, block_rows, tile_n, B.num_warps, window=4096)
        if name == "float":  # an attention logit soft-cap (Gemma 2's 50): a constexpr variant
            for splits in (1, 4):
                decode.decode_attention(q[:rows], k[:rows], k[:rows], kv, tables, i32[:rows],
                                        out[:rows], 0.1, splits, decode_tile_n, B.num_warps,
                                        B.num_stages, soft_cap=50.0)
            for window in (None, 4096):
                prefill.prefill_attention(q, k, k, kv, i32[:2], i32[:2], i32[:2], tables[:2], 20,
                                          out, 0.1, block_rows, tile_n, B.num_warps,
                                          window=window, soft_cap=50.0)


def record_quant(dtype, hq, hkv, dim, block_size, quick: bool) -> None:
    """The KVQuant / KIVI decode launcher over CPU stores, as the backend calls it."""
    from nanokv.attention.triton_paged import TritonPagedBackend
    from nanokv.attention.triton_quantized import kivi_views, kvquant_views
    from nanokv.cache.kv_pool import KVLayout
    from nanokv.layers.rotary import RotaryEmbedding
    from nanokv.quant import KVQuantConfig, KVQuantStore
    from nanokv.quant.kivi_store import KIVIStore

    class Rope:
        rope_parameters = {"rope_type": "default", "rope_theta": 1000000.0}

    lay = KVLayout(1, hkv, dim, block_size, torch.float32)
    configs = [KVQuantConfig(bits=4)] if quick else [
        KVQuantConfig(bits=4), KVQuantConfig(bits=2, outlier_fraction=0.02, num_sink_tokens=3)]
    stores = [KVQuantStore(lay, 8, c, num_staging_blocks=4) for c in configs]
    for store in stores:
        store.rotary = RotaryEmbedding(Rope(), dim, 4096)
    views = [kvquant_views(s, 0, kvquant_decode.QuantLayerViews) for s in stores]
    if not quick:
        kivi = KIVIStore.from_settings(lay, 8, "cpu", bits=2, num_staging_blocks=4)
        views.append(kivi_views(kivi, 0, kvquant_decode.QuantLayerViews))
    rows = 4
    q = torch.zeros(rows, hq, dim, dtype=dtype)
    k = torch.zeros(rows, hkv, dim, dtype=dtype)
    tables = torch.zeros(rows, 4, dtype=torch.int32)
    lens = torch.zeros(rows, dtype=torch.int32)
    for view in views:
        for splits in ((1,) if quick else (1, 4)):
            kvquant_decode.kvquant_decode_attention(q, k, k, view, tables, lens,
                                                    torch.empty_like(q), 0.1, splits)
    ids = torch.zeros(2, dtype=torch.int32)
    scratch = torch.zeros(2, block_size, hkv, dim, dtype=dtype)  # a prefill's prefix, decoded
    for view in views:
        kvquant_read.kvquant_read_blocks(view, ids, scratch, scratch.clone())
    # a step's prefill: the pasts' partial blocks read before the write (their staging rows
    # given), then the chunks over the scratch in decode's view (staged keys; KIVI: and values)
    kvquant_read.kvquant_read_blocks(views[0], ids, scratch, scratch.clone(), staging_rows=ids)
    tile_n, block_rows = TritonPagedBackend.tiles_for(dtype)
    paged = PagedKV(scratch, scratch.clone())
    for staged_values in ((False,) if quick else (False, True)):
        for window in (None, 4096):  # and a sliding window's variant
            prefill.prefill_attention(q, k, k, paged, ids, ids, ids, tables[:2], 4,
                                      torch.empty_like(q), 0.1, block_rows, tile_n,
                                      TritonPagedBackend.num_warps, tables[:2], scratch,
                                      scratch if staged_values else None, window)
    if not quick:  # two blocks a loop iteration (a launch variant the GPU sweep tries)
        kvquant_decode.kvquant_decode_attention(q, k, k, views[0], tables, lens,
                                                torch.empty_like(q), 0.1, 4, unroll=2)


def record_quant_write(dtype, hkv, dim, block_size, quick: bool) -> None:
    """KVQuant's quantize-on-write launches (`kvquant_write`), as the store makes them on CUDA:
    a prefill of two blocks and a half, then a decode step that fills the third."""
    from nanokv.cache.kv_pool import KVLayout
    from nanokv.quant import KVQuantConfig, KVQuantStore

    lay = KVLayout(1, hkv, dim, block_size, dtype)
    configs = [KVQuantConfig(bits=4)] if quick else [
        KVQuantConfig(bits=4), KVQuantConfig(bits=2, outlier_fraction=0.02, num_sink_tokens=3),
        KVQuantConfig(bits=3, sparse_dtype="bfloat16"),
        KVQuantConfig(bits=4, layer_bits=(8,),
                      key_codebooks=(torch.linspace(-1, 1, 256).tolist(),),
                      value_codebooks=(torch.linspace(-1, 1, 256).tolist(),))]
    prompt = 2 * block_size + block_size // 2
    for config in configs:
        store = KVQuantStore(lay, 8, config, num_staging_blocks=4)
        store.triton_write = True
        for slots in (list(range(prompt)), list(range(prompt, 3 * block_size))):
            plan = store.begin_step(slots, slots)
            x = torch.zeros(len(slots), hkv, dim, dtype=dtype)
            store.write(0, plan, x, x)


def record_kivi_write(dtype, hkv, dim, block_size, quick: bool) -> None:
    """KIVI's quantize-on-write launches (`kivi_write`, keys per channel and values in groups),
    as the store makes them on CUDA: a prefill of two blocks and a half, then a decode step
    that fills the third (2-bit; else also 4-bit)."""
    from nanokv.cache.kv_pool import KVLayout
    from nanokv.quant.kivi_store import KIVIStore

    lay = KVLayout(1, hkv, dim, block_size, dtype)
    prompt = 2 * block_size + block_size // 2
    for bits in ((2,) if quick else (2, 4)):
        store = KIVIStore.from_settings(lay, 8, "cpu", bits=bits, num_staging_blocks=4)
        store.triton_write = True
        for slots in (list(range(prompt)), list(range(prompt, 3 * block_size))):
            plan = store.begin_step(slots, slots)
            x = torch.zeros(len(slots), hkv, dim, dtype=dtype)
            store.write(0, plan, x, x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10")
    parser.add_argument("--quick", action="store_true", help="bfloat16 float pool and int8 only")
    args = parser.parse_args()
    recorders = {}
    for module, name in ((decode, "_decode_split_kernel"), (decode, "_decode_merge_kernel"),
                         (prefill, "_prefill_kernel"), (kv_write, "_write_kv_kernel")):
        recorders[name] = Recorder(getattr(module, name))
        setattr(module, name, recorders[name])
    for module, name in ((kvquant_decode, "_kvquant_decode_kernel"),
                         (kvquant_read, "_kvquant_read_kernel")):
        recorders[name] = Recorder(getattr(module, name))
        setattr(module, name, recorders[name])
    for name in ("_quantize_tokens_kernel", "_quantize_blocks_kernel", "_scatter_rows_kernel"):
        recorders[name] = Recorder(getattr(kvquant_write, name))
        setattr(kvquant_write, name, recorders[name])
    recorders["kivi_quantize_blocks"] = Recorder(kivi_write._quantize_blocks_kernel)
    kivi_write._quantize_blocks_kernel = recorders["kivi_quantize_blocks"]
    record(torch.bfloat16, 16, 8, 128, 16, args.quick)
    record_quant_write(torch.bfloat16, 8, 128, 16, args.quick)
    record_kivi_write(torch.bfloat16, 8, 128, 16, args.quick)
    record_quant(torch.bfloat16, 16, 8, 128, 16, args.quick)
    if not args.quick:
        record(torch.float32, 16, 2, 64, 64, quick=True)
    target = GPUTarget("cuda", args.arch, 32)
    seen = set()
    for name, rec in recorders.items():
        for launch_args, kwargs in rec.launches:
            sig, constexprs, attrs, options = signature(rec.kernel, launch_args, kwargs)
            key = (name, tuple(sorted(sig.items())), tuple(sorted(map(str, constexprs.items()))))
            if key in seen:
                continue
            seen.add(key)
            what = (f"{name} {', '.join(f'{k}={v}' for k, v in constexprs.items())} "
                    f"({', '.join(v for v in sig.values() if v.startswith('*'))})")
            start = time.time()
            try:
                compiled = triton.compile(ASTSource(rec.kernel, sig, constexprs, attrs),
                                          target=target, options=options)
            except Exception as e:
                print(f"FAILED {what}\n{type(e).__name__}: {e}", file=sys.stderr)
                sys.exit(1)
            print(f"ok {time.time() - start:4.1f}s  {resource_usage(compiled.asm['cubin'])}  "
                  f"shared {compiled.metadata.shared} B  {what}")
    print(f"{len(seen)} variants compiled for sm_{args.arch}")


if __name__ == "__main__":
    main()
