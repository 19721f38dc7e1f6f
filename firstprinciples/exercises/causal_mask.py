"""causal_mask(T) -> (T, T) float32 mask: the exercise's tests, declared once.

0 on and below the diagonal, -inf above (row t = the query at position t, column s = the key at
position s). Decisions stated once:

- The contract says -inf, so a large negative finite number (-1e9, -1e4, the dtype's lowest
  value) is rejected by the tests of the mask's values, with the reason: exp(-inf) is exactly 0
  whatever the scores, a finite number is only "small enough" while the scores stay small, and a
  finite mask turns a fully masked row into uniform weights over forbidden positions instead of
  showing it (NaN). Used in attention (``test_no_peeking``) such a mask gives the right outputs,
  and passes there.
- float32, as the source's mask (torch's default float). A float64 mask fails the tests of the
  mask itself by its dtype, and ``test_no_peeking`` because added to float32 scores it makes float64
  weights, which cannot multiply float32 values.
- ``test_no_peeking`` runs the mask in an attention written in the adapter (not the course's), on
  random tokens and on copies whose tokens after position t were replaced, for every t: the outputs
  at positions 0..t must not move, and outputs and weights must be those of the right mask.
- PyTorch's own causal mask (``nn.Transformer.generate_square_subsequent_mask``) is a Python
  function that builds the mask from torch.full and torch.triu: the torch function mode of the
  kernel's guard sees only those, so the adapter watches for its code with a profile hook (the
  re-check's observer also recognises it by name). Calling it, or the course's reference, scores 0.
"""
from __future__ import annotations

import contextlib
import sys

import numpy as np
import torch
import torch.nn.modules.transformer as _transformer

from .. import given
from . import Exercise, Mistake, Test, case

# The source's mask for a sequence of 4 tokens, row by row (query t sees keys 0..t).
_NEG = float("-inf")
SEED_MASK_4 = (
    (0.0, _NEG, _NEG, _NEG),
    (0.0, 0.0, _NEG, _NEG),
    (0.0, 0.0, 0.0, _NEG),
    (0.0, 0.0, 0.0, 0.0),
)

FORBIDDEN = dict(torch_patterns=("generate_square_subsequent_mask",), pieces=("causal_mask",), what="the causal mask")

# ---------------------------------------------------------------- the adapter
_TORCH_MASK_CODES = {
    _transformer._generate_square_subsequent_mask.__code__,
    _transformer.Transformer.generate_square_subsequent_mask.__code__,
}
TORCH_MASK_MESSAGE = ("it calls torch.nn.Transformer.generate_square_subsequent_mask, PyTorch's own causal mask. This "
                      "exercise asks you to build the causal mask yourself from basic tensor operations, so this check "
                      "scores 0.")


@contextlib.contextmanager
def watch_torch_mask():
    """Record calls of PyTorch's causal-mask helpers, however the answer names them: a profile hook
    sees every Python call by its code object, so an alias is seen too. A hook already set (the
    re-check's observer) keeps running, and is set back afterwards."""
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


def _attend(x, W, mask):
    """Self-attention of the tokens x (B, T, d) with an additive mask: (output (B, T, d), weights (B, T, T)),
    PyTorch's own attention (``given.attention``: the attention exercise's answer is not written here)."""
    promoted = torch.promote_types(x.dtype, mask.dtype)
    if promoted != x.dtype:  # (added to the scores, the mask makes them promoted; the product with V then fails)
        raise RuntimeError(f"expected both operands to have the same dtype, but got {promoted} != {x.dtype}")
    return given.attention(x @ W[0], x @ W[1], x @ W[2], mask)


def adapter(fn, case):
    """The mask for ``case["T"]``; with tokens ``x`` and weights ``W`` in the case, instead the attention
    output and weights with that mask, and the outputs for ``changed`` (copies of x, the t-th with the
    tokens after position t replaced)."""
    T = int(case["T"])
    with watch_torch_mask() as hits:
        mask = fn(T)
    if hits:
        raise AssertionError(TORCH_MASK_MESSAGE)
    if "x" not in case:
        return {"mask": mask}
    if not isinstance(mask, torch.Tensor):
        raise AssertionError(f"causal_mask({T}) returned a {type(mask).__module__}.{type(mask).__name__}, not a "
                             "torch.Tensor: build it with torch operations.")
    try:
        output, weights = _attend(case["x"], case["W"], mask)
    except RuntimeError as err:
        B, T, _ = case["x"].shape
        hint = ""
        if tuple(mask.shape[-2:]) != (T, T):
            hint = f" The mask must have shape ({T}, {T}): one row and one column per token."
        elif mask.dtype != case["x"].dtype:
            hint = (f" Your mask is {mask.dtype}: added to {case['x'].dtype} scores it changes their dtype, and the product "
                    f"with the {case['x'].dtype} values then fails. Return a float32 mask.")
        raise AssertionError(f"the attention with your mask (shape {tuple(mask.shape)}, {mask.dtype}) added to scores of "
                             f"shape ({B}, {T}, {T}) raised RuntimeError: {err}.{hint}") from None
    changed = [_attend(x, case["W"], mask)[0] for x in case["changed"]]
    return {"output": output, "weights": weights,
            "outputs with the future changed": torch.stack(changed) if changed else output.new_zeros((0, *output.shape))}


# ---------------------------------------------------------------- typical mistakes
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


MASK_TESTS = frozenset({"test_seed_mask", "test_values"})
ALL = frozenset({"test_seed_mask", "test_shapes_and_dtype", "test_values", "test_no_peeking"})
MISTAKES = (
    Mistake("diagonal masked",
            "each position must see itself: keep 0 on the diagonal and put -inf only above it (triu with diagonal=1).",
            _diagonal_masked, MASK_TESTS | {"test_no_peeking"}),
    Mistake("one future position visible",
            "only the diagonal and what is below it may be 0; the entry just above the diagonal is already the future.",
            _one_future_visible, MASK_TESTS | {"test_no_peeking"}),
    Mistake("tril and triu swapped",
            "your mask hides the past and shows the future: -inf belongs above the diagonal "
            "(row t = the query at position t, column s = the key at position s, hidden when s > t).",
            _swapped, MASK_TESTS | {"test_no_peeking"}),
    Mistake("boolean mask instead of float",
            "the mask is added to the scores, so it must be a float tensor of 0 and -inf, not True/False.",
            _boolean, ALL),
    Mistake("0/1 mask instead of 0/-inf (1 = hidden)",
            "the mask is added to the scores: adding 1 barely changes a score. Use -inf where a position is hidden.",
            _zero_one_hidden, MASK_TESTS | {"test_no_peeking"}),
    Mistake("0/1 mask instead of 0/-inf (1 = visible)",
            "this mask would be multiplied, but it is added to the scores: use 0 where a position is visible "
            "and -inf where it is hidden.",
            _zero_one_visible, MASK_TESTS | {"test_no_peeking"}),
    Mistake("large negative number instead of -inf",
            "use float('-inf'): exp(-inf) is exactly 0 for any score, while a finite number only works as long "
            "as the scores stay small, and it turns a fully masked row into uniform weights instead of NaN.",
            _large_negative, MASK_TESTS),
    Mistake("-inf multiplied by a 0/1 matrix",
            "0 * -inf is NaN, not 0: build the mask with torch.full(..., float('-inf')) and triu, "
            "or with masked_fill, instead of multiplying by -inf.",
            _times_minus_inf, MASK_TESTS | {"test_no_peeking"}),
    Mistake("shape (T + 1, T + 1)", "the mask has one row and one column per token: shape (T, T).",
            _one_too_big, ALL),
    Mistake("extra leading dimension",
            "return a (T, T) matrix; broadcasting adds the batch and head dimensions when the mask is added to the "
            "scores.",
            _batch_dim, MASK_TESTS | {"test_shapes_and_dtype"}),
)


# ---------------------------------------------------------------- properties (plain data)
def _matrix(m: np.ndarray) -> str:
    """A small matrix written row by row, for messages."""
    cell = str if m.dtype == np.bool_ else (lambda v: f"{float(v):g}")
    return "\n".join("    [" + ", ".join(f"{cell(v):>6}" for v in row) + "]" for row in m)


def shape_and_dtype(case, out, want):
    """A (T, T) float32 tensor: the shape first, then a boolean or another float dtype, each with
    what to do about it (a result that is not an array is left to the comparison of types)."""
    got, T = out.get("mask"), int(case["T"])
    if got is None:
        return None
    if got.shape != (T, T):
        hint = ""
        if got.shape == (1, T, T):
            hint = " No batch dimension: broadcasting adds it when the mask is added to the scores."
        elif got.shape == (T + 1, T + 1):
            hint = " One row and one column per token: is there a T + 1 somewhere?"
        return f"the mask has shape {got.shape} but should have shape ({T}, {T}).{hint}"
    if got.dtype == np.bool_:
        return ("the mask is a boolean tensor; it must be a float tensor of 0 and -inf (boolean masks exist "
                "elsewhere, but this course's attention adds its mask to the scores).")
    if got.dtype != np.float32:
        return (f"the mask has dtype torch.{got.dtype.name} but should be torch.float32 (a float tensor, like "
                "torch.full's default).")
    return None


def exact_values(case, out, want):
    """Exactly 0 on and below the diagonal and exactly -inf above; says what the first wrong entry is
    (NaN, a large negative number instead of -inf, or an entry on the wrong side of the diagonal)."""
    got, right = out.get("mask"), want["mask"]
    if got is None or got.shape != right.shape or np.array_equal(got, right):
        return None
    g = got.astype(np.float64)
    T = right.shape[0]
    future = np.triu(np.ones((T, T), dtype=bool), 1)
    if np.isnan(g).any():
        i, j = (int(v) for v in np.argwhere(np.isnan(g))[0])
        return f"causal_mask({T})[{i}, {j}] is NaN: 0 * -inf is NaN, not 0."
    finite_future = future & np.isfinite(g) & (g < -1.0)
    if finite_future.any() and (g[~future] == 0).all():
        i, j = (int(v) for v in np.argwhere(finite_future)[0])
        return (f"causal_mask({T})[{i}, {j}] = {g[i, j]:g}: a large negative number, but not -inf. The contract asks for "
                "-inf: exp(-inf) is exactly 0 for any score, while a finite number is only small enough as long as the "
                "scores stay small.")
    wrong = np.argwhere(g != right.astype(np.float64))
    i, j = (int(v) for v in wrong[0])
    where = "above the diagonal (the future)" if j > i else ("on the diagonal" if i == j else "below the diagonal (the past)")
    should = (f"-inf: the query at position {i} must not see the key at position {j}" if j > i else
              f"0: the query at position {i} may see the key at position {j}")
    return f"causal_mask({T})[{i}, {j}] = {float(g[i, j])!r} {where} but should be {should}. {len(wrong)} of the {T * T} entries are wrong."


def exact_values_shown(case, out, want):
    """``exact_values``, and for a small mask both matrices, the answer's and the source's."""
    reason = exact_values(case, out, want)
    if reason and out["mask"].ndim == 2 and out["mask"].shape[0] <= 8:
        T = int(case["T"])
        whose = "The source's mask for 4 tokens" if T == 4 else f"The right mask for {T} tokens"
        reason += (f"\nYours:\n{_matrix(out['mask'])}\n{whose} (row t = query t, column s = key s):\n"
                   f"{_matrix(want['mask'])}")
    return reason


def finite_outputs(case, out, want):
    """Every position's attention output is finite: each row of the mask lets its query see something."""
    got = out.get("output")
    if got is None or got.shape != want["output"].shape or np.isfinite(got).all():
        return None
    bad = int(np.argwhere(~np.isfinite(got).all(-1))[0][1])
    return (f"with your mask, the attention output at position {bad} is not finite: its row of the mask hides every "
            "position (or holds NaN), so the softmax has nothing to attend to. Every position must at least see itself.")


def no_peeking(case, out, want):
    """Replacing the tokens after position t leaves the outputs at positions 0..t unchanged, for every t.
    With -inf above the diagonal they do not move at all; the tolerance (the dtype's atol) only absorbs
    rounding, while a future that leaks moves them by about 0.1."""
    from . import tolerance

    got, changed, weights = out.get("output"), out.get("outputs with the future changed"), out.get("weights")
    if got is None or changed is None or changed.shape != (got.shape[1] - 1, *got.shape):
        return None
    atol = tolerance(got.dtype.name)[0]
    for t in range(got.shape[1] - 1):
        moved = float(np.abs(changed[t][:, : t + 1].astype(np.float64) - got[:, : t + 1]).max())
        if not moved <= atol:
            peek = float(weights[:, : t + 1, t + 1:].max()) if weights is not None and weights.ndim == 3 else float("nan")
            return (f"with your mask, changing the tokens after position {t} changed the output at positions 0..{t} (by up "
                    f"to {moved:.3g}): earlier positions can see the future (the largest weight a position 0..{t} puts "
                    f"on a later one is {peek!r}; it must be exactly 0).")
    return None


# ---------------------------------------------------------------- the cases
def _peek(rng, B, T, d, dtype, label=None):
    """Tokens x (B, T, d), projections W (3, d, d) of scale 1/sqrt(d), and T - 1 copies of x, the t-th
    with new tokens after position t."""
    x = rng.standard_normal((B, T, d)).astype(dtype)
    W = (rng.standard_normal((3, d, d)) / np.sqrt(d)).astype(dtype)
    changed = np.repeat(x[None], max(T - 1, 0), axis=0)
    for t in range(T - 1):
        changed[t, :, t + 1:] = rng.standard_normal((B, T - t - 1, d)).astype(dtype)
    return case(label or f"for T = {T}, in the attention of {B} sequence{'s' if B > 1 else ''} of {dtype} tokens "
                         f"(d = {d}) with your mask added to the scores", "peek", T=T, x=x, W=W, changed=changed)


def _visible() -> tuple:
    return (
        case("for T = 4 (the chapter's mask)", "seed", T=4),
        *(case(f"for T = {T}", "shapes", T=T) for T in (1, 3, 7)),
        *(case(f"for T = {T}", "values", T=T) for T in (1, 6)),
        _peek(np.random.default_rng(17), 2, 5, 4, "float32"),
    )


def secret(rng: np.random.Generator) -> list:
    """The re-check's cases: the chapter's T = 4 and another small T (a typed-in 4 x 4 matrix earns
    nothing), shapes and values for sizes from 1 to 128, and the mask in attention on float32 and
    float64 tokens, from one token to 16."""
    other = int(rng.choice([2, 3, 5, 6, 7]))
    cases = [case(f"for T = {T}", "seed", T=T) for T in (4, other)]
    cases += [case(f"for T = {T}", "shapes", T=T)
              for T in (1, 2, 3, 5, 7, 8, 16, 33, 100, *(int(t) for t in rng.integers(8, 41, size=2)))]
    cases += [case(f"for T = {T}", "values", T=T) for T in (1, 2, 3, 5, 6, 9, 17, 32, 128, int(rng.integers(10, 33)))]
    for B, T, d, dtype in ((2, 5, 4, "float32"), (1, 1, 3, "float32"), (3, 8, 6, "float64"), (2, 12, 8, "float32"),
                           (1, int(rng.integers(9, 17)), 4, "float64")):
        cases.append(_peek(rng, B, T, d, dtype))
    return cases


EXERCISE = Exercise(
    name="causal_mask",
    piece="causal_mask",
    call="causal_mask(T)",
    adapter=adapter,
    reference="firstprinciples.reference:causal_mask",
    names={"mask": "causal_mask(T)", "outputs with the future changed": "the outputs with the future tokens changed"},
    visible=_visible(),
    secret=secret,
    tests={
        "test_seed_mask": Test(2, frozenset({"seed"}), first=(shape_and_dtype, exact_values_shown)),
        "test_shapes_and_dtype": Test(1, frozenset({"shapes"}), first=(shape_and_dtype,), values=False),
        "test_values": Test(2, frozenset({"values"}), first=(shape_and_dtype, exact_values)),
        "test_no_peeking": Test(3, frozenset({"peek"}), first=(finite_outputs, no_peeking)),
    },
    forbidden=FORBIDDEN,
    mistakes=MISTAKES,
)
