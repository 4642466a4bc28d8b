"""PrefixAffinityRouter's choices (nanokv/replicas/router.py) without a Ray cluster: the router
is built in-process, replicas are stand-ins with a queue length and routing stats, and requests
carry block hashes as the ingress attaches them. The oracle is a brute-force count of the
leading hashes each replica was sent or reported."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

pytest.importorskip("ray", reason="the [ray] extra is not installed (pip install 'nanokv[ray]')")

from ray.serve._private.common import (DeploymentHandleSource, DeploymentID,  # noqa: E402
                                       ReplicaID)

from nanokv.replicas.router import CACHED_HASHES_KEY, PrefixAffinityRouter  # noqa: E402

DEPLOYMENT = DeploymentID(name="EngineReplica", app_name="nanokv")
TEMPLATE = 10**6  # the block every chat prompt starts with (template head), shared by all users


def make_router(**kwargs) -> PrefixAffinityRouter:
    router = PrefixAffinityRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
    router.initialize_state(**kwargs)
    return router


@dataclass(eq=False)
class Replica:
    """What the router reads of Serve's RunningReplica."""
    replica_id: ReplicaID
    routing_stats: dict = field(default_factory=dict)
    max_ongoing_requests: int = 64


def make_replicas(n: int) -> list[Replica]:
    return [Replica(ReplicaID(f"r{i}", DEPLOYMENT)) for i in range(n)]


def request(hashes: list[int]) -> SimpleNamespace:
    return SimpleNamespace(args=[SimpleNamespace(block_hashes=hashes)], kwargs={})


def user_prompt(user: int, question: int, system_blocks: int = 10) -> list[int]:
    """Template block, the user's own system prompt blocks, one block of the question."""
    return ([TEMPLATE] + [user * 1000 + b for b in range(system_blocks)]
            + [user * 1000 + 500 + question])


def route(router, replicas, hashes: list[int], loads: dict | None = None):
    for r in replicas:
        router.replica_queue_len_cache.update(r.replica_id, (loads or {}).get(r, 0))
    ranks = asyncio.run(router.choose_replicas(replicas, request(hashes)))
    assert sorted(id(r) for [r] in ranks) == sorted(id(r) for r in replicas)  # every replica
    chosen = ranks[0][0]
    router.on_request_routed(request(hashes), chosen.replica_id, None)
    return chosen


def test_users_spread_over_replicas_and_stay_on_theirs():
    random.seed(0)
    router, replicas = make_router(), make_replicas(2)
    home = {}
    for question in range(4):
        for user in range(8):
            chosen = route(router, replicas, user_prompt(user, question))
            home.setdefault(user, chosen)
            assert chosen is home[user], (user, question)  # affinity: the same replica
    per_replica = [sum(h is r for h in home.values()) for r in replicas]
    assert per_replica == [4, 4]  # new users went to the smallest tenant, not after the template


def test_new_users_go_to_the_smallest_tenant_whatever_the_moments_loads():
    """Without a match worth following, a new user goes to the replica holding the fewest
    routed hashes, not the idler one: with requests in flight the loads change from one moment
    to the next, and following them split 8 users 5 / 3 or 6 / 2 (one replica thrashing). The
    imbalance rule still yields to load beyond its threshold."""
    random.seed(1)
    router, replicas = make_router(imbalance_threshold=4), make_replicas(2)
    a, b = replicas
    home = {}
    for user in range(8):  # b looks busier whenever a new user arrives (within the threshold)
        home[user] = route(router, replicas, user_prompt(user, 0), {a: 0, b: 3})
    assert sorted(sum(h is r for h in home.values()) for r in replicas) == [4, 4]
    # brute force: at each arrival the chosen replica held no more routed hashes than the other
    router, replicas = make_router(imbalance_threshold=4), make_replicas(2)
    for user in range(8):
        held = {r: len(router._routed_hashes(r.replica_id)) for r in replicas}
        chosen = route(router, replicas, user_prompt(user, 0), {replicas[0]: 0, replicas[1]: 3})
        assert held[chosen] == min(held.values())
    # beyond the threshold, the least loaded whatever it holds
    assert route(router, replicas, user_prompt(9, 0), {replicas[0]: 0, replicas[1]: 5}) \
        is replicas[0]
    assert route(router, replicas, user_prompt(10, 0), {replicas[0]: 5, replicas[1]: 0}) \
        is replicas[1]


def test_without_a_match_ratio_every_user_follows_the_shared_template():
    """What min_match_ratio prevents: the template block alone pulls every new user to the
    replica that served the first one."""
    random.seed(0)
    router, replicas = make_router(min_match_ratio=0.0), make_replicas(2)
    first = route(router, replicas, user_prompt(0, 0))
    assert all(route(router, replicas, user_prompt(u, 0)) is first for u in range(1, 8))


@pytest.mark.parametrize("system_blocks", [1, 2, 5, 30])
def test_affinity_follows_a_match_of_at_least_the_ratio(system_blocks):
    """A user's repeat matches 1 + system_blocks of its 2 + system_blocks blocks; a new user
    matches 1 (the template). Brute force: the choice is the ratio rule on those counts."""
    ratio = 0.25
    router, replicas = make_router(min_match_ratio=ratio), make_replicas(2)
    a, b = replicas
    router.on_request_routed(request(user_prompt(0, 0, system_blocks)), a.replica_id, None)
    loads = {a: 1, b: 0}  # b is idler: only a followed match sends the request to a
    new_user = user_prompt(1, 0, system_blocks)
    assert route(router, replicas, new_user, loads) is (a if 1 >= ratio * len(new_user) else b)
    router, replicas = make_router(min_match_ratio=ratio), make_replicas(2)
    a, b = replicas
    router.on_request_routed(request(user_prompt(0, 0, system_blocks)), a.replica_id, None)
    repeat = user_prompt(0, 1, system_blocks)
    assert router.match(a, repeat) == 1 + system_blocks and router.match(b, repeat) == 0
    assert route(router, replicas, repeat, {a: 1, b: 0}) is a


def test_reported_hashes_count_and_imbalance_yields_to_load():
    router, replicas = make_router(imbalance_threshold=2), make_replicas(3)
    a, b, c = replicas
    prompt = user_prompt(3, 0)
    b.routing_stats = {CACHED_HASHES_KEY: prompt[:6]}  # b reports 6 leading blocks cached
    c.routing_stats = {CACHED_HASHES_KEY: prompt[1:]}  # not a prefix: matches nothing
    assert [router.match(r, prompt) for r in replicas] == [0, 6, 0]
    assert route(router, replicas, prompt, {a: 0, b: 2, c: 1}) is b
    # b more than imbalance_threshold busier than a: the least loaded instead
    assert route(router, replicas, prompt, {a: 0, b: 3, c: 1}) is a


def test_bad_router_settings_are_rejected():
    with pytest.raises(ValueError, match="min_match_ratio must be in"):
        make_router(min_match_ratio=1.5)
    with pytest.raises(ValueError, match="min_match_ratio must be in"):
        make_router(min_match_ratio=float("nan"))
    with pytest.raises(ValueError, match="imbalance_threshold must be >= 0"):
        make_router(imbalance_threshold=-1)
