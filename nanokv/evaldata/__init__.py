"""Offline evaluation and training data: seeded long-context tasks and the stdlib text corpus.

Pure Python (no torch), so the evaluation harness and the tiny-model trainer share it.
"""

from nanokv.evaldata.corpus import heldout_files, is_heldout, stdlib_root, training_files
from nanokv.evaldata.tasks import (
    TASKS,
    TaskSample,
    count_tokens,
    kv_lookup_sample,
    multikey_needle_sample,
    passkey_sample,
    score,
    variable_tracking_sample,
)

__all__ = [
    "TASKS",
    "TaskSample",
    "count_tokens",
    "heldout_files",
    "is_heldout",
    "kv_lookup_sample",
    "multikey_needle_sample",
    "passkey_sample",
    "score",
    "stdlib_root",
    "training_files",
    "variable_tracking_sample",
]
