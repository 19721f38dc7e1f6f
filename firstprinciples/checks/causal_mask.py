"""Checks for ``causal_mask(T) -> (T, T) float32 tensor``: 0 on and below the
diagonal, -inf above.

Visible checks (the student runs them): the source's 4 x 4 mask, shapes and
dtype, exact values, and that the mask stops attention from seeing the future.
Hidden checks (added at grading, ``full=True``): more sizes, float32 and float64
attention inputs.

Decisions stated once:

- The contract says -inf, so a large negative finite number (-1e9, -1e4, the
  dtype's lowest value) is rejected, with a message that says why: exp(-inf) is
  exactly 0 whatever the scores, a finite number is only "small enough" while
  the scores stay small, and a finite mask hides a fully masked row (uniform
  weights over forbidden positions) instead of showing it (NaN).
- float32, as the source's mask (torch's default float); a float64 mask is
  rejected by the dtype check only.

Every check runs the answer under ``call_without`` (the course's reference
``causal_mask`` is forbidden) and watches for PyTorch's own causal mask,
``torch.nn.Transformer.generate_square_subsequent_mask``; either scores 0.
"""
from __future__ import annotations

import contextlib
import math
import sys

import torch
import torch.nn.modules.transformer as _transformer

from ..guard import ForbiddenCall, call_without
from ..reference import causal_mask as reference
from ..reference import scaled_dot_product_attention
from ._student import wrap_checks
from ._core import Mistake, assert_matches, diagnose, exact, expect_tensor, tolerance

FORBIDDEN = dict(
    torch_patterns=("generate_square_subsequent_mask",),
    pieces=("causal_mask",),
    what="the causal mask",
)

# The source's mask for a sequence of 4 tokens, row by row (query t sees keys 0..t).
_NEG = float("-inf")
SEED_MASK_4 = (
    (0.0, _NEG, _NEG, _NEG),
    (0.0, 0.0, _NEG, _NEG),
    (0.0, 0.0, 0.0, _NEG),
    (0.0, 0.0, 0.0, 0.0),
)


# ---------------------------------------------------------------- mistakes
def _neg_inf_full(T):
    return torch.full((T, T), float("-inf"))


def _diagonal_masked(T):
    return torch.triu(_neg_inf_full(T), diagonal=0)


def _one_future_visible(T):
    return torch.triu(_neg_inf_full(T), diagonal=2)


def _swapped(T):
    return torch.tril(_neg_inf_full(T), diagonal=-1)


def _boolean(T):
    return torch.tril(torch.ones(T, T, dtype=torch.bool))


def _zero_one_hidden(T):
    return torch.triu(torch.ones(T, T), diagonal=1)


def _zero_one_visible(T):
    return torch.tril(torch.ones(T, T))


def _large_negative(T):
    return torch.triu(torch.full((T, T), -1e9), diagonal=1)


def _times_minus_inf(T):
    return torch.triu(torch.ones(T, T), diagonal=1) * float("-inf")  # 0 * -inf is NaN


def _one_too_big(T):
    return torch.triu(_neg_inf_full(T + 1), diagonal=1)


def _batch_dim(T):
    return torch.triu(_neg_inf_full(T), diagonal=1).unsqueeze(0)


MISTAKES = (
    Mistake(
        "diagonal masked",
        "each position must see itself: keep 0 on the diagonal and put -inf only above it (triu with diagonal=1).",
        _diagonal_masked,
    ),
    Mistake(
        "one future position visible",
        "only the diagonal and what is below it may be 0; the entry just above the diagonal is already the future.",
        _one_future_visible,
    ),
    Mistake(
        "tril and triu swapped",
        "your mask hides the past and shows the future: -inf belongs above the diagonal "
        "(row t = the query at position t, column s = the key at position s, hidden when s > t).",
        _swapped,
    ),
    Mistake(
        "boolean mask instead of float",
        "the mask is added to the scores, so it must be a float tensor of 0 and -inf, not True/False.",
        _boolean,
    ),
    Mistake(
        "0/1 mask instead of 0/-inf (1 = hidden)",
        "the mask is added to the scores: adding 1 barely changes a score. Use -inf where a position is hidden.",
        _zero_one_hidden,
    ),
    Mistake(
        "0/1 mask instead of 0/-inf (1 = visible)",
        "this mask would be multiplied, but it is added to the scores: use 0 where a position is visible "
        "and -inf where it is hidden.",
        _zero_one_visible,
    ),
    Mistake(
        "large negative number instead of -inf",
        "use float('-inf'): exp(-inf) is exactly 0 for any score, while a finite number only works as long "
        "as the scores stay small, and it turns a fully masked row into uniform weights instead of NaN.",
        _large_negative,
    ),
    Mistake(
        "-inf multiplied by a 0/1 matrix",
        "0 * -inf is NaN, not 0: build the mask with torch.full(..., float('-inf')) and triu, "
        "or with masked_fill, instead of multiplying by -inf.",
        _times_minus_inf,
    ),
    Mistake(
        "shape (T + 1, T + 1)",
        "the mask has one row and one column per token: shape (T, T).",
        _one_too_big,
    ),
    Mistake(
        "extra leading dimension",
        "return a (T, T) matrix; broadcasting adds the batch and head dimensions when the mask is added to the scores.",
        _batch_dim,
    ),
)

_BY_LABEL = {m.label: m for m in MISTAKES}


# ---------------------------------------------------------------- calling the answer
_TORCH_MASK_CODES = {
    _transformer._generate_square_subsequent_mask.__code__,
    _transformer.Transformer.generate_square_subsequent_mask.__code__,
}


@contextlib.contextmanager
def _watch_torch_mask():
    """Record calls to PyTorch's causal-mask helpers, however the answer names them.

    A profile hook sees every Python function call by its code object, so an alias
    (``from torch.nn.modules.transformer import _generate_square_subsequent_mask``)
    is seen as well. The previous hook, if any, keeps running.
    """
    hits = []
    previous = sys.getprofile()

    def hook(frame, event, arg):
        if event == "call" and frame.f_code in _TORCH_MASK_CODES:
            hits.append(frame.f_code.co_name)
        if previous is not None:
            previous(frame, event, arg)

    sys.setprofile(hook)
    try:
        yield hits
    finally:
        sys.setprofile(previous)


def _call(fn, T):
    """The answer's causal_mask(T), under the guard; must be a tensor."""
    with _watch_torch_mask() as hits:
        result = call_without(fn, (T,), {}, **FORBIDDEN)
    if hits:
        raise ForbiddenCall(
            "Your answer calls torch.nn.Transformer.generate_square_subsequent_mask, PyTorch's own causal mask. "
            "This exercise asks you to build the causal mask yourself from basic tensor operations, "
            "so this check scores 0."
        )
    return expect_tensor(f"causal_mask({T})", result)


def _show(m):
    """A small matrix written row by row, for messages."""
    rows = m.detach().to(torch.float64).tolist() if m.dtype != torch.bool else m.tolist()
    cell = (lambda v: str(v)) if m.dtype == torch.bool else (lambda v: f"{v:g}")
    return "\n".join("    [" + ", ".join(f"{cell(v):>6}" for v in row) + "]" for row in rows)


def _sentence(hint):
    return hint[0].upper() + hint[1:]


def _check_shape_dtype(got, T):
    name = f"causal_mask({T})"
    if tuple(got.shape) != (T, T):
        hint = ""
        if tuple(got.shape) == (1, T, T):
            hint = " " + _sentence(_BY_LABEL["extra leading dimension"].hint)
        elif tuple(got.shape) == (T + 1, T + 1):
            hint = " " + _sentence(_BY_LABEL["shape (T + 1, T + 1)"].hint) + " Is there a T + 1 somewhere?"
        raise AssertionError(f"{name} has shape {tuple(got.shape)} but should have shape ({T}, {T}).{hint}")
    if got.dtype == torch.bool:
        raise AssertionError(
            f"{name} is a boolean tensor. {_sentence(_BY_LABEL['boolean mask instead of float'].hint)} "
            "(Boolean masks exist elsewhere, but this course's attention adds its mask to the scores.)"
        )
    if got.dtype != torch.float32:
        raise AssertionError(
            f"{name} has dtype {got.dtype} but should be torch.float32 (a float tensor, like torch.full's default)."
        )
    if got.device.type != "cpu":
        raise AssertionError(f"{name} is on {got.device}; build it on the CPU (the default).")


def _check_values(got, T):
    """Exact 0 on and below the diagonal, exact -inf above; explain the first wrong entry."""
    name = f"causal_mask({T})"
    want = reference(T)
    if torch.equal(got, want):
        return
    g = got.detach().to(torch.float64)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    if bool(torch.isnan(g).any()):
        i, j = (int(v) for v in torch.isnan(g).nonzero()[0])
        raise AssertionError(f"{name}[{i}, {j}] is NaN. {_sentence(_BY_LABEL['-inf multiplied by a 0/1 matrix'].hint)}")
    finite_future = future & torch.isfinite(g) & (g < -1.0)
    if bool(finite_future.any()) and bool((g[~future] == 0).all()):
        i, j = (int(v) for v in finite_future.nonzero()[0])
        raise AssertionError(
            f"{name}[{i}, {j}] = {g[i, j].item():g}: a large negative number, but not -inf. The contract asks for "
            "-inf. " + _sentence(_BY_LABEL["large negative number instead of -inf"].hint)
        )
    wrong = (g != want.to(torch.float64)).nonzero()
    i, j = (int(v) for v in wrong[0])
    where = "above the diagonal (the future)" if j > i else ("on the diagonal" if i == j else "below the diagonal (the past)")
    should = "-inf: the query at position {i} must not see the key at position {j}" if j > i else \
        "0: the query at position {i} may see the key at position {j}"
    raise AssertionError(
        f"{name}[{i}, {j}] = {g[i, j].item()} {where} but should be {should.format(i=i, j=j)}. "
        f"{len(wrong)} of the {T * T} entries are wrong."
    )


def _matching_mistakes(got, T):
    """The named mistakes whose mask equals ``got`` (same values and same dtype)."""
    found = diagnose((got,), (T,), MISTAKES, reference.__wrapped__)
    return [m for m in found if m.fn(T).dtype == got.dtype]


def _diagnosis_lines(got, T, already=""):
    found = [m for m in _matching_mistakes(got, T) if _sentence(m.hint) not in already]
    if not found:
        return ""
    return "\nYour mask matches a typical mistake:\n" + "\n".join(f"  - {m.label}: {m.hint}" for m in found)


def _diagnosed(got, T, check, *args, **kwargs):
    """Run ``check(*args, **kwargs)``; if it fails, append the mistakes that ``got`` equals."""
    try:
        check(*args, **kwargs)
    except AssertionError as err:
        raise AssertionError(f"{err}{_diagnosis_lines(got, T, str(err))}") from None


# ---------------------------------------------------------------- visible
def check_seed_mask(fn):
    """causal_mask(4) is the source's matrix, entry by entry (and float32)."""
    got = _call(fn, 4)

    def check():
        _check_shape_dtype(got, 4)
        try:
            _check_values(got, 4)
        except AssertionError as err:
            raise AssertionError(
                f"{err}\nYours:\n{_show(got)}\nThe source's mask for 4 tokens (row t = query t, column s = key s):\n"
                + _show(torch.tensor(SEED_MASK_4))
            ) from None

    _diagnosed(got, 4, check)


def check_shapes_and_dtype(fn, full=True):
    """A float32 tensor of shape (T, T), for T = 1, 3, 7 (and more at grading)."""
    sizes = (1, 3, 7) + ((2, 5, 8, 16, 33, 100) if full else ())
    for T in sizes:
        got = _call(fn, T)
        _diagnosed(got, T, _check_shape_dtype, got, T)


def check_values(fn, full=True):
    """Exactly 0 on and below the diagonal and exactly -inf above, for T = 1 and 6 (and more at grading)."""
    sizes = (1, 6) + ((2, 3, 5, 9, 17, 32, 128) if full else ())
    for T in sizes:
        got = _call(fn, T)
        _diagnosed(got, T, _check_shape_dtype, got, T)
        _diagnosed(got, T, _check_values, got, T)


def _attention_case(g, B, T, d, dtype):
    x = torch.randn(B, T, d, generator=g, dtype=dtype)  # one vector per token
    W = torch.randn(3, d, d, generator=g, dtype=dtype) / math.sqrt(d)
    return x, W


def _attend(x, W, mask):
    """Self-attention of the tokens x (B, T, d) with the given additive mask."""
    Q, K, V = x @ W[0], x @ W[1], x @ W[2]  # (B, T, d) each
    return scaled_dot_product_attention(Q, K, V, mask)  # output (B, T, d), weights (B, T, T)


def check_no_peeking(fn, full=True):
    """With your mask in attention, changing the tokens after position t leaves the
    outputs at positions 0..t unchanged; every position sees itself and its past.

    The mask is added to float32 scores (visible) and, at grading, to float64 scores
    too, for several sequence lengths; the attention is the course's reference.
    """
    g = torch.Generator().manual_seed(17)
    cases = [(2, 5, 4, torch.float32)]
    if full:
        cases += [(1, 1, 3, torch.float32), (3, 8, 6, torch.float64), (2, 12, 8, torch.float32), (1, 16, 4, torch.float64)]
    for B, T, d, dtype in cases:
        mask = _call(fn, T)
        label = f"for T = {T}, {str(dtype).replace('torch.', '')} tokens"
        x, W = _attention_case(g, B, T, d, dtype)
        try:
            out, w = _attend(x, W, mask)
        except RuntimeError as err:
            hint = ""
            if tuple(mask.shape[-2:]) != (T, T):
                hint = f" The mask must have shape ({T}, {T})."
            elif mask.dtype != torch.float32:
                hint = (f" Your mask is {mask.dtype}: added to float32 scores it changes their dtype, and the "
                        "product with the float32 values then fails. Return a float32 mask.")
            raise AssertionError(
                f"Attention with causal_mask({T}) (shape {tuple(mask.shape)}, {mask.dtype}) added to scores of "
                f"shape ({B}, {T}, {T}) failed {label}: {err}.{hint}"
            ) from err
        w = w.detach().to(torch.float64)
        if not bool(torch.isfinite(out).all()):
            bad = int(torch.isfinite(out).all(-1).logical_not().nonzero()[0, 1])
            raise AssertionError(
                f"With your mask, the attention output at position {bad} is not finite {label}: its row of the mask "
                "hides every position (or holds NaN), so the softmax has nothing to attend to. "
                "Every position must at least see itself."
            )
        for t in range(T - 1):
            # New, different tokens after position t; positions 0..t keep theirs.
            changed = x.clone()
            changed[:, t + 1:] = torch.randn(B, T - t - 1, d, generator=g, dtype=dtype)
            out2, _ = _attend(changed, W, mask)
            moved = (out2[:, : t + 1] - out[:, : t + 1]).abs().max().item()
            # With -inf above the diagonal the earlier outputs do not move at all; the
            # tolerance only absorbs rounding (a future that leaks moves them by ~0.1).
            if moved > tolerance(dtype)[0]:
                peek = w[:, : t + 1, t + 1:].amax().item()
                raise AssertionError(
                    f"With your mask, changing the tokens after position {t} changed the output at positions "
                    f"0..{t} (by up to {moved:.3g}) {label}: earlier positions can see the future "
                    f"(the largest weight a position 0..{t} puts on a later one is {exact(peek)}; it must be exactly 0)."
                    + _diagnosis_lines(mask, T)
                )
        # Nothing hidden that should be seen: the same attention as with the right mask.
        _, w_right = _attend(x, W, reference(T))
        _diagnosed(
            mask, T, assert_matches, "the attention weights with your mask", w, w_right.to(torch.float64),
            context=label + " (against the right mask)",
        )



wrap_checks(globals())  # student-facing failures: the student's own line first, their frames only
