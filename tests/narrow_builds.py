"""Re-run a kernel test module's checks against a narrower build of its C library: `CC="cc
FLAGS"` (`-mno-avx512f`: the AVX2 paths and vector width; `-mno-avx2`: plain C) in a fresh
process with its own kernel cache, so every C kernel is checked as the CPUs without AVX-512
build it."""

import os
import subprocess
import sys


def run_narrow_build(test_file: str, select: str, cache_dir, library: str,
                     flags: str = "-mno-avx512f", timeout: int = 600) -> None:
    """Run `pytest test_file -k select` with the library built with `flags`; assert that the
    tests passed and that `library` (the source's stem) was built in `cache_dir`."""
    env = dict(os.environ, CC=f"cc {flags}", NANOKV_CACHE_DIR=str(cache_dir))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           test_file, "-k", select], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout
    assert list(cache_dir.glob(f"{library}-*.so")), f"{library} was not built in the test's cache"
