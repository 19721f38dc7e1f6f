"""alibi: the answers the generic harness (test_declarations.py) runs besides the declaration's own
mistakes: unusual correct answers, which must pass everywhere, and wrong answers that no mistake
names, each with the test cells it fails in the notebook (its visible cases) and in the trusted
re-check (the secret ones)."""
from __future__ import annotations

import math

import torch

from course import as_student_code
from firstprinciples import reference

correct = as_student_code(reference.alibi_bias)  # what a correct student writes


def loops(n_heads, T, dtype=torch.float32):
    """Three Python loops, one entry at a time (test_alibi.py compares the reference with it; as an
    answer it is left out: 7 s per re-check under the grader's watch, for T = 128)."""
    bias = torch.zeros(n_heads, T, T, dtype=dtype)
    for h in range(n_heads):
        m = 2 ** (-8 * (h + 1) / n_heads)
        for i in range(T):
            for j in range(i + 1):
                bias[h, i, j] = -m * (i - j)
    return bias


def row_loops(n_heads, T, dtype=torch.float32):
    """Python loops over heads and queries, one row at a time: keys 0..i at distances i..0."""
    bias = torch.zeros(n_heads, T, T, dtype=dtype)
    for h in range(n_heads):
        m = 2 ** (-8 * (h + 1) / n_heads)
        for i in range(T):
            bias[h, i, : i + 1] = -m * torch.arange(i, -1, -1, dtype=torch.float64)
    return bias


def broadcast_in_dtype(n_heads, T, dtype=torch.float32):
    """Everything in the requested dtype from the start, arange broadcast against itself."""
    pos = torch.arange(T, dtype=dtype)
    rel = pos.view(1, T, 1) - pos.view(1, 1, T)  # (1, T, T)
    m = 2.0 ** (-8.0 * torch.arange(1, n_heads + 1, dtype=dtype) / n_heads)
    return torch.where(rel >= 0, -m.view(-1, 1, 1) * rel, torch.zeros((), dtype=dtype))


def outer_tril(n_heads, T, dtype=torch.float32):
    """An outer product of the slopes with the distance table, the upper triangle cut by tril."""
    dist = torch.arange(T)[:, None] - torch.arange(T)[None, :]
    m = torch.tensor([2 ** (-8 * (h + 1) / n_heads) for h in range(n_heads)], dtype=torch.float64)
    table = torch.einsum("h,ij->hij", m, dist.double())
    return torch.tril(-table).to(dtype)


def float32_then_cast(n_heads, T, dtype=torch.float32):
    """float32 arithmetic throughout, cast to float64 only at the end when asked."""
    d = torch.arange(T, dtype=torch.float32)
    dist = (d[:, None] - d[None, :]).clamp(min=0)
    m = torch.pow(2.0, -8.0 * (torch.arange(n_heads, dtype=torch.float32) + 1) / n_heads)
    return (-(m[:, None, None] * dist)).to(dtype) + 0


def logspace_slopes(n_heads, T, dtype=torch.float32):
    """Slopes from torch.logspace (base 2), the distance via tril_indices."""
    m = torch.logspace(-8 / n_heads, -8, n_heads, base=2.0, dtype=torch.float64)
    bias = torch.zeros(n_heads, T, T, dtype=torch.float64)
    i, j = torch.tril_indices(T, T)
    bias[:, i, j] = -m[:, None] * (i - j).double()
    return bias.to(dtype)


def exp_log_slopes(n_heads, T, dtype=torch.float32):
    """Slopes as exp((h + 1) * log(2^(-8 / n))): a geometric sequence, the ratio from a log."""
    ratio = math.log(2.0) * -8.0 / n_heads
    m = torch.exp(ratio * torch.arange(1, n_heads + 1, dtype=torch.float64))
    i = torch.arange(T).unsqueeze(1)
    j = torch.arange(T).unsqueeze(0)
    return (-m[:, None, None] * (i - j).clamp_min(0)).to(dtype).add(0.0)


# (new with the declaration: written in ways the old tables did not foresee)
def cumsum_distances(n_heads, T, dtype=torch.float32):
    """The distances counted, not subtracted: a running sum down each column of the strictly lower
    triangle of ones gives i - j below the diagonal and 0 elsewhere."""
    dist = torch.ones(T, T, dtype=torch.float64).tril(-1).cumsum(dim=0)  # (T, T)
    m = 2.0 ** (-8.0 * torch.arange(1, n_heads + 1, dtype=torch.float64) / n_heads)
    return torch.stack([-mh * dist for mh in m]).to(dtype)  # (n_heads, T, T)


def slopes_by_cumprod(n_heads, T, dtype=torch.float32):
    """Each slope the previous one times the ratio 2^(-8 / n_heads) (torch.cumprod), and each head's
    table filled row by row from a reversed arange, in float32 when float32 is asked for."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    m = torch.full((n_heads,), 2.0 ** (-8.0 / n_heads), dtype=torch.float64).cumprod(0).to(work)
    bias = torch.zeros(n_heads, T, T, dtype=work)
    for i in range(T):
        bias[:, i, : i + 1] = -m[:, None] * torch.arange(i, -1, -1, dtype=work)  # keys 0..i at distance i..0
    return bias.to(dtype)


def heads_last_then_permuted(n_heads, T, dtype=torch.float32):
    """Built as (T, T, n_heads) by broadcasting over a trailing head axis, then moved to the front;
    the zeros above the diagonal come from multiplying by a boolean mask."""
    i = torch.arange(T, dtype=dtype).view(T, 1, 1)
    j = torch.arange(T, dtype=dtype).view(1, T, 1)
    m = torch.tensor([2.0 ** (-8.0 * (h + 1) / n_heads) for h in range(n_heads)], dtype=dtype)
    table = -(i - j) * m * (j <= i)  # (T, T, n_heads)
    return table.permute(2, 0, 1).contiguous() + 0.0  # (n_heads, T, T); + 0.0: no -0.0


CORRECT = {"reference": correct, "loops over heads and queries": row_loops, "broadcast in dtype": broadcast_in_dtype,
           "outer + tril": outer_tril,
           "float32 then cast": float32_then_cast, "logspace slopes": logspace_slopes,
           "exp-log slopes": exp_log_slopes, "cumsum distances": cumsum_distances,
           "slopes by cumprod": slopes_by_cumprod, "heads last, then permuted": heads_last_then_permuted}


def calls_reference(n_heads, T, dtype=torch.float32):
    return reference.alibi_bias(n_heads, T, dtype)


def calls_reference_slopes(n_heads, T, dtype=torch.float32):
    m = reference.alibi_slopes(n_heads)
    d = (torch.arange(T)[:, None] - torch.arange(T)[None, :]).clamp(min=0)
    return (-m[:, None, None] * d).to(dtype)


_WORKED = correct(4, 5)


def hard_coded_example(n_heads, T, dtype=torch.float32):
    return _WORKED.clone()  # the chapter's table, typed in


ALL = {"test_worked_example", "test_shapes", "test_slopes", "test_upper_triangle", "test_against_definition",
       "test_in_attention"}

# name: (answer, the test cells it fails in the notebook, those it fails in the re-check)
WRONG = {
    "calls the reference": (calls_reference, ALL, ALL),
    "calls the reference's slopes": (calls_reference_slopes, ALL, ALL),
    "returns a NumPy array": (lambda n_heads, T, dtype=torch.float32: correct(n_heads, T, dtype).numpy(), ALL, ALL),
    # (the re-check's worked example has other lengths besides T = 5)
    "hard-coded worked example": (hard_coded_example, ALL - {"test_worked_example"}, ALL),
}
