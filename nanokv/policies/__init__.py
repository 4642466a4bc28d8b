"""KV-cache policies: which of a request's cached tokens stay. See base.py for the contract and
apply.py for the calls the engine makes.

Importing this package registers the built-in policies:
streaming, h2o, snapkv, pyramidkv, knorm, paged_eviction, kvcrush, kvzip.
"""

from nanokv.policies.apply import (
                                   CompressionPlan,
                                   apply_compression,
                                   compress_request,
                                   decode_block_to_evict,
                                   plan_compression,
)
from nanokv.policies.base import (
                                   KVPolicy,
                                   LayerKV,
                                   PolicyConfig,
                                   available_policies,
                                   make_policy,
                                   policy_options,
                                   register_policy,
                                   validate_kept,
)
from nanokv.policies.compaction import (
                                   compact_blocks,
                                   compact_slots,
                                   gather_request_kv,
                                   window_attention,
)
from nanokv.policies.h2o import H2O
from nanokv.policies.knorm import KeyNorm
from nanokv.policies.kvcrush import KVCrush
from nanokv.policies.kvzip import KVzip
from nanokv.policies.paged_eviction import PagedEviction, select_pool_evictions
from nanokv.policies.pyramidkv import PyramidKV, pyramid_budgets
from nanokv.policies.scoring import ScoredPolicy
from nanokv.policies.snapkv import SnapKV
from nanokv.policies.streaming import StreamingLLM

__all__ = [
    "H2O", "CompressionPlan", "KVCrush", "KVzip", "KVPolicy", "KeyNorm", "LayerKV", "PagedEviction",
    "PolicyConfig", "PyramidKV", "ScoredPolicy", "SnapKV", "StreamingLLM", "apply_compression",
    "available_policies", "compact_blocks", "compact_slots", "compress_request",
    "decode_block_to_evict", "gather_request_kv", "make_policy", "plan_compression",
    "policy_options", "pyramid_budgets", "register_policy", "select_pool_evictions",
    "validate_kept", "window_attention",
]
