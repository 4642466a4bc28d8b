"""KV-cache quantization ablation on the ENGINE, like KVQuant's (arXiv 2401.18079) table.

For each setting one engine is started (`LLM(model, kv_cache_dtype=..., ...)`) and measured:

  perplexity   held-out stdlib windows (`nanokv.eval.harness.heldout_windows`), scored with the
               harness's `_Run.continuation_logits`: the first `context_fraction` (75%) of each
               window is prefilled and STORED in the setting's KV cache, then the rest is computed
               as one chunk that reads that context back dequantized and is scored teacher-forced
               (the scored tokens attend to each other with their own fresh K/V, as the engine's
               prefill does). Also KL(float32 || setting) and top-1 agreement on those tokens.
  passkey      `nanokv.eval.tasks.passkey_sample` (the harness's retrieval task), greedy.
  bits/element every byte the setting's KV cache holds per block (codes, scales / zero-points,
               codebooks, outlier values + indices, sinks, slot positions; kvquant's fixed
               staging excluded, shown apart) * 8 / (block_size * 2 * L * Hkv * D).

Settings: float32 (the float pool), int8, fp8_e4m3, fp8_e5m2; KIVI at each width of
`--kivi-bits` (per-channel keys, per-token values in groups, the newest block in full precision;
no calibration); then for each kvquant width the paper's parts added one at a time:

  uniform per-token   keys and values per token, keys after RoPE, uniform grid, no outliers,
                      no sinks
  + per-channel keys  keys per channel over a block's tokens
  + pre-RoPE          keys stored before RoPE, rotated after dequantizing
  + nuq               Fisher-weighted k-means codebooks per layer (learned here, see below)
  + 1% outliers       dense-and-sparse: calibrated per-channel key thresholds, per-token values
  + sinks             the first token in fp16 (= full KVQuant, what `nanokv calibrate` writes)

The parts reach the engine through per-setting calibration files (`--kv-quant-config`, schema in
nanokv/quant/calibration_file.py: settings.per_channel_keys / pre_rope_keys / nuq /
outlier_fraction / num_sink_tokens, codebooks, key_outlier_thresholds) written to --work-dir.
Codebooks and thresholds are learned with nanokv.quant.calibrate's own functions on held-out text
that FOLLOWS the perplexity windows (no overlap), once per (outlier fraction, sinks) combination,
so each setting's codebooks match its normalisation.

    .venv/bin/python benchmarks/quant_ablation.py --model models/nanokv-tiny \\
        --out docs/results/kvquant --num-threads 1
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nanokv.eval.harness import EvalSettings, _Run, heldout_windows  # noqa: E402

FLOAT_SETTINGS = ("float32", "int8", "fp8_e4m3", "fp8_e5m2")
# (label, parts switched on) in the order they are added
PARTS = ("per_channel_keys", "pre_rope_keys", "nuq", "outliers", "sinks")
STEPS = (
    ("uniform per-token", ()),
    ("+ per-channel keys", PARTS[:1]),
    ("+ pre-RoPE", PARTS[:2]),
    ("+ nuq", PARTS[:3]),
    ("+ 1% outliers", PARTS[:4]),
    ("+ sinks", PARTS[:5]),
)
OUTLIER_FRACTION = 0.01
NUM_SINKS = 1


@dataclass(frozen=True)
class Setting:
    name: str
    kv_cache_dtype: str  # auto (float32) | int8 | fp8_e4m3 | fp8_e5m2 | kivi | kvquant
    bits: int | None = None
    parts: tuple[str, ...] = ()

    @property
    def outlier_fraction(self) -> float:
        return OUTLIER_FRACTION if "outliers" in self.parts else 0.0

    @property
    def num_sinks(self) -> int:
        return NUM_SINKS if "sinks" in self.parts else 0


@dataclass
class Row:
    setting: str
    kv_cache_dtype: str
    bits: int | None
    parts: list[str]
    bits_per_element: float  # per block: everything but kvquant's fixed staging
    bits_per_element_held: float  # the whole cache (staging included) over the pool's slots
    bytes_per_token: float
    perplexity: float
    delta: float
    kl: float | None
    top1: float | None
    passkey: float | None
    passkey_by_depth: list | None
    seconds: float
    memory: dict = field(default_factory=dict)


def ablation_settings(bits: tuple[int, ...] = (4, 3, 2),
                      floats: tuple[str, ...] = FLOAT_SETTINGS,
                      steps: tuple[str, ...] | None = None,
                      kivi_bits: tuple[int, ...] = ()) -> list[Setting]:
    """float32 first (the reference), then the other float/int/fp8 settings, KIVI widths, then
    kvquant widths x steps (`steps` filters by label)."""
    out = []
    for name in floats:
        if name not in FLOAT_SETTINGS:
            raise ValueError(f"unknown setting {name!r}; allowed: {list(FLOAT_SETTINGS)}")
        out.append(Setting(name, "auto" if name == "float32" else name))
    for b in kivi_bits:
        if b not in (2, 4):
            raise ValueError(f"kivi bits must be 2 or 4, got {b}")
        out.append(Setting(f"kivi {b}-bit", "kivi", b))
    for b in bits:
        if b not in (2, 3, 4):
            raise ValueError(f"kvquant bits must be 2, 3 or 4, got {b}")
        for label, parts in STEPS:
            if steps is None or label in steps:
                out.append(Setting(f"{b}-bit {label}", "kvquant", b, parts))
    return out


# ---- calibration files ---------------------------------------------------------------------
def learn_parts(model_dir: str, calib_ids: torch.Tensor, block_size: int,
                combos: set[tuple[float, int]], codebook_bits: tuple[int, ...],
                kmeans_iters: int = 50, log=print) -> dict:
    """(outlier_fraction, num_sinks) -> (codebooks {bits: (keys, values)}, thresholds or None),
    learned with nanokv.quant.calibrate's functions on calib_ids [N, S] (HF model, float32)."""
    from transformers import AutoModelForCausalLM

    from nanokv.quant.calibrate import (CalibrationSettings, collect_activations, key_thresholds,
                                        learn_codebooks)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    t0 = time.perf_counter()
    acts = collect_activations(model, calib_ids)
    log(f"[ablation] activations + Fisher on {calib_ids.numel()} tokens "
        f"({time.perf_counter() - t0:.1f}s)")
    learned = {}
    for frac, sinks in sorted(combos):
        cs = CalibrationSettings(candidate_bits=codebook_bits, codebook_bits=codebook_bits,
                                 block_size=block_size, outlier_fraction=frac,
                                 num_sink_tokens=sinks, per_channel_keys=True, nuq=True,
                                 kmeans_iters=kmeans_iters)
        thr = key_thresholds(acts, frac, sinks) if frac > 0 else None
        t0 = time.perf_counter()
        books = learn_codebooks(acts, thr, cs)
        log(f"[ablation] codebooks {list(codebook_bits)}-bit, outliers {frac:g}, sinks {sinks} "
            f"({time.perf_counter() - t0:.1f}s)")
        learned[(frac, sinks)] = (books, thr)
    return learned


def calibration_json(setting: Setting, dims: tuple[int, int, int], model_dir: str,
                     block_size: int, learned: dict, baseline: float, calib_tokens: int) -> dict:
    """A calibration file (nanokv/quant/calibration_file.py schema) switching the parts."""
    from nanokv.quant.calibration_file import FORMAT, VERSION

    layers, heads, dim = dims
    nuq = "nuq" in setting.parts
    books, thr = {}, None
    key = (setting.outlier_fraction, setting.num_sinks)
    if nuq or setting.outlier_fraction:
        books, thr = learned[key]
    return {
        "format": FORMAT, "version": VERSION,
        "model": {"path": model_dir, "num_layers": layers, "num_kv_heads": heads,
                  "head_dim": dim},
        "settings": {"block_size": block_size, "outlier_fraction": setting.outlier_fraction,
                     "num_sink_tokens": setting.num_sinks,
                     "per_channel_keys": "per_channel_keys" in setting.parts,
                     "pre_rope_keys": "pre_rope_keys" in setting.parts, "nuq": nuq,
                     "calib_tokens": calib_tokens, "text": "python-stdlib-heldout (after the "
                     "perplexity windows)", "ablation_setting": setting.name},
        "codebooks": {str(b): {"keys": [list(c) for c in kb], "values": [list(c) for c in vb]}
                      for b, (kb, vb) in sorted(books.items()) if nuq and b == setting.bits},
        # calibrated per-channel key thresholds only with per-channel keys and outliers on
        "key_outlier_thresholds": None if (thr is None or "per_channel_keys" not in setting.parts)
        else {"lower": thr[:, 0].tolist(), "upper": thr[:, 1].tolist()},
        "perplexity": {"baseline": baseline, "trials": []},
        "decision": None,
    }


# ---- measuring -----------------------------------------------------------------------------
def _dims(model_dir: str) -> tuple[int, int, int]:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"], cfg["num_key_value_heads"], dim


def measure(setting: Setting, eval_settings: EvalSettings, windows, reference,
            config_path: str | None, do_passkey: bool,
            passkey_context: int | None = None) -> tuple[Row, list]:
    """Start the engine for one setting; perplexity/KL on `windows`, passkey accuracy."""
    opts = dict(eval_settings.engine_options)
    opts["kv_cache_dtype"] = setting.kv_cache_dtype
    if setting.kv_cache_dtype == "kvquant":
        opts.update(kv_quant_bits=setting.bits, kv_quant_config=config_path)
    elif setting.kv_cache_dtype == "kivi":
        opts.update(kv_quant_bits=setting.bits)
    es = EvalSettings(**{**asdict(eval_settings), "engine_options": opts})
    t0 = time.perf_counter()
    run = _Run(es, "full", 1.0)
    engine = run.engine
    logits, split, _, _ = run.continuation_logits(windows)
    nll, count = 0.0, 0
    for lg, w in zip(logits, windows):
        target = torch.tensor(w[split:])
        nll += float(torch.nn.functional.cross_entropy(lg.float(), target, reduction="sum"))
        count += len(target)
    ppl = math.exp(nll / count)
    kl = top1 = None
    if reference is not None:
        kl_sum, agree = 0.0, 0
        for ref, lg in zip(reference, logits):
            p_log, q_log = ref.float().log_softmax(-1), lg.float().log_softmax(-1)
            kl_sum += float((p_log.exp() * (p_log - q_log)).sum())
            agree += int((ref.argmax(-1) == lg.argmax(-1)).sum())
        kl, top1 = kl_sum / count, agree / count
    passkey = by_depth = None
    if do_passkey:
        if passkey_context is not None:  # retrieval prompts of another length than the windows
            run.settings = EvalSettings(**{**asdict(run.settings),
                                           "context_tokens": passkey_context})
        row = run.retrieval("passkey")
        passkey, by_depth = row.score, row.extra["accuracy_by_depth"]
    layers, heads, dim = engine.layout.num_layers, engine.layout.num_kv_heads, \
        engine.layout.head_dim
    elements = 2 * layers * heads * dim
    bsz = engine.config.block_size
    memory = {"bytes_per_block": engine.kv_bytes_per_block, "block_size": bsz,
              "num_blocks": engine.kv_cache.num_blocks, "kv_cache_bytes": engine.kv_cache.nbytes}
    breakdown = engine.kv_cache.memory_breakdown()  # empty for the float pool
    if breakdown:
        slots = engine.kv_cache.num_blocks * bsz
        memory.update({k: n / slots for k, n in breakdown.items()})
    row = Row(setting.name, setting.kv_cache_dtype, setting.bits, list(setting.parts),
              bits_per_element=engine.kv_bytes_per_block * 8 / (bsz * elements),
              bits_per_element_held=engine.kv_bytes_per_token * 8 / elements,
              bytes_per_token=engine.kv_bytes_per_block / bsz, perplexity=ppl, delta=0.0,
              kl=kl, top1=top1, passkey=passkey, passkey_by_depth=by_depth,
              seconds=time.perf_counter() - t0, memory=memory)
    del run, engine
    return row, logits


def run_ablation(model: str, settings: list[Setting], *, context_tokens: int = 2048,
                 ppl_windows: int = 8, context_fraction: float = 0.75, passkey_samples: int = 20,
                 block_size: int = 128, num_threads: int | None = 1, max_num_seqs: int = 16,
                 calib_samples: int = 8, calib_seq_len: int = 512, kmeans_iters: int = 50,
                 work_dir: str = "runs/quant_ablation", seed: int = 0, log=print,
                 passkey_context: int | None = None) -> list[Row]:
    """Measure every setting on the engine; returns the rows (float32 first if present, the
    reference for the perplexity delta and KL)."""
    from transformers import AutoTokenizer

    if num_threads:
        torch.set_num_threads(num_threads)
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(model)
    calib_windows = math.ceil(calib_samples * calib_seq_len / context_tokens)
    all_windows = heldout_windows(tokenizer, ppl_windows + calib_windows, context_tokens)
    if len(all_windows) < ppl_windows + calib_windows:
        raise ValueError("the held-out corpus is too short for the windows and calibration")
    windows = all_windows[:ppl_windows]
    calib_ids = torch.tensor([t for w in all_windows[ppl_windows:] for t in w]
                             [:calib_samples * calib_seq_len]).view(calib_samples, calib_seq_len)
    engine_options = dict(dtype="float32", block_size=block_size, max_num_seqs=max_num_seqs,
                          num_threads=num_threads, seed=seed)
    es = EvalSettings(model, policies=["full"], tasks=["passkey", "perplexity"],
                      num_samples=max(1, passkey_samples), context_tokens=context_tokens,
                      ppl_windows=ppl_windows, context_fraction=context_fraction, seed=seed,
                      engine_options=engine_options)
    quant = [s for s in settings if s.kv_cache_dtype == "kvquant"]
    combos = {(s.outlier_fraction, s.num_sinks) for s in quant
              if "nuq" in s.parts or s.outlier_fraction}
    learned = {}
    if combos:
        learned = learn_parts(model, calib_ids, block_size, combos,
                              tuple(sorted({s.bits for s in quant})), kmeans_iters, log)
    dims = _dims(model)
    rows, reference, baseline = [], None, math.nan
    for s in settings:
        path = None
        if s.kv_cache_dtype == "kvquant":
            path = str(work / f"calib_{s.bits}bit_{'-'.join(s.parts) or 'none'}.json")
            Path(path).write_text(json.dumps(calibration_json(
                s, dims, model, block_size, learned, baseline, calib_ids.numel())) + "\n")
        row, logits = measure(s, es, windows, reference, path, passkey_samples > 0,
                              passkey_context)
        if reference is None and s.kv_cache_dtype == "auto":
            reference, baseline = logits, row.perplexity
            row.kl, row.top1 = 0.0, 1.0
        rows.append(row)
        log(_line(row))
    base = next((r.perplexity for r in rows if r.kv_cache_dtype == "auto"), math.nan)
    for r in rows:
        r.delta = r.perplexity - base
    return rows


def _line(r: Row) -> str:
    pk = "-" if r.passkey is None else f"{r.passkey:.2f}"
    kl = "-" if r.kl is None else f"{r.kl:.5f}"
    return (f"[ablation] {r.setting:<28} bits/elem {r.bits_per_element:6.2f} "
            f"ppl {r.perplexity:8.4f} KL {kl} passkey {pk} ({r.seconds:.1f}s)")


# ---- output --------------------------------------------------------------------------------
def markdown_table(rows: list[Row]) -> str:
    lines = ["| setting | kv_cache_dtype | bits / element | perplexity | Δ vs float32 | "
             "KL (nats) | top-1 agree | passkey |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kl = "-" if r.kl is None else f"{r.kl:.5f}"
        top1 = "-" if r.top1 is None else f"{r.top1:.3f}"
        pk = "-" if r.passkey is None else f"{r.passkey:.2f}"
        dtype = r.kv_cache_dtype + (f" {r.bits}-bit" if r.bits else "")
        lines.append(f"| {r.setting} | {dtype} | {r.bits_per_element:.2f} | "
                     f"{r.perplexity:.4f} | {r.delta:+.4f} | {kl} | {top1} | {pk} |")
    return "\n".join(lines)


def overhead_table(rows: list[Row]) -> str:
    """Bytes per token by category (the store's memory report)."""
    cats = ("codes", "scales", "outliers", "sinks", "bookkeeping")
    lines = ["| setting | bytes / token | " + " | ".join(cats) + " | staging (fixed, over "
             "the pool) |", "|---|---|" + "---|" * (len(cats) + 1)]
    for r in rows:
        m = r.memory
        if "codes" not in m:
            lines.append(f"| {r.setting} | {r.bytes_per_token:.1f} | "
                         + " | ".join("-" for _ in cats) + " | - |")
            continue
        lines.append(f"| {r.setting} | {r.bytes_per_token:.1f} | "
                     + " | ".join(f"{m.get(c, 0):.1f}" for c in cats)
                     + f" | {m.get('staging', 0):.1f} |")
    return "\n".join(lines)


def plot(rows: list[Row], path: str | Path, title: str) -> None:
    """Left: perplexity vs bits per element (one line per width, the parts added in turn);
    right: perplexity per step (the same lines against the step)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 5.5))
    labels = [label for label, _ in STEPS]
    kvquant = [r for r in rows if r.kv_cache_dtype == "kvquant"]
    for bits in sorted({r.bits for r in kvquant}, reverse=True):
        sub = [r for r in kvquant if r.bits == bits]
        line, = ax.plot([r.bits_per_element for r in sub], [r.perplexity for r in sub], "o-",
                        label=f"kvquant {bits}-bit: parts added in turn")
        for i, r in enumerate(sub):
            step = r.setting.split(" ", 1)[1].replace("uniform per-token", "uniform")
            ax.annotate(step, (r.bits_per_element, r.perplexity), fontsize=6,
                        xytext=(4, 4 if i % 2 else -8), textcoords="offset points")
        xs = [labels.index(r.setting.split(" ", 1)[1]) for r in sub]
        ax2.plot(xs, [r.perplexity for r in sub], "o-", color=line.get_color(),
                 label=f"kvquant {bits}-bit")
    base = next((r.perplexity for r in rows if r.kv_cache_dtype == "auto"), None)
    for r in rows:
        if r.kv_cache_dtype != "kvquant":
            ax.plot([r.bits_per_element], [r.perplexity], "s", label=r.setting)
    for a in (ax, ax2):
        if base is not None:
            a.axhline(base, color="gray", lw=0.8, ls="--", label="float32")
            a.axhline(base + 0.2, color="red", lw=0.8, ls=":", label="float32 + 0.2 (the rule)")
        a.set_ylabel("held-out perplexity (engine)")
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bits per element, overhead included (log2)")
    ax2.set_xticks(range(len(labels)))
    ax2.set_xticklabels(labels, rotation=20, fontsize=8)
    ax2.set_xlabel("KVQuant part added")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(rows: list[Row], out: Path, command: str, meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "ablation.json").write_text(json.dumps(
        {"meta": meta, "command": command, "rows": [asdict(r) for r in rows]}, indent=1) + "\n")
    plot(rows, out / "ablation.png",
         f"{meta['model']}: KV quantization ablation ({meta['ppl_windows']} windows x "
         f"{meta['context_tokens']} tokens)")
    md = [f"# KV-cache quantization ablation on `{meta['model']}`", "",
          "Measured on the engine (not simulated): one `LLM(...)` per setting. Perplexity: "
          f"{meta['ppl_windows']} held-out stdlib windows of {meta['context_tokens']} tokens; the "
          f"first {meta['context_fraction']:.0%} is prefilled and stored in the setting's KV "
          "cache, the rest is computed in one chunk reading that context dequantized and scored "
          "teacher-forced (`nanokv.eval.harness`: `heldout_windows`, "
          "`_Run.continuation_logits`); the scored tokens attend to each other with fresh K/V, "
          "so only context -> continuation attention sees the quantization. KL and top-1 "
          "against float32 on the same tokens. Passkey: "
          f"{meta['passkey_samples']} samples at "
          f"{meta.get('passkey_context', meta['context_tokens']) - 16} tokens, greedy, "
          "exact match. Bits per element: every byte the cache holds per block (codes, "
          "scales / zero-points, codebooks, outlier values and indices, sinks, the 4-byte slot "
          "position) x 8 / (block tokens x 2 x layers x KV heads x head dim); kvquant's fixed "
          "staging (the partial block of each running request, full precision) is excluded "
          "and shown below.", "",
          f"Model shape: {meta['num_layers']} layers, {meta['num_kv_heads']} KV heads of "
          f"{meta['head_dim']}, block size {meta['block_size']}. Codebooks (nuq) and key "
          f"outlier thresholds: learned with `nanokv.quant.calibrate`'s functions on "
          f"{meta['calib_tokens']} held-out tokens that follow the perplexity windows.", "",
          markdown_table(rows), "",
          "## Bytes per token by category", "", overhead_table(rows), "",
          "![ablation](ablation.png)", "",
          "## Command", "", "```bash", command, "```", "",
          f"Total time {meta['seconds']:.0f} s on {meta['host']}.", ""]
    (out / "ablation.md").write_text("\n".join(md))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/nanokv-tiny")
    p.add_argument("--out", default="docs/results/kvquant", help="results directory")
    p.add_argument("--work-dir", default="runs/quant_ablation",
                   help="per-setting calibration files")
    p.add_argument("--bits", type=int, nargs="*", default=[4, 3, 2], help="kvquant widths")
    p.add_argument("--kivi-bits", type=int, nargs="*", default=[4, 2], help="KIVI widths")
    p.add_argument("--floats", nargs="*", default=list(FLOAT_SETTINGS),
                   help="float/int8/fp8 settings (float32 is the reference)")
    p.add_argument("--steps", nargs="*", default=None,
                   help="kvquant steps to run (default all): "  # '%' escaped for argparse
                        + str([s for s, _ in STEPS]).replace("%", "%%"))
    p.add_argument("--context-tokens", type=int, default=2048)
    p.add_argument("--ppl-windows", type=int, default=8)
    p.add_argument("--context-fraction", type=float, default=0.75)
    p.add_argument("--passkey-samples", type=int, default=20, help="0 = skip passkey")
    p.add_argument("--passkey-context", type=int, default=None,
                   help="passkey prompt length in tokens (default: --context-tokens)")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--calib-samples", type=int, default=8)
    p.add_argument("--calib-seq-len", type=int, default=512)
    p.add_argument("--kmeans-iters", type=int, default=50)
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    import platform

    t0 = time.perf_counter()
    settings = ablation_settings(tuple(args.bits), tuple(args.floats),
                                 None if args.steps is None else tuple(args.steps),
                                 tuple(args.kivi_bits))
    rows = run_ablation(args.model, settings, context_tokens=args.context_tokens,
                        ppl_windows=args.ppl_windows, context_fraction=args.context_fraction,
                        passkey_samples=args.passkey_samples, block_size=args.block_size,
                        num_threads=args.num_threads, max_num_seqs=args.max_num_seqs,
                        calib_samples=args.calib_samples, calib_seq_len=args.calib_seq_len,
                        kmeans_iters=args.kmeans_iters, work_dir=args.work_dir, seed=args.seed,
                        passkey_context=args.passkey_context)
    layers, heads, dim = _dims(args.model)
    meta = {"model": args.model, "context_tokens": args.context_tokens,
            "ppl_windows": args.ppl_windows, "context_fraction": args.context_fraction,
            "passkey_samples": args.passkey_samples, "block_size": args.block_size,
            "passkey_context": args.passkey_context or args.context_tokens,
            "num_layers": layers, "num_kv_heads": heads, "head_dim": dim,
            "calib_tokens": args.calib_samples * args.calib_seq_len,
            "seconds": time.perf_counter() - t0,
            "host": f"{platform.machine()} CPU, {args.num_threads} thread(s)"}
    command = ".venv/bin/python benchmarks/quant_ablation.py " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    write_results(rows, Path(args.out), command, meta)
    print(markdown_table(rows))
    print(f"wrote {args.out}/ablation.md, ablation.json, ablation.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
