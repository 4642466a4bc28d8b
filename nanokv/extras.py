"""Optional parts of nanokv and the pip extras that install them.

`pip install nanokv` installs the engine (torch, transformers, tokenizers, safetensors, numpy);
the server, the load tester, the evaluation plots and replicas on Ray Serve need more. `require`
checks an extra's modules before work starts and says which extra to install instead of a bare
ImportError.
"""

from __future__ import annotations

import importlib.util

# extra -> the top-level modules nanokv imports from it (keep in step with pyproject.toml)
EXTRAS: dict[str, tuple[str, ...]] = {
    "serve": ("fastapi", "uvicorn", "prometheus_client", "httpx"),
    "eval": ("matplotlib",),
    "ray": ("ray",),  # nanokv serve --replicas (nanokv/replicas); its server needs [serve] too
    "structured": ("xgrammar",),  # SamplingParams.structured_outputs, response_format
}


class MissingExtraError(ImportError):
    """A feature's optional dependencies are not installed; the message names the extra."""


def missing_modules(extra: str) -> list[str]:
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; known: {sorted(EXTRAS)}")
    return [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]


def install_hint(extra: str) -> str:
    return f"pip install 'nanokv[{extra}]'"


def require(extra: str, feature: str) -> None:
    """Raise MissingExtraError naming `extra` if any of its modules is missing."""
    missing = missing_modules(extra)
    if missing:
        raise MissingExtraError(f"{feature} needs the [{extra}] extra (missing: "
                                f"{', '.join(missing)}): {install_hint(extra)}")


def extra_for_module(name: str | None) -> str | None:
    """The extra that provides module `name` (a dotted name is reduced to its top level)."""
    top = (name or "").split(".")[0]
    return next((extra for extra, mods in EXTRAS.items() if top in mods), None)
