"""`nanokv eval` sub-command."""

from __future__ import annotations

import argparse
import json
import shlex
import sys


def add_eval_parser(sub, add_engine_args, engine_options) -> None:
    from nanokv.eval.harness import TASKS

    p = sub.add_parser("eval", help="quality vs memory of KV policies: tasks x policies x "
                                    "compression (tables + plots)")
    add_engine_args(p)
    p.add_argument("--policies", default="full",
                   help="comma-separated KV policies ('full' = no compression; others from "
                        "the policy registry); 'label=name' lists one policy several times, "
                        "its options looked up by label in --policy-options")
    p.add_argument("--compressions", default="2,4,8",
                   help="comma-separated compression factors (4 = keep a quarter)")
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of {TASKS}")
    p.add_argument("--num-samples", type=int, default=50, help="samples per retrieval task")
    p.add_argument("--context-tokens", type=int, default=2048,
                   help="prompt length in tokens (retrieval prompts and perplexity/KL windows)")
    p.add_argument("--retrieval-context-tokens", type=int, default=None,
                   help="prompt length of passkey/multikey only (default: --context-tokens)")
    p.add_argument("--ppl-windows", type=int, default=8,
                   help="held-out windows for perplexity / KL")
    p.add_argument("--context-fraction", type=float, default=0.75,
                   help="part of each perplexity window that is context (compressed)")
    p.add_argument("--eval-seed", type=int, default=0,
                   help="seed of the generated task data and, other than 0, of the choice of "
                        "perplexity/KL windows (0: the first held-out windows)")
    p.add_argument("--protocol", choices=("whole", "question"), default="whole",
                   help="retrieval tasks: 'whole' compresses the whole prompt; 'question' "
                        "compresses the context, then computes the question on the compressed "
                        "cache (kvpress's pipeline)")
    p.add_argument("--passkey-format", default="classic",
                   help="passkey haystack and needle wording: 'classic' (KVQuant/LongLoRA "
                        "filler and wording, keys up to 50000), 'trained' or 'held_out' (a "
                        "random haystack and wording per sample from the formats a model may "
                        "train on / the ones kept out of training), or HAYSTACK/WORDING, e.g. "
                        "story/secret_code (see nanokv/eval/passkey_formats.py)")
    p.add_argument("--depth", type=float, default=None,
                   help="needle depth in [0, 1] for passkey/multikey (default: random per sample)")
    p.add_argument("--policy-options", default="{}",
                   help='JSON: policy name -> options, e.g. \'{"snapkv": {"window": 32}}\'')
    p.add_argument("--out", default=None, help="directory for results.md/json and plots")
    p.set_defaults(func=lambda args: run(args, engine_options))


def run(args: argparse.Namespace, engine_options) -> int:
    from nanokv.eval.harness import EvalSettings, run_eval
    from nanokv.eval.report import to_markdown, write_results
    from nanokv.extras import require

    if args.out:  # before the run, not after it: the plots need matplotlib
        require("eval", "nanokv eval --out (plots)")
    try:
        policy_options = json.loads(args.policy_options)
    except json.JSONDecodeError as e:
        raise ValueError(f"--policy-options is not valid JSON: {e}") from None
    try:
        compressions = [float(c) for c in _split(args.compressions)]
    except ValueError:
        raise ValueError(f"--compressions must be comma-separated numbers, got "
                         f"{args.compressions!r}") from None
    opts = engine_options(args)
    opts = {k: v for k, v in opts.items() if v is not None}
    settings = EvalSettings(
        model=args.model, policies=_split(args.policies), tasks=_split(args.tasks),
        compressions=compressions,
        num_samples=args.num_samples, context_tokens=args.context_tokens,
        retrieval_context_tokens=args.retrieval_context_tokens,
        ppl_windows=args.ppl_windows, context_fraction=args.context_fraction,
        seed=args.eval_seed, depth=args.depth, protocol=args.protocol,
        passkey_format=args.passkey_format,
        policy_options=policy_options,
        engine_options=opts)
    rows = run_eval(settings, log=lambda line: print(line, file=sys.stderr))
    print(to_markdown(rows))
    if args.out:
        command = "nanokv " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        for path in write_results(rows, args.out, command):
            print(f"[eval] wrote {path}", file=sys.stderr)
    return 0


def _split(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]
