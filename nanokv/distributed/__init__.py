"""Tensor parallelism: one engine's model split over N processes (`tensor_parallel_size`).

    parallel_state.py   a rank's place in the group and the collectives the layers call
    support.py          which engine options and models can be split over N ranks (checked first)
    tp_layers.py        column / row / vocabulary-parallel layers and how the loader shards them
    messages.py         the plain-data commands rank 0 sends to the other ranks
    executor.py         rank 0's end: starts the ranks, sends each step, turns a lost rank into
                        an error
    sharded_kv_cache.py the KV cache as rank 0's block manager and KV policies see it: every
                        rank's KV heads
    worker_process.py   the loop of ranks 1..N-1

Rank 0 is the engine's own process: it holds the scheduler, the block manager, the KV policies
and the sampler, and a model shard like every other rank. Nothing here is imported when
tensor_parallel_size is 1.
"""
