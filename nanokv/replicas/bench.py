"""Prefix hit rate and throughput of the routers on a local Ray cluster.

The workload: users each with their own long system prompt, each sending a few chat requests
(a short question after the system prompt), in round-robin order over users, a fixed number in
flight. The hit rate is the servers' own count: prompt tokens served from the prefix cache over
prompt tokens (`usage.prompt_tokens_details.cached_tokens` / `usage.prompt_tokens`).

    python -m nanokv.replicas.bench --model DIR --out docs/results/scaling/routers.json

deploys the same replicas twice, with Ray Serve's default power-of-two router and with
PrefixAffinityRouter, runs the same workload on each and writes one JSON object per router.
"""

import argparse
import json
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

WORDS = ("alpha beta gamma delta block cache table query token value layer head prefix "
         "route replica engine batch chunk pool page slot hash chain store score budget").split()


@dataclass
class RouterRun:
    router: str
    num_requests: int
    failed: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    elapsed_s: float

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "hit_rate": round(self.hit_rate, 4),
                "requests_per_s": round(self.num_requests / self.elapsed_s, 3),
                "output_tok_per_s": round(self.completion_tokens / self.elapsed_s, 2)}


def user_requests(num_users: int, requests_per_user: int, system_words: int,
                  seed: int = 0) -> list[list[dict]]:
    """Chat messages of every request, round-robin over users (user u's j-th request is at
    j * num_users + u)."""
    rng = random.Random(seed)
    systems = [f"user {u}: " + " ".join(rng.choice(WORDS) for _ in range(system_words))
               for u in range(num_users)]
    return [[{"role": "system", "content": systems[u]},
             {"role": "user", "content": f"question {j} of user {u}: {rng.choice(WORDS)}?"}]
            for j in range(requests_per_user) for u in range(num_users)]


def run_workload(base_url: str, model: str, requests: list[list[dict]], concurrency: int,
                 max_tokens: int, router: str, timeout_s: float = 120.0) -> RouterRun:
    import httpx

    def one(messages):
        with httpx.Client(base_url=base_url, timeout=timeout_s) as client:
            r = client.post("/v1/chat/completions", json={
                "model": model, "messages": messages, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True})
        return r.json()["usage"] if r.status_code == 200 else None

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        usages = list(pool.map(one, requests))
    elapsed = time.perf_counter() - t0
    ok = [u for u in usages if u is not None]
    return RouterRun(router, len(requests), len(usages) - len(ok),
                     sum(u["prompt_tokens"] for u in ok),
                     sum(u["prompt_tokens_details"]["cached_tokens"] for u in ok),
                     sum(u["completion_tokens"] for u in ok), elapsed)


def deploy(model: str, router: str, engine_kwargs: dict, num_replicas: int = 2,
           model_name: str = "m", **app_kwargs) -> None:
    """(Re)deploy the application on the running Serve instance and wait until it is ready."""
    from ray import serve

    from nanokv.replicas.deployment import build_replica_app
    from nanokv.server.serving import ServerSettings

    app = build_replica_app(model, engine_kwargs, ServerSettings(model_name=model_name),
                            num_replicas, router=router, **app_kwargs)
    serve.run(app, name="nanokv", route_prefix="/")
    wait_for_replicas(num_replicas)


def wait_for_replicas(num_replicas: int, timeout_s: float = 120.0, settle_s: float = 2.0) -> None:
    """Until the engine deployment has exactly `num_replicas` replicas RUNNING and none starting
    or stopping (a redeploy's old replicas gone), then `settle_s` more: the ingress learns the
    new replica set asynchronously, and on a slow machine a run that starts at once can find
    only one replica routable."""
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while True:
        app = serve.status().applications.get("nanokv")
        engine = app.deployments.get("EngineReplica") if app else None
        states = engine.replica_states if engine else {}
        if states.get("RUNNING", 0) == num_replicas and sum(states.values()) == num_replicas:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"the replicas did not all reach RUNNING in {timeout_s:.0f} s: "
                               f"{states}")
        time.sleep(0.2)
    time.sleep(settle_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--out", default=None, help="write the results (JSON) here")
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--requests-per-user", type=int, default=4)
    p.add_argument("--system-words", type=int, default=60)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--num-kv-blocks", type=int, default=72)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-cpus", type=int, default=2, help="CPUs of the local Ray cluster")
    p.add_argument("--port", type=int, default=18300)
    p.add_argument("--rounds", type=int, default=1, help="runs per router, alternating")
    args = p.parse_args(argv)

    import ray
    from ray import serve

    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    engine_kwargs = {"num_kv_blocks": args.num_kv_blocks, "block_size": args.block_size,
                     "max_model_len": 1024}
    requests = user_requests(args.users, args.requests_per_user, args.system_words)
    results = []
    try:
        for rnd in range(args.rounds):
            for router in ("pow2", "affinity"):
                deploy(args.model, router, engine_kwargs)
                run = run_workload(f"http://127.0.0.1:{args.port}", "m", requests,
                                   args.concurrency, args.max_tokens, router)
                row = {**run.to_dict(), "round": rnd, "users": args.users,
                       "requests_per_user": args.requests_per_user,
                       "concurrency": args.concurrency, "num_kv_blocks": args.num_kv_blocks,
                       "block_size": args.block_size, "replicas": 2, "model": args.model}
                print(json.dumps(row), flush=True)
                results.append(row)
    finally:
        serve.shutdown()
        ray.shutdown()
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            for row in results:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
