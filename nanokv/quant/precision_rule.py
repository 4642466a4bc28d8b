"""The precision rule of `nanokv calibrate`: the cheapest KV precision whose measured quality stays
within the acceptance bounds.

A candidate passes when its perplexity rises by at most `max_ppl_increase` percent of the
full-precision baseline's and, when `max_kl` is set, its mean KL divergence to the full-precision
next-token distributions is at most `max_kl` nats per token. The bound is relative because the
design document's "+0.2 perplexity" was written for models near perplexity 6 (+3%); on a model
near perplexity 100 the same absolute bound is a 0.2% change, below the measurement's noise.

Order (4 bits first: KVQuant's quality point; more bits only where quality suffers):
  1. uniform widths from the highest candidate width down while they pass: the lowest passing;
  2. else per-layer mixed precision at the highest width: each layer's sensitivity is measured
     with that layer alone at that width and every other layer at 8 bits (its perplexity
     increase, or its KL when a KL bound is set: the steadier signal, since a layer's errors
     can cancel in the mean NLL while moving the distributions); the most sensitive layers go
     to 8 bits one by one until the setting passes (all layers at 8 bits is step 3);
  3. else int8;
  4. else full precision.
The rule sees only measurements (`evaluate(candidate) -> Measurement`); where they come from
(the engine's own store, or the simulation inside the Hugging Face model) is the caller's choice.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from nanokv.quant.calibration_file import Candidate, Decision, Trial

MAX_PPL_INCREASE_LIMIT = 100.0  # percent: doubling the perplexity is no longer quantization noise


@dataclass(frozen=True)
class Measurement:
    """Quality of one candidate on the scored tokens."""

    perplexity: float
    kl: float  # mean KL(full precision || candidate) per scored token, nats
    top1: float = math.nan  # share of scored tokens whose argmax equals full precision's


@dataclass(frozen=True)
class Acceptance:
    """The bounds a candidate must stay within."""

    max_ppl_increase: float = 3.0  # percent of the baseline perplexity
    max_kl: float | None = None  # nats per scored token; None: no KL bound

    def __post_init__(self) -> None:
        check_max_ppl_increase(self.max_ppl_increase)
        check_max_kl(self.max_kl)

    def passes(self, trial: Trial) -> bool:
        if trial.increase > self.max_ppl_increase:
            return False
        return self.max_kl is None or trial.kl <= self.max_kl

    def violations(self, trial: Trial) -> str:
        """What a failing trial breaks, e.g. 'perplexity over +3%' or 'KL over 0.005'."""
        broken = []
        if trial.increase > self.max_ppl_increase:
            broken.append(f"perplexity over +{self.max_ppl_increase:g}%")
        if self.max_kl is not None and trial.kl > self.max_kl:
            broken.append(f"KL over {self.max_kl:g}")
        return " and ".join(broken)

    def describe(self) -> str:
        kl = "" if self.max_kl is None else f" and KL <= {self.max_kl:g}"
        return f"+{self.max_ppl_increase:g}% perplexity{kl}"


def check_max_ppl_increase(value) -> None:
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or not 0 < value <= MAX_PPL_INCREASE_LIMIT):
        raise ValueError(f"max_ppl_increase is a percent of the baseline perplexity in "
                         f"(0, {MAX_PPL_INCREASE_LIMIT:g}] (e.g. 3 for +3%), got {value!r}")


def check_max_kl(value) -> None:
    if value is None:
        return
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or value <= 0):
        raise ValueError(f"max_kl is a mean KL divergence in nats per token, a finite number "
                         f"> 0 (or unset for no KL bound), got {value!r}")


def make_trial(candidate: Candidate, m: Measurement, baseline: float) -> Trial:
    delta = m.perplexity - baseline
    return Trial(candidate, m.perplexity, delta, 100.0 * delta / baseline, m.kl, m.top1)


def _summary(t: Trial) -> str:
    return f"{t.increase:+.2f}% perplexity ({t.delta:+.4f}), KL {t.kl:.5f}"


def choose_precision(evaluate: Callable[[Candidate], Measurement], num_layers: int,
                     candidate_bits: tuple[int, ...], acceptance: Acceptance
                     ) -> tuple[Decision, list[Trial], float]:
    """The rule of the module docstring. Returns (decision, trials in the order measured,
    baseline perplexity)."""
    trials: list[Trial] = []
    seen: dict[Candidate, Trial] = {}  # a mix can equal a probe (2 layers): measured once

    def run(c: Candidate) -> Trial:
        if c not in seen:
            m = evaluate(c)
            base = trials[0].perplexity if trials else m.perplexity
            trials.append(make_trial(c, m, base))
            seen[c] = trials[-1]
        return seen[c]

    def decide(t: Trial, reason: str) -> tuple[Decision, list[Trial], float]:
        return (Decision(t.candidate, t.perplexity, t.delta, reason, t.increase, t.kl), trials,
                trials[0].perplexity)

    bound = acceptance.describe()
    run(Candidate("auto"))
    passed = None
    for bits in sorted(candidate_bits, reverse=True):  # 4 first; lower widths while they pass
        t = run(Candidate("kvquant", bits))
        if not acceptance.passes(t):
            break
        passed = t
    if passed is not None:
        return decide(passed, f"{passed.candidate.bits}-bit: {_summary(passed)}, within {bound}")
    high = max(candidate_bits)
    failed = trials[1]
    why = f"{high}-bit: {_summary(failed)}: {acceptance.violations(failed)}"
    sensitivity = []
    for layer in range(num_layers):
        probe = run(Candidate("kvquant", high,
                              tuple(high if i == layer else 8 for i in range(num_layers))))
        sensitivity.append(probe.increase if acceptance.max_kl is None else probe.kl)
    widths = [high] * num_layers
    order = sorted(range(num_layers), key=lambda i: -sensitivity[i])
    for k, layer in enumerate(order[:-1]):  # all layers at 8 bits is the int8 fallback below
        widths[layer] = 8
        t = run(Candidate("kvquant", high, tuple(widths)))
        if acceptance.passes(t):
            return decide(t, f"{why}; mixed: layers {sorted(order[:k + 1])} at 8 bits: "
                             f"{_summary(t)}")
    t = run(Candidate("int8"))
    if acceptance.passes(t):
        return decide(t, f"{why}, and no per-layer mix passes; int8: {_summary(t)}")
    base = trials[0]
    return (Decision(base.candidate, base.perplexity, 0.0,
                     f"no quantized setting stays within {bound}: full precision", 0.0, 0.0),
            trials, base.perplexity)
