"""`nanokv advise`: sweep a deployment's KV settings over a trace with the simulator.

For each candidate (block size, KV dtype, max_num_seqs, KV policy) the pool is sized the way
the engine sizes it from an explicit `kv_cache_memory`: the KV cache kind's spec
(`nanokv/cache/registry.py`: bytes per block, fixed bytes such as staging) gives
num_blocks = (memory - fixed) // bytes_per_block. The step model prices the KV bytes each step
reads at the same bytes per token, so a smaller KV dtype both holds more and reads less.

Each candidate is simulated twice: at the trace's own arrival times (the latency view: TTFT,
TPOT, hit rate at the offered load) and with its arrivals compressed until requests queue for
most of the run: what it serves while requests wait is its capacity, the request rate it can
sustain. Below saturation every candidate serves the offered load, so candidates are ranked by
capacity (requests/s, in steps of 2%), then by TPOT p50 while saturated, then by TTFT p90 at
the offered load.

The sweep is staged, not a full product: block size x KV dtype first, then max_num_seqs for the
best of those, then KV policies (compression, pool-pressure eviction) on the best. Policies
change what the model attends to (see docs/results/policies): they are only recommended when
they win clearly, with that caveat.

A model with a sliding window on every layer (Mistral's `sliding_window`, Qwen's windowed
layers from layer 0: `model_window`) is replayed as the engine runs it: each request's blocks
behind its next token's window are freed after each step (so a long request holds about the
window's blocks, and a decode reads at most the window), and no KV policy is swept (the engine
runs such a model without one). A model whose other layers see the whole context keeps every
block, as in the engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from nanokv.cache.kv_cache import KVCacheOptions
from nanokv.cache.layout import KVLayout
from nanokv.cache.registry import KV_CACHE_DTYPES, kv_cache_class, kv_cache_settings
from nanokv.config import check_block_size
from nanokv.layers.int8_weights import QUANTIZATIONS
from nanokv.sim.server_overhead import ServerOverhead
from nanokv.sim.simulator import SimConfig, SimResult, Simulator
from nanokv.sim.step_model import DeviceSpec, LinearStepModel, ModelShape, RooflineStepModel
from nanokv.sim.trace import TraceRecord
from nanokv.validation import check_choice, check_fraction, check_int

SATURATING = (8.0, 64.0, 512.0)  # arrival-time compressions tried until requests queue
SATURATED_FRACTION = 0.5  # of the run's duration with requests waiting


@dataclass(frozen=True)
class Candidate:
    block_size: int
    kv_dtype: str
    max_num_seqs: int
    compression_ratio: float | None = None
    eviction_ratio: float | None = None

    def __post_init__(self) -> None:
        check_block_size("block size must be", self.block_size)
        check_choice("kv_cache_dtype", self.kv_dtype, KV_CACHE_DTYPES)
        check_int("max_num_seqs", self.max_num_seqs, 1)
        if self.compression_ratio is not None:
            check_fraction("compression ratio", self.compression_ratio, low_open=False,
                           high_open=True, meaning=" (fraction removed)")
        if self.eviction_ratio is not None:
            check_fraction("eviction ratio", self.eviction_ratio)

    @property
    def policy(self) -> str:
        if self.compression_ratio is not None:
            return f"compress {1 / (1 - self.compression_ratio):.0f}x"
        if self.eviction_ratio is not None:
            return f"pool-pressure {self.eviction_ratio}"
        return "full"


@dataclass
class Outcome:
    candidate: Candidate
    num_blocks: int
    bytes_per_token: float
    bytes_per_block: int
    result: SimResult  # at the trace's arrival times
    saturated: SimResult | None = None  # arrivals compressed `compression` times
    compression: float | None = None

    @property
    def capacity_req_s(self) -> float | None:
        return None if self.saturated is None else self.saturated.capacity_req_s

    @property
    def capacity_tok_s(self) -> float | None:
        return None if self.saturated is None else self.saturated.capacity_tok_s


@dataclass(frozen=True)
class AdviseSettings:
    model: ModelShape
    kv_memory: int  # bytes for the KV cache
    device: DeviceSpec | None = None  # roofline step model ...
    fitted: LinearStepModel | None = None  # ... or one measured here (nanokv bench)
    overhead: ServerOverhead | None = None  # the server's time outside steps (a step log)
    compute_dtype: torch.dtype = torch.bfloat16
    # the engine's `quantization`: "int8" weights are read at one byte a parameter (their
    # float32 scales, one per output row, left out: under 0.4% at hidden sizes from 1024);
    # they compute in float32
    quantization: str | None = None
    max_model_len: int = 8192
    max_num_batched_tokens: int = 8192
    block_sizes: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024)
    kv_dtypes: tuple[str, ...] = ("auto", "fp8", "kvquant")
    max_num_seqs: tuple[int, ...] = (64, 128, 256, 512)
    compressions: tuple[float, ...] = (0.5, 0.75)
    eviction_ratios: tuple[float, ...] = (0.2,)
    default_max_num_seqs: int = 256
    admission: str = "arrival"  # or "recorded" (a served trace's own step boundaries)
    num_blocks: int | None = None  # a served run's pool, instead of kv_memory's
    # the window every layer of the model attends over (`model_window`): the blocks behind a
    # request's window are freed after each step and no KV policy is swept; None: none
    sliding_window: int | None = None
    # each layer's window of a model whose layers mix windows and full attention
    # (`model_layer_windows`): the float pool's candidates replay the engine's hybrid KV cache
    # manager, and no KV policy is swept; None: none
    layer_windows: tuple[int | None, ...] | None = None

    def __post_init__(self) -> None:
        if self.quantization is not None:
            if self.quantization not in QUANTIZATIONS:
                raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)} or None, "
                                 f"got {self.quantization!r}")
            if self.compute_dtype != torch.float32:
                raise ValueError(f"quantization {self.quantization!r} computes in float32 (as "
                                 f"the engine runs it); the compute dtype must be float32, got "
                                 f"{str(self.compute_dtype).removeprefix('torch.')}")
        check_int("max_model_len", self.max_model_len, 2)
        if self.sliding_window is not None:
            check_int("sliding_window", self.sliding_window, 1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.num_blocks is not None:
            check_int("num_kv_blocks", self.num_blocks, 1)
        for b in self.block_sizes:
            check_block_size("block sizes must each be", b)
        for c in self.compressions:
            check_fraction("compression ratio", c, low_open=False, high_open=True,
                           meaning=" (fraction removed)")
        for e in self.eviction_ratios:
            check_fraction("eviction ratio", e)

    @property
    def weight_bytes_per_param(self) -> float:
        """Bytes a step reads per weight: the compute dtype's, one with int8 weights."""
        if self.quantization == "int8":
            return 1.0
        return torch.empty(0, dtype=self.compute_dtype).element_size()


def model_window(model_dir: str, max_model_len: int) -> int | None:
    """The window every layer of the checkpoint's model attends over at max_model_len, as the
    engine reads it (`layer_windows` of its architecture; `KVLayout.common_window`): None when
    some layer sees the whole context or the config sets no `sliding_window`."""
    import json

    from nanokv.cache.layout import common_window
    from nanokv.models.registry import model_class
    from nanokv.worker.loader import load_hf_config

    with open(f"{model_dir}/config.json", encoding="utf-8") as f:
        if json.load(f).get("sliding_window") is None:
            return None
    cfg, arch = load_hf_config(model_dir)
    return common_window(model_class(arch).layer_windows(cfg, max_model_len),
                         cfg.num_hidden_layers)


def model_layer_windows(model_dir: str, max_model_len: int) -> tuple[int | None, ...] | None:
    """Each layer's window at max_model_len when the checkpoint's layers mix windows and full
    attention (Gemma 3, Qwen's max_window_layers), as the engine reads them
    (`KVLayout.mixed_windows`); None otherwise."""
    import json

    from nanokv.models.registry import model_class
    from nanokv.worker.loader import load_hf_config

    with open(f"{model_dir}/config.json", encoding="utf-8") as f:
        raw = json.load(f)
    if raw.get("sliding_window") is None and raw.get("text_config", {}).get(
            "sliding_window") is None:
        return None
    cfg, arch = load_hf_config(model_dir)
    windows = tuple(model_class(arch).layer_windows(cfg, max_model_len))
    windows += (None,) * (cfg.num_hidden_layers - len(windows))
    if all(w is None for w in windows) or None not in windows:
        return None
    return windows


def engine_kv_dtypes(model_dir: str, kv_dtypes: tuple[str, ...]
                     ) -> tuple[tuple[str, ...], str | None]:
    """The candidates' KV cache dtypes the engine runs for the checkpoint's model, and why any
    were left out: a model whose attention soft-caps its scores (Gemma 2) runs on the float
    pool ("auto") only, as the engine refuses the others (`check_soft_cap`); a ValueError when
    none of `kv_dtypes` is left. A config without `architectures` (a shape only) is taken as
    given."""
    import json

    from nanokv.models.registry import model_class
    from nanokv.worker.loader import load_hf_config

    with open(f"{model_dir}/config.json", encoding="utf-8") as f:
        raw = json.load(f)
    if not raw.get("architectures") or (raw.get("attn_logit_softcapping") is None and raw.get(
            "text_config", {}).get("attn_logit_softcapping") is None):
        return kv_dtypes, None
    cfg, arch = load_hf_config(model_dir)
    cap = model_class(arch).attention_soft_cap(cfg)
    if cap is None or all(d == "auto" for d in kv_dtypes):
        return kv_dtypes, None
    if "auto" not in kv_dtypes:
        raise ValueError(f"the model soft-caps its attention scores (attn_logit_softcapping "
                         f"{cap}) and runs on the float KV pool only: --kv-dtypes must include "
                         f"auto, got {','.join(kv_dtypes)}")
    left = tuple(d for d in kv_dtypes if d != "auto")
    return ("auto",), (f"kv dtypes {','.join(left)} left out: the model soft-caps its attention "
                       f"scores (attn_logit_softcapping {cap}), which only the float pool's "
                       f"attention applies")


def kv_cost(model: ModelShape, kv_dtype: str, block_size: int, max_num_seqs: int,
            compute_dtype: torch.dtype = torch.bfloat16) -> tuple[int, int]:
    """(bytes per block, fixed bytes) of a KV cache kind for this model, from its spec."""
    layout = KVLayout(model.num_layers, model.num_kv_heads, model.head_dim, block_size,
                      compute_dtype)
    cls, settings = kv_cache_settings(KVCacheOptions(kv_dtype, max_num_seqs), layout)
    spec = cls.spec(layout, settings)
    return spec.bytes_per_block, spec.fixed_bytes


def compress_arrivals(records: list[TraceRecord], factor: float) -> list[TraceRecord]:
    """The same requests in the same order, arriving `factor` times faster (a client that
    aborted keeps its patience: the abort comes as long after the arrival as before)."""
    t0 = min(r.t for r in records)
    out = []
    for r in records:
        t = t0 + (r.t - t0) / factor
        out.append(replace(r, t=t, abort_t=None if r.abort_t is None else t + r.abort_t - r.t))
    return out


def evaluate(records: list[TraceRecord], s: AdviseSettings, c: Candidate,
             capacity: bool = False) -> Outcome:
    """Simulate `c` on the trace; `capacity`: also with its arrivals compressed (x8, x64, x512:
    the first where requests wait for half the run or more) to measure its capacity."""
    per_block, fixed = kv_cost(s.model, c.kv_dtype, c.block_size, c.max_num_seqs,
                               s.compute_dtype)
    num_blocks = s.num_blocks or (s.kv_memory - fixed) // per_block
    if num_blocks < 1:
        raise ValueError(f"{c}: {s.kv_memory / 2**30:.1f} GiB holds no block after "
                         f"{fixed / 2**30:.1f} GiB of fixed cost")
    per_token = per_block / c.block_size
    step = s.fitted if s.fitted is not None else RooflineStepModel(
        s.device, s.model, per_token,
        weight_bytes_per_param=s.weight_bytes_per_param)
    cfg = SimConfig(block_size=c.block_size, num_blocks=int(num_blocks),
                    max_num_seqs=c.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
                    max_model_len=s.max_model_len, bytes_per_block=per_block,
                    compression_ratio=c.compression_ratio, eviction_ratio=c.eviction_ratio,
                    admission=s.admission, sliding_window=s.sliding_window,
                    layer_windows=s.layer_windows if kv_cache_class(
                        c.kv_dtype).supports_layer_slices else None)
    out = Outcome(c, int(num_blocks), per_token, per_block,
                  Simulator(records, cfg, step, overhead=s.overhead).run())
    if capacity:
        cfg = replace(cfg, admission="arrival")  # compressed arrivals: no recorded steps
        for factor in SATURATING:
            sat = Simulator(compress_arrivals(records, factor), cfg, step,
                            overhead=s.overhead).run()
            out.saturated, out.compression = sat, factor
            if sat.saturated_s >= SATURATED_FRACTION * sat.duration_s:
                break
    return out


CAPACITY_STEP = 1.02  # capacities in the same 2% step tie


def _key(o: Outcome):
    r, sat = o.result, o.saturated
    # capacity first (in steps of 2%: closer is a tie), then the per-token latency while
    # saturated (a larger batch that adds 0.4% throughput for twice the TPOT loses), then TTFT
    # p90 at the offered load, preemptions
    step = math.floor(math.log(max(o.capacity_req_s or 0.0, 1e-9)) / math.log(CAPACITY_STEP))
    return (-step, (sat.tpot_s["p50"] if sat else None) or 0.0, r.ttft_s["p90"] or 0.0,
            r.preemptions)


def sweep(records: list[TraceRecord], s: AdviseSettings, progress=None) -> list[Outcome]:
    """The staged sweep; every outcome, ranked best first."""
    if records and max(r.hash_block_size for r in records) > min(s.block_sizes):
        raise ValueError(f"the trace's hash block size {records[0].hash_block_size} is larger "
                         f"than block size {min(s.block_sizes)}")
    done: dict[Candidate, Outcome] = {}

    def run(c: Candidate) -> Outcome | None:
        if c not in done:
            try:
                done[c] = evaluate(records, s, c, capacity=True)
            except ValueError as e:
                if progress:
                    progress(f"skipped {c}: {e}")
                return None
            if progress:
                progress(line(done[c]))
        return done[c]

    stage1 = [o for o in (run(Candidate(bs, d, s.default_max_num_seqs))
                          for d in s.kv_dtypes for bs in s.block_sizes) if o]
    if not stage1:
        raise ValueError("no candidate fits the KV memory")
    best = min(stage1, key=_key).candidate
    for m in s.max_num_seqs:
        run(replace(best, max_num_seqs=m))
    best = min(done.values(), key=_key).candidate
    if s.sliding_window is None and s.layer_windows is None:  # (windows: no KV policy)
        for r in s.compressions:
            run(replace(best, compression_ratio=r))
        for e in s.eviction_ratios:
            run(replace(best, eviction_ratio=e))
    return sorted(done.values(), key=_key)


def line(o: Outcome) -> str:
    c, r = o.candidate, o.result
    ttft = r.ttft_s["p90"]
    tpot = r.tpot_s["p50"]
    cap = o.capacity_req_s
    return (f"bs {c.block_size:4d} {c.kv_dtype:8s} seqs {c.max_num_seqs:4d} {c.policy:17s} "
            f"blocks {o.num_blocks:7d} capacity {_f(cap):>7s} req/s "
            f"hit {r.prefix_hit_rate:.3f} out {r.output_tok_s:8.0f} "
            f"tok/s ttft90 {_f(ttft, digits=3):>7s} s tpot50 "
            f"{_f(tpot, 1e3, 1):>6s} ms run {r.mean_running:5.1f}/{r.peak_running:4d} "
            f"preempt {r.preemptions}")


HEADER = ("| rank | block | KV dtype | B/token | max_num_seqs | policy | blocks | "
          "capacity req/s | capacity out tok/s | bound at capacity | TPOT p50 ms at capacity | "
          "hit rate at capacity | "
          "hit rate | output tok/s | TTFT p50 / p90 s | TPOT p50 ms | running mean / peak | "
          "peak KV use | preemptions | evictions (prefix_lru / preemption / policy) | "
          "KV MiB / request p50 |")


def table(outcomes: list[Outcome], limit: int | None = None) -> str:
    rows = [HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    for i, o in enumerate(outcomes[:limit] if limit else outcomes, 1):
        c, r = o.candidate, o.result
        ev = r.evicted_blocks
        sat = o.saturated
        rows.append(
            f"| {i} | {c.block_size} | {c.kv_dtype} | {o.bytes_per_token:.0f} | "
            f"{c.max_num_seqs} | {c.policy} | {o.num_blocks} | {_f(o.capacity_req_s)} | "
            f"{_f(o.capacity_tok_s, digits=0)} | "
            f"{bound_by(sat, c.max_num_seqs) if sat else '-'} | "
            f"{_f(sat.tpot_s['p50'] if sat else None, 1e3, 1)} | "
            f"{_f(sat.prefix_hit_rate if sat else None, digits=3)} | {r.prefix_hit_rate:.3f} | "
            f"{r.output_tok_s:.0f} | {_f(r.ttft_s['p50'])} / {_f(r.ttft_s['p90'])} | "
            f"{_f(r.tpot_s['p50'], 1e3, 1)} | {r.mean_running:.1f} / {r.peak_running} | "
            f"{r.peak_kv_usage:.2f} | {r.preemptions} | {ev.get('prefix_lru', 0)} / "
            f"{ev.get('preemption', 0)} / {ev.get('policy', 0)} | "
            f"{r.kv_bytes_per_request['p50'] / 2**20:.0f} |")
    return "\n".join(rows)


def _f(v, scale=1.0, digits=2) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def recommended(outcomes: list[Outcome]) -> tuple[Outcome, str]:
    """The recommended outcome and the caveat that goes with it: the top-ranked one, or the
    best full-cache one where a KV policy would add under 10% capacity."""
    best = outcomes[0]
    full = [o for o in outcomes if o.candidate.policy == "full"]
    if best.candidate.policy == "full" or not full:
        return best, ""
    f = full[0]
    gain = (best.capacity_req_s or 0.0) / (f.capacity_req_s or 1e-12) - 1
    if gain < 0.10:
        return f, (f" {best.candidate.policy} would add only {gain:.0%} capacity, not worth "
                   f"what it removes from the context.")
    return best, (f" It uses a KV policy ({best.candidate.policy}): +{gain:.0%} capacity over "
                  f"the best full cache, at a cost in quality to check with `nanokv eval` (the "
                  f"design document: at most 4x for code or maths).")


def recommend(outcomes: list[Outcome]) -> str:
    """The winner and why, against the best full-cache candidate and its neighbours."""
    pick, caveat = recommended(outcomes)
    c, r = pick.candidate, pick.result
    seqs = _stage1_seqs(outcomes, c.max_num_seqs)  # the block-size stage's max_num_seqs
    same_dtype = [o for o in outcomes if o.candidate.kv_dtype == c.kv_dtype
                  and o.candidate.max_num_seqs == seqs and o.candidate.policy == "full"]
    bs_hits = ", ".join(f"{o.candidate.block_size}: {o.result.prefix_hit_rate:.2f}"
                        for o in sorted(same_dtype, key=lambda o: o.candidate.block_size))
    sat = pick.saturated
    bound = (f", bound by {bound_by(sat, c.max_num_seqs)}, peak KV use "
             f"{sat.peak_kv_usage:.2f}" if sat else "")
    why = [f"block size {c.block_size}, kv_cache_dtype {c.kv_dtype}, max_num_seqs "
           f"{c.max_num_seqs}, policy {c.policy}: capacity {_f(pick.capacity_req_s)} req/s "
           f"({_f(pick.capacity_tok_s, digits=0)} output tok/s{bound}, TPOT p50 "
           f"{_f(sat.tpot_s['p50'] if sat else None, 1e3, 1)} ms); at the offered load "
           f"({r.requests_per_s:.1f} req/s served): TTFT p90 {_f(r.ttft_s['p90'])} s, TPOT "
           f"p50 {_f(r.tpot_s['p50'], 1e3, 1)} ms, hit rate {r.prefix_hit_rate:.2f}, "
           f"{pick.num_blocks} blocks ({pick.bytes_per_token:.0f} B/token), running "
           f"{r.mean_running:.0f} on average (peak {r.peak_running}), "
           f"{r.preemptions} preemptions."]
    if bs_hits:
        why.append(f"Hit rate by block size ({c.kv_dtype}, max_num_seqs {seqs}): {bs_hits} "
                   f"(only full blocks are "
                   f"shared, so smaller blocks catch more of each shared prefix).")
    return " ".join(why) + caveat


def plot(outcomes: list[Outcome], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    by_dtype: dict[str, list[Outcome]] = {}
    ref = outcomes[0].candidate.max_num_seqs
    for o in outcomes:
        c = o.candidate
        if c.policy == "full" and c.max_num_seqs == _stage1_seqs(outcomes, ref):
            by_dtype.setdefault(c.kv_dtype, []).append(o)
    for dtype, os_ in sorted(by_dtype.items()):
        os_.sort(key=lambda o: o.candidate.block_size)
        xs = [o.candidate.block_size for o in os_]
        ax1.plot(xs, [o.result.prefix_hit_rate for o in os_], "o-", label=dtype)
        ax2.plot(xs, [o.result.output_tok_s for o in os_], "o-", label=dtype)
    for ax, label in ((ax1, "prefix-cache hit rate"), (ax2, "output tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size (tokens)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(title="kv_cache_dtype")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _stage1_seqs(outcomes: list[Outcome], fallback: int) -> int:
    """The max_num_seqs the block-size x dtype stage ran at (the most common one)."""
    counts: dict[int, int] = {}
    for o in outcomes:
        counts[o.candidate.max_num_seqs] = counts.get(o.candidate.max_num_seqs, 0) + 1
    return max(counts, key=counts.get) if counts else fallback


def pool_bottleneck(make_records, s: AdviseSettings, c: Candidate,
                    rates: list[float]) -> list[tuple[float, SimResult]]:
    """Simulate `c` at each offered rate (make_records(rate) -> trace)."""
    return [(rate, evaluate(make_records(rate), s, c).result) for rate in rates]


def bottleneck_table(rows: list[tuple[float, SimResult]], max_num_seqs: int) -> str:
    out = ["| offered req/s | served req/s | output tok/s | hit rate | running mean / peak | "
           "peak KV use | mean KV use | preemptions | prefix_lru evictions | TTFT p90 s | "
           "TPOT p50 ms | bound by |", "|" + "---|" * 12]
    for rate, r in rows:
        out.append(f"| {rate:g} | {r.requests_per_s:.2f} | {r.output_tok_s:.0f} | "
                   f"{r.prefix_hit_rate:.3f} | {r.mean_running:.1f} / {r.peak_running} | "
                   f"{r.peak_kv_usage:.2f} | {r.mean_kv_usage:.2f} | {r.preemptions} | "
                   f"{r.evicted_blocks.get('prefix_lru', 0)} | {_f(r.ttft_s['p90'])} | "
                   f"{_f(r.tpot_s['p50'], 1e3, 1)} | {bound_by(r, max_num_seqs)} |")
    return "\n".join(out)


def bound_by(r: SimResult, max_num_seqs: int) -> str:
    """What limits the batch: the KV pool (preemptions, or full while fewer than max_num_seqs
    run), max_num_seqs, max_num_batched_tokens, or nothing (the offered load is served)."""
    if r.preemptions > 0 or (r.peak_kv_usage > 0.97 and r.peak_running < max_num_seqs):
        return "KV pool"
    if r.peak_running >= max_num_seqs:
        return "max_num_seqs"
    if r.saturated_s > 0:  # requests waited with sequences and blocks to spare
        return "token budget"
    return "-"
