"""Evaluation harness: tasks x KV policies x compression, on the shipped model or any HF dir.

Tasks (data generated at run time, seeded; see nanokv/eval):
  passkey          exact match of the pass key, needle at a random depth
  multikey         multi-key needle in a haystack, exact match of the queried number
  perplexity       held-out stdlib text: the first `context_fraction` of each window is the
                   context (compressed by the policy), the rest is scored teacher-forced
  kl               on the same windows: KL(full cache || policy) of the next-token
                   distributions over the scored part, and top-1 agreement
Compression "4x" keeps a quarter of the context: compression_ratio = 1 - 1/4 in the kvpress
convention (fraction removed). The full cache is policy "full" at 1x.

Protocols of the retrieval tasks: "whole" compresses the whole prompt, question included, once
it is computed (the first answer token is read from the full cache); "question" (kvpress's
pipeline) compresses the context once, then computes the question on the compressed cache
(`compress_after` = the context's tokens), so the question's tokens are never evicted.
`seed` draws the retrieval samples and, other than 0, the perplexity / KL windows (seed 0: the
first consecutive windows of the held-out text, as before).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm

from nanokv.eval import corpus, passkey_formats, tasks
from nanokv.worker.loader import load_hf_config

TASKS = ("passkey", "multikey", "perplexity", "kl")
PROTOCOLS = ("whole", "question")


# engine options each run sets itself from its policy entry (`policy_engine_options`)
RUN_POLICY_OPTIONS = ("kv_policy", "kv_budget", "kv_compression_ratio", "kv_policy_options")


@dataclass
class EvalSettings:
    model: str
    policies: list[str] = field(default_factory=lambda: ["full"])
    compressions: list[float] = field(default_factory=lambda: [2.0, 4.0, 8.0])
    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    num_samples: int = 50
    context_tokens: int = 2048
    # prompt length of the retrieval tasks (passkey, multikey); None: context_tokens
    retrieval_context_tokens: int | None = None
    ppl_windows: int = 8
    context_fraction: float = 0.75
    seed: int = 0
    depth: float | None = None  # needle depth in [0, 1] for the retrieval tasks; None: random
    protocol: str = "whole"  # retrieval: "whole" prompt compressed, or "question" left out
    # passkey haystack and wording (nanokv.eval.passkey_formats): "classic", "trained",
    # "held_out" or HAYSTACK/WORDING
    passkey_format: str = "classic"
    policy_options: dict = field(default_factory=dict)  # policy name -> its options
    engine_options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.tasks) - set(TASKS))
        if unknown:
            raise ValueError(f"unknown task(s) {unknown}; available: {list(TASKS)}")
        if any(isinstance(c, bool) or not isinstance(c, (int, float)) or not 1 <= c < math.inf
               for c in self.compressions):
            raise ValueError(f"compressions must be factors >= 1 (2 = keep half), "
                             f"got {self.compressions}")
        if self.num_samples < 1 or self.ppl_windows < 1:
            raise ValueError("num_samples and ppl_windows must be >= 1")
        if self.context_tokens < 64:
            raise ValueError(f"context_tokens must be >= 64, got {self.context_tokens}")
        if self.retrieval_context_tokens is not None and (
                isinstance(self.retrieval_context_tokens, bool)
                or not isinstance(self.retrieval_context_tokens, int)
                or self.retrieval_context_tokens < 64):
            raise ValueError(f"retrieval_context_tokens must be None or an integer >= 64, "
                             f"got {self.retrieval_context_tokens!r}")
        if not 0 < self.context_fraction < 1:
            raise ValueError(f"context_fraction must be in (0, 1), got {self.context_fraction}")
        if self.depth is not None and (isinstance(self.depth, bool)
                                       or not isinstance(self.depth, (int, float))
                                       or not 0 <= self.depth <= 1):
            raise ValueError(f"depth must be None (random) or in [0, 1], got {self.depth!r}")
        if not self.policies:
            raise ValueError("at least one policy is needed ('full' is the uncompressed cache)")
        from nanokv.policies.base import available_policies

        names = {policy_name(p) for p in self.policies}
        unknown = sorted(names - {"full"} - set(available_policies()))
        if unknown:  # before any task runs
            raise ValueError(f"unknown KV policy {unknown}; available: 'full', "
                             f"{', '.join(available_policies())} (or label=name)")
        if not self.compressions and names - {"full"}:
            raise ValueError(f"compressions is empty: policies {sorted(names - {'full'})} would "
                             f"not run (give factors >= 1, 2 = keep half)")
        self._check_policy_options()
        per_run = sorted(set(self.engine_options) & set(RUN_POLICY_OPTIONS))
        if per_run:  # each run's policy comes from policies / compressions / policy_options
            raise ValueError(f"engine options {per_run} conflict with the evaluation's own "
                             f"policy per run: give policies (and compressions, "
                             f"policy_options) instead (--policies, --compressions, "
                             f"--policy-options)")
        passkey_formats.parse_format(self.passkey_format)
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {self.protocol!r}")

    def _check_policy_options(self) -> None:
        """policy_options: {label: {option: value}} for labels in `policies`; each policy's
        options are checked as its engine would (names, then values at a compression) before
        any task runs."""
        from nanokv.policies.base import PolicyConfig

        if not isinstance(self.policy_options, dict) or not all(
                isinstance(k, str) and isinstance(v, dict) for k, v in self.policy_options.items()):
            raise ValueError(f"policy_options must map a policy label to a dict of its options, "
                             f"got {self.policy_options!r}")
        labels = {policy_label(p) for p in self.policies}
        stray = sorted(set(self.policy_options) - labels)
        if stray:
            raise ValueError(f"policy_options for {stray}, which is not a policy of this run "
                             f"(policies: {self.policies})")
        block_size = self.engine_options.get("block_size")  # "auto" or absent: the policy's
        block_size = block_size if isinstance(block_size, int) else None
        for policy in self.policies:
            name = policy_name(policy)
            if name == "full":
                continue
            options = self.policy_options.get(policy_label(policy), {})
            for c in self.compressions:
                try:
                    PolicyConfig(name, compression_ratio=1.0 - 1.0 / c,
                                 options=dict(options)).build(block_size=block_size)
                except (TypeError, ValueError) as e:
                    raise ValueError(f"policy {policy!r} at compression {c:g}: {e}") from None


def policy_label(policy: str) -> str:
    """A policy entry's label: `label` of `label=name`, else the name itself."""
    return policy.split("=", 1)[0]


def policy_name(policy: str) -> str:
    """A policy entry's registered policy name: `name` of `label=name`, else the entry."""
    return policy.split("=", 1)[1] if "=" in policy else policy


@dataclass
class EvalRow:
    task: str
    policy: str
    compression: float  # requested factor (1 = full cache)
    score: float  # accuracy, perplexity, or KL (see `metric`)
    metric: str
    num_samples: int
    kept_fraction: float  # cached slots / logical tokens at the end of each request (mean)
    kv_bytes: float  # KV bytes held per request at its end (mean), scales etc. included
    extra: dict = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def policy_engine_options(policy: str, compression: float, options: dict) -> dict:
    """Engine options for a policy entry: a registered name, or `label=name` so one policy can
    appear with several option sets (options are looked up by label)."""
    name = policy_name(policy)
    if name == "full":
        return {}
    return {"kv_policy": name, "kv_compression_ratio": 1.0 - 1.0 / compression,
            "kv_policy_options": dict(options)}


class _Run:
    """One engine with one policy setting."""

    def __init__(self, settings: EvalSettings, policy: str, compression: float) -> None:
        from nanokv import LLM

        self.settings = settings
        opts = dict(settings.engine_options)
        opts.update(policy_engine_options(policy, compression,
                                          settings.policy_options.get(policy_label(policy), {})))
        if "max_model_len" not in opts:  # derived from the flags: a refusal names them
            opts["max_model_len"] = max(settings.context_tokens,
                                        settings.retrieval_context_tokens or 0) + 64
            limit = int(load_hf_config(settings.model)[0].max_position_embeddings)
            if opts["max_model_len"] > limit:
                flags = f"--context-tokens {settings.context_tokens}"
                if settings.retrieval_context_tokens is not None:
                    flags += f" / --retrieval-context-tokens {settings.retrieval_context_tokens}"
                raise ValueError(
                    f"{flags} is too long for this model: the prompts need max_model_len "
                    f"{opts['max_model_len']} (the longest + 64 tokens of question and "
                    f"answer); the model's max_position_embeddings is {limit}")
        self.llm = LLM(settings.model, **opts)
        self.engine = self.llm.engine
        self.tokenizer = self.llm.tokenizer
        if self.tokenizer is None:
            raise ValueError("nanokv eval needs a model directory with a tokenizer")

    def _held(self, outs) -> tuple[float, float]:
        bpb = self.engine.kv_bytes_per_block  # a quantized KV cache's real cost per block
        kept = [o.kv_slots_at_finish / max(1, o.logical_tokens_at_finish) for o in outs]
        held = [o.kv_blocks_at_finish * bpb for o in outs]
        return sum(kept) / len(kept), sum(held) / len(held)

    def retrieval(self, task: str, use_tqdm=False) -> EvalRow:
        """`use_tqdm`: as LLM.generate's (run_eval lends its bar)."""
        from nanokv import SamplingParams

        s = self.settings
        ctx = s.retrieval_context_tokens or s.context_tokens
        if task == "passkey":
            samples = [tasks.passkey_sample(self.tokenizer, ctx - 16, depth=s.depth,
                                            seed=s.seed + i, fmt=s.passkey_format)
                       for i in range(s.num_samples)]
        else:
            samples = [tasks.multikey_needle_sample(self.tokenizer, ctx - 16, depth=s.depth,
                                                    seed=s.seed + i)
                       for i in range(s.num_samples)]
        longest = max(len(self.tokenizer.encode(x.answer)) for x in samples)
        params = SamplingParams(temperature=0, max_tokens=longest + 2)
        t0 = time.perf_counter()
        if s.protocol == "whole":
            outs = self.llm.generate([x.prompt for x in samples], params, use_tqdm=use_tqdm)
        else:  # the context compressed once, then the question on the compressed cache
            requests = [self.engine.make_request(x.prompt, params,
                                                 compress_after=self.context_length(x))
                        for x in samples]
            outs = self.llm.generate_requests(requests, use_tqdm=use_tqdm)
        scores = [tasks.score(x, o.text) for x, o in zip(samples, outs)]
        kept, held = self._held(outs)
        by_depth = _accuracy_by_depth(samples, scores)
        return EvalRow(task, "", 0, sum(scores) / len(scores), "accuracy", len(samples), kept,
                       held, {"accuracy_by_depth": by_depth, "protocol": s.protocol},
                       time.perf_counter() - t0)

    def context_length(self, sample) -> int:
        """Tokens of the prompt before its question (the part the "question" protocol
        compresses): the prompt's tokens that the context alone encodes to."""
        return tasks.context_length(self.tokenizer, sample)

    def continuation_logits(self, windows: list[list[int]], use_tqdm=False):
        """Logits over the scored part of each window, with the context compressed first."""
        from nanokv import SamplingParams

        split = int(len(windows[0]) * self.settings.context_fraction)
        params = SamplingParams(temperature=0, max_tokens=1, return_prompt_logits=True)
        outs = []
        for w in windows:  # one at a time: peak memory stays one window of logits
            request = self.engine.make_request(w, params, compress_after=split)
            outs += self.llm.generate_requests([request], use_tqdm=use_tqdm)
        # row t predicts token t + 1: rows split-1 .. n-2 predict the scored tokens split .. n-1
        logits = [o.prompt_logits[split - 1:len(w) - 1] for o, w in zip(outs, windows)]
        kept, held = self._held(outs)
        return logits, split, kept, held


def heldout_windows(tokenizer, num_windows: int, length: int, seed: int = 0,
                    pool: int = 8) -> list[list[int]]:
    """Windows of `length` tokens from the held-out stdlib files. seed 0: the first
    `num_windows` consecutive ones; another seed: `num_windows` distinct ones drawn by it from
    the first `pool` x `num_windows` windows of the held-out text."""
    want = num_windows if seed == 0 else pool * num_windows
    ids: list[int] = []
    for path in corpus.heldout_files():
        ids += tokenizer.encode(corpus.read_text(path), add_special_tokens=False)
        if len(ids) >= want * length:
            break
    if len(ids) < length:
        raise ValueError("the held-out corpus is shorter than one window")
    available = len(ids) // length
    chosen = list(range(min(num_windows, available)))
    if seed != 0:
        chosen = sorted(random.Random(seed).sample(range(min(want, available)),
                                                   min(num_windows, available)))
    return [ids[i * length:(i + 1) * length] for i in chosen]


def _accuracy_by_depth(samples, scores, bins: int = 5) -> list[float | None]:
    sums, counts = [0.0] * bins, [0] * bins
    for x, sc in zip(samples, scores):
        b = min(bins - 1, int((x.depth or 0) * bins))
        sums[b] += sc
        counts[b] += 1
    return [round(s / c, 3) if c else None for s, c in zip(sums, counts)]


class _LentBar:
    """Lends run_eval's progress bar to `LLM.generate` (its `use_tqdm` callable): finished
    prompts advance it and the tokens/s show in it; closing it is run_eval's business."""

    def __init__(self, bar: tqdm) -> None:
        self.bar = bar

    def __call__(self, **_tqdm_kwargs) -> _LentBar:
        return self

    def update(self, n: int = 1) -> None:
        self.bar.update(n)

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.bar.set_postfix_str(s, refresh=refresh)

    def close(self) -> None:
        pass


def run_eval(settings: EvalSettings, log=print, progress: bool = True) -> list[EvalRow]:
    """Every task for the full cache, then for each policy x compression. `progress`: one tqdm
    bar over all of it (prompts and perplexity windows), on stderr."""
    rows: list[EvalRow] = []
    settings_list = [("full", 1.0)] + [(p, c) for p in settings.policies if p != "full"
                                       for c in settings.compressions]
    retrieval_tasks = [t for t in settings.tasks if t in ("passkey", "multikey")]
    scores_windows = "perplexity" in settings.tasks or "kl" in settings.tasks
    per_setting = (len(retrieval_tasks) * settings.num_samples
                   + (settings.ppl_windows if scores_windows else 0))
    bar = tqdm(total=len(settings_list) * per_setting, desc="eval", unit="sample",
               dynamic_ncols=True, disable=not progress)
    lent = _LentBar(bar) if progress else False

    def report(row: EvalRow) -> None:
        rows.append(row)
        with tqdm.external_write_mode():
            log(_line(row))

    try:  # the bar closed before an error leaves (its line would follow the message)
        reference = None  # full-cache continuation logits for KL
        windows = None
        for policy, compression in settings_list:
            label = policy.split("=", 1)[0]
            bar.set_description(f"eval {label}"
                                + ("" if policy == "full" else f" {compression:g}x"))
            run = _Run(settings, policy, compression)
            for task in retrieval_tasks:
                row = run.retrieval(task, lent)
                row.policy, row.compression = label, compression
                report(row)
            if scores_windows:
                if windows is None:
                    windows = heldout_windows(run.tokenizer, settings.ppl_windows,
                                              settings.context_tokens, seed=settings.seed)
                    bar.total -= (settings.ppl_windows - len(windows)) * len(settings_list)
                t0 = time.perf_counter()
                logits, split, kept, held = run.continuation_logits(windows, lent)
                if reference is None:
                    reference = logits
                elapsed = time.perf_counter() - t0
                if "perplexity" in settings.tasks:
                    nll, count = 0.0, 0
                    for lg, w in zip(logits, windows):
                        target = torch.tensor(w[split:])
                        nll += float(torch.nn.functional.cross_entropy(lg, target, reduction="sum"))
                        count += len(target)
                    report(EvalRow("perplexity", label, compression, math.exp(nll / count),
                                   "perplexity", len(windows), kept, held,
                                   {"scored_tokens": count}, elapsed))
                if "kl" in settings.tasks:
                    kl, agree, count = 0.0, 0, 0
                    for ref, lg in zip(reference, logits):
                        p_log = ref.log_softmax(-1)
                        q_log = lg.log_softmax(-1)
                        kl += float((p_log.exp() * (p_log - q_log)).sum())
                        agree += int((ref.argmax(-1) == lg.argmax(-1)).sum())
                        count += ref.shape[0]
                    report(EvalRow("kl", label, compression, kl / count, "kl_nats", len(windows),
                                   kept, held, {"top1_agreement": agree / count}, elapsed))
            del run
    finally:
        bar.close()
    return rows


def _line(row: EvalRow) -> str:
    extra = ""
    if "top1_agreement" in row.extra:
        extra = f" top1={row.extra['top1_agreement']:.3f}"
    if "protocol" in row.extra:
        extra += f" protocol={row.extra['protocol']}"
    return (f"[eval] {row.task:<10} {row.policy:<16} {row.compression:>4.1f}x "
            f"{row.metric}={row.score:.4f}{extra} kept={row.kept_fraction:.3f} "
            f"kv={row.kv_bytes / 1024:.0f}KiB ({row.seconds:.1f}s)")
