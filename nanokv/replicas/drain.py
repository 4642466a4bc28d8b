"""Graceful shutdown of the replicas: each one drains as `nanokv serve` does.

    SIGTERM -> the CLI sets the DrainSignal (a Ray actor) -> each replica sees it at its next
    health check (Serve calls `check_health` every 2 s) and drains its server: new requests
    503, in-flight ones finish for at most --shutdown-timeout s, the rest end with an OpenAI
    error (streams: an error event and [DONE]) -> it reports done -> once every replica has
    (or the timeout and a margin passed) the CLI removes the application.

Without it, Serve's shutdown cut running streams off with no error and no [DONE].
"""

from __future__ import annotations

import time

import ray

SIGNAL_NAMESPACE = "nanokv"
HEALTH_PERIOD_S = 2.0  # the replicas' health-check period: how late a replica sees the signal


@ray.remote(num_cpus=0)
class DrainSignal:
    """Set once by the CLI; read by the replicas, which report back when drained."""

    def __init__(self) -> None:
        self.timeout: float | None = None
        self.drained: set[str] = set()

    def set(self, timeout: float) -> None:
        self.timeout = timeout

    def get(self) -> float | None:
        return self.timeout

    def done(self, replica_id: str) -> None:
        self.drained.add(replica_id)

    def num_drained(self) -> int:
        return len(self.drained)


def create_signal(name: str):
    """The named signal actor (replaced if a stale one of that name is left)."""
    try:
        ray.kill(ray.get_actor(name, namespace=SIGNAL_NAMESPACE))
    except ValueError:
        pass
    return DrainSignal.options(name=name, namespace=SIGNAL_NAMESPACE).remote()


def drain_all(signal, num_replicas: int, timeout: float) -> int:
    """Tell the replicas to drain and wait until they all have (at most `timeout` plus the
    health-check period and a margin); returns how many reported."""
    ray.get(signal.set.remote(timeout))
    deadline = time.monotonic() + timeout + HEALTH_PERIOD_S + 5.0
    drained = 0
    while time.monotonic() < deadline:
        drained = ray.get(signal.num_drained.remote())
        if drained >= num_replicas:
            break
        time.sleep(0.2)
    return drained
