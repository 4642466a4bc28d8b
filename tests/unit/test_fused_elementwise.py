"""The fused element-wise kernels (`csrc/fused_elementwise.c`) against their PyTorch references
in float64: RMSNorm and the residual add with it, per-head norm + RoPE over a strided q / k view
of a qkv output (full and partial rotary, with and without the norm), SiLU-and-multiply over
extreme inputs; row counts on both sides of the threading threshold; bad inputs refused; and
the default CPU engine running them (so the Hugging Face parity tests cover them)."""

import pytest
import torch
from narrow_builds import run_narrow_build
import torch.nn.functional as F

from nanokv.layers import native_elementwise as ne
from nanokv.layers.native_attention import NativeKernelUnavailable
from nanokv.layers.norm import RMSNorm
from nanokv.layers.rotary import apply_rotary

try:
    ne.load_elementwise()
except NativeKernelUnavailable as e:  # no C compiler with OpenMP here
    pytest.skip(f"fused element-wise kernels unavailable: {e}", allow_module_level=True)


def _ref_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("rows,dim", [(1, 64), (3, 37), (7, 1024), (300, 256)])
def test_rms_norm_equals_reference(rows, dim):
    gen = _gen(rows * 7 + dim)
    x = torch.randn(rows, dim, generator=gen) * 3
    w = torch.randn(dim, generator=gen)
    torch.testing.assert_close(ne.rms_norm(x, w, 1e-6), _ref_rms(x, w, 1e-6).float(),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows,dim", [(2, 48), (200, 512)])
def test_add_rms_norm_updates_the_residual_in_place(rows, dim):
    gen = _gen(rows + dim)
    x, res = torch.randn(rows, dim, generator=gen), torch.randn(rows, dim, generator=gen)
    w = torch.randn(dim, generator=gen)
    total = x.double() + res.double()
    kept = res
    out, res_out = ne.add_rms_norm(x, res, w, 1e-5)
    assert res_out is kept
    torch.testing.assert_close(res_out, total.float(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out, _ref_rms(total, w, 1e-5).float(), atol=1e-5, rtol=1e-5)


def test_rmsnorm_module_paths_agree():
    """RMSNorm with `native` set, with and without a residual, equals the module's PyTorch
    path; an input the kernel cannot take (float64, non-contiguous) still works."""
    norm = RMSNorm(96, 1e-6)
    norm.weight.data = torch.randn(96, generator=_gen(1))
    x, res = torch.randn(5, 96, generator=_gen(2)), torch.randn(5, 96, generator=_gen(3))
    plain = norm(x)
    plain_sum_out, plain_sum = norm(x, res.clone())
    norm.native = True
    torch.testing.assert_close(norm(x), plain, atol=1e-5, rtol=1e-5)
    out, total = norm(x, res.clone())
    torch.testing.assert_close(out, plain_sum_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(total, plain_sum)
    strided = torch.randn(96, 5, generator=_gen(4)).t()
    torch.testing.assert_close(norm(strided), norm.reference(strided), atol=1e-5, rtol=1e-5)


def _tables(positions: int, rot_dim: int, seed: int):
    ang = torch.rand(positions, rot_dim // 2, generator=_gen(seed)) * 6.3
    emb = torch.cat([ang, ang], dim=-1)  # [P, rot_dim], halves repeated as RotaryEmbedding's
    return emb.cos() * 1.1, emb.sin() * 1.1  # a scaled table (YaRN's attention scaling)


@pytest.mark.parametrize("tokens", [1, 9, 700])
@pytest.mark.parametrize("heads,dim,rot_dim", [(4, 64, 64), (2, 128, 128), (3, 80, 32)])
@pytest.mark.parametrize("with_norm", [False, True])
def test_head_norm_rope_equals_reference(tokens, heads, dim, rot_dim, with_norm):
    gen = _gen(tokens * 31 + heads + dim + rot_dim)
    # q as the qkv projection leaves it: heads packed in each row, rows further apart
    qkv = torch.randn(tokens, heads * dim + 40, generator=gen)
    x = qkv[:, 8:8 + heads * dim].view(tokens, heads, dim)
    cos, sin = _tables(1000, rot_dim, tokens)
    positions = torch.randint(0, 1000, (tokens,), generator=gen)
    weight = torch.randn(dim, generator=gen) if with_norm else None
    rotated, pre = ne.head_norm_rope(x, positions, cos, sin, weight, 1e-6, keep_pre=with_norm)
    normed = _ref_rms(x, weight, 1e-6) if with_norm else x.double()
    ref = apply_rotary(normed, cos[positions].unsqueeze(1).double(),
                       sin[positions].unsqueeze(1).double(), rot_dim)
    torch.testing.assert_close(rotated, ref.float(), atol=2e-5, rtol=1e-5)
    if with_norm:
        torch.testing.assert_close(pre, normed.float(), atol=1e-5, rtol=1e-5)
    else:
        assert pre is None


def test_norm_rope_module_paths_agree(tiny_qwen3):
    """RotaryEmbedding.norm_rope on the C kernel equals its PyTorch path, keeps the unrotated
    heads when asked, and refuses positions outside its tables."""
    from nanokv.worker.loader import load_model

    model = load_model(tiny_qwen3, device="cpu", dtype="float32", skip_tokenizer_init=True,
                       linear_backend="torch").model
    rotary, attn = model.rotary, model.layers[0].self_attn
    assert not rotary.native  # the reference backend leaves the C path off
    x = torch.randn(6, attn.num_kv_heads, attn.head_dim, generator=_gen(5))
    positions = torch.tensor([0, 1, 2, 50, 7, 3])
    plain = rotary.norm_rope(positions, x, attn.k_norm, keep_pre=True)
    rotary.native = True
    fused = rotary.norm_rope(positions, x, attn.k_norm, keep_pre=True)
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    rotated, pre = rotary.norm_rope(positions, x, None, keep_pre=True)
    assert pre is x
    with pytest.raises(IndexError, match="RoPE positions"):
        rotary.norm_rope(torch.tensor([0, rotary.cos.shape[0]]), x[:2], None)


@pytest.mark.parametrize("tokens,inter", [(1, 8), (5, 33), (64, 3072)])
def test_silu_mul_equals_reference(tokens, inter):
    gen = _gen(tokens + inter)
    gate_up = torch.randn(tokens, 2 * inter, generator=gen) * 4
    gate_up[0, :4] = torch.tensor([-200.0, -88.0, 0.0, 200.0])[:min(4, inter)]
    gate, up = gate_up.double().split(inter, dim=-1)
    ref = F.silu(gate) * up
    torch.testing.assert_close(ne.silu_mul(gate_up), ref.float(), atol=1e-5, rtol=2e-6)


def test_bad_inputs_are_refused():
    w = torch.ones(16)
    for x in (torch.randn(4, 16, dtype=torch.float64), torch.randn(16, 4).t(),
              torch.randn(4, 8)):
        assert not ne.fits_rows(x, w)
        with pytest.raises(ValueError, match="rms_norm takes"):
            ne.rms_norm(x, w, 1e-6)
    with pytest.raises(ValueError, match="one shape"):
        ne.add_rms_norm(torch.randn(2, 16), torch.randn(3, 16), w, 1e-6)
    cos, sin = _tables(10, 16, 0)
    x = torch.randn(3, 2, 16)
    with pytest.raises(ValueError, match="head_norm_rope takes"):
        ne.head_norm_rope(x.transpose(1, 2), torch.zeros(3, dtype=torch.long), cos, sin)
    with pytest.raises(ValueError, match="head_norm_rope takes"):
        ne.head_norm_rope(x, torch.zeros(3, dtype=torch.int32), cos, sin)
    with pytest.raises(ValueError, match="rot_dim"):
        ne.head_norm_rope(torch.randn(3, 2, 8), torch.zeros(3, dtype=torch.long), cos, sin)
    with pytest.raises(ValueError, match="silu_mul takes"):
        ne.silu_mul(torch.randn(2, 7))


def test_the_default_cpu_engine_uses_them(tiny_qwen3):
    """linear_backend auto on CPU: the norms, RoPE and MLP take the C kernels (what the Hugging
    Face parity tests then check end to end); torch: none of them."""
    from nanokv.layers.linear import onednn_available
    from nanokv.worker.loader import load_model

    if not onednn_available():
        pytest.skip("no oneDNN in this PyTorch build")
    for backend, on in (("auto", True), ("torch", False)):
        model = load_model(tiny_qwen3, device="cpu", dtype="float32", skip_tokenizer_init=True,
                           linear_backend=backend).model
        flags = {m.native for m in model.modules() if hasattr(m, "native")}
        assert flags == {on}, backend


def test_a_build_without_avx512_equals_reference(tmp_path):
    """The same checks with the library built without AVX-512 (an AVX2 machine's width)."""
    run_narrow_build(__file__, "equals_reference and not build", tmp_path, "fused_elementwise")
