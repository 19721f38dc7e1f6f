"""The recaps of the KV-cache exercise that the capstone runs in its imports' name ``kv_checks``
(its test cells ``recap_kv_cache`` and ``test_cached_attention_step``).

The KV-cache exercise itself is declared in ``firstprinciples.exercises.kv_cache`` and its notebook
calls ``check(grade_id, piece)``; this module only runs that declaration's recap cases, until the
capstone is declared too (then it goes).
"""
from __future__ import annotations

from ..exercises.kv_cache import CACHE_RECAP, CACHE_RECAP_ID, STEP_RECAP, STEP_RECAP_ID
from ..grading.declared import run_test
from ._student import student_facing


@student_facing
def check_kv_cache(KVCache, full=False):
    """Your KVCache on the exercise's visible cases: a new cache, then [1, 1, 1] and [3, 1, 2] positions
    appended (B=2, H=2, d_k=4, float64): K, V, len(cache), the attributes K and V, untouched inputs.
    (``full`` is ignored: the capstone's recap runs the visible cases; the grader re-checks more.)"""
    run_test(CACHE_RECAP, CACHE_RECAP_ID, KVCache)


@student_facing
def check_one_token_at_a_time(cached_attention_step):
    """Your step as the KV-cache exercise's test_one_token_at_a_time runs it: six tokens one at a time
    against full recomputation, the same with W_k and W_v changed after every call (a cache keeps what
    it computed), then the keys and values cached for two tokens at once. The cache is your notebook's
    KVCache (found where the step is defined) when it passes its own test, else a correct one."""
    run_test(STEP_RECAP, STEP_RECAP_ID, cached_attention_step)
