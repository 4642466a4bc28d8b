"""The seams between the engine's parts: KV cache kinds declare their costs (brute-force check
against what they allocate), attention backends are chosen once per cache and device, the
config and the model stay free of the parts they must not know, the CLI follows the config."""

import argparse
from dataclasses import fields

import pytest
import torch

from nanokv.attention.native_cpu import NativeCPUBackend
from nanokv.attention.quantized import QuantizedTorchBackend
from nanokv.attention.selector import backend_names, select_backend
from nanokv.attention.torch_paged import TorchPagedBackend
from nanokv.cache.kv_cache import KVCacheOptions
from nanokv.cache.kv_pool import KVPool
from nanokv.cache.layout import KVLayout
from nanokv.cache.registry import KV_CACHE_DTYPES, kv_cache_settings
from nanokv.cli import add_engine_args, engine_options
from nanokv.config import EngineConfig
from nanokv.layers.native_attention import NativeKernelUnavailable, load_decode_kernel
from nanokv.layers.rotary import RotaryEmbedding

CPU = torch.device("cpu")


def layout(dtype=torch.float32, block_size=16):
    return KVLayout(num_layers=3, num_kv_heads=2, head_dim=32, block_size=block_size,
                    dtype=dtype)


def allocated_bytes(cache) -> int:
    """Brute force: every tensor the cache object holds."""
    tensors = [cache.slot_positions]
    if isinstance(cache, KVPool):
        tensors.append(cache.kv)
    else:
        tensors += list(cache.buffers.values())
    return sum(t.nbytes for t in tensors)


KINDS = [(d, None) for d in KV_CACHE_DTYPES] + [("kvquant", 2), ("kvquant", 3), ("kivi", 2),
                                                 ("kivi", 4)]


@pytest.mark.parametrize("kv_cache_dtype,bits", KINDS)
def test_spec_predicts_every_allocated_byte(kv_cache_dtype, bits):
    lay = layout()
    cls, settings = kv_cache_settings(KVCacheOptions(kv_cache_dtype, 3, kv_quant_bits=bits), lay)
    spec = cls.spec(lay, settings)
    for num_blocks in (1, 7, 20):
        cache = cls.create(lay, num_blocks, CPU, settings)
        assert allocated_bytes(cache) == cache.nbytes == spec.pool_bytes(num_blocks)
        assert cache.kv_cache_dtype == spec.kv_cache_dtype
    if kv_cache_dtype == "auto":
        assert spec.bytes_per_block == lay.bytes_per_block and spec.fixed_bytes == 0
    else:  # quantized: cheaper per block than the float pool, with decode scratch declared
        assert spec.bytes_per_block < lay.bytes_per_block
        assert spec.scratch_bytes_per_block > 0


def test_kind_options_are_checked_where_the_parts_meet():
    lay = layout()
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        kv_cache_settings(KVCacheOptions("int4", 2), lay)
    with pytest.raises(ValueError, match="kv_quant_bits applies to kv_cache_dtype 'kivi', "
                                         "'kvquant' only"):
        kv_cache_settings(KVCacheOptions("int8", 2, kv_quant_bits=4), lay)
    with pytest.raises(ValueError, match="kv_quant_config applies to kv_cache_dtype 'kvquant'"):
        kv_cache_settings(KVCacheOptions("kivi", 2, kv_quant_config="x.json"), lay)
    with pytest.raises(ValueError, match="kv_quant_bits must be one of"):
        kv_cache_settings(KVCacheOptions("kvquant", 2, kv_quant_bits=5), lay)


def _kernel_builds() -> bool:
    try:
        load_decode_kernel()
    except NativeKernelUnavailable:
        return False
    return True


def test_one_backend_per_cache_and_device():
    pool = KVPool(layout(), 4, CPU)
    bf16_pool = KVPool(layout(torch.bfloat16), 4, CPU)
    _, settings = kv_cache_settings(KVCacheOptions("int8", 2), layout())
    store = kv_cache_settings(KVCacheOptions("int8", 2), layout())[0].create(
        layout(), 4, CPU, settings)
    expected_auto = NativeCPUBackend if _kernel_builds() else TorchPagedBackend
    assert select_backend("auto", pool, CPU)[0] is expected_auto
    assert select_backend("torch", pool, CPU)[0] is TorchPagedBackend
    assert select_backend("auto", bf16_pool, CPU)[0] is TorchPagedBackend
    # int8: the quantized C kernels where they build (tests/unit/test_native_quant_attention.py)
    assert select_backend("auto", store, CPU)[0].name == ("native" if _kernel_builds()
                                                          else "torch")
    assert select_backend("torch", store, CPU)[0] is QuantizedTorchBackend
    with pytest.raises(ValueError, match="CPUs only"):
        select_backend("native", store, torch.device("cuda"))
    with pytest.raises(ValueError, match="CPUs only"):
        select_backend("native", pool, torch.device("cuda"))
    assert backend_names() == ["auto", "native", "torch", "triton"]


def nanokv_imports(module: str, seen: set[str] | None = None) -> set[str]:
    """Every nanokv module `module` imports, directly or through the modules it imports (read
    from the source, imports inside functions included; the package's __init__ is left out,
    it is the public face that imports everything)."""
    import ast
    from pathlib import Path

    import nanokv

    seen = set() if seen is None else seen
    root = Path(nanokv.__file__).parent
    rel = module.removeprefix("nanokv").lstrip(".").replace(".", "/")
    path = root / f"{rel}.py" if (root / f"{rel}.py").exists() else root / rel / "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nanokv"):
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("nanokv")]
        for name in names:
            if name != "nanokv" and name not in seen:
                seen.add(name)
                nanokv_imports(name, seen)
    return seen


def test_config_imports_neither_quant_nor_policies():
    loaded = nanokv_imports("nanokv.config")
    assert not [m for m in loaded if m.startswith(("nanokv.quant", "nanokv.policies"))], loaded


def test_model_imports_no_kv_storage():
    loaded = nanokv_imports("nanokv.models.llama")
    assert not [m for m in loaded if m.startswith(("nanokv.quant", "nanokv.cache"))], loaded
    assert "nanokv.attention.common" in loaded  # it calls its attention backend


def test_cli_flags_follow_the_config_fields():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    defaults = engine_options(parser.parse_args([]))
    for f in fields(EngineConfig):
        if f.name == "model":
            continue
        assert defaults[f.name] == f.default, f.name
        assert f.metadata.get("help"), f"{f.name} has no help text"
    EngineConfig(model="m", **defaults)  # the defaults are a valid config
    flipped = engine_options(parser.parse_args(
        ["--no-prefix-caching", "--no-chunked-prefill", "--skip-tokenizer-init",
         "--block-size", "32", "--kv-policy-options", '{"window": 8}', "--kv-cache-dtype",
         "kivi", "--kv-quant-bits", "2", "--kv-cache-memory", "1GiB"]))
    assert flipped["enable_prefix_caching"] is False and flipped["enable_chunked_prefill"] is False
    assert flipped["skip_tokenizer_init"] is True and flipped["block_size"] == 32
    assert flipped["kv_policy_options"] == {"window": 8} and flipped["kv_quant_bits"] == 2
    assert flipped["kv_cache_dtype"] == "kivi" and flipped["kv_cache_memory"] == "1GiB"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "int4"])


def test_rotary_unrotate_inverts_rotate():
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=2, rope_theta=10000.0)
    rotary = RotaryEmbedding(cfg, 32, 256)
    x = torch.randn(50, 2, 32, dtype=torch.float64)
    pos = torch.randint(0, 256, (50,))
    torch.testing.assert_close(rotary.unrotate(pos, rotary.rotate(pos, x)), x)
