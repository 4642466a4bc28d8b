"""The few-rows linear kernel (`csrc/small_linear.c`) against F.linear in float64: 1-16 rows
(on AVX2 builds: groups of 4 rows of x, the last one shorter), vocabulary sizes that are not
multiples of 16, head sizes that are not multiples of 16 (the plain-C rows), a bias; bad inputs
refused; the tied LM head of a loaded model takes it; and the same checks built without AVX-512
(the AVX2 rows) and without AVX2 (plain C)."""

import pytest
import torch
from narrow_builds import run_narrow_build

from nanokv.layers import native_linear
from nanokv.layers.native_attention import NativeKernelUnavailable

try:
    native_linear.load_small_linear()
except NativeKernelUnavailable as e:  # no C compiler with OpenMP here
    pytest.skip(f"few-rows kernel unavailable: {e}", allow_module_level=True)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 13, 16])
@pytest.mark.parametrize("n,k", [(4096, 256), (1000, 64), (77, 48), (33, 40), (130, 16)])
def test_equals_f_linear(rows, n, k):
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen) if n % 2 else None
    got = native_linear.small_m_linear(x, w, bias)
    ref = torch.nn.functional.linear(x.double(), w.double(),
                                     None if bias is None else bias.double())
    torch.testing.assert_close(got, ref.float(), atol=1e-4, rtol=1e-5)


def test_bad_inputs_are_refused():
    w = torch.randn(32, 16)
    for x in (torch.randn(17, 16), torch.randn(0, 16), torch.randn(2, 8),
              torch.randn(2, 16, dtype=torch.float64)):
        assert not native_linear.fits(x, w)
        with pytest.raises(ValueError, match="small_m_linear takes"):
            native_linear.small_m_linear(x, w)
    with pytest.raises(ValueError, match="bias must be"):
        native_linear.small_m_linear(torch.randn(2, 16), w, torch.randn(31))


def test_the_tied_lm_head_takes_it(tiny_qwen3):
    """A model loaded with oneDNN linear layers: its tied LM head sets few_rows and gives
    F.linear's logits for a few rows (and still the packed path for more)."""
    from nanokv.layers.linear import onednn_available
    from nanokv.worker.loader import load_model

    if not onednn_available():
        pytest.skip("no oneDNN in this PyTorch build")
    loaded = load_model(tiny_qwen3, device="cpu", dtype="float32", skip_tokenizer_init=True)
    head = loaded.model.lm_head
    assert head.few_rows and loaded.model.tie_word_embeddings
    for rows in (3, 40):
        x = torch.randn(rows, head.in_features)
        torch.testing.assert_close(head(x), torch.nn.functional.linear(x, head.weight),
                                   atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("flags", ["-mno-avx512f", "-mno-avx2"])
def test_a_narrower_build_equals_f_linear(tmp_path, flags):
    """The AVX2 rows (built without AVX-512) and the plain-C rows (without AVX2, which every CPU
    builds): the same checks with the library built that way."""
    run_narrow_build(__file__, "test_equals_f_linear", tmp_path, "small_linear", flags=flags,
                     timeout=300)
