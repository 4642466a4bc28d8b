"""A bounded load test against a running server: a fixed number of concurrent clients send
streaming completions for a fixed time, then stop by themselves. A client of the server, not
part of it; it needs the [serve] extra (httpx, prometheus_client).

    python -m nanokv.workloads.loadtest --url http://127.0.0.1:8000 --concurrency 8 --duration 30

Every request ends in exactly one of: completed, refused (503), failed (any other error) or
hung (no answer within --request-timeout). Latencies come from the client's side: TTFT from
sending to the first token, ITL between tokens (a chunk carrying k tokens after a gap g counts
k gaps of g/k). After the run it waits for the server to go idle and reads /metrics: running and
waiting requests and KV usage must return to 0 (no leaked blocks).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field

from nanokv.extras import MissingExtraError, require
from nanokv.metrics.stats import percentile
from nanokv.validation import check_finite, check_int

PREFIXES = [
    "You are a helpful assistant. Answer briefly and precisely.\n",
    "The following is a conversation about Python programming and data structures.\n",
    "Summarize the text below in one sentence, keeping the key facts.\n",
]
WORDS = ("block cache token prefix memory page request batch model layer value key query "
         "python list dict queue hash table tree graph").split()


@dataclass
class LoadTestResult:
    concurrency: int
    duration_s: float  # time clients kept sending
    elapsed_s: float  # until the last request ended
    sent: int = 0
    completed: int = 0
    refused: int = 0  # 503 with Retry-After
    failed: int = 0
    hung: int = 0
    output_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list, repr=False)
    itl_s: list[float] = field(default_factory=list, repr=False)
    errors: list[str] = field(default_factory=list)
    idle_metrics: dict[str, float] = field(default_factory=dict)  # /metrics after the run
    idle_error: str | None = None  # why /metrics could not be read after the run

    @property
    def requests_per_s(self) -> float:
        return self.completed / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def summary(self) -> dict:
        def pcts(xs):
            return {f"p{q}": percentile(xs, q) for q in (50, 90, 99)}

        d = {k: v for k, v in asdict(self).items() if k not in ("ttft_s", "itl_s")}
        d.update(requests_per_s=self.requests_per_s, output_tokens_per_s=self.output_tokens_per_s,
                 ttft_s=pcts(self.ttft_s), itl_s=pcts(self.itl_s))
        return d

    def format(self) -> str:
        s = self.summary()

        def ms(p):
            return " ".join(f"{k} {v * 1000:.1f} ms" if v is not None else f"{k} -"
                            for k, v in p.items())

        return (f"{self.concurrency} clients for {self.duration_s:g} s (ended after "
                f"{self.elapsed_s:.1f} s): sent {self.sent}, completed {self.completed}, "
                f"refused(503) {self.refused}, failed {self.failed}, hung {self.hung}\n"
                f"{self.requests_per_s:.2f} requests/s, {self.output_tokens_per_s:.1f} output "
                f"tokens/s\nTTFT {ms(s['ttft_s'])}\nITL  {ms(s['itl_s'])}\n"
                f"after the run: {self.idle_error or self.idle_metrics}")

    @property
    def clean(self) -> bool:
        """Every request answered (completed or refused) and the server seen idle after."""
        lost = self.sent - self.completed - self.refused
        return (lost == 0 and self.idle_error is None
                and all(v == 0 for v in self.idle_metrics.values()))


def make_prompt(rng: random.Random) -> str:
    return rng.choice(PREFIXES) + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 20)))


async def _one_request(client, url: str, body: dict, headers: dict, result: LoadTestResult,
                       timeout: float) -> float:
    """Send one streaming completion; returns the Retry-After to honour (0 unless refused)."""
    import httpx

    result.sent += 1
    t0 = time.perf_counter()
    last = None
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url, json=body, headers=headers) as r:
                if r.status_code == 503:
                    await r.aread()
                    result.refused += 1
                    return float(r.headers.get("retry-after", "1"))
                if r.status_code != 200:
                    text = (await r.aread()).decode(errors="replace")
                    result.failed += 1
                    result.errors.append(f"{r.status_code}: {text[:200]}")
                    return 0.0
                finished = False
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise RuntimeError(chunk["error"]["message"])
                    for choice in chunk.get("choices", []):
                        n = len(choice.get("token_ids") or [])
                        now = time.perf_counter()
                        if n:
                            if last is None:
                                result.ttft_s.append(now - t0)
                                gaps = n - 1
                            else:
                                gaps = n
                            if gaps and last is not None:
                                result.itl_s.extend([(now - last) / gaps] * gaps)
                            last = now
                            result.output_tokens += n
                        if choice.get("finish_reason"):
                            finished = True
                if not finished:
                    raise RuntimeError("the stream ended without a finish_reason")
                result.completed += 1
    except TimeoutError:
        result.hung += 1
    except (httpx.HTTPError, RuntimeError, ValueError) as e:
        result.failed += 1
        result.errors.append(repr(e)[:200])
    return 0.0


async def run_load(base_url: str, model: str, concurrency: int = 8, duration_s: float = 10.0,
                   max_tokens: tuple[int, int] = (8, 32), api_key: str | None = None,
                   request_timeout: float = 60.0, seed: int = 0,
                   idle_timeout: float = 10.0) -> LoadTestResult:
    import httpx

    check_load_options(concurrency, duration_s, max_tokens, request_timeout)
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    result = LoadTestResult(concurrency, duration_s, 0.0)
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        start = time.perf_counter()
        deadline = start + duration_s

        async def worker(k: int) -> None:
            rng = random.Random(seed * 1000 + k)
            while time.perf_counter() < deadline:
                body = {"model": model, "prompt": make_prompt(rng), "temperature": 0,
                        "max_tokens": rng.randint(*max_tokens), "ignore_eos": True,
                        "stream": True, "return_token_ids": True}
                wait = await _one_request(client, url, body, headers, result, request_timeout)
                if wait:
                    await asyncio.sleep(min(wait, max(0.0, deadline - time.perf_counter()),
                                            0.25 + rng.random() * 0.25))

        await asyncio.gather(*(worker(k) for k in range(concurrency)))
        result.elapsed_s = time.perf_counter() - start
        try:
            result.idle_metrics = await wait_idle(client, base_url, headers, idle_timeout)
        except (httpx.HTTPError, ValueError) as e:  # unreachable, or not Prometheus text: the
            result.idle_error = f"/metrics not read: {e!r}"[:200]  # counts are unknown, say so
    return result


def check_load_options(concurrency: int, duration_s: float, max_tokens: tuple[int, int],
                       request_timeout: float) -> None:
    """ValueError naming the first bad option of a load test."""
    check_int("concurrency", concurrency, 1)
    check_finite("duration_s", duration_s, 0, " of seconds")
    check_finite("request_timeout", request_timeout, 0, " of seconds")
    lo, hi = max_tokens
    check_int("max_tokens minimum", lo, 1)
    check_int("max_tokens maximum", hi, lo)


IDLE_METRICS = ("nanokv:num_requests_running", "nanokv:num_requests_waiting",
                "nanokv:kv_cache_usage_perc")


async def wait_idle(client, base_url: str, headers: dict, timeout: float) -> dict[str, float]:
    """Poll /metrics until nothing runs, waits or holds KV blocks; return the last values."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    end = time.perf_counter() + timeout
    while True:
        r = await client.get(base_url.rstrip("/") + "/metrics", headers=headers)
        r.raise_for_status()
        values = {s.name: s.value for fam in text_string_to_metric_families(r.text)
                  for s in fam.samples if s.name in IDLE_METRICS}
        if all(values.get(n) == 0 for n in IDLE_METRICS) or time.perf_counter() > end:
            return values
        await asyncio.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nanokv.workloads.loadtest",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--concurrency", type=int, default=8, help="concurrent clients (>= 1)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of sending (> 0)")
    p.add_argument("--max-tokens", type=int, nargs=2, default=[8, 32], metavar=("MIN", "MAX"),
                   help="output length range of each request (1 <= MIN <= MAX)")
    p.add_argument("--request-timeout", type=float, default=60.0,
                   help="client-side limit per request; past it the request counts as hung")
    p.add_argument("--api-key", default=None, help="bearer key of the server")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    try:
        require("serve", "the load tester")
    except MissingExtraError as e:
        print(f"loadtest: error: {e}", file=sys.stderr)
        return 2
    import httpx

    try:
        check_load_options(args.concurrency, args.duration, tuple(args.max_tokens),
                           args.request_timeout)
        model = args.model or _first_model(args.url, args.api_key)
    except ValueError as e:
        print(f"loadtest: error: {e}", file=sys.stderr)
        return 2
    except httpx.HTTPError as e:
        print(f"loadtest: error: cannot list the models of {args.url}: {e!r}", file=sys.stderr)
        return 2
    result = asyncio.run(run_load(args.url, model, args.concurrency, args.duration,
                                  tuple(args.max_tokens), args.api_key, args.request_timeout,
                                  args.seed))
    print(json.dumps(result.summary()) if args.json else result.format())
    return 0 if result.clean else 1


def _first_model(url: str, api_key: str | None) -> str:
    """The server's first model id (GET /v1/models)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(url.rstrip("/") + "/v1/models", headers=headers)
    r.raise_for_status()
    try:
        return r.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ValueError(f"{url}/v1/models lists no model: {r.text[:200]!r}") from None


if __name__ == "__main__":
    sys.exit(main())
