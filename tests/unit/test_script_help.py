"""Every command-line script in benchmarks/ and scripts/ answers --help (exit 0, a usage line):
argparse formats the help only when asked, so a help string it cannot format (a lone '%')
fails nowhere else."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# vllm_bench_serve.py runs in vLLM's virtualenv (it imports vllm first)
NOT_HERE = {"vllm_bench_serve.py"}
SCRIPTS = sorted(p for d in ("benchmarks", "scripts") for p in (ROOT / d).glob("*.py")
                 if p.name not in NOT_HERE and "argparse" in p.read_text(encoding="utf-8"))


def test_the_scripts_are_found():
    assert len(SCRIPTS) >= 20 and ROOT / "benchmarks" / "quant_ablation.py" in SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=[f"{p.parent.name}/{p.name}" for p in SCRIPTS])
def test_help(script):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the suite's own
    r = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True,
                       cwd=ROOT, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.lstrip().startswith("usage:"), r.stdout[:300]
