"""The one comparison of a result with its expected value, for both runners of a declaration.

Both sides compare *encoded* values (``wire``: exact type, dtype, shape, ``requires_grad`` and the
raw numbers): the test cell in the student's kernel encodes the answer's results and the
reference's before comparing, and the trusted grader reads the runner's report already encoded.
So a result passes or fails the same way in the notebook and in the re-check, by one rule:

1. the same type (a ``torch.Tensor``, not a NumPy array or a list), dtype and shape;
2. the same ``requires_grad`` (only where the test compares it: ``grad=True``);
3. NaN and infinities in the same places;
4. every finite entry within ``atol + rtol * |expected|``.

The message says what differs first. In the notebook (``show=True``) it names the entry and both
values; the re-check's inputs are secret, so there it says only by how much (``show=False``).
"""
from __future__ import annotations

import math

import numpy as np

from ..exercises import TOLERANCE, tolerance  # noqa: F401 (the defaults: data, with the declarations)
from . import wire


def _short(t: str) -> str:
    return {"torch.Tensor": "torch.Tensor", "numpy.ndarray": "NumPy array", "builtins.list": "list",
            "builtins.tuple": "tuple", "builtins.NoneType": "None"}.get(t, t.rsplit(".", 1)[-1])


def describe(d) -> str:
    """An encoded value in a few words: "a torch.Tensor of dtype float32 and shape (3, 3)"."""
    if not isinstance(d, dict):
        return "nothing"
    t = _short(str(d.get("type", "?")))
    if wire.is_array(d):
        return f"a {t} of dtype {d.get('dtype')} and shape {tuple(d.get('shape', ()))}"
    return "None" if t == "None" else f"a {t}"


def fmt(x: float) -> str:
    return "NaN" if x != x else f"{x:.6g}"


def compare(name: str, got, want: dict, *, context: str = "", tol: dict | None = None, values: bool = True,
            grad: bool = True, show: bool = True) -> str | None:
    """None when the encoded ``got`` matches the encoded ``want``; else what differs, as a sentence
    about ``name`` ("softmax(x)") in its ``context`` ("for x of shape (3, 3), float32").

    ``tol``: dtype name -> (atol, rtol), over the defaults. ``values=False`` compares only type,
    dtype, shape (and requires_grad): for a test of shapes or of a property. ``grad=False`` leaves
    requires_grad out. ``show``: name the entry and both values (never for secret inputs).
    """
    entry, name = name, f"{name} {context}".strip()
    if not isinstance(got, dict) or got.get("type") != want.get("type"):
        hint = ""
        if isinstance(got, dict) and wire.is_array(want) and _short(str(got.get("type"))) in ("NumPy array", "list"):
            hint = " Build it with torch operations (not NumPy, not Python lists)."
        return f"{name} is {describe(got)}, but should be {describe(want)}.{hint}"
    if wire.is_array(want):
        return _arrays(name, entry, got, want, tol, values, grad, show)
    if "items" in want:
        items = got.get("items")
        if not isinstance(items, list) or len(items) != len(want["items"]):
            n = len(items) if isinstance(items, list) else "no"
            return f"{name} has {n} items, but should have {len(want['items'])}."
        if want.get("keys") is not None and got.get("keys") != want["keys"]:
            return f"{name} has keys {got.get('keys')}, but should have {want['keys']}."
        for i, (g, w) in enumerate(zip(items, want["items"])):
            reason = compare(f"{entry}[{i}]", g, w, context=context, tol=tol, values=values, grad=grad, show=show)
            if reason:
                return reason
        return None
    if not values:
        return None
    gv, wv = wire.scalar(got), wire.scalar(want)
    if isinstance(wv, float) and isinstance(gv, float):
        if math.isclose(gv, wv, rel_tol=1e-8, abs_tol=1e-10) or (math.isnan(gv) and math.isnan(wv)):
            return None
    elif gv == wv:
        return None
    return f"{name} is {gv!r}, but should be {wv!r}." if show else f"{name} differs from the reference."


def _arrays(name, entry, got, want, tol, values, grad, show) -> str | None:
    if not wire.is_array(got):
        return f"{name} holds no data."
    if got.get("dtype") != want["dtype"]:
        return f"{name} has dtype {got.get('dtype')}, but should keep the input's dtype {want['dtype']}."
    if list(got.get("shape", [])) != list(want["shape"]):
        return f"{name} has shape {tuple(got.get('shape', []))}, but should have shape {tuple(want['shape'])}."
    if grad and bool(got.get("requires_grad")) != bool(want.get("requires_grad")):
        if want.get("requires_grad"):
            return (f"{name} has requires_grad=False although its inputs require grad: gradients cannot flow "
                    "back. Avoid .detach(), .numpy(), .item(), torch.tensor(...) of results and torch.no_grad() "
                    "inside it.")
        return f"{name} has requires_grad=True, but none of its inputs requires grad."
    if not values:
        return None
    try:
        g = wire.array(got)
    except wire.WireError as e:
        return f"{name}: {e}"
    w = wire.array(want)
    if w.dtype.kind not in "fc":
        if np.array_equal(g, w):
            return None
        if not show:
            return f"{name} differs from the reference."
        idx = tuple(int(i) for i in np.argwhere(g != w)[0])
        return f"{name} is wrong: {entry}{list(idx)} = {g[idx]!r} but should be {w[idx]!r}."
    g64, w64 = g.astype(np.float64), w.astype(np.float64)
    bad = ~np.isfinite(g64) & np.isfinite(w64)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        at = f": {entry}{list(idx)} = {fmt(g64[idx])} where {fmt(w64[idx])} was expected" if show else ""
        nan = int(np.isnan(g64[bad]).sum())
        return (f"{name} has a non-finite entry{at} ({nan} NaN and {int(bad.sum()) - nan} infinite where finite "
                "values were expected). Look for overflow in exp() or for -inf reaching a place it should not.")
    if not np.array_equal(np.isnan(g64), np.isnan(w64)) or not np.array_equal(
            np.isinf(g64) * np.sign(np.nan_to_num(g64)), np.isinf(w64) * np.sign(np.nan_to_num(w64))):
        idx = tuple(int(i) for i in np.argwhere(~np.isfinite(w64) & (np.nan_to_num(g64, nan=0.5) != np.nan_to_num(w64, nan=0.5)))[0])
        at = f": {entry}{list(idx)} = {fmt(g64[idx])}, but should be {fmt(w64[idx])}" if show else ""
        return f"{name} is finite where it should be NaN or infinite{at}."
    atol, rtol = tolerance(want["dtype"], tol)
    finite = np.isfinite(w64)
    err = np.where(finite, np.abs(g64 - np.where(finite, w64, 0.0)), 0.0)
    excess = err - (atol + rtol * np.abs(np.where(finite, w64, 0.0)))
    if not err.size or excess.max() <= 0:
        return None
    if not show:
        return f"{name} differs from the reference by up to {fmt(err.max())} (allowed: {atol:g} + {rtol:g}·|reference|)."
    idx = tuple(int(i) for i in np.argwhere(excess == excess.max())[0])
    return (f"{name} is wrong: {entry}{list(idx)} = {fmt(g64[idx])} but should be {fmt(w64[idx])} "
            f"(off by {fmt(err[idx])}; tolerance atol={atol:g}, rtol={rtol:g}). "
            f"Largest difference over all entries: {fmt(err.max())}.")


def same(got: dict, want: dict, tol: dict | None = None) -> bool:
    """Whether two encoded results agree by ``compare`` (values, within the tolerance; requires_grad
    left out): used to tell which named mistake an answer's results are."""
    return compare("", got, want, tol=tol, grad=False) is None
