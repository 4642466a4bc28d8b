"""The precision rule of `nanokv calibrate` fed measured numbers: its decision against a
declarative oracle over random tables of measurements, and the acceptance bounds' validation."""

import math
import random

import pytest

from nanokv.quant.calibrate import CalibrationSettings
from nanokv.quant.calibration_file import Candidate
from nanokv.quant.precision_rule import Acceptance, Measurement, choose_precision

AUTO, INT8 = Candidate("auto"), Candidate("int8")


def random_table(rng: random.Random, layers: int, widths: tuple[int, ...]) -> dict:
    """Candidate -> Measurement for every candidate the rule may ask for: uniform widths, each
    layer alone at the highest width (others at 8), every mix of the highest width with 8."""
    base = rng.uniform(5, 200)
    table = {AUTO: Measurement(base, 0.0)}

    def noisy(increase: float) -> Measurement:  # KL drawn apart: it may rank layers otherwise
        ppl = base * (1 + increase / 100)
        return Measurement(ppl, max(0.0, increase / 100 * rng.uniform(0.0, 0.05)
                                    + rng.uniform(-0.002, 0.004)))

    for w in widths:
        table[Candidate("kvquant", w)] = noisy(rng.uniform(-0.5, 12) * (5 - w))
    high = max(widths)
    for mask in range(2 ** layers):  # bit i set: layer i at 8 bits
        bits = tuple(8 if mask >> i & 1 else high for i in range(layers))
        if mask != 2 ** layers - 1:
            table[Candidate("kvquant", high, bits)] = noisy(rng.uniform(-0.3, 6))
    table[INT8] = noisy(rng.uniform(-0.2, 4))
    return table


def oracle(table: dict, layers: int, widths: tuple[int, ...], acc: Acceptance) -> Candidate:
    """The rule stated as a preference list (cheapest first) filtered by what it may choose."""
    base = table[AUTO].perplexity

    def passes(c: Candidate) -> bool:
        m = table[c]
        increase = 100 * (m.perplexity - base) / base
        return increase <= acc.max_ppl_increase and (acc.max_kl is None or m.kl <= acc.max_kl)

    down = sorted(widths, reverse=True)
    # a width may be chosen when it and every higher candidate width pass
    eligible = [w for i, w in enumerate(down) if all(passes(Candidate("kvquant", v))
                                                     for v in down[:i + 1])]
    if eligible:
        return Candidate("kvquant", min(eligible))
    high = down[0]

    def probe(layer: int) -> Candidate:
        return Candidate("kvquant", high, tuple(high if i == layer else 8 for i in range(layers)))

    # sensitivity: the probe's perplexity, or its KL when the KL is bounded
    sensitivity = [table[probe(i)].perplexity if acc.max_kl is None else table[probe(i)].kl
                   for i in range(layers)]
    ranked = sorted(range(layers), key=lambda i: (-sensitivity[i], i))
    mixes = [Candidate("kvquant", high, tuple(8 if i in ranked[:k] else high
                                               for i in range(layers)))
             for k in range(1, layers)]
    for c in mixes + [INT8]:
        if passes(c):
            return c
    return AUTO


@pytest.mark.parametrize("seed", range(4))
def test_rule_picks_the_oracles_candidate_on_random_tables(seed):
    rng = random.Random(seed)
    kinds = set()
    for _ in range(150):
        layers = rng.randint(1, 4)
        widths = tuple(sorted(rng.sample((2, 3, 4), rng.randint(1, 3))))
        table = random_table(rng, layers, widths)
        acc = Acceptance(rng.choice((0.5, 1.0, 3.0, 10.0)),
                         rng.choice((None, None, 0.001, 0.01)))
        asked = []

        def evaluate(c: Candidate, table=table, asked=asked) -> Measurement:
            asked.append(c)
            return table[c]

        decision, trials, base = choose_precision(evaluate, layers, widths, acc)
        want = oracle(table, layers, widths, acc)
        assert decision.candidate == want
        assert base == table[AUTO].perplexity and len(asked) == len(set(asked))
        assert [t.candidate for t in trials] == asked
        if want != AUTO:
            m = table[want]
            assert decision.perplexity == m.perplexity and decision.kl == m.kl
            assert decision.increase == pytest.approx(100 * (m.perplexity - base) / base)
            assert decision.increase <= acc.max_ppl_increase
        kinds.add("mixed" if want.layer_bits else want.kv_cache_dtype)
    assert kinds == {"kvquant", "mixed", "int8", "auto"}  # the tables reach every branch


def test_kl_bound_rejects_a_width_the_perplexity_bound_accepts():
    table = {AUTO: Measurement(100.0, 0.0), Candidate("kvquant", 4): Measurement(101.0, 0.02),
             INT8: Measurement(100.1, 0.001)}
    table[Candidate("kvquant", 4, (4,))] = table[Candidate("kvquant", 4)]
    d, _, _ = choose_precision(table.__getitem__, 1, (4,), Acceptance(3.0))
    assert d.candidate == Candidate("kvquant", 4)
    d, _, _ = choose_precision(table.__getitem__, 1, (4,), Acceptance(3.0, max_kl=0.01))
    assert d.candidate == INT8 and "4-bit: +1.00% perplexity" in d.reason
    assert "KL over 0.01" in d.reason and "perplexity over" not in d.reason


@pytest.mark.parametrize("value", [0, -1, 0.0, 100.5, 1000, math.nan, math.inf, True, "3"])
def test_max_ppl_increase_must_be_a_sensible_percent(value):
    with pytest.raises(ValueError, match=r"percent of the baseline perplexity in \(0, 100\]"):
        Acceptance(value)
    with pytest.raises(ValueError, match="max_ppl_increase"):
        CalibrationSettings(max_ppl_increase=value)


@pytest.mark.parametrize("value", [0, -0.1, math.inf, math.nan, False])
def test_max_kl_must_be_positive_and_finite(value):
    with pytest.raises(ValueError, match="max_kl is a mean KL divergence"):
        CalibrationSettings(max_kl=value)


def test_protocol_settings_are_validated():
    with pytest.raises(ValueError, match="measure must be one of"):
        CalibrationSettings(measure="hf")
    with pytest.raises(ValueError, match="chunk_size"):
        CalibrationSettings(chunk_size=0)
    with pytest.raises(ValueError, match=r"context_fraction must be in \(0, 1\)"):
        CalibrationSettings(context_fraction=1.0)
    Acceptance(100.0)  # the upper bound itself is allowed
    CalibrationSettings(max_ppl_increase=0.5, max_kl=0.01, measure="both", chunk_size=1)


def test_cli_rejects_a_bad_threshold_before_loading_anything():
    import argparse

    from nanokv.cli import add_engine_args, engine_options
    from nanokv.quant.cli import add_calibrate_parser

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    add_calibrate_parser(sub, add_engine_args, engine_options)
    args = parser.parse_args(["calibrate", "--model", "/nonexistent", "--block-size", "16",
                              "--max-ppl-increase", "0.0"])
    with pytest.raises(ValueError, match="max_ppl_increase is a percent"):
        args.func(args)
