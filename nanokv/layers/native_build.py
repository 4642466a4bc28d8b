"""Building and loading the C kernels of csrc/: each compiled on first use with the system C
compiler (`$CC`, default `cc`; `-O3 -march=native -fopenmp`) into a cache directory
(`$NANOKV_CACHE_DIR`, default `~/.cache/nanokv`), keyed by the source, its headers, the flags and
the CPU, and loaded with ctypes. No compiler, or a build that fails: `NativeKernelUnavailable`
with the reason (callers fall back to their PyTorch path and say why). Shared by the model's
kernels (linear panels, fused norms) and the attention / KV-store kernels alike.

OpenMP: a library links `libgomp.so.1`, the soname PyTorch's CPU wheel already loaded, so the
kernels share torch's OpenMP runtime and its thread count (`torch.set_num_threads`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import subprocess
import tempfile
from pathlib import Path

FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


class NativeKernelUnavailable(RuntimeError):
    """The C kernel could not be built or loaded on this machine (the message says why)."""


def _cpu_key() -> str:
    """What -march=native depends on: the CPU model and its flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))][:2]
        return "\n".join(lines)
    except OSError:
        return platform.processor() or platform.machine()


def build_library(source_path: Path) -> ctypes.CDLL:
    """Compile a C source of csrc/ (once per source, flags and CPU; cached) and load it."""
    cc = shlex.split(os.environ.get("CC", "cc"))
    source = source_path.read_bytes()
    # the headers next to it are part of what is built (a changed header rebuilds the library)
    headers = b"".join(h.read_bytes() for h in sorted(source_path.parent.glob("*.h")))
    key = hashlib.sha256(source + headers + " ".join(cc + FLAGS).encode() + _cpu_key().encode())
    cache = Path(os.environ.get("NANOKV_CACHE_DIR", Path.home() / ".cache" / "nanokv"))
    target = cache / f"{source_path.stem}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        # build next to the target, then rename: concurrent builders never load a partial file
        try:
            cache.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        except OSError as e:
            raise NativeKernelUnavailable(f"kernel cache directory {cache} is not writable ({e}); "
                                          f"set NANOKV_CACHE_DIR") from None
        os.close(fd)
        try:
            proc = subprocess.run([*cc, *FLAGS, str(source_path), "-o", tmp, "-lm"],
                                  capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            os.unlink(tmp)
            raise NativeKernelUnavailable(f"C compiler {cc[0]!r} could not run: {e}") from None
        if proc.returncode != 0:
            os.unlink(tmp)
            raise NativeKernelUnavailable(f"building {source_path.name} with {' '.join(cc)} "
                                          f"failed: {proc.stderr.strip()[-400:]}")
        os.replace(tmp, target)
    return ctypes.CDLL(str(target))


class LazyLibrary:
    """A csrc/ library built and loaded on first use, its functions typed by `setup(lib)`; a
    failed build is remembered (its reason raised again, no retry per step)."""

    def __init__(self, source: Path, setup) -> None:
        self.source, self.setup = source, setup
        self._lib: ctypes.CDLL | None = None
        self._error: str | None = None

    def get(self) -> ctypes.CDLL:
        """The library; raises NativeKernelUnavailable (with the reason) when it cannot be
        built here."""
        if self._lib is None and self._error is None:
            try:
                lib = build_library(self.source)
            except NativeKernelUnavailable as e:
                self._error = str(e)
            except OSError as e:
                self._error = f"loading the built kernel failed: {e}"
            else:
                self.setup(lib)
                self._lib = lib
        if self._lib is None:
            raise NativeKernelUnavailable(self._error)
        return self._lib

    def available(self) -> bool:
        """Whether it builds and loads here (built on the first call)."""
        try:
            self.get()
        except NativeKernelUnavailable:
            return False
        return True
