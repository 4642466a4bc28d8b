#!/usr/bin/env python
"""Build a model and a draft model that agree often, from one random checkpoint, for the
draft-model speculation benchmarks (no download: random weights cannot give a trained pair).

The draft model is the checkpoint's first --draft-layers layers with its embeddings, final norm
and head. The model ("target") is the whole checkpoint with the output projections of every
later layer (attention's o_proj, the MLP's down_proj) scaled by --damping: those layers still
cost their full compute, but add little to the residual stream, so the target's greedy token
is usually the draft's. --damping sets how often (0: always; larger: less often): the
benchmark reports the acceptance rate it gets (greedy, the Qwen3-0.6B shape with weights of std
0.08, 2 draft layers: about 60% of drafts accepted at 0.02, 90% at 0.01; the default init of
0.02 gives outputs that repeat one token).

    python benchmarks/make_qwen3_0_6b.py --init-std 0.08 --out /tmp/qwen3-0.6b-std08
    python benchmarks/make_draft_pair.py --base /tmp/qwen3-0.6b-std08 --draft-layers 2 \\
        --damping 0.02 --out /tmp/draft-pair
    # -> /tmp/draft-pair/target (28 layers), /tmp/draft-pair/draft (2 layers)
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

LAYER = re.compile(r"^model\.layers\.(\d+)\.")
DAMPED = (".self_attn.o_proj.weight", ".mlp.down_proj.weight")


def load_weights(base: Path) -> dict:
    from safetensors.torch import load_file

    weights = {}
    for path in sorted(base.glob("*.safetensors")):
        weights.update(load_file(str(path)))
    if not weights:
        raise SystemExit(f"no *.safetensors in {base}")
    return weights


def write(out: Path, base: Path, weights: dict, config: dict) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for path in base.iterdir():  # tokenizer, generation config ...
        if path.is_file() and not path.name.endswith(".safetensors") \
                and path.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(path, out / path.name)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})


def build(base: Path, out: Path, draft_layers: int, damping: float) -> None:
    config = json.loads((base / "config.json").read_text())
    layers = int(config["num_hidden_layers"])
    if not 1 <= draft_layers < layers:
        raise SystemExit(f"--draft-layers must be in [1, {layers - 1}] (the checkpoint has "
                         f"{layers} layers), got {draft_layers}")
    if damping < 0:
        raise SystemExit(f"--damping must be >= 0, got {damping}")
    weights = load_weights(base)
    target = {}
    for name, w in weights.items():
        m = LAYER.match(name)
        if m and int(m.group(1)) >= draft_layers and name.endswith(DAMPED):
            w = w * damping
        target[name] = w
    write(out / "target", base, target, config)
    draft = {name: w for name, w in weights.items()
             if not (m := LAYER.match(name)) or int(m.group(1)) < draft_layers}
    draft_config = {**config, "num_hidden_layers": draft_layers}
    if "max_window_layers" in draft_config:
        draft_config["max_window_layers"] = draft_layers
    if draft_config.get("layer_types"):  # one entry a layer
        draft_config["layer_types"] = draft_config["layer_types"][:draft_layers]
    write(out / "draft", base, draft, draft_config)
    print(f"wrote {out / 'target'} ({layers} layers, layers {draft_layers}.. damped by "
          f"{damping}) and {out / 'draft'} ({draft_layers} layers)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, required=True, help="a checkpoint directory")
    ap.add_argument("--out", type=Path, required=True,
                    help="writes OUT/target and OUT/draft")
    ap.add_argument("--draft-layers", type=int, default=2,
                    help="the draft model's layers: the checkpoint's first N (default 2)")
    ap.add_argument("--damping", type=float, default=0.02,
                    help="scale of the later layers' output projections in the target "
                         "(default 0.02; 0 makes the target's tokens the draft's)")
    args = ap.parse_args()
    build(args.base, args.out, args.draft_layers, args.damping)


if __name__ == "__main__":
    main()
