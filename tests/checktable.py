"""The harness shared by the table-driven check tests (tests/test_checks_*.py).

Each of those files holds a table: its checks (name -> check function), its
variants (name -> (answer, the set of check names it must fail)) and its
correct answers (name -> answer). The functions below turn such a table into
the standard tests. Each returns one pytest test function, parametrized so that
every variant, check or case keeps its own test id; a test file binds it to the
name pytest shows, for example::

    test_variant_fails_exactly_the_expected_checks = variants_test(CHECKS, VARIANTS)

Files with several exercise functions ("pieces") key their variants by
``(piece, name)`` and use the ``*_by_piece_test`` functions. The ``assert_*``
helpers are the assertions themselves, for a file's own tests.

A check fails the way a notebook test cell does: by raising any exception.
"""
from __future__ import annotations

import pytest

MIN_REJECTIONS = 5  # every check must reject at least this many variants


# ---------------------------------------------------------------- running checks
def outcome(check, fn):
    """(True, None) if ``check(fn)`` passes, else (False, the exception it raised)."""
    try:
        check(fn)
    except Exception as err:  # any exception fails a notebook test cell
        return False, err
    return True, None


def failed_checks(checks, fn):
    """The names of the checks that ``fn`` fails."""
    return {name for name, check in checks.items() if not outcome(check, fn)[0]}


# ---------------------------------------------------------------- assertions
def assert_passes(check, answer, what):
    ok, err = outcome(check, answer)
    assert ok, f"{what}: {err}"


def assert_fails_exactly(checks, fn, must_fail, what):
    failed = failed_checks(checks, fn)
    assert failed == must_fail, f"{what}: failed {sorted(failed)}, expected {sorted(must_fail)}"


def assert_rejected_by_enough(name, variants, what=None):
    """``variants``: name -> (answer, must fail); ``name`` must be in at least MIN_REJECTIONS of the sets."""
    rejected = [v for v, (_, fails) in variants.items() if name in fails]
    assert len(rejected) >= MIN_REJECTIONS, f"{what or name} rejects only {rejected}"


def assert_names_the_mistake(check, fn, label):
    ok, err = outcome(check, fn)
    assert not ok, f"the check accepts the mistake '{label}'"
    assert "typical mistake" in str(err) and label in str(err), str(err)


# ---------------------------------------------------------------- standard tests, one table
def expectations_test(*pairs):
    """Test: for each (expectations, mistakes) pair, the expectation table's keys are
    exactly the labels of the package's named mistakes."""

    def test():
        for expected, mistakes in pairs:
            assert set(expected) == {m.label for m in mistakes}

    return test


def correct_answers_test(checks, correct):
    """Test with ids ``check-answer``: every correct answer passes every check."""

    @pytest.mark.parametrize("answer", sorted(correct))
    @pytest.mark.parametrize("name", sorted(checks))
    def test(name, answer):
        assert_passes(checks[name], correct[answer], f"the correct answer '{answer}' fails {name}")

    return test


def variants_test(checks, variants):
    """Test with ids ``variant``: each variant fails exactly the checks its table entry names."""

    @pytest.mark.parametrize("variant", sorted(variants))
    def test(variant):
        fn, must_fail = variants[variant]
        assert_fails_exactly(checks, fn, must_fail, variant)

    return test


def rejections_test(checks, variants):
    """Test with ids ``check``: each check is expected to reject at least MIN_REJECTIONS variants."""

    @pytest.mark.parametrize("name", sorted(checks))
    def test(name):
        assert_rejected_by_enough(name, variants)

    return test


def naming_test(checks, variants, cases):
    """Test with ids ``label-check``: for each (label, check name) case, that check
    fails the named mistake and its message names it."""

    @pytest.mark.parametrize("label, check", cases)
    def test(label, check):
        assert_names_the_mistake(checks[check], variants[label][0], label)

    return test


def naming_test_for(check, variants, labels):
    """Test with ids ``label``: one check function fails each labelled mistake and names it."""

    @pytest.mark.parametrize("label", labels)
    def test(label):
        assert_names_the_mistake(check, variants[label][0], label)

    return test


# ---------------------------------------------------------------- standard tests, several pieces
# checks_of: piece -> (name -> check); variants: (piece, name) -> (answer, must fail).
def _by_piece(checks_of, keys):
    order = list(checks_of)
    return sorted(keys, key=lambda key: (order.index(key[0]), key[1:]))


def variants_by_piece_test(checks_of, variants):
    """Test with ids ``piece-variant``: each variant fails exactly the checks of its piece its entry names."""

    @pytest.mark.parametrize("piece, variant", _by_piece(checks_of, variants))
    def test(piece, variant):
        fn, must_fail = variants[(piece, variant)]
        assert_fails_exactly(checks_of[piece], fn, must_fail, f"{piece}, {variant}")

    return test


def rejections_by_piece_test(checks_of, variants):
    """Test with ids ``piece-check``: each check rejects at least MIN_REJECTIONS of its piece's variants."""

    @pytest.mark.parametrize("piece, name", [(piece, name) for piece in checks_of for name in sorted(checks_of[piece])])
    def test(piece, name):
        own = {v: entry for (p, v), entry in variants.items() if p == piece}
        assert_rejected_by_enough(name, own, f"{piece}.{name}")

    return test


def naming_by_piece_test(checks_of, variants, cases):
    """Test with ids ``piece-label-check``: as naming_test, for (piece, label, check name) cases."""

    @pytest.mark.parametrize("piece, label, check", cases)
    def test(piece, label, check):
        assert_names_the_mistake(checks_of[piece][check], variants[(piece, label)][0], label)

    return test


def outputs_variant(base, name, transform):
    """A wrong answer: module ``base`` whose ``forward`` returns each output through
    ``transform`` (for example ``torch.Tensor.detach``, or a cast)."""

    def forward(self, *args, **kwargs):
        return tuple(transform(t) for t in base.forward(self, *args, **kwargs))

    return type(name, (base,), {"forward": forward})


# The usual ways an otherwise right module loses its outputs' autograd, type or dtype.
OUTPUT_BREAKS = {
    "Detached": lambda t: t.detach(),
    "ReturnsNumpy": lambda t: t.detach().numpy(),
    "CastsToFloat32": lambda t: t.float(),
}


# ---------------------------------------------------------------- what the student reads
def assert_message(check, fn, fragments, what):
    """``check(fn)`` fails and its message contains every one of ``fragments``."""
    ok, err = outcome(check, fn)
    assert not ok, f"{what}: the check accepts it"
    text = str(err)
    missing = [f for f in fragments if f not in text]
    assert not missing, f"{what}: the message lacks {missing}:\n{text}"


def messages_test(checks, variants, rows):
    """Test with ids ``variant-check``: rows (variant, check name, fragments): the student's bug,
    the check that must fail on it, and what its message must say (every fragment, verbatim)."""

    @pytest.mark.parametrize("variant, check, fragments", rows, ids=[f"{v}-{c}" for v, c, _ in rows])
    def test(variant, check, fragments):
        assert_message(checks[check], variants[variant][0], fragments, f"{variant}, {check}")

    return test


def messages_by_piece_test(checks_of, variants, rows):
    """As messages_test, for rows (piece, variant, check name, fragments)."""

    @pytest.mark.parametrize("piece, variant, check, fragments", rows,
                             ids=[f"{p}-{v}-{c}" for p, v, c, _ in rows])
    def test(piece, variant, check, fragments):
        assert_message(checks_of[piece][check], variants[(piece, variant)][0], fragments, f"{piece}, {variant}, {check}")

    return test
