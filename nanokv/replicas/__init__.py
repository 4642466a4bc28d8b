"""Replicas of the OpenAI server on Ray Serve, with prefix-cache-aware routing.

One nanokv engine per replica behind nanokv's own OpenAI app, an ingress that tokenizes each
prompt and computes its chained block hashes (the block manager's), and a request router that
sends a request to the replica whose prefix cache holds the longest prefix of those hashes,
falling back to the least loaded replica when load is unbalanced.

    prefix_hashes.py   HashSpec, a prompt's block hashes, the tokenization the server does (no Ray)
    asgi.py            call an ASGI app in-process, the response as a stream of parts (no Ray)
    router.py          PrefixAffinityRouter: Ray Serve's RequestRouter API
    deployment.py      the replica and ingress deployments, build_replica_app
    cli.py             `nanokv serve MODEL --replicas N`

Everything importing Ray needs the [ray] extra: pip install 'nanokv[ray]'.
"""
