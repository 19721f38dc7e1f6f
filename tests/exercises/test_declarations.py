"""The generic harness: every declared exercise (``firstprinciples.exercises``), through both runners.

For each declared piece, with its answers table (``tests/exercises/<assignment>_answers.py``: unusual
correct answers, and wrong answers that no declared mistake names; for an assignment of several
pieces the table sets ``PIECES = True`` and keys ``CORRECT`` and ``WRONG`` by piece):

- the declaration matches its notebook: the same test cells, points and one-line calls, and every
  test has cases in the notebook and in the re-check;
- the reference, written as a student would, passes every test in the kernel (visible cases) and in
  the trusted re-check (secret cases, several seeds); so does every extra correct answer;
- every declared mistake fails exactly the test cells it declares, in the kernel (and its message
  names it there, unless the answer raised) and in the re-check (``fails`` and ``hidden``);
- every wrong answer of the table fails exactly its cells, in the kernel and in the re-check;
- every test rejects at least five wrong answers.

The re-check runs in this process (``trusted.local_verdicts``: the same watch, wire format and
judgement as the grader's runner), on seeds 0, 1 and 2. The correct answers, the mistakes and the
wrong answers run in files of their own (``test_harness_*.py``, helpers in ``harness.py``), so that
the suite's workers (a test file each) share the harness.
"""
from __future__ import annotations

import re

import pytest

from course import SOLUTIONS, as_student_code, nbgrader_meta
from exercises.harness import MIN_REJECTIONS, SEEDS, _params, answers, kernel_failures, notebook, recheck_failures
from firstprinciples import exercises


@pytest.mark.parametrize("name", exercises.NAMES)
def test_each_declaration_is_named_as_its_assignment_and_covers_its_notebook(name):
    assert (SOLUTIONS / name).is_dir(), f"firstprinciples/exercises/{name}.py has no solutions/{name}/"
    cells = {nbgrader_meta(c)["grade_id"] for c in notebook(name).cells
             if nbgrader_meta(c).get("grade") and not nbgrader_meta(c).get("solution")}
    declared_tests = [gid for ex in exercises.pieces(name) for gid in ex.tests]
    assert sorted(declared_tests) == sorted(cells), "every test cell declared once, by one piece"


@pytest.mark.parametrize("exercise", _params("exercise"))
def test_the_declaration_matches_its_notebook(exercise):
    cells = {nbgrader_meta(c)["grade_id"]: c for c in notebook(exercise.name).cells
             if nbgrader_meta(c).get("grade") and not nbgrader_meta(c).get("solution")}
    for gid, test in exercise.tests.items():
        meta, source = nbgrader_meta(cells[gid]), cells[gid].source
        assert meta["points"] == test.points, gid
        code = [ln for ln in source.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
        assert code == [f'check("{gid}", {exercise.piece})'], (gid, code)
        said = re.match(r"# (\d+) points?:", source)
        assert said and int(said.group(1)) == test.points, f"{gid}: the comment students read says {said and said.group(1)}"
        assert exercise.cases(gid), f"{gid} has no visible case"
        for seed in SEEDS:
            import numpy as np

            assert exercise.cases(gid, "secret", np.random.default_rng(seed)), f"{gid} has no secret case"
    for m in exercise.mistakes:
        assert (m.fails | m.hidden) <= set(exercise.tests) and m.missed <= m.fails, m.label


@pytest.mark.parametrize("exercise", [p for p in _params("exercise") if p.values[0].recap_of])
def test_a_recap_is_judged_as_its_exercise_judges_it(exercise):
    """A recap cell is re-checked by its exercise's probe (one per piece): the exercise declares the
    same grade_id, in its own notebook or as ``elsewhere``, with the same cases."""
    source = exercises.by_piece()[exercise.piece]
    assert source.name == exercise.recap_of
    for gid, test in exercise.tests.items():
        theirs = {**source.elsewhere, **source.tests}.get(gid)
        assert theirs is not None, f"{source.name} does not declare {gid} (add it to its elsewhere)"
        assert (theirs.tags, theirs.first, theirs.then, theirs.values) == (test.tags, test.first, test.then, test.values), gid


@pytest.mark.parametrize("exercise", _params("exercise"))
@pytest.mark.parametrize("seed", SEEDS)
def test_the_reference_passes_both_runners(exercise, seed):
    piece = as_student_code(exercise.reference_piece())
    if seed == SEEDS[0]:
        assert kernel_failures(exercise, piece) == {}
    assert recheck_failures(exercise, piece, seed) == {}


@pytest.mark.parametrize("exercise", _params("exercise"))
def test_every_test_rejects_enough_wrong_answers(exercise):
    table = answers(exercise.name)
    wrong = table.WRONG.get(exercise.piece, {}) if hasattr(table, "PIECES") else table.WRONG
    for gid in exercise.tests:
        rejected = [m.label for m in exercise.mistakes if gid in m.fails | m.hidden]
        rejected += [label for label, (_, k, r) in wrong.items() if gid in set(k) | set(r)]
        assert len(rejected) >= MIN_REJECTIONS, f"{gid} rejects only {rejected}"


@pytest.mark.parametrize("name", exercises.NAMES)
def test_the_stored_expected_results_are_the_references(name):
    """The notebook's checks compare with stored results (``exercises.expected``): they are the
    reference's today, within the comparison's tolerance (another CPU may round a float32 sum
    otherwise), case by case."""
    from firstprinciples.exercises import expected
    from firstprinciples.grading import compare, store

    stored = expected.stored(name)
    assert stored is not None, f"no stored results: python -m firstprinciples.grading.store {name}"
    now = store.compute(name)
    declared_pieces = {e.piece: e for e in exercises.pieces(name) if e.reference}
    assert sorted(stored) == sorted(now), "regenerate: python -m firstprinciples.grading.store"
    for piece, tests in now.items():
        assert sorted(stored[piece]) == sorted(tests), piece
        for gid, cases in tests.items():
            assert len(stored[piece][gid]) == len(cases), (piece, gid)
            for i, (old, new) in enumerate(zip(stored[piece][gid], cases)):
                assert sorted(old) == sorted(new), (piece, gid, i)
                for key in new:
                    values = not declared_pieces[piece].tests[gid].structure_only  # (stored without numbers)
                    why = compare.compare(key, old[key], new[key], values=values)
                    assert why is None, f"{piece} {gid} case {i}: {why} (python -m firstprinciples.grading.store)"


NO_REFERENCE = r'''
import importlib, importlib.abc, sys
import firstprinciples
name = sys.argv[1]
table = importlib.import_module(f"exercises.{name}_answers")  # (its answers are made with the reference: first)
for module in [m for m in sys.modules if m.startswith("firstprinciples.reference")]:
    del sys.modules[module]
if hasattr(firstprinciples, "reference"):
    del firstprinciples.reference
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, module, path=None, target=None):
        if module.startswith("firstprinciples.reference"):
            raise ImportError("no reference here")
sys.meta_path.insert(0, Refuse())
from firstprinciples import exercises
from firstprinciples.grading.declared import check_for
for exercise in [e for e in exercises.pieces(name) if e.reference]:  # (a trained model: test_capstone_trained.py)
    correct = table.CORRECT.get(exercise.piece, {}) if hasattr(table, "PIECES") else table.CORRECT
    for gid in exercise.tests:
        for answer in correct.values():
            check_for(name)(gid, answer)
assert "firstprinciples.reference" not in sys.modules
print("passed without the reference")
'''


@pytest.mark.parametrize("name", exercises.NAMES)
def test_the_notebooks_checks_need_no_reference(name, tmp_path):
    """What a student's kernel runs for a declared exercise (``check``) passes the correct answers in
    a process where the course's reference cannot be imported: the expected results are data."""
    import os
    import subprocess
    import sys

    from course import ROOT

    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    out = subprocess.run([sys.executable, "-c", NO_REFERENCE, name], capture_output=True, text=True, timeout=300,
                         env=env, cwd=tmp_path)
    assert out.returncode == 0 and "passed without the reference" in out.stdout, out.stderr[-3000:]
