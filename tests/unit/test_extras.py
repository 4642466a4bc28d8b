"""Optional dependencies: a missing extra is named with its pip command, pyproject.toml's extras
match what the code checks, and the engine and the CLI import without any extra."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import nanokv.cli as cli
from nanokv import extras
from nanokv.workloads import loadtest

ROOT = Path(__file__).resolve().parents[2]


def _hide(monkeypatch, *names: str) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(extras.importlib.util, "find_spec",
                        lambda name, *a: None if name in names else real(name, *a))


def test_require_names_the_extra_and_its_pip_command(monkeypatch):
    extras.require("serve", "x")  # installed here
    _hide(monkeypatch, "fastapi", "httpx")
    with pytest.raises(extras.MissingExtraError) as e:
        extras.require("serve", "nanokv serve")
    msg = str(e.value)
    assert "[serve] extra" in msg and "fastapi, httpx" in msg
    assert "pip install 'nanokv[serve]'" in msg
    with pytest.raises(ValueError, match="unknown extra"):
        extras.require("gpu", "x")
    assert extras.extra_for_module("prometheus_client.parser") == "serve"
    assert extras.extra_for_module("matplotlib.pyplot") == "eval"
    assert extras.extra_for_module("torch") is None


def test_cli_serve_and_eval_plots_say_which_extra(monkeypatch, capsys, tmp_path):
    _hide(monkeypatch, "uvicorn")
    assert cli.main(["serve", str(ROOT / "models" / "nanokv-tiny")]) == 2
    assert "pip install 'nanokv[serve]'" in capsys.readouterr().err
    _hide(monkeypatch, "matplotlib")
    assert cli.main(["eval", "--out", str(tmp_path / "out"), "--num-samples", "1"]) == 2
    assert "pip install 'nanokv[eval]'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before any work


def test_cli_maps_a_missing_module_to_its_extra(monkeypatch, capsys):
    def needs_prometheus(args):
        raise ModuleNotFoundError("No module named 'prometheus_client'", name="prometheus_client")

    monkeypatch.setattr(cli, "cmd_bench", needs_prometheus)
    assert cli.main(["bench"]) == 2
    assert "nanokv bench needs prometheus_client" in capsys.readouterr().err


def test_loadtest_without_serve_extra(monkeypatch, capsys):
    _hide(monkeypatch, "httpx")
    assert loadtest.main(["--duration", "1"]) == 2
    assert "pip install 'nanokv[serve]'" in capsys.readouterr().err


def test_pyproject_extras_cover_the_checked_modules():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = project["optional-dependencies"]
    for extra, modules in extras.EXTRAS.items():
        names = {req.split(">")[0].split("=")[0].split("<")[0].split("[")[0].strip()
                 .replace("-", "_").lower()
                 for req in optional[extra]}
        assert set(modules) <= names, (extra, modules, names)
    assert not any("==" in req for req in project["dependencies"])  # ranges; pins: constraints
    pins = (ROOT / "constraints.txt").read_text().splitlines()
    assert "torch==2.13.0" in pins  # CI takes the CPU wheel on disk


def test_engine_and_cli_import_without_any_extra():
    blocked = sorted({m for mods in extras.EXTRAS.values() for m in mods})
    code = (f"import sys\nfor m in {blocked!r}: sys.modules[m] = None\n"
            "import nanokv, nanokv.cli, nanokv.workloads.run, nanokv.eval.harness\n"
            "nanokv.cli.build_parser().parse_args(['serve', 'm'])\n"
            "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
