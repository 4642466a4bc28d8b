"""The Python standard library's source as an offline text corpus, split deterministically.

Every ``*.py`` file under the interpreter's stdlib directory is a candidate, except installed
third-party packages (``site-packages``) and the test suites (any path component named ``test``,
``tests`` or ``idle_test``), which are full of generated data rather than ordinary code.

Held-out rule (fixed, written down here and in the model card): a file is HELD OUT when
``int(sha1(relpath).hexdigest(), 16) % HELDOUT_MODULUS == 0``, where ``relpath`` is the file's
POSIX path relative to the stdlib root (for example ``"json/decoder.py"``). With the modulus 20
that is about 5% of the files. The rule depends only on the relative path, so the split is the
same on every machine with the same Python version, and adding or removing other files never moves
a file from one side to the other.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

HELDOUT_MODULUS = 20
EXCLUDED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__"})


def stdlib_root() -> Path:
    """The directory holding the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def _relpath(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def is_heldout(relpath: str, modulus: int = HELDOUT_MODULUS) -> bool:
    """True when the file with this stdlib-relative POSIX path belongs to the held-out set."""
    if modulus < 2:
        raise ValueError(f"modulus must be >= 2, got {modulus}")
    return int(hashlib.sha1(relpath.encode("utf-8")).hexdigest(), 16) % modulus == 0


def all_files(root: Path | None = None) -> list[Path]:
    """Every corpus candidate, sorted by relative path (deterministic order)."""
    root = stdlib_root() if root is None else Path(root)
    if not root.is_dir():
        raise ValueError(f"stdlib root {root} is not a directory")
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        if path.is_file():
            files.append(path)
    return sorted(files, key=lambda p: _relpath(p, root))


def heldout_files(root: Path | None = None, modulus: int = HELDOUT_MODULUS) -> list[Path]:
    """Files excluded from training (and from tokenizer training): the perplexity set."""
    root = stdlib_root() if root is None else Path(root)
    return [p for p in all_files(root) if is_heldout(_relpath(p, root), modulus)]


def training_files(root: Path | None = None, modulus: int = HELDOUT_MODULUS) -> list[Path]:
    """Every candidate that is not held out."""
    root = stdlib_root() if root is None else Path(root)
    return [p for p in all_files(root) if not is_heldout(_relpath(p, root), modulus)]


def read_text(path: Path) -> str:
    """A source file as text; undecodable bytes are replaced so every file can be read."""
    return Path(path).read_text(encoding="utf-8", errors="replace")
