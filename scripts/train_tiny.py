#!/usr/bin/env python
"""Train nanokv-tiny: a small Qwen3-format decoder + byte-level BPE tokenizer, fully offline.

Data (all generated or read locally, seeded):
  * natural text: the Python standard library's own source (nanokv.eval.corpus training split;
    the held-out split, ~5% of files chosen by sha1 of the relative path, is never trained on and
    is used for perplexity);
  * synthetic long-context retrieval tasks from nanokv.eval.tasks: passkey, multi-key needle,
    JSON key-value lookup, variable tracking.

Each step is one batch of ``--tokens-per-step`` tokens at one sequence length L drawn from a
curriculum (progress < 0.25: L in {128, 256}; < 0.45: {256, 512}; < 0.65: {512, 1024}; then
{1024, 2048, 2048}, up
to --max-context). A row is an induction row with probability --copy-frac (a segment, unrelated
stdlib text, the same segment again; the segment is random token ids with probability
--copy-random, else stdlib text), a stdlib window with probability --stdlib-frac, otherwise a
synthetic task prompt (random length in [max(L/2, 80), L-24]) + answer + eos, right-padded.
Loss = mean CE on stdlib tokens + --copy-weight * mean CE on the repeated segment
+ --prompt-weight * mean CE on task prompt tokens + --answer-weight * mean CE on answer tokens.
The first --induction-warmup steps use rows "A G A T" of random token ids (A of random length at a
random offset; loss on the second A) and a --induction-lm-frac share of stdlib rows.
The q_norm/k_norm weights get --qk-norm-lr-mult times the learning rate.

Progress = max(step / --steps, train_seconds / (--max-minutes * 60)): the curriculum and the cosine
learning rate follow whichever is further along, so a slow machine still reaches long contexts.
Checkpoints (model + optimizer + step) go to --workdir every --eval-every steps; --resume restarts
from the last one. Passkey accuracy at 512/1k/2k is measured with transformers' greedy
``generate``. The final model, tokenizer, eval_results.json and README.md go to --out.

Example (a first phase from scratch; the shipped model is a chain of phases, each started with
--init-from the previous one's --out, and its model card lists every phase's exact command):
  nice -n 10 python scripts/train_tiny.py --out runs/exp1/out --workdir runs/exp1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nanokv.eval import corpus, passkey_formats, tasks  # noqa: E402

EOS = "<|endoftext|>"
# Qwen2-style pre-tokenizer regex: digits one by one, letters with an optional leading char.
# BPE is learnt with this pattern; `add_digit_groups` then switches digits to groups of three.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TASK_WEIGHTS = {
    "passkey": 0.55,
    "multikey_needle": 0.2,
    "kv_lookup": 0.15,
    "variable_tracking": 0.1,
}
EVAL_SEED_BASE = 2**40  # eval seeds: EVAL_SEED_BASE + ctx * 100_000 + i; training seeds < 2**31


def log(msg: str) -> None:
    # tqdm.write keeps the training progress bar (stderr) below the log lines (stdout)
    tqdm.write(f"[{time.strftime('%H:%M:%S')}] {msg}")
    sys.stdout.flush()


# ----------------------------------------------------------------------------- tokenizer


def train_tokenizer(vocab_size: int, files: list[Path], seed: int, digit_groups: bool = False):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def byte_len(text: str) -> list[int]:
        return list(text.encode())

    def texts():
        for f in files:
            yield corpus.read_text(f)
        rng = random.Random(seed)
        for i in range(400):  # task templates, so their words become single tokens
            name = list(TASK_WEIGHTS)[i % len(TASK_WEIGHTS)]
            yield tasks.TASKS[name](byte_len, 600, seed=rng.randrange(2**31)).prompt

    tok.train_from_iterator(texts(), trainer=trainer)
    return add_digit_groups(tok) if digit_groups else tok


DIGITS = "0123456789"


def add_digit_groups(tok):
    """Numbers as groups of up to three digits from the left ("28891" -> "288" "91").

    Llama 3 and GPT-4 split numbers the same way. With one token per digit a 5-digit pass key
    like 28891 repeats a symbol, so copying it token by token is ambiguous (after "8": "8" or
    "9"?) and the model slipped on exactly those; 3-digit groups almost never repeat within a
    number. The BPE vocabulary learnt with single digits keeps its ids; the 1100 two- and
    three-digit groups are appended after it, with merges that reach every group whatever
    pair merges first (ab+c and a+bc).

    Opt-in (`--digit-groups`). Tried on the shipped model (--init-from, 600 steps at 2k): its
    retrieval fell from 0.6 / 0.3 to 0 at 512 / 2k and did not recover. That model never learnt a
    general copy circuit (its loss on random-token copy rows stays at ln V), so 1100 new tokens
    with no trained embedding cannot be copied; a model trained from scratch with groups might.
    """
    from tokenizers import Tokenizer

    data = json.loads(tok.to_str())
    split = data["pre_tokenizer"]["pretokenizers"][0]
    single = r"|\p{N}|"
    if single not in split["pattern"]["Regex"]:
        raise ValueError("tokenizer pre-tokenizer has no single-digit rule to widen")
    split["pattern"]["Regex"] = split["pattern"]["Regex"].replace(single, r"|\p{N}{1,3}|")
    vocab, merges = data["model"]["vocab"], data["model"]["merges"]
    groups = [a + b for a in DIGITS for b in DIGITS]
    groups += [g + c for g in groups for c in DIGITS]
    for g in groups:
        if g in vocab:
            raise ValueError(f"digit group {g!r} is already in the vocabulary")
        vocab[g] = len(vocab)
        if len(g) == 2:
            merges.append([g[0], g[1]])
        else:
            merges.extend([[g[:2], g[2]], [g[0], g[1:]]])
    return Tokenizer.from_str(json.dumps(data))


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def tokenize_files(tok, files: list[Path], eos_id: int) -> torch.Tensor:
    out: list[int] = []
    texts = [corpus.read_text(f) for f in files]
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        out.extend(enc.ids)
        out.append(eos_id)
    return torch.tensor(out, dtype=torch.int32)


# ----------------------------------------------------------------------------- data


def length_choices(progress: float, max_context: int) -> list[int]:
    if progress < 0.25:
        ls = [128, 256]
    elif progress < 0.45:
        ls = [256, 512]
    elif progress < 0.65:
        ls = [512, 1024]
    else:
        ls = [1024, 2048, 2048]
    return [min(L, max_context) for L in ls]


def synthetic_row(tok, rng: random.Random, L: int, task_weights: dict[str, float] = TASK_WEIGHTS,
                  early_frac: float = 0.0, early_depth: float = 0.25,
                  passkey_format: str = "classic"):
    """One task row. A share `early_frac` of passkey rows puts the needle in the first
    `early_depth` of the prompt (uniformly there); the rest draw the depth uniformly. Passkey rows
    are drawn in `passkey_format` (nanokv.eval.passkey_formats; trained formats only)."""
    name = rng.choices(list(task_weights), weights=list(task_weights.values()))[0]
    ctx = rng.randint(max(L // 2, 80), L - 24)
    seed = rng.randrange(2**31)
    # no draw at all when early_frac is 0: the row stream stays that of the recipes before it
    early = early_frac > 0 and rng.random() < early_frac
    depth = rng.uniform(0.0, early_depth) if early else None
    try:
        s = _task(tok, rng, name, ctx, seed, depth, passkey_format)
    except ValueError:  # too many needles for a short context: fall back to a passkey
        try:
            name, s = "passkey", tasks.passkey_sample(tok, ctx, depth=depth, seed=seed,
                                                      fmt=passkey_format)
        except ValueError as e:
            raise ValueError(f"training rows of {L} tokens are too short for the task prompts "
                             f"with this tokenizer ({e}); use longer --lengths") from None
    return name, encode(tok, s.prompt), encode(tok, s.answer)


def _task(tok, rng: random.Random, name: str, ctx: int, seed: int, depth: float | None = None,
          passkey_format: str = "classic"):
    if name == "passkey":
        s = tasks.passkey_sample(tok, ctx, depth=depth, seed=seed, fmt=passkey_format)
    elif name == "multikey_needle":
        s = tasks.multikey_needle_sample(
            tok, ctx, num_needles=rng.randint(2, 6), seed=seed, value_digits=rng.choice([5, 6, 7])
        )
    elif name == "kv_lookup":
        s = tasks.kv_lookup_sample(
            tok, ctx, seed=seed, key_chars=rng.choice([6, 8]), value_chars=rng.choice([6, 8])
        )
    else:
        s = tasks.variable_tracking_sample(
            tok, ctx, num_hops=rng.randint(1, 4), num_chains=rng.randint(1, 2), seed=seed
        )
    return s


def make_batch(
    tok, train_ids: torch.Tensor, step: int, seed: int, progress: float, args, eos_id: int
):
    """Deterministic in (seed, step, progress). Returns ids [B, L] and categories [B, L].

    Category of the token at each position (as a prediction TARGET): 0 ignore, 1 task prompt,
    2 task answer (+ eos), 3 stdlib text, 4 copy (second occurrence of a repeated segment).
    """
    rng = random.Random(seed * 1_000_003 + step)
    vocab_size = tok.get_vocab_size()
    if step < args.induction_warmup:
        # induction warm-up: every row is a random segment repeated twice ("A A"); copying is the
        # only way to predict the second half. Measured on this 4-layer shape (4096 tokens per
        # step, rows of 128): it did NOT grow copy heads in the time tried: copy loss 8.38 -> 8.10
        # (ln V = 8.32) over 540 steps from scratch at lr 2e-3, and flat at 8.32 over 280 steps
        # from a trained model at lr 5e-4. The shipped model retrieves without general copying.
        L = args.induction_len
        B = max(1, args.tokens_per_step // L)
        # A G A T with random lengths: the copy offset varies, so a fixed-offset (positional)
        # head cannot solve it and a content-based induction head has to form
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        ids = torch.randint(1, vocab_size, (B, L), generator=gen)
        cat = torch.zeros((B, L), dtype=torch.long)
        for b in range(B):
            h = rng.randint(6, L // 3)
            g = rng.randint(0, L - 2 * h)
            ids[b, h + g : 2 * h + g] = ids[b, :h]
            cat[b, h + g + 1 : 2 * h + g] = 4
        for b in range(B):  # a share of ordinary stdlib rows, so the LM is not starved
            if rng.random() < args.induction_lm_frac:
                start = rng.randrange(0, len(train_ids) - L - 1)
                ids[b] = train_ids[start : start + L].long()
                cat[b] = 3
                cat[b, 0] = 0
        return ids, cat
    lengths = args.lengths or length_choices(progress, args.max_context)
    L = rng.choice(lengths)
    B = max(1, args.tokens_per_step // L)
    ids = torch.full((B, L), eos_id, dtype=torch.long)
    cat = torch.zeros((B, L), dtype=torch.long)
    for b in range(B):
        r = rng.random()
        if r < args.copy_frac and rng.random() < args.copy_digits:
            # digit rows: a random digit string (as digit groups), stdlib text, the same
            # string again: copying numbers exactly, what the pass key and needle tasks need
            h = rng.randint(4, 24)
            g = rng.randrange(0, len(train_ids) - L - 1)
            digits = "".join(rng.choice(DIGITS) for _ in range(h))
            seg = torch.tensor(encode(tok, digits))
            h = len(seg)
            gap = rng.randint(0, L - 2 * h)
            ids[b] = torch.cat([train_ids[g : g + gap].long(), seg,
                                train_ids[g + gap : g + L - 2 * h].long(), seg])
            cat[b, 1 : L - h + 1] = 3
            cat[b, L - h + 1 :] = 4
        elif r < args.copy_frac:
            # induction rows: segment, unrelated stdlib text, the same segment again; the
            # segment is random tokens most of the time (only copying can predict it)
            h = rng.randint(L // 4, L // 2)
            g = rng.randrange(0, len(train_ids) - L - 1)
            if rng.random() < args.copy_random:
                seg = torch.tensor([rng.randrange(1, vocab_size) for _ in range(h)])
            else:
                a = rng.randrange(0, len(train_ids) - L - 1)
                seg = train_ids[a : a + h].long()
            ids[b] = torch.cat([seg, train_ids[g : g + L - 2 * h].long(), seg])
            cat[b, 1 : L - h + 1] = 3
            cat[b, L - h + 1 :] = 4
        elif r < args.copy_frac + args.stdlib_frac:
            start = rng.randrange(0, len(train_ids) - L - 1)
            ids[b] = train_ids[start : start + L].long()
            cat[b, 1:] = 3
        else:
            _, p, a = synthetic_row(tok, rng, L, args.task_weights,
                                    args.early_needle_frac, args.early_needle_depth,
                                    args.passkey_format)
            seq = (p + a + [eos_id])[:L]
            ids[b, : len(seq)] = torch.tensor(seq)
            cat[b, 1 : len(p)] = 1
            cat[b, len(p) : len(seq)] = 2
    return ids, cat


def loss_terms(logits: torch.Tensor, ids: torch.Tensor, cat: torch.Tensor):
    # logits [B, L, V] predicts ids shifted by one
    ce = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)).float(),
        ids[:, 1:].reshape(-1),
        reduction="none",
    )  # [B*(L-1)]
    c = cat[:, 1:].reshape(-1)
    terms = {}
    for k, name in ((1, "prompt"), (2, "answer"), (3, "lm"), (4, "copy")):
        m = c == k
        if m.any():
            terms[name] = ce[m].mean()
    return terms


# ----------------------------------------------------------------------------- eval


@torch.no_grad()
def passkey_accuracy(model, tok, ctx: int, n: int, device, eos_id: int,
                     fmt: str = "classic") -> tuple[float, list]:
    model.eval()
    hits, fails = 0, []
    for i in range(n):
        s = tasks.passkey_sample(tok, ctx, seed=EVAL_SEED_BASE + ctx * 100_000 + i, fmt=fmt)
        x = torch.tensor([encode(tok, s.prompt)], device=device)
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=eos_id,
            pad_token_id=eos_id,
        )
        text = tok.decode(out[0, x.shape[1] :].tolist())
        ok = tasks.score(s, text)
        hits += ok
        if not ok and len(fails) < 3:
            fails.append((round(s.depth, 2), s.answer.strip(), text))
    model.train()
    return hits / n, fails


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, window: int, device, max_tokens: int | None = None):
    """exp(mean NLL) over non-overlapping windows of `window` tokens (each scored from scratch)."""
    model.eval()
    if max_tokens is not None:
        ids = ids[:max_tokens]
    total, count = 0.0, 0
    for s in range(0, len(ids) - 1, window):
        chunk = ids[s : s + window].long().unsqueeze(0).to(device)
        if chunk.shape[1] < 2:
            break
        logits = model(input_ids=chunk, use_cache=False).logits
        nll = F.cross_entropy(logits[0, :-1].float(), chunk[0, 1:], reduction="sum")
        total += nll.item()
        count += chunk.shape[1] - 1
    model.train()
    return math.exp(total / count), count


@torch.no_grad()
def sample_text(
    model,
    tok,
    prompt: str,
    device,
    eos_id: int,
    max_new_tokens: int = 80,
    do_sample: bool = False,
    seed: int = 0,
) -> str:
    model.eval()
    torch.manual_seed(seed)
    x = torch.tensor([encode(tok, prompt)], device=device)
    kw = dict(do_sample=True, temperature=0.8, top_k=50) if do_sample else dict(do_sample=False)
    out = model.generate(
        x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        **kw,
    )
    model.train()
    return prompt + tok.decode(out[0, x.shape[1] :].tolist())


# ----------------------------------------------------------------------------- model / io


def build_model(args, vocab_size: int, eos_id: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        rope_theta=args.rope_theta,
        rms_norm_eps=1e-6,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        use_cache=True,
        attn_implementation="sdpa",
        torch_dtype="float32",
    )
    torch.manual_seed(args.seed)
    return Qwen3ForCausalLM(cfg)


def grow_embeddings(weights: dict, tok, vocab_size: int, seed: int) -> None:
    """Give tokens appended to the vocabulary (digit groups) embedding rows, in place.

    New rows are random with the old rows' scale: random vectors in the hidden space are nearly
    orthogonal, so the model's copy (induction) circuits can tell the new tokens apart from the
    first step. (Starting them at the mean of their digits' embeddings made all groups alike;
    retrieval fell to zero and had not come back 600 steps later.)
    """
    emb = weights["model.embed_tokens.weight"]  # [old_vocab, hidden]
    old = emb.shape[0]
    if old >= vocab_size:
        return
    for i in range(old, vocab_size):
        text = tok.id_to_token(i)
        if not text or not text.isdigit():
            raise ValueError(f"cannot initialise new token {i} ({text!r}): only digit groups "
                             f"can be added to an initialising model's vocabulary")
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(vocab_size - old, emb.shape[1], generator=gen) * emb.std()
    weights["model.embed_tokens.weight"] = torch.cat([emb, rows])  # [vocab, hidden]
    weights.pop("lm_head.weight", None)  # tied to the embeddings


def export(model, tok, out: Path, eos_id: int) -> None:
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, do_sample=False
    ).save_pretrained(out)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=EOS,
        bos_token=EOS,
        unk_token=None,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.save_pretrained(out)


def save_ckpt(path: Path, model, opt, step: int, train_seconds: float, history: list) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "model": model.state_dict(),
            "opt": opt.state_dict(),
            "step": step,
            "train_seconds": train_seconds,
            "history": history,
        },
        tmp,
    )
    os.replace(tmp, path)


def write_model_card(out: Path, r: dict) -> None:
    """README.md for the model directory, from eval_results.json's numbers."""
    a = r["args"]
    pk = r["passkey_accuracy"]
    n = r["passkey_samples_per_length"]
    hist = "\n".join(
        f"| {h['step']} | {h['train_minutes']} | "
        + " | ".join(
            f"{h['passkey'].get(k, h['passkey'].get(int(k), float('nan'))):.2f}"
            for k in ("512", "1024", "2048")
        )
        + f" | {h['heldout_ppl_32k']} |"
        for h in r["history"]
    )
    samples = "\n\n".join(f"```python\n{s}\n```" for s in r["samples"])
    held = ", ".join(f"`{f}`" for f in r["heldout_files"])
    tw = a.get("task_weights", TASK_WEIGHTS)
    phases = r.get("previous_phases", [])
    total_minutes = round(r["train_minutes"] + sum(p["train_minutes"] for p in phases), 1)
    phase_rows = "\n".join(
        f"| {i + 1} | `{p['command']}` | {p['steps']} | {p['train_minutes']} | "
        f"{p['passkey_accuracy']} | {p['heldout_perplexity']} |"
        for i, p in enumerate(phases + [r]))
    train_what = ("the last phase (every phase's command is in the table above; each "
                  "--init-from is the previous phase's --out)") if phases else "train"
    phase_text = "" if not phases else f"""
Trained in {len(phases) + 1} phases, each starting from the previous one's weights
(`--init-from`, fresh optimizer and schedule):

| phase | command | steps | train min | passkey at its end | held-out ppl |
|---|---|---|---|---|---|
{phase_rows}

The settings and in-training evaluations below are those of the last phase.
"""
    lengths_text = (
        f"L drawn uniformly from {a['lengths']} at every step" if a.get("lengths") else
        "curriculum over progress = max(step / steps, train time / budget): L from {128, 256} "
        "(progress < 0.25), {256, 512} (< 0.45), {512, 1024} (< 0.65), then {1024, 2048, 2048}")
    notes = f"\n{r['notes'].strip()}\n" if r.get("notes") else ""
    early_text = (f" (in {a['early_needle_frac']:g} of passkey rows uniformly in the first "
                  f"{a['early_needle_depth']:g} of the prompt instead)"
                  if a.get("early_needle_frac") else "")
    ok = pk.get("2048", 0.0) >= 0.95
    status = (f"Passkey target (>= 0.95 at 2048 tokens) {'MET' if ok else 'NOT met'}: "
              f"{pk.get('2048', float('nan')):.2f} over {n} samples.")
    vocab_size = r.get("vocab_size", a["vocab"])
    vocab_desc = (f"{vocab_size}: byte-level BPE of {a['vocab']} tokens learnt with digits one by "
                  f"one, then the 1100 groups \"00\"..\"999\" appended; numbers split into groups "
                  f"of up to three digits from the left (\"28891\" -> \"288\" \"91\")"
                  if vocab_size > a["vocab"] else
                  f"{vocab_size}, byte-level BPE, digits split one per token")
    text = f"""# nanokv-tiny

A {r["parameters"] / 1e6:.2f}M-parameter decoder in Hugging Face **Qwen3** format
(`Qwen3ForCausalLM`), with a {vocab_size}-token byte-level BPE tokenizer, trained from scratch
on a CPU in {total_minutes} minutes of training steps, fully offline. It is nanokv's default test
model: small enough to run anywhere, with GQA (so the engine's grouped KV heads are exercised),
and trained on passkey retrieval up to 2k tokens so that KV-cache compression and eviction get a
quality signal that breaks when the needle is dropped.

**{status}**
{notes}
| measure (full KV cache, greedy) | value |
|---|---|
| passkey exact match @512 tokens | {pk.get("512", float("nan")):.2f} ({n} samples) |
| passkey exact match @1024 tokens | {pk.get("1024", float("nan")):.2f} ({n} samples) |
| passkey exact match @2048 tokens | {pk.get("2048", float("nan")):.2f} ({n} samples) |
| held-out perplexity (stdlib files never trained on) | {r["heldout_perplexity"]:.2f} \
over {r["heldout_tokens"]:,} tokens |

These numbers were produced by `scripts/train_tiny.py` at the end of training and are stored in
`eval_results.json` (with the in-training evaluations and the full argument list).

## Model

| | |
|---|---|
| architecture | Qwen3ForCausalLM (RMSNorm, q/k-norm, SwiGLU, RoPE) |
| layers / hidden / MLP | {a["layers"]} / {a["hidden"]} / {a["intermediate"]} |
| heads | {a["heads"]} query heads, {a["kv_heads"]} KV heads (GQA), head_dim \
{a["head_dim"]} |
| vocabulary | {vocab_desc}, `<|endoftext|>` = id 0 (eos, pad) |
| embeddings | tied input/output |
| positions | RoPE theta {a["rope_theta"]:g}, max_position_embeddings 4096 (trained up to \
{a["max_context"]}) |
| dtype | float32 (`model.safetensors`) |

## Data (all local, seeded with `--seed {a["seed"]}`)

* **Natural text**: the Python {sys.version.split()[0]} standard library's `*.py` files
  (`nanokv.eval.corpus`): every file under `sysconfig.get_paths()['stdlib']` except
  `site-packages` and the test suites (directories `test`, `tests`, `idle_test`);
  {r["training_files"]} training files = {r["training_tokens_available"]:,} tokens. Files are
  joined with `<|endoftext|>`; a training row is a random window of that stream.
* **Held out** (never trained on, not even by the tokenizer): a file is held out when
  `int(sha1(relpath).hexdigest(), 16) % 20 == 0` (`relpath` relative to the stdlib root, POSIX).
  {len(r["heldout_files"])} files: {held}.
* **Synthetic long-context tasks** (`nanokv.eval.tasks`, pure functions of a seed):
  passkey (weight {tw["passkey"]}; the KVQuant/LongLoRA format: filler "The grass is
  green. The sky is blue. The sun is yellow. Here we go. There and back again." repeated, needle
  "The pass key is N. Remember it. N is the pass key." at a uniformly random
  depth{early_text}, query "What is the pass key? The pass key is", N in [1, 50000]);
  multi-key needle (weight
  {tw["multikey_needle"]}; 2-6 needles "The special magic number for KEY is N.", 5-7
  digits); JSON key-value lookup (weight {tw["kv_lookup"]}; 6-8 hex characters);
  variable tracking (weight {tw["variable_tracking"]}; 1-4 hops, 1-2 chains).
* **Mix**: a row is an induction row with probability {a["copy_frac"]} (a segment of L/4..L/2
  tokens, random token ids with probability {a["copy_random"]} and stdlib text otherwise, then
  unrelated stdlib text,
  then the same segment again; its second occurrence is weighted {a["copy_weight"]}; a share
  {a.get("copy_digits", 0.0)} of these rows instead copy a random string of 4-24 digits placed at
  a random offset), stdlib
  text with probability {a["stdlib_frac"]}, else a task prompt of
  max(L/2, 80) .. L-24 tokens + answer + eos (right-padded). Loss = mean CE on stdlib tokens
  + {a["prompt_weight"]} x mean CE on task prompt tokens + {a["answer_weight"]} x mean CE on
  answer tokens.
* **Induction warm-up**: in the first {a["induction_warmup"]} steps a row is "A G A T" of
  {a["induction_len"]} random token ids, A of 6..L/3 tokens at a random offset (loss only on the
  second A), or with probability
  {a["induction_lm_frac"]} a stdlib window, meant to grow copy (induction) heads before the mixed
  data starts.
* **Sequence lengths**: {lengths_text};
  {a["tokens_per_step"]} tokens per step (batch = {a["tokens_per_step"]} / L).

## Training
{phase_text}
* {r["steps"]} AdamW steps (betas 0.9/0.95, weight decay {a["weight_decay"]}, lr {a["lr"]:g},
  {a["warmup"]} warmup steps, cosine to {a["min_lr_frac"]} x lr), gradient clip 1.0, about
  {r["tokens_seen_approx"]:,} tokens seen.
* Wall time: {r["train_minutes"]} min of training steps, {r["total_wall_minutes"]} min in total
  including tokenizer training, tokenization, periodic evaluations and the final evaluation
  ({r["final_eval_minutes"]} min). Device: {r["device"]} (2 shared CPU cores,
  `torch.set_num_threads({a["threads"]})`, torch {r["torch"]}).

In-training evaluations ({a["eval_samples"]} passkey samples per length; perplexity on the first
32k held-out tokens):

| step | train min | passkey@512 | @1024 | @2048 | held-out ppl (32k) |
|---|---|---|---|---|---|
{hist}

## Evaluation protocol

Passkey: `passkey_sample(tokenizer, ctx, seed=2**40 + ctx * 100000 + i)` for i < {n} (the depth
is drawn from the seed, uniform in [0, 1]); the prompt holds at most ctx tokens; greedy
`model.generate(do_sample=False, max_new_tokens=8)`; correct when the first run of digits in the
continuation equals N. Perplexity: exp(mean next-token NLL) over all held-out tokens, in
non-overlapping 1024-token windows, each window scored from an empty cache.

## Samples (greedy for the first, temperature 0.8 / top-k 50 for the others)

{samples}

## Commands

```bash
# {train_what}; checkpoints and logs go to its --workdir, resumable with --resume
{r["command"]}
# tests of the data builders
pytest tests/unit/test_eval_tasks.py
```

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained("models/nanokv-tiny")
model = AutoModelForCausalLM.from_pretrained("models/nanokv-tiny")
```

## Limitations

A toy: it writes Python-looking text, not correct programs, and knows nothing beyond the stdlib
and the four task formats. Passkey accuracy is only meaningful in the trained format and up to
the trained length ({a["max_context"]} tokens); longer contexts are untested. The multi-key,
key-value
and variable-tracking tasks were trained with lower weight and are not measured here.
"""
    (out / "README.md").write_text(text)


class ThreadGovernor:
    """Shares the CPU politely: when other processes keep more than ~0.6 of a core busy, run
    torch on one thread (a starved second thread stalls every parallel op), else on --threads.
    Reads /proc/stat (Linux); elsewhere it leaves the thread count alone."""

    def __init__(self, max_threads: int):
        self.max_threads = max_threads
        self.threads = max_threads
        self.last = self._sample()

    @staticmethod
    def _sample():
        try:
            with open("/proc/stat") as f:
                vals = [int(v) for v in f.readline().split()[1:9]]
        except OSError:
            return None
        hz = os.sysconf("SC_CLK_TCK")
        t = os.times()
        return time.time(), (sum(vals) - vals[3] - vals[4]) / hz, t.user + t.system

    def update(self) -> int:
        now = self._sample()
        if now is None or self.last is None or self.max_threads < 2:
            return self.threads
        wall = now[0] - self.last[0]
        if wall < 5:
            return self.threads
        other = ((now[1] - self.last[1]) - (now[2] - self.last[2])) / wall  # cores used by others
        self.last = now
        want = 1 if other > 0.6 else self.max_threads
        if want != self.threads:
            torch.set_num_threads(want)
            log(f"other processes use {other:.1f} cores: torch threads {self.threads} -> {want}")
            self.threads = want
        return self.threads


# ----------------------------------------------------------------------------- main


def parse_lengths(text: str) -> list[int]:
    try:
        lengths = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--lengths must be comma-separated integers, got {text!r}") from None
    if any(n < 128 for n in lengths):
        raise argparse.ArgumentTypeError(f"every length must be >= 128, got {lengths}")
    return lengths


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {value}")
    return value


def parse_task_weights(text: str) -> dict[str, float]:
    weights = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        if name.strip() not in TASK_WEIGHTS:
            raise argparse.ArgumentTypeError(
                f"unknown task {name.strip()!r}; allowed: {', '.join(TASK_WEIGHTS)}"
            )
        try:
            weights[name.strip()] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"task weight {part!r} is not name=number") from None
        if weights[name.strip()] < 0:
            raise argparse.ArgumentTypeError(f"task weight {part!r} must be >= 0")
    if sum(weights.values()) <= 0:
        raise argparse.ArgumentTypeError("task weights must not all be 0")
    return weights


def training_format(value: str) -> str:
    """A passkey format that may be trained on: classic, trained, or HAYSTACK/WORDING of the
    trained split."""
    fmt = passkey_formats.parse_format(value)
    if fmt == "held_out" or ("/" in fmt and (
            fmt.split("/")[0] in passkey_formats.HELD_OUT_HAYSTACKS
            or fmt.split("/")[1] in passkey_formats.HELD_OUT_WORDINGS)):
        raise argparse.ArgumentTypeError(
            f"{value!r} uses a held-out haystack or wording ({passkey_formats.HELD_OUT_HAYSTACKS},"
            f" {passkey_formats.HELD_OUT_WORDINGS}): those are kept out of training for the "
            f"evaluation; use 'classic', 'trained' or a trained HAYSTACK/WORDING")
    return fmt


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--out", default="models/nanokv-tiny", help="final model directory")
    p.add_argument(
        "--workdir",
        default="runs/nanokv-tiny",
        help="tokenizer, token caches, checkpoints, log of evals",
    )
    p.add_argument("--steps", type=int, default=2400, help="optimizer steps")
    p.add_argument(
        "--max-minutes",
        type=float,
        default=60.0,
        help="training wall-time budget; progress is max(step/steps, time/budget)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-context", type=int, default=2048, help="longest training sequence")
    p.add_argument("--tokens-per-step", type=int, default=2048, help="batch size in tokens")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument(
        "--qk-norm-lr-mult",
        type=float,
        default=10.0,
        help="learning-rate multiplier of the q_norm/k_norm weights",
    )
    p.add_argument("--min-lr-frac", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--stdlib-frac", type=float, default=0.25, help="share of rows of stdlib text")
    p.add_argument(
        "--copy-frac",
        type=float,
        default=0.35,
        help="share of induction rows: a stdlib segment, other text, the segment again",
    )
    p.add_argument(
        "--induction-warmup",
        type=int,
        default=350,
        help="first steps made only of repeated random segments (induction warm-up)",
    )
    p.add_argument(
        "--induction-lm-frac",
        type=float,
        default=0.25,
        help="share of stdlib rows during the induction warm-up",
    )
    p.add_argument(
        "--induction-len", type=int, default=64, help="row length during the induction warm-up"
    )
    p.add_argument(
        "--copy-random",
        type=float,
        default=0.7,
        help="share of induction rows whose segment is random token ids",
    )
    p.add_argument(
        "--digit-groups",
        action="store_true",
        help="tokenize numbers as groups of up to three digits (1100 tokens appended to the BPE "
        "vocabulary; with --init-from, a digit-by-digit model's tokenizer and embeddings are "
        "widened); default: one token per digit, as the shipped model",
    )
    p.add_argument(
        "--copy-digits",
        type=fraction,
        default=0.0,
        help="share of induction rows whose segment is a random digit string of 4-24 digits, "
        "placed at a random offset",
    )
    p.add_argument(
        "--copy-weight",
        type=float,
        default=1.0,
        help="loss weight of the repeated segment's tokens",
    )
    p.add_argument(
        "--prompt-weight", type=float, default=0.1, help="loss weight of task prompt tokens"
    )
    p.add_argument("--answer-weight", type=float, default=1.0, help="loss weight of answers")
    p.add_argument(
        "--task-weights",
        type=parse_task_weights,
        default=dict(TASK_WEIGHTS),
        help="share of each synthetic task among task rows, e.g. "
        "passkey=0.55,multikey_needle=0.2,kv_lookup=0.15,variable_tracking=0.1",
    )
    p.add_argument(
        "--passkey-format",
        type=training_format,
        default="classic",
        help="format of the passkey training rows (nanokv.eval.passkey_formats): 'classic', "
        "'trained' (a random trained haystack and wording per row) or HAYSTACK/WORDING of the "
        "trained split; held-out formats are refused (they are kept for evaluation)",
    )
    p.add_argument(
        "--eval-formats",
        type=lambda v: [passkey_formats.parse_format(f.strip()) for f in v.split(",") if f.strip()],
        default=["held_out"],
        help="comma-separated passkey formats also evaluated at 2k tokens (in-training and "
        "final evaluations; the per-length table stays the classic format)",
    )
    p.add_argument(
        "--early-needle-frac",
        type=fraction,
        default=0.0,
        help="share of passkey rows whose needle is placed in the first --early-needle-depth of "
        "the prompt (default 0: the depth is uniform in [0, 1])",
    )
    p.add_argument(
        "--early-needle-depth",
        type=fraction,
        default=0.25,
        help="upper end of the early needle depths, a fraction of the prompt in [0, 1]",
    )
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--eval-samples", type=int, default=16, help="passkey samples per length")
    p.add_argument(
        "--final-samples",
        type=int,
        default=100,
        help="passkey samples per length in the final evaluation",
    )
    p.add_argument(
        "--stop-passkey",
        type=float,
        default=0.97,
        help="stop early once 2k passkey accuracy reaches this at two consecutive "
        "evals after progress 0.7 (>1 disables)",
    )
    p.add_argument(
        "--init-from",
        default=None,
        help="start from the weights of an exported model directory (a previous phase's --out; "
        "its eval_results.json is recorded as that phase); fresh optimizer and schedule",
    )
    p.add_argument(
        "--lengths",
        type=parse_lengths,
        default=None,
        help="fixed training sequence lengths, e.g. 1024,2048,2048 (default: the curriculum)",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--resume", action="store_true", help="continue from workdir/ckpt.pt")
    p.add_argument(
        "--card-only",
        action="store_true",
        help="only rewrite --out/README.md from --out/eval_results.json",
    )
    p.add_argument(
        "--eval-only",
        action="store_true",
        help="skip training: evaluate workdir/ckpt.pt and export it",
    )
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.card_only:
        results = json.loads((Path(args.out) / "eval_results.json").read_text())
        write_model_card(Path(args.out), results)
        return
    t_start = time.time()
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)

    from tokenizers import Tokenizer

    train_files, held_files = corpus.training_files(), corpus.heldout_files()
    log(
        f"stdlib: {len(train_files)} training files, {len(held_files)} held out "
        f"(root {corpus.stdlib_root()})"
    )
    tok_path = work / "tokenizer.json"
    init_tok = Path(args.init_from or "") / "tokenizer.json"
    if tok_path.exists():
        tok = Tokenizer.from_file(str(tok_path))
    elif args.init_from and init_tok.is_file():  # continue with the model's own tokenizer
        tok = Tokenizer.from_file(str(init_tok))
        if args.digit_groups and tok.token_to_id("288") is None:  # widen a digit-by-digit one
            tok = add_digit_groups(tok)
            log(f"{init_tok}: digit groups added, vocab {tok.get_vocab_size()}")
        tok.save(str(tok_path))
    else:
        t0 = time.time()
        tok = train_tokenizer(args.vocab, train_files, args.seed, args.digit_groups)
        tok.save(str(tok_path))
        log(f"tokenizer trained in {time.time() - t0:.0f}s, vocab {tok.get_vocab_size()}")
    eos_id = tok.token_to_id(EOS)
    cache = work / "tokens.pt"
    if cache.exists():
        train_ids, held_ids = torch.load(cache)
    else:
        train_ids = tokenize_files(tok, train_files, eos_id)
        held_ids = tokenize_files(tok, held_files, eos_id)
        torch.save((train_ids, held_ids), cache)
    log(f"tokens: train {len(train_ids):,}, held-out {len(held_ids):,}")

    model = build_model(args, tok.get_vocab_size(), eos_id).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f}M parameters, attn {model.config._attn_implementation}")
    # q_norm / k_norm weights set the attention temperature (Qwen3 normalises q and k): they
    # start at 1, which caps logits near sqrt(head_dim), too flat to pick one needle among 2k
    # tokens; a larger learning rate lets them grow in tens of steps instead of thousands.
    named = list(model.named_parameters())
    qk = [p for n, p in named if n.endswith(("q_norm.weight", "k_norm.weight"))]
    decay = [p for n, p in named if p.dim() >= 2]
    no_decay = [
        p for n, p in named if p.dim() < 2 and not n.endswith(("q_norm.weight", "k_norm.weight"))
    ]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
            {"params": qk, "weight_decay": 0.0, "lr_mult": args.qk_norm_lr_mult},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    previous_phases = []
    if args.init_from:
        from safetensors.torch import load_file

        init = Path(args.init_from)
        if not (init / "model.safetensors").is_file():
            raise SystemExit(f"--init-from {init}: no model.safetensors there (give a previous "
                             f"phase's --out directory)")
        weights = load_file(str(init / "model.safetensors"))
        grow_embeddings(weights, tok, model.config.vocab_size, args.seed)
        missing, unexpected = model.load_state_dict(weights, strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:  # lm_head is tied to embeddings
            raise ValueError(f"{init} does not match this architecture: missing {missing}, "
                             f"unexpected {unexpected}")
        model.tie_weights()
        if (init / "eval_results.json").exists():
            prev = json.loads((init / "eval_results.json").read_text())
            previous_phases = prev.get("previous_phases", []) + [
                {k: prev[k] for k in ("command", "steps", "train_minutes", "passkey_accuracy",
                                      "heldout_perplexity", "tokens_seen_approx", "history")}]
        log(f"initialised from {init} ({len(previous_phases)} earlier phase(s))")
    step, train_seconds, history = 0, 0.0, []
    ckpt = work / "ckpt.pt"
    if (args.resume or args.eval_only) and ckpt.exists():
        state = torch.load(ckpt, map_location=device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, train_seconds, history = state["step"], state["train_seconds"], state["history"]
        log(f"resumed from step {step} ({train_seconds / 60:.1f} min trained)")

    budget = args.max_minutes * 60
    progress = max(step / args.steps, train_seconds / budget)
    good_evals = 0
    governor = ThreadGovernor(args.threads if device.type == "cpu" else 0)
    model.train()
    # steps, or the time budget, whichever ends the phase first
    bar = tqdm(total=args.steps, initial=step, desc="train", unit="step", dynamic_ncols=True,
               disable=args.eval_only)
    while not args.eval_only and step < args.steps and progress < 1.0:
        if step % 10 == 0:
            governor.update()
        t0 = time.time()
        lr_scale = min(1.0, (step + 1) / args.warmup)
        cosine = 0.5 * (1 + math.cos(math.pi * progress))
        lr_scale *= args.min_lr_frac + (1 - args.min_lr_frac) * cosine
        for g in opt.param_groups:
            g["lr"] = args.lr * lr_scale * g.get("lr_mult", 1.0)
        ids, cat = make_batch(tok, train_ids, step, args.seed, progress, args, eos_id)
        ids, cat = ids.to(device), cat.to(device)
        logits = model(input_ids=ids, use_cache=False).logits
        terms = loss_terms(logits, ids, cat)
        weights = {
            "lm": 1.0,
            "prompt": args.prompt_weight,
            "answer": args.answer_weight,
            "copy": args.copy_weight,
        }
        loss = sum(weights[k] * v for k, v in terms.items())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        train_seconds += time.time() - t0
        progress = max(step / args.steps, train_seconds / budget)
        bar.set_postfix_str(f"loss {loss.item():.3f} lr {args.lr * lr_scale:.2e} "
                            f"budget {train_seconds / budget:.0%}", refresh=False)
        bar.update(1)
        if step % 20 == 0 or step == 1:
            parts = " ".join(f"{k}={v.item():.3f}" for k, v in sorted(terms.items()))
            log(
                f"step {step} L={ids.shape[1]} B={ids.shape[0]} lr={args.lr * lr_scale:.2e} "
                f"{parts} progress={progress:.3f} ({train_seconds / 60:.1f} min)"
            )
        if step % args.eval_every == 0 or step >= args.steps or progress >= 1.0:
            accs = {}
            for ctx in (512, 1024, 2048):
                if ctx <= args.max_context:
                    accs[ctx], fails = passkey_accuracy(
                        model, tok, ctx, args.eval_samples, device, eos_id
                    )
            by_format = {fmt: passkey_accuracy(model, tok, min(2048, args.max_context),
                                               args.eval_samples, device, eos_id, fmt)[0]
                         for fmt in args.eval_formats}
            ppl, _ = perplexity(model, held_ids, 1024, device, max_tokens=32 * 1024)
            history.append(
                {
                    "step": step,
                    "train_minutes": round(train_seconds / 60, 2),
                    "passkey": accs,
                    "passkey_2k_by_format": by_format,
                    "heldout_ppl_32k": round(ppl, 3),
                }
            )
            log(
                f"EVAL step {step}: passkey {accs} (n={args.eval_samples}), at 2k by format "
                f"{by_format}, held-out ppl "
                f"(first 32k tokens) {ppl:.2f}; 2k failures {fails}"
            )
            save_ckpt(ckpt, model, opt, step, train_seconds, history)
            if accs.get(2048, 0) >= args.stop_passkey and progress >= 0.7:
                good_evals += 1
                if good_evals >= 2:
                    log("passkey target reached at two consecutive evals: stopping early")
                    break
            else:
                good_evals = 0

    bar.close()
    # final evaluation
    log("final evaluation")
    t_eval = time.time()
    final = {}
    for ctx in (512, 1024, 2048):
        if ctx <= args.max_context:
            acc, fails = passkey_accuracy(model, tok, ctx, args.final_samples, device, eos_id)
            final[ctx] = acc
            log(f"passkey @{ctx}: {acc:.3f} (n={args.final_samples}) failures {fails}")
    final_by_format = {}
    for fmt in args.eval_formats:
        ctx = min(2048, args.max_context)
        final_by_format[fmt], fails = passkey_accuracy(model, tok, ctx, args.final_samples,
                                                       device, eos_id, fmt)
        log(f"passkey @{ctx} in format {fmt}: {final_by_format[fmt]:.3f} failures {fails}")
    ppl, n_tok = perplexity(model, held_ids, 1024, device)
    log(f"held-out perplexity {ppl:.3f} over {n_tok:,} tokens ({len(held_files)} files)")
    samples = [
        sample_text(model, tok, "def ", device, eos_id),
        sample_text(model, tok, "import os\n\n\ndef ", device, eos_id, do_sample=True),
        sample_text(model, tok, "class ", device, eos_id, do_sample=True, seed=1),
    ]
    for s in samples:
        log("sample:\n" + s)
    export(model, tok, out, eos_id)
    results = {
        "steps": step,
        "train_minutes": round(train_seconds / 60, 1),
        "total_wall_minutes": round((time.time() - t_start) / 60, 1),
        "final_eval_minutes": round((time.time() - t_eval) / 60, 1),
        "parameters": n_params,
        "vocab_size": tok.get_vocab_size(),
        "passkey_accuracy": {str(k): v for k, v in final.items()},
        "passkey_samples_per_length": args.final_samples,
        "passkey_2k_by_format": final_by_format,
        "passkey_eval_seeds": f"{EVAL_SEED_BASE} + ctx*100000 + i, i < {args.final_samples}",
        "heldout_perplexity": round(ppl, 3),
        "heldout_tokens": n_tok,
        "heldout_files": [p.relative_to(corpus.stdlib_root()).as_posix() for p in held_files],
        "training_files": len(train_files),
        "training_tokens_available": len(train_ids),
        "tokens_seen_approx": step * args.tokens_per_step,
        "history": history,
        "previous_phases": previous_phases,
        "samples": samples,
        "args": vars(args),
        "command": "python " + " ".join(map(shlex.quote, sys.argv)),
        "device": str(device),
        "torch": torch.__version__,
    }
    (out / "eval_results.json").write_text(json.dumps(results, indent=1))
    write_model_card(out, results)
    keys = ("steps", "train_minutes", "passkey_accuracy", "heldout_perplexity")
    log(f"exported to {out}: {json.dumps({k: results[k] for k in keys})}")


if __name__ == "__main__":
    main()
