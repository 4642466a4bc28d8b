"""`nanokv serve MODEL --replicas N`: the server's flags, N engine replicas on Ray Serve.

The flags are added to `nanokv serve` (nanokv/server/cli.py calls `add_replica_args` and hands
over to `serve_replicas` when --replicas is given); importing this module does not import Ray.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

ROUTER_CHOICES = ("affinity", "pow2")


# the replica flags' defaults: without --replicas, any other value is a mistake to refuse
REPLICA_DEFAULTS = {"router": "affinity", "replica_cpus": 1.0, "imbalance_threshold": 4,
                    "min_match_ratio": 0.1, "routing_stats_period": 2.0, "metrics_port": None,
                    "ray_address": None, "ray_num_cpus": None}


def add_replica_args(p: argparse.ArgumentParser) -> None:
    r = p.add_argument_group("replicas (Ray Serve; needs the [ray] extra)")
    d = REPLICA_DEFAULTS
    r.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="serve N engine replicas on Ray Serve behind one OpenAI endpoint, "
                        "routed by prefix-cache affinity (default: one engine, no Ray)")
    r.add_argument("--router", choices=ROUTER_CHOICES, default=d["router"],
                   help="affinity: the replica whose prefix cache holds the longest prefix of "
                        "the prompt, the least loaded one when load is unbalanced; pow2: Ray "
                        "Serve's default power-of-two choices (default affinity)")
    r.add_argument("--replica-cpus", type=float, default=d["replica_cpus"],
                   help="Ray CPUs per replica; also its engine's --num-threads unless given "
                        "(default 1)")
    r.add_argument("--imbalance-threshold", type=int, default=d["imbalance_threshold"],
                   help="ongoing requests by which the busiest replica may exceed the idlest "
                        "before affinity yields to load (default 4)")
    r.add_argument("--min-match-ratio", type=float, default=d["min_match_ratio"],
                   help="affinity follows a cached prefix only when it covers at least this "
                        "fraction of the prompt's blocks (a shared chat-template head does not "
                        "count); below it, the replica holding the fewest routed prefixes, "
                        "then the least loaded (0-1, default 0.1)")
    r.add_argument("--routing-stats-period", type=float, default=d["routing_stats_period"],
                   help="seconds between the replicas' reports of their cached block hashes "
                        "(default 2)")
    r.add_argument("--metrics-port", type=int, default=d["metrics_port"],
                   help="replica of rank i serves its /metrics on this port + i, for "
                        "Prometheus (default: off)")
    r.add_argument("--ray-address", default=d["ray_address"],
                   help="join this Ray cluster (default: $RAY_ADDRESS, else a local one)")
    r.add_argument("--ray-num-cpus", type=int, default=d["ray_num_cpus"],
                   help="CPUs of the local Ray cluster started when no address is given "
                        "(default: all)")


def check_replica_args(args: argparse.Namespace) -> None:
    if args.replicas is None:
        given = [name for name, default in REPLICA_DEFAULTS.items()
                 if getattr(args, name) != default]
        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            raise ValueError(f"{flags} set the replicas of Ray Serve: they need --replicas N "
                             f"(without it one engine serves, and they would be ignored)")
        return
    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    if not args.replica_cpus > 0:
        raise ValueError(f"--replica-cpus must be > 0, got {args.replica_cpus}")
    if args.imbalance_threshold < 0:
        raise ValueError(f"--imbalance-threshold must be >= 0, got {args.imbalance_threshold}")
    if not 0.0 <= args.min_match_ratio <= 1.0:
        raise ValueError(f"--min-match-ratio must be in [0, 1], got {args.min_match_ratio}")
    if not args.routing_stats_period > 0:
        raise ValueError(f"--routing-stats-period must be > 0, got "
                         f"{args.routing_stats_period}")
    if args.metrics_port is not None and not 0 < args.metrics_port < 65536 - args.replicas:
        raise ValueError(f"--metrics-port must leave room for {args.replicas} ports below "
                         f"65536, got {args.metrics_port}")


def serve_replicas(args: argparse.Namespace, model: str, settings, engine_kwargs: dict) -> int:
    """Start (or join) Ray, deploy, serve until SIGTERM / Ctrl-C, then shut Serve down."""
    import os

    import ray
    from ray import serve

    from nanokv.replicas.deployment import build_replica_app
    from nanokv.replicas.drain import create_signal, drain_all

    check_replica_args(args)
    signal_name = f"drain-{os.getpid()}"
    app = build_replica_app(model, engine_kwargs, settings, args.replicas, router=args.router,
                            replica_cpus=args.replica_cpus, metrics_port=args.metrics_port,
                            metrics_host=args.host,
                            routing_stats_period_s=args.routing_stats_period,
                            imbalance_threshold=args.imbalance_threshold,
                            min_match_ratio=args.min_match_ratio, drain_signal=signal_name)
    address = args.ray_address or os.environ.get("RAY_ADDRESS")
    ray.init(address=address, num_cpus=None if address else args.ray_num_cpus,
             include_dashboard=False)
    serve.start(http_options={"host": args.host, "port": args.port})
    stop = threading.Event()

    def on_signal(*_) -> None:
        if stop.is_set():  # a second signal: stop at once
            raise KeyboardInterrupt
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    drain = create_signal(signal_name)
    deployed = False
    try:
        serve.run(app, name="nanokv", route_prefix="/")
        deployed = True
        ports = (f"; replica metrics on ports {args.metrics_port}.."
                 f"{args.metrics_port + args.replicas - 1}" if args.metrics_port else "")
        print(f"[nanokv] serving {settings.model_name!r} on http://{args.host}:{args.port} with "
              f"{args.replicas} replicas, router {args.router}{ports}", file=sys.stderr,
              flush=True)
        if address and not listening(args.host, args.port):
            print(f"[nanokv] warning: nothing listens on {args.host}:{args.port}: Serve was "
                  f"already running on this cluster with other HTTP options, which it keeps; "
                  f"the application is served where that Serve instance listens",
                  file=sys.stderr, flush=True)
        stop.wait()
        print(f"[nanokv] shutting down: the replicas drain (at most "
              f"{settings.shutdown_timeout:g} s)", file=sys.stderr, flush=True)
        drain_all(drain, args.replicas, settings.shutdown_timeout)
    finally:
        if address:  # a cluster it joined: only its own application goes
            if deployed:
                serve.delete("nanokv")
        else:
            serve.shutdown()
        ray.kill(drain)
        ray.shutdown()
    return 0


def listening(host: str, port: int) -> bool:
    """Whether something accepts connections on host:port (a wildcard host: on localhost)."""
    import socket

    target = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    try:
        with socket.create_connection((target, port), timeout=2):
            return True
    except OSError:
        return False
