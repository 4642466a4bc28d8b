"""Load a Hugging Face checkpoint directory: config, safetensors weights (strict), tokenizer,
generation config."""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from dataclasses import dataclass

import torch
from safetensors import safe_open

from nanokv.layers.int8_weights import QUANTIZATIONS
from nanokv.layers.linear import onednn_available
from nanokv.models.registry import model_class
from nanokv.utils import head_dim_of
from nanokv.worker.cpu_memory import release_free_heap

logger = logging.getLogger("nanokv")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    hf_config: object
    dtype: torch.dtype
    device: torch.device
    eos_token_ids: tuple[int, ...]
    tokenizer: object | None
    dtype_note: str  # why this dtype was chosen (printed at start-up)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available; use 'cpu' or 'auto'")
    return torch.device(device)


def cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(requested: str, checkpoint_dtype: torch.dtype | None,
                  device: torch.device) -> tuple[torch.dtype, str]:
    if requested != "auto":
        return _DTYPES[requested], f"dtype {requested} (requested)"
    ckpt = checkpoint_dtype or torch.float32
    if ckpt == torch.float32:
        return ckpt, "dtype float32 (checkpoint dtype)"
    if device.type == "cuda":
        if ckpt == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            return torch.float16, "dtype float16 (this GPU has no native bfloat16)"
        return ckpt, f"dtype {str(ckpt).removeprefix('torch.')} (checkpoint dtype)"
    if ckpt == torch.bfloat16 and cpu_has_native_bf16():
        return ckpt, "dtype bfloat16 (checkpoint dtype; this CPU has native bf16)"
    return torch.float32, (f"dtype float32: the checkpoint is {str(ckpt).removeprefix('torch.')} "
                           f"but this CPU has no native support for it")


def load_hf_config(path: str):
    if not os.path.isdir(path):
        raise ValueError(f"model path {path!r} is not a directory; expected a local Hugging Face "
                         f"checkpoint directory with config.json and *.safetensors")
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise ValueError(f"{cfg_file} is missing: a model directory needs config.json")
    try:
        with open(cfg_file) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{cfg_file} is not valid JSON: {e}") from None
    archs = raw.get("architectures") or []
    if not archs:
        raise ValueError(f"{cfg_file} names no 'architectures'")
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(path)
    except Exception as e:  # transformers raises many types for a bad config
        raise ValueError(f"could not parse {cfg_file}: {e}") from None
    try:  # a multimodal checkpoint's text part (Gemma 3): what the engine builds and reads
        cfg = model_class(archs[0]).text_config(cfg)
    except ValueError:
        pass  # an architecture nanokv does not run: refused where the model is built
    return cfg, archs[0]


def checkpoint_dtype(cfg) -> torch.dtype | None:
    dt = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
    if isinstance(dt, str):
        return _DTYPES.get(dt)
    return dt if isinstance(dt, torch.dtype) else None


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index} is not a valid safetensors index: {e}") from None
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights found in {path}")
    full = [os.path.join(path, f) for f in files]
    for f in full:
        if not os.path.isfile(f):
            raise ValueError(f"weight file {f} listed in the index is missing")
    return full


def load_weights(model: torch.nn.Module, path: str, on_loaded=None) -> None:
    """Copy checkpoint tensors into the model; raise on missing, unexpected or mis-shaped ones.
    A tensor-parallel model (`model.tp`) takes its rank's shard of each (the full tensor's shape
    is what is checked). A parameter still on the meta device (`load_model` defers int8
    quantization's linear weights so) is allocated when its first tensor arrives;
    `on_loaded(name)`, where given, is called as soon as a parameter holds every tensor it
    takes (all parts of a packed one), in the checkpoint's order."""
    params = dict(model.named_parameters())
    ranks = 1 if getattr(model, "tp", None) is None else model.tp.size
    if ranks > 1:
        from nanokv.distributed.tp_layers import param_shard
    # checkpoint tensor name -> (parameter name, dim-0 offset, rows, tensor-parallel shard or
    # None) for every slot to fill
    targets: dict[str, tuple[str, int, int, object]] = {}
    for name, param in params.items():
        if name.startswith("lm_head") and model.tie_word_embeddings:
            continue
        ckpt_name = model.checkpoint_name(name)
        shard = param_shard(model, name) if ranks > 1 else None
        packed = next(((src, dst, idx) for src, (dst, idx) in model.packed_modules.items()
                       if f".{dst}." in ckpt_name), None)
        if packed is None:
            targets[ckpt_name] = (name, 0, param.shape[0], shard)
            continue
        src, dst, _ = packed
        sizes = [n // ranks for n in _packed_sizes(model, dst, param)]  # this rank's rows
        siblings = [s for s, (d, _) in model.packed_modules.items() if d == dst]
        for s in siblings:
            idx = model.packed_modules[s][1]
            offset = sum(sizes[:idx])
            targets[ckpt_name.replace(f".{dst}.", f".{s}.")] = (name, offset, sizes[idx], shard)
    slots_left = Counter(name for name, *_ in targets.values())  # parameter -> tensors to come
    device = next((p.device for p in params.values() if not p.is_meta), torch.device("cpu"))

    def materialized(name: str) -> torch.nn.Parameter:
        param = params[name]
        if param.is_meta:  # deferred: allocated now, filled by this and its packed siblings
            owner, _, attr = name.rpartition(".")
            param = torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype,
                                                   device=device), requires_grad=False)
            setattr(model.get_submodule(owner), attr, param)
            params[name] = param
        return param

    loaded: dict[str, str] = {}  # tensor -> the file it came from
    skip_suffixes = ("rotary_emb.inv_freq",)
    for file in safetensors_files(path):
        try:
            handle = safe_open(file, framework="pt", device="cpu")
        except Exception as e:
            raise ValueError(f"weight file {file} is unreadable or corrupt: {e}") from None
        with handle:
            for key in handle.keys():
                if key.endswith(skip_suffixes) or key.startswith(model.ignored_tensors):
                    continue
                if key == "lm_head.weight" and model.tie_word_embeddings:
                    continue  # tied embeddings: the checkpoint may carry a copy
                if key not in targets:
                    raise ValueError(f"unexpected tensor {key!r} in {file}")
                if key in loaded:
                    raise ValueError(f"tensor {key!r} appears twice in the checkpoint: in "
                                     f"{loaded[key]} and in {file}")
                try:
                    tensor = handle.get_tensor(key)
                except Exception as e:
                    raise ValueError(f"tensor {key!r} in {file} is unreadable: {e}") from None
                name, offset, rows, shard = targets[key]
                local = (rows,) + tuple(params[name].shape[1:])
                expected = local if shard is None else shard.full_shape(local)
                if tuple(tensor.shape) != expected:
                    raise ValueError(f"tensor {key!r} has shape {tuple(tensor.shape)}, "
                                     f"expected {expected}")
                if shard is not None:
                    tensor = shard.take(tensor, local)
                with torch.no_grad():
                    materialized(name).data[offset:offset + rows].copy_(tensor)
                del tensor
                loaded[key] = file
                slots_left[name] -= 1
                if slots_left[name] == 0:
                    del params[name]  # not held here past its load (int8 frees the float copy)
                    if on_loaded is not None:
                        on_loaded(name)
    missing = sorted(set(targets) - set(loaded))
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} tensor(s), e.g. {missing[:5]}")


def _packed_sizes(model, dst: str, param: torch.nn.Parameter) -> list[int]:
    cfg = model.config
    if dst == "qkv_proj":
        head_dim = head_dim_of(cfg)
        q = cfg.num_attention_heads * head_dim
        kv = cfg.num_key_value_heads * head_dim
        return [q, kv, kv]
    if dst == "gate_up_proj":  # a dense MLP's or an expert's: half the packed rows each
        width = param.shape[0] * (1 if model.tp is None else model.tp.size) // 2
        return [width, width]
    raise ValueError(f"unknown packed module {dst}")


def check_quantization(quantization: str, dtype: str, device: torch.device) -> None:
    """Where weight-only int8 runs: CPU (the panel kernel), float32 activations (dtype auto or
    float32). ValueError otherwise."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)} or None, got "
                         f"{quantization!r}")
    if device.type != "cpu":
        raise ValueError(f"quantization {quantization!r} runs on CPU (its kernel is the CPU "
                         f"panel kernel); device is {device.type}")
    if dtype not in ("auto", "float32"):
        raise ValueError(f"quantization {quantization!r} computes in float32 (int8 weights, "
                         f"float32 activations); dtype must be auto or float32, got {dtype!r}")


def load_eos_token_ids(path: str, cfg, tokenizer) -> tuple[int, ...]:
    ids: list[int] = []
    gen_file = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_file):
        try:
            with open(gen_file) as f:
                eos = json.load(f).get("eos_token_id")
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{gen_file} is not valid JSON: {e}") from None
        ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    if not ids:
        eos = getattr(cfg, "eos_token_id", None)
        ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    if not ids and tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(int(i) for i in ids))


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    if not os.path.isdir(path):  # nothing is downloaded: a tokenizer is a local directory
        raise ValueError(f"tokenizer directory {path} does not exist (nanokv reads tokenizers "
                         f"from local directories); pass a tokenizer directory, or "
                         f"skip_tokenizer_init=True for token-id prompts")
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise ValueError(f"could not load a tokenizer from {path}: {e}. Pass a tokenizer "
                         f"directory, or skip_tokenizer_init=True for token-id prompts") from None


def materialize(model: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                deferred=()) -> torch.nn.Module:
    """A model built on the meta device, allocated on `device` in `dtype` (uninitialized),
    except the weights of the `deferred` linear layers: they stay on the meta device, in
    `dtype`, for `load_weights` to allocate as their tensors arrive."""
    shapes = {}
    for module in deferred:
        shapes[module] = module.weight.shape
        module.weight = None  # skipped by to_empty
    model = model.to_empty(device=device).to(dtype)
    for module, shape in shapes.items():
        module.weight = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"),
                                           requires_grad=False)
    return model


def load_model(model_path: str, dtype: str = "auto", device: str = "auto",
               max_positions: int | None = None, tokenizer_path: str | None = None,
               skip_tokenizer_init: bool = False, linear_backend: str = "auto",
               tp=None, quantization: str | None = None) -> LoadedModel:
    """tp: this rank's `nanokv.distributed.parallel_state.TensorParallel` (None: the whole
    model in this process). quantization "int8": the linear layers' weights become int8 codes
    with a scale per output row (`LlamaForCausalLM.quantize_int8`; CPU, float32 activations;
    every rank quantizes its shard with the whole rows' scales)."""
    cfg, arch = load_hf_config(model_path)
    cls = model_class(arch)
    dev = resolve_device(device)
    if quantization is not None:
        check_quantization(quantization, dtype, dev)
        dtype = "float32"  # int8 weights take float32 activations
    torch_dtype, note = resolve_dtype(dtype, checkpoint_dtype(cfg), dev)
    n_pos = max_positions or cfg.max_position_embeddings
    cls.layer_windows(cfg, n_pos)  # refuses a sliding window nanokv cannot apply as HF does
    with torch.device("meta"):
        model = cls(cfg, n_pos) if tp is None else cls(cfg, n_pos, tp=tp)
    # int8: each linear weight is allocated when its first tensor is read and quantized once
    # it holds all of them, so at most about one layer's float weights are held at a time
    int8 = set(model.int8_layers()) if quantization is not None else set()
    quantized = {f"{name}.weight": m for name, m in model.named_modules() if m in int8}
    model = materialize(model, dev, torch_dtype, deferred=quantized.values())
    for rotary in model.rotaries():
        rotary.build_tables(dev)

    def on_loaded(name: str) -> None:
        if name in quantized:
            quantized[name].quantize_int8()
        elif name == "embed_tokens.weight" and quantization is not None:
            model.quantize_embedding_int8()  # (with a tied LM head's codes)
        else:
            return
        release_free_heap()  # the float weight's pages, before the next is allocated

    load_weights(model, model_path, on_loaded=on_loaded)
    model.loaded()
    model.tie_weights()
    model.eval()
    if quantization is not None:
        layers = model.quantize_int8()  # any left (none where the checkpoint held them all)
        note += f", int8 weights ({layers} linear layers, a scale per output row)"
        release_free_heap()  # the float weights' memory, freed between the codes
    backend = linear_backend
    if backend == "auto":
        backend = "onednn" if dev.type == "cpu" and onednn_available() else "torch"
    if backend == "onednn":
        if dev.type != "cpu" or not onednn_available():
            raise ValueError("linear_backend 'onednn' needs a CPU build of PyTorch with oneDNN")
        model.pack_linear_weights()
        if model.use_native_elementwise():  # the fused C norm / RoPE / SiLU kernels
            silu = any(getattr(m, "act", None) == "silu" for m in model.modules())
            note += ", fused C norm / RoPE" + (" / SiLU-and-multiply" if silu else "")
    tokenizer = None if skip_tokenizer_init else load_tokenizer(tokenizer_path or model_path)
    eos = load_eos_token_ids(model_path, cfg, tokenizer)
    note += f", {backend} linear layers"
    return LoadedModel(model, cfg, torch_dtype, dev, eos, tokenizer, note)
