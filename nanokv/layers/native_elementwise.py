"""The decoder layer's fused element-wise kernels (`csrc/fused_elementwise.c`): RMSNorm, the
residual add with RMSNorm, per-head norm + RoPE, SiLU-and-multiply, on float32 CPU tensors.

PyTorch composes each of these from several element-wise ops, each a pass over the activations:
the rotate-half RoPE alone is six (`chunk`, `neg`, `cat`, two `mul`, `add`). Over a 4096-token
prefill chunk of the Qwen3-0.6B shape they take about 14% of the step here; fused, each reads
its input once and writes its output once. The references are the PyTorch paths next to each
call (`RMSNorm.reference`, `rotary.apply_rotary`, `F.silu(gate) * up`); the model takes these
kernels with its oneDNN linear layers (`linear_backend` auto / onednn on CPU,
`LlamaForCausalLM.use_native_elementwise`). Built on first use like the decode kernels
(`native_build.build_library`).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from nanokv.layers.native_build import LazyLibrary

SOURCE = Path(__file__).with_name("csrc") / "fused_elementwise.c"
MAX_HEAD_DIM = 1024  # the kernel's per-head scratch


def _setup(lib: ctypes.CDLL) -> None:
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.rms_norm.argtypes = [p, i64, p, p, i64, i64, f32]
    lib.add_rms_norm.argtypes = [p, p, p, p, i64, i64, f32]
    lib.head_norm_rope.argtypes = [p, i64, i64, i64, i64, p, f32, p, p, p, i64, p, p]
    lib.silu_mul.argtypes = [p, p, i64, i64]
    for fn in (lib.rms_norm, lib.add_rms_norm, lib.head_norm_rope, lib.silu_mul):
        fn.restype = ctypes.c_int


_LIBRARY = LazyLibrary(SOURCE, _setup)


def load_elementwise() -> ctypes.CDLL:
    """The library; raises NativeKernelUnavailable (with the reason) when it cannot be built."""
    return _LIBRARY.get()


def elementwise_available() -> bool:
    return _LIBRARY.available()


def _cpu_f32(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def fits_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Can the norm kernels take x [..., dim] with weight [dim]: float32 CPU, x contiguous."""
    return (_cpu_f32(x, weight) and x.dim() >= 1 and weight.dim() == 1
            and x.shape[-1] == weight.shape[0] and x.is_contiguous() and weight.is_contiguous())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., dim] -> x * rsqrt(mean(x^2) + eps) * weight, same shape."""
    if not fits_rows(x, weight):
        raise ValueError(f"rms_norm takes contiguous float32 CPU x [..., {weight.shape[0]}] and "
                         f"weight [dim], got x {tuple(x.shape)} {x.dtype} {x.device}")
    dim = x.shape[-1]
    out = torch.empty_like(x)
    load_elementwise().rms_norm(x.data_ptr(), dim, weight.data_ptr(), out.data_ptr(),
                                x.numel() // max(dim, 1), dim, eps)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x (in place); returns (rms_norm(residual), residual)."""
    if not (fits_rows(x, weight) and fits_rows(residual, weight) and x.shape == residual.shape):
        raise ValueError(f"add_rms_norm takes two contiguous float32 CPU tensors of one shape "
                         f"[..., {weight.shape[0]}], got {tuple(x.shape)} and "
                         f"{tuple(residual.shape)}")
    dim = x.shape[-1]
    out = torch.empty_like(x)
    load_elementwise().add_rms_norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(),
                                    out.data_ptr(), x.numel() // max(dim, 1), dim, eps)
    return out, residual


def fits_heads(x: torch.Tensor, cos: torch.Tensor, positions: torch.Tensor) -> bool:
    """Can `head_norm_rope` take x [T, H, D]: float32 CPU, heads packed in each row (a view
    of the qkv projection's output is fine), tables [P, rot_dim] contiguous, positions int64."""
    return (_cpu_f32(x, cos) and x.dim() == 3 and x.stride(2) == 1
            and x.stride(1) == x.shape[2] and x.shape[2] <= MAX_HEAD_DIM
            and cos.dim() == 2 and cos.is_contiguous() and positions.dtype == torch.int64
            and positions.device.type == "cpu" and positions.dim() == 1
            and positions.shape[0] == x.shape[0])


def head_norm_rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, norm_weight: torch.Tensor | None = None,
                   eps: float = 0.0, keep_pre: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [T, H, D] (per-head RMSNorm with norm_weight [D] first, when given) rotated to
    positions [T] by tables cos / sin [P, rot_dim] (rotate-half; channels past rot_dim pass
    through). Returns (rotated [T, H, D], the normed unrotated heads when keep_pre, else None).
    Positions must lie in [0, P): the caller's positions index its own tables."""
    if not fits_heads(x, cos, positions) or sin.shape != cos.shape or not sin.is_contiguous():
        raise ValueError(f"head_norm_rope takes float32 CPU x [T, H, D] with packed heads, "
                         f"int64 positions [T] and contiguous cos / sin [P, rot_dim]; got x "
                         f"{tuple(x.shape)} stride {x.stride()}, cos {tuple(cos.shape)}")
    num_tokens, heads, dim = x.shape
    rot_dim = cos.shape[1]
    if rot_dim > dim or rot_dim % 2:
        raise ValueError(f"rot_dim {rot_dim} must be even and <= head_dim {dim}")
    if norm_weight is not None and not (fits_rows(norm_weight, norm_weight)
                                        and norm_weight.shape == (dim,)):
        raise ValueError(f"norm_weight must be a float32 CPU [{dim}] tensor")
    positions = positions.contiguous()
    out = torch.empty(num_tokens, heads, dim)
    pre = torch.empty(num_tokens, heads, dim) if keep_pre else None
    status = load_elementwise().head_norm_rope(
        x.data_ptr(), x.stride(0), num_tokens, heads, dim,
        None if norm_weight is None else norm_weight.data_ptr(), eps, cos.data_ptr(),
        sin.data_ptr(), positions.data_ptr(), rot_dim, out.data_ptr(),
        None if pre is None else pre.data_ptr())
    if status != 0:  # checked above
        raise RuntimeError("head_norm_rope refused its inputs")
    return out, pre


def fits_gate_up(gate_up: torch.Tensor) -> bool:
    """Can `silu_mul` take it: a contiguous float32 CPU [T, 2 * inter] tensor."""
    return (_cpu_f32(gate_up) and gate_up.dim() == 2 and gate_up.is_contiguous()
            and gate_up.shape[1] % 2 == 0)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 I] (gate first) -> silu(gate) * up [T, I]."""
    if not fits_gate_up(gate_up):
        raise ValueError(f"silu_mul takes a contiguous float32 CPU [T, 2 * inter] tensor, got "
                         f"{tuple(gate_up.shape)} {gate_up.dtype} {gate_up.device}")
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_tokens, inter)
    load_elementwise().silu_mul(gate_up.data_ptr(), out.data_ptr(), num_tokens, inter)
    return out
