"""Calibration: the user's precision rule, the calibration file, and an end-to-end run on a tiny
random model (where 2-bit breaks the 0.2 perplexity limit and calibration picks another setting).
"""

import json
import sys
from pathlib import Path

import pytest
import torch

from nanokv.quant.calibrate import CalibrationSettings, calibrate
from nanokv.quant.calibration_file import Candidate, load_calibration
from nanokv.quant.kvquant_store import KVQuantStore
from nanokv.quant.precision_rule import Acceptance, Measurement, choose_precision

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def fake_evaluator(table):
    """Perplexity from a rule: base 10 + the cost of each layer's precision (8 bits: free)."""
    def ppl(c: Candidate) -> float:
        if c.kv_cache_dtype == "auto":
            return 10.0
        if c.kv_cache_dtype == "int8":
            return 10.0 + table["int8"]
        widths = c.layer_bits or (c.bits,) * len(table["layers"])
        return 10.0 + sum(table["layers"][i].get(w, 0.0) for i, w in enumerate(widths))
    return lambda c: Measurement(ppl(c), 0.0)


LIMIT = Acceptance(2.0)  # +2% of perplexity 10: +0.2


def test_rule_keeps_4bit_when_it_passes():
    ev = fake_evaluator({"int8": 0.01, "layers": [{4: 0.05}, {4: 0.1}]})
    d, trials, base = choose_precision(ev, 2, (4,), LIMIT)
    assert (d.candidate.kv_cache_dtype, d.candidate.bits, d.candidate.layer_bits) == \
        ("kvquant", 4, None)
    assert base == 10.0 and len(trials) == 2 and d.delta == pytest.approx(0.15)
    assert d.increase == pytest.approx(1.5)


def test_rule_takes_the_lowest_passing_candidate():
    ev = fake_evaluator({"int8": 0.0, "layers": [{4: 0.01, 3: 0.05, 2: 0.5}] * 2})
    d, _, _ = choose_precision(ev, 2, (2, 3, 4), LIMIT)
    assert (d.candidate.bits, d.candidate.layer_bits) == (3, None)


def test_rule_falls_back_to_mixed_precision_most_sensitive_layer_first():
    layers = [{2: 0.05}, {2: 0.9}, {2: 0.1}]  # layer 1 is the sensitive one
    ev = fake_evaluator({"int8": 0.01, "layers": layers})
    d, _, _ = choose_precision(ev, 3, (2,), LIMIT)
    assert d.candidate.kv_cache_dtype == "kvquant"
    assert d.candidate.layer_bits == (2, 8, 2) and d.delta <= 0.2
    assert "mixed" in d.reason


def test_rule_falls_back_to_int8_then_full_precision():
    layers = [{2: 0.5}, {2: 0.5}]
    d, _, _ = choose_precision(fake_evaluator({"int8": 0.1, "layers": layers}), 2, (2,), LIMIT)
    assert d.candidate.kv_cache_dtype == "int8"
    d, _, _ = choose_precision(fake_evaluator({"int8": 0.3, "layers": layers}), 2, (2,), LIMIT)
    assert d.candidate.kv_cache_dtype == "auto" and d.delta == 0.0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_models import build_tiny_model, load_hf

    path = build_tiny_model(str(tmp_path_factory.mktemp("tiny_quant")), tokenizer=False)
    return path, load_hf(path)


def test_calibration_on_tiny_model_falls_back_when_2bit_breaks_the_limit(tiny, tmp_path):
    """Through the engine (the default measure): 2-bit breaks +0.5% on this random model."""
    path, model = tiny
    ids = torch.randint(0, 320, (6, 64), generator=torch.Generator().manual_seed(0))
    settings = CalibrationSettings(candidate_bits=(2,), codebook_bits=(2, 4), block_size=16,
                                   max_ppl_increase=0.5, kmeans_iters=20, chunk_size=16,
                                   context_fraction=0.5)
    calib = calibrate(model, ids[:4], ids[4:].tolist(), settings, model_path=path)
    two_bit = [t for t in calib.trials
               if t.candidate == Candidate("kvquant", 2)]
    assert two_bit and two_bit[0].increase > 0.5  # 2-bit breaks the limit on this model
    d = calib.decision
    assert not (d.candidate.kv_cache_dtype == "kvquant" and d.candidate.layer_bits is None)
    assert d.increase <= 0.5
    # the file round-trips and gives a config a store accepts
    out = tmp_path / "calib.json"
    calib.save(out)
    loaded = load_calibration(out)
    assert loaded.decision.candidate == d.candidate
    assert [(t.candidate, t.perplexity, t.increase, t.kl) for t in loaded.trials] == \
        [(t.candidate, t.perplexity, t.increase, t.kl) for t in calib.trials]
    assert loaded.codebooks == calib.codebooks
    torch.testing.assert_close(loaded.key_thresholds, calib.key_thresholds)
    cfg = loaded.kvquant_config(bits=4)
    assert cfg.key_codebooks == calib.codebooks[4][0]
    from nanokv.cache.kv_pool import KVLayout

    KVQuantStore(KVLayout(2, 2, 16, 16, torch.float32), 4, cfg, num_staging_blocks=1)
    if d.candidate.kv_cache_dtype == "kvquant":
        assert loaded.kvquant_config().layer_bits == d.candidate.layer_bits


def test_loader_rejects_bad_files(tmp_path):
    good = {"format": "nanokv-kv-calibration", "version": 1,
            "model": {"path": "m", "num_layers": 1, "num_kv_heads": 1, "head_dim": 2},
            "settings": {"block_size": 16, "outlier_fraction": 0.01, "num_sink_tokens": 1,
                         "per_channel_keys": True, "nuq": True},
            "codebooks": {"2": {"keys": [[-1, -0.3, 0.3, 1]], "values": [[-1, 0, 0.5, 1]]}},
            "key_outlier_thresholds": {"lower": [[[-1, -1]]], "upper": [[[1, 1]]]},
            "perplexity": {"baseline": 5.0, "trials": []},
            "decision": {"kv_cache_dtype": "kvquant", "bits": 2, "layer_bits": None,
                         "perplexity": 5.1, "delta": 0.1, "reason": "ok"}}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(good))
    assert load_calibration(path).kvquant_config().bits == 2
    bad_cases = [
        (("format",), "nope", "format"),
        (("codebooks", "2", "keys"), [[1, 0, -0.5, -1]], "sorted"),
        (("key_outlier_thresholds", "lower"), [[[2, 2]]], "lower"),
        (("decision", "kv_cache_dtype"), "int4", "kv_cache_dtype"),
        (("decision", "layer_bits"), [5], "layer_bits"),
        (("model", "num_layers"), 0, "num_layers"),
    ]
    for keys, value, match in bad_cases:
        data = json.loads(json.dumps(good))
        node = data
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value
        path.write_text(json.dumps(data))
        with pytest.raises(ValueError, match=match):
            load_calibration(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        load_calibration(path)


def test_calibrate_cli_parser_is_wired():
    import argparse

    from nanokv.cli import add_engine_args, engine_options
    from nanokv.quant.cli import add_calibrate_parser, token_batches

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    add_calibrate_parser(sub, add_engine_args, engine_options)
    args = parser.parse_args(["calibrate", "--model", "m", "--bits", "4", "3", "--seq-len", "64",
                              "--output", "x.json", "--block-size", "16"])
    assert args.bits == [4, 3] and args.block_size == 16 and callable(args.func)
    assert (args.measure, args.chunk_size, args.max_ppl_increase) == ("engine", 32, 3.0)
    # evaluation windows first, the calibration tokens after them (no overlap)
    calib_ids, windows = token_batches(list(range(300)), 2, 64, 1, 100)
    assert calib_ids.shape == (2, 64) and windows == [list(range(100))]
    assert calib_ids[0, 0] == 100
    with pytest.raises(ValueError, match="tokens"):
        token_batches(list(range(10)), 2, 64, 1, 64)
