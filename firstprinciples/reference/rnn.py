"""The recurrent network whose sequential bottleneck motivates attention."""
from __future__ import annotations

import torch

from ..guard import reference_piece


@reference_piece("rnn_forward")
def rnn_forward(x, h0, W_xh, W_hh, b):
    """Run a tanh RNN over a sequence.

    x: (B, T, d_in), h0: (B, d_h), W_xh: (d_in, d_h), W_hh: (d_h, d_h), b: (d_h,).
    Returns every hidden state, (B, T, d_h), with h_t = tanh(x_t W_xh + h_{t-1} W_hh + b).
    """
    h = h0
    states = []
    for t in range(x.shape[1]):  # one step at a time: step t needs step t-1
        h = torch.tanh(x[:, t] @ W_xh + h @ W_hh + b)  # (B, d_h)
        states.append(h)
    return torch.stack(states, dim=1)  # (B, T, d_h)
