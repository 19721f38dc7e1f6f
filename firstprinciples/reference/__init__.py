"""Reference implementations: exactly one of each concept in the course.

Chapters import them to compute figures, the checks compare students' answers
with them, and ``tests/`` validates them against PyTorch's own modules.
Each is marked with ``reference_piece`` so that an exercise can tell when a
student's answer simply calls the reference instead of building the piece.
"""
from .alibi import alibi_bias, alibi_slopes
from .attention import causal_mask, dot_product_scores, project_qkv, scaled_dot_product_attention, softmax
from .block import FeedForward, TransformerBlock
from .decoding import KVCache, cached_attention_step, cross_attention, generate
from .induction import induction_score
from .modern_block import GroupedQueryAttention, RMSNorm, SwiGLU
from .multihead import MultiHeadAttention, merge_heads, split_heads
from .position import apply_rope, sinusoidal_encoding
from .rnn import rnn_forward
from .sampling import next_token_probabilities, sample_next_token
from .tiled import tiled_attention

__all__ = [
    "FeedForward",
    "GroupedQueryAttention",
    "KVCache",
    "MultiHeadAttention",
    "RMSNorm",
    "SwiGLU",
    "TransformerBlock",
    "alibi_bias",
    "alibi_slopes",
    "apply_rope",
    "cached_attention_step",
    "causal_mask",
    "cross_attention",
    "dot_product_scores",
    "generate",
    "induction_score",
    "merge_heads",
    "next_token_probabilities",
    "project_qkv",
    "rnn_forward",
    "sample_next_token",
    "scaled_dot_product_attention",
    "sinusoidal_encoding",
    "softmax",
    "split_heads",
    "tiled_attention",
]
