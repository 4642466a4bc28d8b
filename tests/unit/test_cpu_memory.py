"""glibc malloc tuning: freed large tensors are reused instead of fresh, page-faulting mmaps."""

import os
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent("""
    import resource, sys, torch
    from nanokv.worker.cpu_memory import tune_glibc_malloc
    applied = tune_glibc_malloc() if sys.argv[1] == "tune" else False
    def faults_of_one_step():
        # the first large step: activations of growing sizes (4-48 MiB: past the 32 MiB
        # mmap threshold too), allocated, written and freed, twice over
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for mb in (4, 8, 12, 16, 20, 24, 28, 40, 48) * 2:
            t = torch.empty(mb * 2**18)  # float32: mb MiB
            t.fill_(1.0)
            del t
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    torch.ones(2**20).fill_(2.0)  # start the OpenMP threads before counting
    print(applied, faults_of_one_step())
""")


def probe(mode: str, env: dict | None = None) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                         check=True, env={**os.environ, **(env or {})}).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc only")
def test_tuned_malloc_reuses_freed_activation_memory():
    applied, tuned = probe("tune")
    assert applied
    _, plain = probe("plain")
    largest = 48 * 2**20 // 4096  # pages of the largest tensor
    # tuned: the heap grows to the largest tensor once and is reused; untuned: glibc's dynamic
    # mmap threshold trails the sizes, so each larger tensor is a fresh mmap, faulted page by
    # page (1.2M faults, 2 s, on the first 2.6k-token prefill of a 0.6B model)
    assert tuned < 2 * largest
    assert plain > 2 * tuned


def test_user_malloc_settings_win():
    applied, _ = probe("tune", {"MALLOC_TRIM_THRESHOLD_": "1000000"})
    assert not applied


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc only")
def test_glibc_tunables_give_another_process_the_same_reuse():
    """glibc_tunables(), set in a process's environment (run_peers.sh's peers), has the effect
    tune_glibc_malloc has in-process."""
    from nanokv.worker.cpu_memory import glibc_tunables

    applied, faults = probe("plain", {"GLIBC_TUNABLES": glibc_tunables()})
    assert not applied
    assert faults < 2 * (48 * 2**20 // 4096)


HUGE_PROBE = textwrap.dedent("""
    import sys, torch
    from nanokv.worker.cpu_memory import huge_page_share, request_huge_pages
    on = request_huge_pages()
    t = torch.ones(64 * 2**18)  # 64 MiB, written
    share = huge_page_share()  # None where the kernel reports no huge pages (not Linux)
    print(on, share[0] if share else 0)
""")


def huge_probe(env: dict) -> tuple[bool, int]:
    base = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    out = subprocess.run([sys.executable, "-c", HUGE_PROBE], capture_output=True, text=True,
                         check=True, env={**base, **env}).stdout.split()
    return out[0] == "True", int(out[1])


def test_huge_pages_requested_unless_the_user_said():
    """request_huge_pages sets PyTorch's THP_MEM_ALLOC_ENABLE where the kernel lends huge pages
    and the user has not set it; the user's value wins either way."""
    from nanokv.worker import cpu_memory

    assert huge_probe({"THP_MEM_ALLOC_ENABLE": "0"})[0] is False
    assert huge_probe({"THP_MEM_ALLOC_ENABLE": "1"})[0] is True
    assert huge_probe({})[0] is cpu_memory.huge_pages_lent()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux transparent huge pages")
def test_large_tensors_get_huge_pages():
    """A large tensor allocated after request_huge_pages lies in huge pages (where the kernel
    lends them: THP `madvise` or `always`); with THP_MEM_ALLOC_ENABLE=0 and THP `madvise`, not."""
    from nanokv.worker import cpu_memory

    if not cpu_memory.huge_pages_lent():
        pytest.skip("this kernel lends no transparent huge pages (THP never)")
    on, huge = huge_probe({})
    assert on and huge >= 32 * 2**20
    with open(cpu_memory.THP_SETTING) as f:
        madvise_only = "[madvise]" in f.read()
    if madvise_only:
        off, huge_off = huge_probe({"THP_MEM_ALLOC_ENABLE": "0"})
        assert not off and huge_off < 8 * 2**20
