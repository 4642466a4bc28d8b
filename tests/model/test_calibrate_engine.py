"""`nanokv calibrate`'s engine measure: the perplexity it reports for a store and protocol equals
`nanokv eval`'s perplexity task (run_eval, another path) for the same store, chunking and windows;
its full-precision numbers equal Hugging Face's; its KL equals one computed from HF's logits,
is 0 for full precision measured again and positive for 2-bit."""

import math

import pytest
import torch
from transformers import AutoTokenizer

from nanokv.eval.harness import EvalSettings, heldout_windows, run_eval
from nanokv.quant.calibrate import CalibrationSettings, fit
from nanokv.quant.calibration_file import Candidate
from nanokv.quant.engine_measure import EngineMeasure, candidate_file
from nanokv.quant.scoring import ScoredWindows
from tiny_models import load_hf

BLOCK, CHUNK, LENGTH, FRACTION = 16, 16, 128, 0.5  # split 64: a chunk boundary
TWO_BIT = Candidate("kvquant", 2)


@pytest.fixture(scope="module")
def calibrated(tiny_qwen3, tmp_path_factory):
    """(model dir, HF model, calibration fitted on random ids, scored held-out windows)."""
    hf = load_hf(tiny_qwen3)
    ids = torch.randint(0, 300, (2, 64), generator=torch.Generator().manual_seed(0))
    settings = CalibrationSettings(candidate_bits=(2,), codebook_bits=(2,), block_size=BLOCK,
                                   kmeans_iters=5)
    calib = fit(hf, ids, settings, model_path=tiny_qwen3)
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    windows = ScoredWindows.of(heldout_windows(tokenizer, 2, LENGTH), FRACTION)
    return tiny_qwen3, hf, calib, windows


def measure_for(calibrated) -> EngineMeasure:
    path, _, calib, windows = calibrated
    return EngineMeasure(path, calib, windows, chunk_size=CHUNK,
                         engine_options={"num_threads": 1, "dtype": "float32"})


def eval_perplexity(path: str, options: dict) -> float:
    settings = EvalSettings(path, tasks=["perplexity"], ppl_windows=2, context_tokens=LENGTH,
                            context_fraction=FRACTION,
                            engine_options={"block_size": BLOCK, "max_num_batched_tokens": CHUNK,
                                            "num_threads": 1, "dtype": "float32", **options})
    (row,) = run_eval(settings, log=lambda _line: None, progress=False)
    return row.score


def test_engine_perplexity_equals_nanokv_eval_for_the_same_store(calibrated, tmp_path):
    path, _, calib, _ = calibrated
    measure = measure_for(calibrated)
    full, two_bit = measure(Candidate("auto")), measure(TWO_BIT)
    assert two_bit.perplexity != pytest.approx(full.perplexity, rel=1e-3)  # the store matters
    config = candidate_file(calib, TWO_BIT, str(tmp_path))
    assert eval_perplexity(path, {"kv_cache_dtype": "kvquant", "kv_quant_config": config}) == \
        pytest.approx(two_bit.perplexity, rel=1e-6)
    assert eval_perplexity(path, {}) == pytest.approx(full.perplexity, rel=1e-6)


def test_full_precision_equals_hf_and_kl_matches_hf_logits(calibrated):
    _, hf, _, windows = calibrated
    measure = measure_for(calibrated)
    full = measure(Candidate("auto"))
    with torch.no_grad():
        hf_scored = [windows.scored_logits(hf(input_ids=torch.tensor([w])).logits[0])
                     for w in windows.windows]
    nll = sum(float(torch.nn.functional.cross_entropy(lg, windows.targets(i), reduction="sum"))
              for i, lg in enumerate(hf_scored))
    assert full.perplexity == pytest.approx(math.exp(nll / windows.num_scored), rel=1e-4)
    # KL of the 2-bit engine's distributions to HF's full-precision ones, computed here
    two_bit_logits = measure.scored_logits(TWO_BIT)
    kl = sum(float(torch.nn.functional.kl_div(q.log_softmax(-1), p.log_softmax(-1),
                                              log_target=True, reduction="sum"))
             for p, q in zip(hf_scored, two_bit_logits)) / windows.num_scored
    two_bit = measure(TWO_BIT)
    assert two_bit.kl == pytest.approx(kl, rel=1e-3)


def test_kl_is_zero_for_full_precision_and_positive_for_2bit(calibrated):
    measure = measure_for(calibrated)
    measure(Candidate("auto"))  # the reference
    again = measure(Candidate("auto"))  # a fresh engine, same store kind
    assert again.kl == pytest.approx(0.0, abs=1e-9) and again.top1 == 1.0
    two_bit = measure(TWO_BIT)
    assert two_bit.kl > 1e-4 and two_bit.top1 < 1.0
