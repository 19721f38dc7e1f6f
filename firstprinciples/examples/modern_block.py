"""The worked example of the chapter "The modern block" and of its exercise's ``RMSNorm``
(a visible case of ``exercises.modern_block``), and the parameter count of grouped-query attention
that the chapter and the exercise's structure test use."""
from __future__ import annotations

# One token (1, 2, 2, 4). Its mean square is 25/4, its RMS 2.5, so with weight ones the
# output is (0.4, 0.8, 0.8, 1.6).
WORKED_X = (1.0, 2.0, 2.0, 4.0)
WORKED_RMS = 2.5
WORKED_OUT = (0.4, 0.8, 0.8, 1.6)


def gqa_parameter_count(d, n_heads, n_kv):
    """The weights of GroupedQueryAttention(d, n_heads, n_kv): W_q and W_o (d, d), W_k and W_v
    (n_kv * d_k, d), d_k = d // n_heads; no biases."""
    return 2 * d * d + 2 * d * n_kv * (d // n_heads)
