"""The two runners of a declaration (``firstprinciples.exercises``), and the judgement they share.

- In the student's kernel, a test cell is one line, ``check("test_dims", softmax)``
  (``check_for(assignment)`` makes ``check``): it runs the test's *visible* cases through the
  declaration's adapter, under the guard that refuses the built-ins the piece must not call,
  computes the reference's results beside them, and fails with a message that names the case,
  the entry and, when the answer's results are those of a declared mistake, the mistake.
- In the trusted grader, the re-check's runner calls the piece on the *secret* cases through the
  same adapter and reports plain data; ``judge`` below decides there, with the same comparison
  (``compare``), the same tolerances, properties and mistakes, but without showing values.

``judge(exercise, test, case, got, want)`` is that shared decision: ``got`` and ``want`` are the
encoded results (``wire``) of the answer and of the reference on ``case``.
"""
from __future__ import annotations

import numpy as np

from .. import exercises
from . import compare, wire

AFTER = " after the call"  # the adapters' name for an input as it is after the call
EXACT = {dtype: (0.0, 0.0) for dtype in compare.TOLERANCE}  # inputs after the call: unchanged, exactly


def plain_case(case: dict) -> dict:
    return {k: exercises.plain(v) for k, v in case.items()}


def _arrays(encoded: dict) -> dict:
    """Encoded results as the properties get them: arrays as NumPy arrays (a stored structure without
    data, ``stored_form``, left out), and numbers, strings and flags as themselves (a module's
    structure, reported as plain data); None and nested values left out."""
    out = {}
    for k, v in encoded.items():
        if wire.is_array(v):
            if v["data"] is not None:
                out[k] = wire.array(v)
        elif isinstance(v, dict) and "items" not in v and wire.scalar(v) is not None:
            out[k] = wire.scalar(v)
    return out


def _structure(encoded: dict) -> dict:
    """An encoded result without its numbers: type, dtype and shape (``data`` None), items alike."""
    if wire.is_array(encoded):
        return {**encoded, "data": None}
    if isinstance(encoded.get("items"), list):
        return {**encoded, "items": [_structure(e) for e in encoded["items"]]}
    return encoded


def stored_form(exercise, grade_id: str, case: dict, results: dict) -> dict:
    """The reference's results on a visible case, encoded as they are stored (``grading.store``),
    with only what the test judges: an input left as it was is ``{"input": name}`` (the case holds
    it), and for a test declared ``structure_only`` arrays keep their type, dtype and shape only. ``unstored`` gives the full results back."""
    inputs = tensors(case)
    out = {}
    for key, value in results.items():
        encoded = wire.encode(value)
        name = key[: -len(AFTER)]
        if key.endswith(AFTER) and name in inputs and encoded == wire.encode(inputs[name]):
            encoded = {"input": name}
        elif exercise.tests[grade_id].structure_only:
            encoded = _structure(encoded)
        out[key] = encoded
    return out


def unstored(case: dict, want: dict) -> dict:
    """Stored results (``stored_form``) as the judgement takes them: each input named, encoded."""
    inputs = tensors(case)
    return {k: wire.encode(inputs[v["input"]]) if isinstance(v, dict) and set(v) == {"input"} else v
            for k, v in want.items()}


def stored_by_label(exercise) -> dict:
    """Visible case label -> the reference's stored results on it (``unstored``), from whichever of the
    piece's tests stores it in full (a test declared ``structure_only`` keeps type and shape only): the
    re-check of a student bundle, which has stored results and no reference, judges these cases."""
    from ..exercises import expected

    stored = (expected.stored(exercise.name) or {}).get(exercise.piece) or {}
    out, full = {}, set()
    for gid, wants in stored.items():
        if gid not in exercise.tests:
            continue
        whole = not exercise.tests[gid].structure_only
        for case, want in zip(exercise.cases(gid), wants):
            label = case["label"]
            if label not in out or (whole and label not in full):
                out[label] = unstored(case, want)
                if whole:
                    full.add(label)
    return out


def _decoded(d):
    """An encoded value as plain data: an array, a tuple, list or dict of plain data, or a scalar."""
    if wire.is_array(d):
        return wire.array(d)
    if isinstance(d, dict) and "items" in d:
        items = [_decoded(v) for v in d["items"]]
        if d.get("keys") is not None:
            return dict(zip(d["keys"], items))
        return tuple(items) if d.get("type") == "builtins.tuple" else items
    return wire.scalar(d) if isinstance(d, dict) else None


def _for_properties(encoded: dict, want: dict) -> dict:
    """What a property reads: the arrays by name and, where the reference's result is not an array
    (a module's structure, reported as plain data: names, shapes, counts), the plain value."""
    out = _arrays(encoded)
    for k, v in encoded.items():
        if k not in out and k in want and not wire.is_array(want[k]):
            out[k] = _decoded(v)
    return out


def judge(exercise, test, case: dict, got: dict, want: dict | None, *, show: bool = True) -> str | None:
    """Why the answer's encoded results ``got`` fail ``test`` on ``case`` (None: they pass).
    ``show``: messages may name entries and values (the visible cases; never the secret ones).
    ``want`` None: the piece has no reference (``Exercise.reference`` ""), its properties alone judge."""
    label = case.get("label", "")
    if want is None:
        plain = {**plain_case(case), "show": show}
        for prop in (*test.first, *test.then):
            reason = prop(plain, _for_properties(got, got), {})
            if reason:
                return f"{exercise.call} {label}: {reason}"
        return None
    if set(got) != set(want):
        if set(got) == {"returned"}:
            return f"{exercise.call} {label} returned {compare.describe(got['returned'])}, not what was asked."
        return f"{exercise.call} {label} gave {', '.join(sorted(got)) or 'nothing'}, expected {', '.join(sorted(want))}."
    plain = {**plain_case(case), "show": show}  # (a property may name values only where ``show``)
    for key in want:  # an input must be left as it was, whatever the test
        if key.endswith(AFTER) and compare.compare(key, got[key], want[key], tol=EXACT, grad=False):
            which = key[: -len(AFTER)]
            return (f"{exercise.call} {label} modified its input {which} in place. Build new tensors instead "
                    f"(for example `x = x / s` rather than `x /= s` or `x.div_(s)`).")
    # (decoded only when a property needs them)
    properties = lambda: (_for_properties(got, want), _for_properties(want, want))  # noqa: E731
    for prop in test.first:
        reason = prop(plain, *properties())
        if reason:
            return f"{exercise.call} {label}: {reason}"
    for key in want:
        if key.endswith(AFTER):
            continue
        tol = exercise.tolerance(plain, key) if exercise.tolerance is not None else None
        reason = compare.compare(exercise.named(key), got[key], want[key], context=label, tol=tol,
                                 values=test.values, show=show)
        if reason:
            return reason
    for prop in test.then:
        reason = prop(plain, *properties())
        if reason:
            return f"{exercise.call} {label}: {reason}"
    return None


def _call(exercise, fn, case: dict, namespace: dict | None):
    """The adapter on ``fn`` and a case's tensors; with the notebook objects it needs, where given."""
    if namespace is not None:
        return exercise.adapter(fn, tensors(case), namespace)
    return exercise.adapter(fn, tensors(case))


def _results(fn, exercise, case: dict, namespace: dict | None = None):
    """``fn``'s encoded results on ``case`` through the adapter (None if it raises)."""
    try:
        return {k: wire.encode(v) for k, v in _call(exercise, fn, case, namespace).items()}
    except Exception:
        return None


def diagnose(exercise, case: dict, got: dict, want: dict | None, namespace: dict | None = None) -> list:
    """The declared mistakes whose results on ``case`` are the answer's (and, where there is a
    reference, not the reference's). ``namespace``: the notebook objects the adapter needs, the same
    as the answer's (the trained model whose decoding a mistake is)."""
    from ..exercises import expected

    kept = expected.mistakes(exercise.name) if exercise.reference else None  # (a student bundle's)
    if kept is not None:
        kept = kept.get(exercise.piece, {}).get(case.get("label"), {})
    found = []
    for m in exercise.mistakes:
        theirs = _results(m.fn, exercise, case, namespace) if kept is None else kept.get(m.label)
        if theirs is None or set(theirs) != set(got):
            continue
        keys = [k for k in got if not k.endswith(AFTER)]
        tol = lambda k: exercise.tolerance(plain_case(case), k) if exercise.tolerance else None  # noqa: E731
        if all(compare.same(got[k], theirs[k], tol(k)) for k in keys) and \
                (want is None or not all(compare.same(want[k], theirs[k], tol(k)) for k in keys)):
            found.append(m)
    return found


def named(mistakes: list, lead: str = "Your output matches", said: str = "") -> str:
    """The lines that name ``mistakes`` after a message (``said``: a mistake whose hint the message
    already gives is not repeated)."""
    mistakes = [m for m in mistakes if m.hint not in said]
    if not mistakes:
        return ""
    return f"\n{lead} a typical mistake:\n" + "\n".join(f"  - {m.label}: {m.hint}" for m in mistakes)


def tensors(case: dict) -> dict:
    """A case's inputs as the adapters take them: arrays become torch tensors (copies)."""
    import torch

    return {k: torch.from_numpy(np.array(v)) if isinstance(v, np.ndarray) else v
            for k, v in case.items() if k not in ("label", "tags")}


# ---------------------------------------------------------------- the kernel's runner
def run_test(exercise, grade_id: str, piece) -> None:
    """Run one test's visible cases on ``piece`` in this process; raise AssertionError with the
    student's message on the first failure."""
    from ..guard import ForbiddenCall, call_without
    from ..checks._student import describe

    from ..exercises import expected

    test = exercise.tests[grade_id]  # (a KeyError names the test that is not there)
    cases = exercise.cases(grade_id)
    # the reference's results, stored as data (the kernel needs no implementation of the piece); where
    # none are stored (a declaration being written), computed here with the reference; a piece without
    # a reference (a trained model) is judged by its test's properties alone
    stored = ((expected.stored(exercise.name) or {}).get(exercise.piece) or {}).get(grade_id)
    if not exercise.reference:
        stored = [None] * len(cases)
    elif not isinstance(stored, list) or len(stored) != len(cases):
        reference = exercise.reference_piece()
        stored = [{k: wire.encode(v) for k, v in exercise.adapter(reference, tensors(case)).items()} for case in cases]
    # a piece without a reference is judged with the notebook's objects it needs (the trained model a
    # decoder decodes), looked up once where the piece was defined and handed to the declared mistakes
    # too; the other pieces' adapters look them up themselves
    namespace = None
    if exercise.needs and not exercise.reference:
        found = exercises.globals_of(piece)
        namespace = {n: found[n] for n in exercise.needs if n in found}
    for case, want in zip(cases, stored):
        want = None if want is None else unstored(case, want)
        try:
            out = call_without(_call, (exercise, piece, case, namespace), **exercise.forbidden)
        except ForbiddenCall:
            raise
        except AssertionError as err:  # the adapter's own finding (no gradient path, say)
            raise AssertionError(f"{exercise.call} {case['label']}: {err}") from None
        except Exception as err:
            text = str(err)
            extra = "".join(f" {hint}" for pattern, hint in exercise.hints if pattern in text)
            raise AssertionError(f"{exercise.call} {case['label']} {describe(err)}{extra}") from None
        got = {k: wire.encode(v) for k, v in out.items()}
        reason = judge(exercise, test, case, got, want, show=True)
        if reason:
            raise AssertionError(reason + named(diagnose(exercise, case, got, want, namespace), said=reason))
        if test.says is not None:
            print(test.says(plain_case(case), _for_properties(got, got)))


def check_for(assignment: str):
    """The ``check(grade_id, piece)`` of a notebook's test cells, for one declared assignment."""
    from ..checks._student import student_facing

    declared = {gid: exercise for exercise in exercises.pieces(assignment) for gid in exercise.tests}

    def check(grade_id: str, piece) -> None:
        if grade_id not in declared:
            raise KeyError(f"{assignment} has no test {grade_id!r}: its tests are {', '.join(declared)}")
        run_test(declared[grade_id], grade_id, piece)

    check.__doc__ = f"Run one test of {assignment} on your code (its visible cases): check(grade_id, piece)."
    return student_facing(check)
