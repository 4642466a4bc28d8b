"""The few-rows linear kernel (`csrc/small_linear.c`) against F.linear in float64: 1-16 rows
(on AVX2 builds: groups of 4 rows of x, the last one shorter), vocabulary sizes that are not
multiples of 16, head sizes that are not multiples of 16 (the plain-C rows), a bias; bad inputs
refused; the tied LM head of a loaded model takes it, and a layer with oneDNN's packed weight
too only below its measured row count for oneDNN (`measure_few_rows`); and the same checks built
without AVX-512 (the AVX2 rows) and without AVX2 (plain C)."""

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


def test_onednn_crossover_is_the_first_row_count_oneDNN_wins_from():
    """The crossover from given timings: the smallest measured row count from which oneDNN
    takes under `margin` of the kernel's time at every larger one; never (MAX_ROWS + 1) when it
    loses at the largest; bad row counts refused."""
    def crossover(onednn_ratio: dict) -> int:
        return native_linear.onednn_crossover(lambda r: (1.0, onednn_ratio[r]),
                                              rows=sorted(onednn_ratio), margin=0.9)

    assert crossover({1: 1.2, 2: 1.1, 4: 0.8, 8: 0.7, 16: 0.6}) == 4
    assert crossover({1: 0.5, 2: 0.5, 4: 0.5, 8: 0.5, 16: 0.5}) == 1
    assert crossover({1: 1.2, 2: 0.5, 4: 0.95, 8: 0.7, 16: 0.6}) == 8  # 4: within the margin
    assert crossover({1: 0.5, 2: 0.5, 4: 0.5, 8: 0.5, 16: 1.0}) == native_linear.MAX_ROWS + 1
    for rows in ([0, 4], [4, 17], []):
        with pytest.raises(ValueError, match="rows must lie in"):
            native_linear.onednn_crossover(lambda r: (1.0, 1.0), rows=rows)


def test_onednn_crossover_measures_both_paths(monkeypatch):
    from nanokv.layers.linear import Linear, onednn_available

    if not onednn_available():
        pytest.skip("no oneDNN in this PyTorch build")
    layer = Linear(64, 512)
    with torch.no_grad():
        layer.weight.normal_()
    layer.pack()
    layer.few_rows = True
    measured = []
    timed = native_linear.median_seconds

    def median_seconds(fns, repeats):
        kernel_s, onednn_s = timed(fns, repeats)
        assert kernel_s > 0 and onednn_s > 0
        measured.append(fns[0]().shape[0])  # the rows timed
        return kernel_s, onednn_s

    monkeypatch.setattr(native_linear, "median_seconds", median_seconds)
    got = layer.measure_few_rows(repeats=2)
    assert measured == list(native_linear.CROSSOVER_ROWS)
    assert got in set(native_linear.CROSSOVER_ROWS) | {native_linear.MAX_ROWS + 1}
    assert layer.onednn_from_rows == got


@pytest.mark.parametrize("packed,onednn_from", [(True, 5), (True, 1), (False, 5)])
def test_few_rows_layer_takes_the_kernel_below_its_onednn_row_count(monkeypatch, packed,
                                                                     onednn_from):
    """A few-rows layer: the kernel for 1-16 rows without a packed weight (whatever
    onednn_from_rows says); with one, for fewer than onednn_from_rows rows and oneDNN from
    there on; F.linear's result either way."""
    from nanokv.layers.linear import Linear, onednn_available

    if packed and not onednn_available():
        pytest.skip("no oneDNN in this PyTorch build")
    gen = torch.Generator().manual_seed(7)
    layer = Linear(64, 300)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(300, 64, generator=gen))
    if packed:
        layer.pack()
    layer.few_rows, layer.onednn_from_rows = True, onednn_from
    calls = []
    kernel = native_linear.small_m_linear
    monkeypatch.setattr(native_linear, "small_m_linear",
                        lambda x, w, b=None: calls.append(x.shape[0]) or kernel(x, w, b))
    for rows in range(1, native_linear.MAX_ROWS + 2):
        x = torch.randn(rows, 64, generator=gen)
        ref = torch.nn.functional.linear(x.double(), layer.weight.double()).float()
        torch.testing.assert_close(layer(x), ref, atol=1e-4, rtol=1e-5)
    limit = onednn_from if packed else native_linear.MAX_ROWS + 1
    assert calls == list(range(1, limit))


def test_the_tied_lm_head_takes_it(tiny_qwen3):
    """A model loaded with oneDNN linear layers: its tied LM head sets few_rows, has its row
    count for oneDNN measured, and gives F.linear's logits for a few rows (and still the packed
    path for more)."""
    from nanokv.layers.linear import onednn_available
    from nanokv.worker.loader import load_model

    if not onednn_available():
        pytest.skip("no oneDNN in this PyTorch build")
    loaded = load_model(tiny_qwen3, device="cpu", dtype="float32", skip_tokenizer_init=True)
    head = loaded.model.lm_head
    assert head.few_rows and loaded.model.tie_word_embeddings
    assert head.onednn_from_rows in set(native_linear.CROSSOVER_ROWS) | {native_linear.MAX_ROWS + 1}
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
