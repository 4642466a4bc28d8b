"""Real servers for the end-to-end tests, started once per session and killed at its end."""

from __future__ import annotations

import pytest

from servers import (API_KEY, MAIN_SERVER_FLAGS, OFFLINE_OPTIONS, launch_server,
                     start_in_process, stop_server, wait_ready)


@pytest.fixture(scope="session", autouse=True)
def _main_server(tiny_llama, tmp_path_factory):
    """The subprocess server (API key on, roomy limits), launched before the first e2e test so
    that its start-up overlaps the in-process tests; stopped at the session end."""
    s = launch_server(tiny_llama, str(tmp_path_factory.mktemp("servers")),
                      *MAIN_SERVER_FLAGS)
    yield s
    stop_server(s)


@pytest.fixture(scope="session")
def server(_main_server):
    return wait_ready(_main_server)


@pytest.fixture(scope="session")
def tight_server(tiny_llama):
    """In-process: 2 running + 2 waiting requests, an 18-block pool, 2 ms more per step; for
    admission control (503), preemption and the load test."""
    s = start_in_process(tiny_llama, step_delay=0.002, max_num_seqs=2, num_kv_blocks=18,
                         settings=dict(max_waiting=2, retry_after=1))
    yield s
    stop_server(s)


@pytest.fixture(scope="session")
def slow_server(tiny_llama):
    """In-process, 10 ms more per step: a 240-token request takes over 2 s, so a client can
    leave while it runs."""
    s = start_in_process(tiny_llama, step_delay=0.01, num_kv_blocks=64)
    yield s
    stop_server(s)


@pytest.fixture(scope="session")
def offline(tiny_llama):
    from nanokv import LLM

    return LLM(tiny_llama, **OFFLINE_OPTIONS)


@pytest.fixture()
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
