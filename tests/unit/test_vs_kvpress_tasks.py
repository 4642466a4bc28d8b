"""benchmarks/vs_kvpress.py runs in kvpress's own virtual environment, where nanokv is not
installed: it loads the harness's prompts (`nanokv.eval.tasks`) from the checkout without the
engine. Checked in a fresh interpreter: the prompts equal the harness's for the same seeds, and
nothing of the engine was imported."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys
sys.path.insert(0, "benchmarks")
import vs_kvpress
tasks = vs_kvpress.load_tasks()
print(json.dumps({"engine": sorted(m for m in sys.modules if m.startswith("nanokv.engine")
                                   or m == "torch"),
                  "prompt": tasks.passkey_sample(str.split, 300, seed=881000).prompt}))
"""


def test_prompts_load_without_the_engine():
    import json

    from nanokv.eval import tasks

    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["engine"] == []  # neither the engine nor torch
    assert got["prompt"] == tasks.passkey_sample(str.split, 300, seed=881000).prompt
