"""The recap of ``scaled_dot_product_attention`` that later notebooks run in their imports' name
``attention_checks`` (transformer_block, capstone: their test
cell ``test_scaled_dot_product_attention``).

The attention exercise itself is declared in ``firstprinciples.exercises.attention`` and its notebook
calls ``check(grade_id, scaled_dot_product_attention)``; this module only runs that declaration's
recap cases, until those notebooks are declared too.
"""
from __future__ import annotations

from ..exercises.attention import RECAP, RECAP_ID
from ..grading.declared import run_test
from ._student import student_facing


@student_facing
def check_batched_worked_example(fn):
    """Your attention as the later exercises call it: "Cat sat mat" inside a batch of 2 sequences
    of 2 heads each, Q, K, V of shape (2, 2, 3, 2), without a mask and with the causal mask (3, 3),
    which broadcasts over the batch and the heads. Values against the reference."""
    run_test(RECAP, RECAP_ID, fn)
