"""The LM head's panel kernel (`csrc/panel_linear.c`) against F.linear in float64 on the unpacked
weight: row counts that fill a group of rows of x, leave it short, or span several groups (the
AVX-512 path takes 8 rows at a time, AVX2 2, plain C 8); vocabulary sizes that are not multiples
of the 32-column panel (the last panel's padding); head sizes of any length; a bias; leading
dimensions. The packing against its PyTorch reference; bad inputs refused; the load-time choice
between the panels and oneDNN's packed copy, and a loaded model's LM head on the copy it keeps
(tied: the embedding keeps its plain matrix; untied: only the kept copy); int8 codes in the same
panels with a scale per row (weight-only int8) against F.linear over the dequantized weight; and
the same checks built without AVX-512 (the AVX2 path) and without AVX2 (plain C)."""

import pytest
import torch
from narrow_builds import run_narrow_build

from nanokv.layers import int8_weights, native_linear
from nanokv.layers.native_attention import NativeKernelUnavailable

try:
    native_linear.load_panel_linear()
except NativeKernelUnavailable as e:  # no C compiler with OpenMP here
    pytest.skip(f"panel kernel unavailable: {e}", allow_module_level=True)


def reference(x, w, bias=None):
    return torch.nn.functional.linear(x.double(), w.double(),
                                      None if bias is None else bias.double()).float()


# rows: every group of a pass (AVX-512 and plain C: 8 rows; AVX2: 2 up to 16 rows, then 6:
# 19-23 and 40 end in groups of 1-5 rows)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16, 19, 20, 21, 22, 23, 40])
@pytest.mark.parametrize("n,k", [(4096, 256), (1000, 64), (77, 48), (33, 40), (130, 7)])
def test_equals_f_linear(rows, n, k):
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen) if n % 2 else None
    got = native_linear.panel_linear(x, native_linear.pack_panels(w), n, bias)
    torch.testing.assert_close(got, reference(x, w, bias), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 19, 23, 40])
@pytest.mark.parametrize("n,k", [(4096, 256), (77, 48), (33, 40), (130, 7)])
def test_int8_panels_equal_f_linear_over_the_dequantized_weight(rows, n, k):
    """Weight-only int8: the codes' panels and a scale per row against F.linear over code *
    scale (float64); the weights' rows of different ranges, a zero row among them."""
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen) * 3
    w[n // 2] = 0
    bias = torch.randn(n, generator=gen) if n % 2 else None
    codes, scale = int8_weights.quantize_rows(w)
    got = native_linear.panel_linear(x, native_linear.panels_of(codes), n, bias, scale=scale)
    torch.testing.assert_close(got, reference(x, int8_weights.dequantize(codes, scale), bias),
                               atol=1e-4, rtol=1e-5)


def test_int8_rows_round_to_the_nearest_step():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(50, 300, generator=gen) * torch.rand(50, 1, generator=gen)
    w[3] = 0
    codes, scale = int8_weights.quantize_rows(w)
    assert codes.dtype == torch.int8 and codes.abs().max() == 127 and scale[3] == 1
    assert codes[3].eq(0).all()
    error = (int8_weights.dequantize(codes, scale) - w).abs()
    assert bool((error <= scale[:, None] / 2 * (1 + 1e-5)).all())
    # each nonzero row uses its whole range: its largest magnitude is code +-127
    assert codes.abs().amax(dim=1)[torch.arange(50) != 3].eq(127).all()


def test_int8_inputs_are_checked():
    codes, scale = int8_weights.quantize_rows(torch.randn(40, 16))
    panels = native_linear.panels_of(codes)
    with pytest.raises(ValueError, match=r"panels must be torch.int8 \[2, K, 32\]"):
        native_linear.panel_linear(torch.randn(3, 16), panels.float(), 40, scale=scale)
    with pytest.raises(ValueError, match=r"scale must be float32 \[40\]"):
        native_linear.panel_linear(torch.randn(3, 16), panels, 40, scale=scale[:39])


def test_packing_equals_its_reference_and_pads_with_zeros():
    w = torch.randn(70, 24)
    panels = native_linear.pack_panels(w)
    assert panels.shape == (3, 24, native_linear.PANEL)
    assert torch.equal(panels, native_linear.panels_of(w))
    assert torch.equal(panels[1, :, 5], w[37])  # panels[p, k, j] = w[32 p + j, k]
    assert not panels[2, :, 6:].any()  # rows 70-95 do not exist


def test_leading_dimensions_and_many_rows():
    """x [..., K] keeps its leading dimensions; a prompt-logits-sized batch of rows."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(300, 64, generator=gen)
    panels = native_linear.pack_panels(w)
    x = torch.randn(2, 3, 64, generator=gen)
    assert native_linear.panel_linear(x, panels, 300).shape == (2, 3, 300)
    torch.testing.assert_close(native_linear.panel_linear(x, panels, 300), reference(x, w),
                               atol=1e-4, rtol=1e-5)
    x = torch.randn(517, 64, generator=gen)
    torch.testing.assert_close(native_linear.panel_linear(x, panels, 300), reference(x, w),
                               atol=1e-4, rtol=1e-5)


def test_bad_inputs_are_refused():
    w = torch.randn(40, 16)
    panels = native_linear.pack_panels(w)
    for x in (torch.randn(2, 8), torch.randn(2, 16, dtype=torch.float64)):
        with pytest.raises(ValueError, match="panel_linear takes"):
            native_linear.panel_linear(x, panels, 40)
    with pytest.raises(ValueError, match="panels must be"):
        native_linear.panel_linear(torch.randn(2, 16), panels, 80)  # 3 panels, not 2
    with pytest.raises(ValueError, match="panels must be"):
        native_linear.panel_linear(torch.randn(2, 16), w, 40)  # not packed
    with pytest.raises(ValueError, match="bias must be"):
        native_linear.panel_linear(torch.randn(2, 16), panels, 40, torch.randn(39))
    with pytest.raises(ValueError, match="pack_panels takes"):
        native_linear.pack_panels(w.double())


def test_panels_win_unless_onednn_is_clearly_faster():
    """The choice from given timings: oneDNN only when the geometric mean over the measured row
    counts of its time / the panels' is under `margin`, each row count weighing alike (not the
    longest call deciding); bad row counts refused."""
    def win(panel_s: dict, onednn_s: dict) -> bool:
        return native_linear.panels_win(lambda r: (panel_s[r], onednn_s[r]),
                                        rows=sorted(panel_s), margin=0.9)

    assert win({1: 1.0, 8: 1.0}, {1: 1.4, 8: 1.3})
    assert win({1: 1.0, 8: 1.0}, {1: 0.95, 8: 0.95})  # within the margin: noise
    assert not win({1: 1.0, 8: 3.0}, {1: 0.7, 8: 3.0})  # ratios, not totals: 0.84
    assert win({1: 1.0, 64: 6.0}, {1: 1.33, 64: 4.9})  # the long call alone does not decide
    assert not win({1: 1.0, 8: 1.0}, {1: 0.8, 8: 0.8})
    for rows in ([], [0, 8]):
        with pytest.raises(ValueError, match="rows must be"):
            native_linear.panels_win(lambda r: (1.0, 1.0), rows=rows)


@pytest.mark.parametrize("panels_faster", [True, False])
def test_keep_faster_path_times_both_and_frees_the_other(monkeypatch, panels_faster):
    from nanokv.layers.linear import Linear, onednn_available

    if not onednn_available():
        pytest.skip("no oneDNN in this PyTorch build")
    layer = Linear(64, 300)
    with torch.no_grad():
        layer.weight.normal_()
    layer.pack()
    assert layer.pack_panels()
    measured = []
    timed = native_linear.median_seconds

    def median_seconds(fns, repeats):
        panel_s, onednn_s = timed(fns, repeats)
        assert panel_s > 0 and onednn_s > 0
        rows = fns[0]().shape[0]
        torch.testing.assert_close(fns[0](), fns[1]())  # the same product both ways
        measured.append(rows)
        return (1.0, 2.0) if panels_faster else (2.0, 1.0)

    monkeypatch.setattr(native_linear, "median_seconds", median_seconds)
    assert layer.keep_faster_path(repeats=2) == panels_faster
    assert measured == list(native_linear.HEAD_ROWS)
    assert (layer.panels is not None, layer.packed is not None) == (panels_faster,
                                                                    not panels_faster)
    x = torch.randn(5, 64)
    torch.testing.assert_close(layer(x), reference(x, layer.weight), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("panels_faster", [True, False])
def test_a_loaded_models_layers_keep_the_faster_copy(tiny_model, monkeypatch, panels_faster):
    """The linear layers of a model loaded with the fast path (tiny Llama: untied LM head; tiny
    Qwen3: tied) keep the copy the measurement picks (forced here) and free the other; the LM
    head gives F.linear's logits at decode and prefill row counts; tied, the embedding keeps the
    plain matrix; untied, only the kept copy remains."""
    from pathlib import Path

    from safetensors.torch import load_file

    from nanokv.layers.linear import Linear, onednn_available
    from nanokv.worker.loader import load_model

    if not onednn_available():
        pytest.skip("no oneDNN in this PyTorch build")
    monkeypatch.setattr(native_linear, "panels_win", lambda time_paths, rows: panels_faster)
    model = load_model(tiny_model, device="cpu", dtype="float32",
                       skip_tokenizer_init=True).model
    head = model.lm_head
    assert (head.panels is not None, head.packed is not None) == (panels_faster,
                                                                  not panels_faster)
    if model.tie_word_embeddings:
        plain = model.embed_tokens.weight
        assert head.weight.data_ptr() == plain.data_ptr()
    else:
        plain = load_file(Path(tiny_model) / "model.safetensors")["lm_head.weight"]
        assert head.weight.numel() == 0
    for rows in (1, 3, 8, 40):
        x = torch.randn(rows, head.in_features)
        torch.testing.assert_close(model.compute_logits(x), reference(x, plain),
                                   atol=1e-4, rtol=1e-5)
    # every decoder layer's linears: one copy each, the one chosen, the plain matrix freed
    layers = [m for m in model.modules() if isinstance(m, Linear) and m is not head]
    assert layers
    for m in layers:
        assert (m.panels is not None, m.packed is not None) == (panels_faster,
                                                                not panels_faster)
        assert m.weight.numel() == 0


def test_the_choice_is_measured_once_per_shape(tiny_model, monkeypatch):
    """pack_linear_weights times each weight shape once (the LM head on its own rows) and gives
    every layer of that shape the same copy."""
    from nanokv.layers.linear import Linear, onednn_available
    from nanokv.worker.loader import load_model

    if not onednn_available():
        pytest.skip("no oneDNN in this PyTorch build")
    calls = []

    def panels_win(time_paths, rows):
        calls.append(tuple(rows))
        return len(calls) % 2 == 1  # alternate, so a shape's layers must share the first answer

    monkeypatch.setattr(native_linear, "panels_win", panels_win)
    model = load_model(tiny_model, device="cpu", dtype="float32",
                       skip_tokenizer_init=True).model
    by_shape: dict = {}
    for m in model.modules():
        if isinstance(m, Linear):
            key = (m is model.lm_head, m.out_features, m.in_features)
            by_shape.setdefault(key, set()).add(m.panels is not None)
    assert all(len(kept) == 1 for kept in by_shape.values())
    assert len(calls) == len(by_shape)
    assert calls.count(native_linear.HEAD_ROWS) == 1
    assert calls.count(native_linear.LAYER_ROWS) == len(by_shape) - 1


@pytest.mark.parametrize("flags", ["-mno-avx512f", "-mno-avx2"])
def test_a_narrower_build_equals_f_linear(tmp_path, flags):
    """The AVX2 path (built without AVX-512) and plain C (without AVX2, which every CPU builds):
    the same checks with the library built that way."""
    run_narrow_build(__file__, "test_equals_f_linear or test_leading or test_int8_panels",
                     tmp_path, "panel_linear", flags=flags, timeout=300)
