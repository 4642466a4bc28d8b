"""Helpers of the end-to-end tests: the real server on a free loopback port, either as a
`python -m nanokv.cli serve` subprocess or in-process (uvicorn in a thread, the same app, with an
engine whose steps can be slowed down so that cancellation tests do not race a fast engine), and
its /metrics parsed with prometheus_client's parser."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

API_KEY = "sk-nanokv-test"
MODEL_NAME = "tiny-llama"
ENGINE_FLAGS = ["--block-size", "16", "--max-model-len", "256"]  # shared with the offline LLM
OFFLINE_OPTIONS = dict(block_size=16, max_model_len=256)
# the main server tokenizes prompts far longer than its context (to test that tokenizing does
# not stall other clients) but refuses bodies over 4 MB
MAIN_SERVER_FLAGS = ["--max-body-bytes", "4000000", "--max-prompt-chars", "3500000",
                     "--request-classes", "rag,batch"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    proc: subprocess.Popen | None  # None: in-process
    log_path: str | None
    api_key: str | None
    app: object = None  # in-process: the FastAPI app
    uvicorn_server: object = None
    thread: threading.Thread | None = None

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        if self.log_path is None:
            return ""
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def metrics(self) -> dict[tuple, float]:
        """{(sample name, sorted labels without model_name): value} from /metrics."""
        r = httpx.get(self.url + "/metrics", headers=self.headers, timeout=10)
        r.raise_for_status()
        out = {}
        for family in text_string_to_metric_families(r.text):
            for s in family.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
                out[(s.name, labels)] = s.value
        return out

    def wait_idle(self, timeout: float = 10.0) -> dict[tuple, float]:
        """Metrics once nothing runs or waits and no KV block is held (fails on timeout)."""
        end = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m[("nanokv:num_requests_running", ())] == 0
                    and m[("nanokv:num_requests_waiting", ())] == 0
                    and m[("nanokv:kv_cache_usage_perc", ())] == 0)
            if idle:
                return m
            if time.monotonic() > end:
                raise AssertionError(f"server not idle after {timeout} s: "
                                     f"{[(k, v) for k, v in m.items() if 'num_req' in k[0]]} "
                                     f"usage {m[('nanokv:kv_cache_usage_perc', ())]}")
            time.sleep(0.05)

    def assert_healthy(self) -> None:
        if self.proc is not None:
            assert self.proc.poll() is None, self.log()[-3000:]
        r = httpx.get(self.url + "/health", timeout=10)
        assert r.status_code == 200, r.text


def launch_server(model: str, tmp_dir: str, *flags: str, api_key: str | None = API_KEY) -> Server:
    """Start the subprocess; `wait_ready` waits for its /health."""
    port = free_port()
    log_path = os.path.join(tmp_dir, f"server-{port}.log")
    cmd = [sys.executable, "-m", "nanokv.cli", "serve", model, "--port", str(port),
           "--served-model-name", MODEL_NAME, "--num-threads", "1", "--no-access-log",
           "--check-invariants", "--log-level", "warning", *ENGINE_FLAGS, *flags]
    if api_key:
        cmd += ["--api-key", api_key]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    return Server(f"http://127.0.0.1:{port}", proc, log_path, api_key)


def wait_ready(server: Server, timeout: float = 120.0) -> Server:
    deadline = time.monotonic() + timeout
    while True:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop_server(server)
            raise RuntimeError(f"server did not come up:\n{server.log()}")
        time.sleep(0.2)


def start_in_process(model: str, step_delay: float = 0.0, api_key: str | None = None,
                     settings: dict | None = None, **engine_options) -> Server:
    """The real app under uvicorn in a thread; each engine step sleeps `step_delay` s more."""
    import uvicorn

    from nanokv import LLM
    from nanokv.server.openai_api import ServerSettings, build_app

    engine = LLM(model, **{**OFFLINE_OPTIONS, **engine_options}).engine
    if step_delay:
        fast_step = engine.step

        def slow_step():
            time.sleep(step_delay)
            return fast_step()

        engine.step = slow_step
    app = build_app(engine, ServerSettings(MODEL_NAME, api_key=api_key, check_invariants=True,
                                           **(settings or {})))
    port = free_port()
    userver = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error",
                                            access_log=False))
    thread = threading.Thread(target=userver.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not userver.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the in-process server did not start")
        time.sleep(0.02)
    return Server(f"http://127.0.0.1:{port}", None, None, api_key, app, userver, thread)


def stop_server(server: Server) -> None:
    if server.proc is None:
        server.uvicorn_server.should_exit = True
        server.thread.join(15)
        return
    if server.proc.poll() is None:
        server.proc.terminate()
        try:
            server.proc.wait(15)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait(5)
