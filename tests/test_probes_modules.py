"""The trusted re-check of the transformer-block and KV-cache pieces agrees with their checks.

For each piece: every correct answer and every variant of the matching table
(tests/test_checks_block.py, _kv_cache) gets, per test cell, the
trusted verdict its checks give (the cell -> check names maps below are read
off the notebooks' test cells). The later notebooks' 1-point recap cells are
covered too, in the notebook where they appear: they have grade_ids of their
own (``recap_feed_forward``, ``recap_kv_cache``, ...) and the re-check grades them as leniently as their
visible checks, with no difference.
"""
from __future__ import annotations

import functools

import nbformat
import pytest
from course import SOLUTIONS
from probetable import agreement_test

import test_checks_block as Bk
import test_checks_kv_cache as C
from firstprinciples import reference
from firstprinciples.grading import trusted, wire
from firstprinciples.grading.runtime import report

BLOCK_NB = "transformer_block/transformer_block.ipynb"
KV_NB = "kv_cache/kv_cache.ipynb"
CAPSTONE_NB = "capstone/capstone.ipynb"

# ====================================================================== FeedForward, TransformerBlock
FFN_ALL = {"ffn_structure", "ffn_values", "ffn_values_visible", "ffn_grads"}
FFN_CORRECT = {"independent": Bk.GoodFFN, "nn.Sequential": Bk.FFNSequential}
test_ffn_agrees = agreement_test(BLOCK_NB, "FeedForward", {"test_feed_forward": FFN_ALL}, FFN_CORRECT,
                                 Bk.FFN_VARIANTS, {})
test_ffn_recap_agrees = agreement_test(
    CAPSTONE_NB, "FeedForward", {"recap_feed_forward": {"ffn_values_visible"}}, FFN_CORRECT, Bk.FFN_VARIANTS, {})

BLOCK_CELLS = {
    "test_block_structure": {"structure"},
    "test_block_against_reference": {"reference", "reference_visible"},
    "test_block_causal": {"causal"},
    "test_block_dropout": {"dropout"},
    "test_block_gradients_and_inputs": {"grads", "grads_visible"},
}
BLOCK_CORRECT = {"independent": Bk.GoodBlock, "nn.Dropout submodule": Bk.SeedStyleDropoutModule}
test_block_agrees = agreement_test(BLOCK_NB, "TransformerBlock", BLOCK_CELLS, BLOCK_CORRECT, Bk.BLOCK_VARIANTS, {})
test_block_recap_agrees = agreement_test(
    CAPSTONE_NB, "TransformerBlock", {"test_transformer_block": {"reference_visible"}}, BLOCK_CORRECT,
    Bk.BLOCK_VARIANTS, {})


# ====================================================================== KVCache, cached_attention_step, generate
def _piece(piece):
    return {name: entry for (p, name), entry in C.VARIANTS.items() if p == piece}


CACHE_VARIANTS, STEP_VARIANTS, GENERATE_VARIANTS = (_piece(p) for p in C.PIECES)
test_kv_cache_agrees = agreement_test(KV_NB, "KVCache", {"test_kv_cache": {"cache", "cache_grads"}},
                                      C.CORRECT["KVCache"], CACHE_VARIANTS, {})
test_cached_attention_step_agrees = agreement_test(
    KV_NB, "cached_attention_step",
    {"test_one_token_at_a_time": {"one_token"}, "test_prompt_then_tokens": {"prompt"},
     "test_step_gradients": {"step_grads"}},
    C.CORRECT["cached_attention_step"], STEP_VARIANTS, {})
test_generate_agrees = agreement_test(KV_NB, "generate", {"test_generate": {"generate"}}, C.CORRECT["generate"],
                                      GENERATE_VARIANTS, {})
test_capstone_step_agrees = agreement_test(
    CAPSTONE_NB, "cached_attention_step", {"test_cached_attention_step": {"one_token"}},
    C.CORRECT["cached_attention_step"], STEP_VARIANTS, {})
test_capstone_kv_cache_agrees = agreement_test(
    CAPSTONE_NB, "KVCache", {"recap_kv_cache": {"cache_visible"}}, C.CORRECT["KVCache"], CACHE_VARIANTS, {})


# ====================================================================== the capstone's cells that use a piece as a part
@functools.lru_cache(maxsize=None)
def _check(notebook, name, seed):
    """The trusted re-check of ``name`` in ``notebook`` (it keeps the reference's results once computed)."""
    plan = trusted.make_plan(nbformat.read(SOLUTIONS / notebook, as_version=4), seed)
    return next(c for c in plan.checks if c.name == name)


def _reason(notebook, name, answer, grade_id, seed=0):
    """The trusted reason (or None) for ``grade_id`` from ``name``'s probe alone, for ``answer``
    (the notebook's other objects, which those cells also name, are left out)."""
    check = _check(notebook, name, seed)
    found = trusted.outcome(check, wire.loads(wire.dumps(report({name: answer}, name, check.cases))))
    return found.reason(check, check.probe.cells[grade_id])


TYPE_ONLY = ("test_model_structure", "test_trained", "test_resolves_it")


@pytest.mark.parametrize("name", sorted(Bk.BLOCK_VARIANTS))
def test_block_as_a_type_is_not_rechecked(name):
    """test_model_structure, test_trained and test_resolves_it pass TransformerBlock along as a
    type: its probe never fails them (the model's probe re-checks what they grade)."""
    answer = Bk.BLOCK_VARIANTS[name][0]
    for grade_id in TYPE_ONLY:
        assert _reason(CAPSTONE_NB, "TransformerBlock", answer, grade_id) is None, (name, grade_id)
    assert _reason(CAPSTONE_NB, "TransformerBlock", answer, "test_transformer_block") is not None or (
        "reference_visible" not in Bk.BLOCK_VARIANTS[name][1])


# A cache that cached generation can use: what append returns is right (len, gradients and
# the inputs left untouched are not what test_generate_cached / test_generate_trained grade).
CACHE_USABLE = {"detached", "len counts appends", "modifies its inputs", "len of an empty cache fails"}


@pytest.mark.parametrize("name", sorted(CACHE_VARIANTS) + sorted(f"correct:{n}" for n in C.CORRECT["KVCache"]))
def test_cache_as_a_part_of_cached_generation(name):
    answer = C.CORRECT["KVCache"][name[8:]] if name.startswith("correct:") else CACHE_VARIANTS[name][0]
    usable = name.startswith("correct:") or name in CACHE_USABLE
    for grade_id in ("test_generate_cached", "test_generate_trained"):
        reason = _reason(CAPSTONE_NB, "KVCache", answer, grade_id)
        assert (reason is None) == usable, (name, grade_id, reason)


# ====================================================================== the student's own KVCache, handed to the step
from probetable import SEEDS, trusted_failures  # noqa: E402

KV_CELLS = ("test_kv_cache", "test_one_token_at_a_time", "test_prompt_then_tokens", "test_step_gradients",
            "test_generate")
STEP_CELLS = ("test_one_token_at_a_time", "test_prompt_then_tokens", "test_step_gradients")


@pytest.mark.parametrize("seed", SEEDS)
def test_honest_notebook_with_cache_helpers_passes_the_re_check(seed):
    """A step that calls helper methods of the notebook's own KVCache (extend, keys_and_values) gets every
    test cell from the re-check, as from the checks (tests/test_checks_kv_cache.py: 11/11)."""
    assert trusted_failures(KV_NB, C.notebook(), seed, KV_CELLS) == set()


def test_the_step_probe_takes_the_cache_from_the_namespace():
    """The probe ``needs`` KVCache: given the notebook's namespace (the runner's third argument) it uses
    that class, even for a step defined elsewhere; without it (and none in the step's globals) the course's,
    on which a step using the helpers raises. The reference side gets ``reference_namespace``."""
    import numpy as np

    from firstprinciples.grading import probes

    probe = probes.load()["cached_attention_step"]
    assert probe.needs == ("KVCache",)
    assert probes.reference_namespace(probe) == {"KVCache": reference.KVCache}
    assert probes.needed(probe, {"KVCache": C.HelperCache, "x": 1}) == {"KVCache": C.HelperCache}
    ref_ns = probes.reference_namespace(probe)
    for enc in (probes.encode_case(c) for c in probe.cases(np.random.default_rng(3))):
        case = probes.decode_case(enc)
        with pytest.raises(AttributeError):
            probe.run(C.helper_step, case)
        got = probe.run(C.helper_step, probes.decode_case(enc), {"KVCache": C.HelperCache})
        want = probe.run(probe.reference, probes.decode_case(enc), ref_ns)
        assert set(got) == set(want)
        for key in want:
            reason = trusted.compare(wire.encode(got[key]), wire.encode(want[key]), key, probe.tolerance)
            assert reason is None, (wire.scalar(enc["label"]), reason)


@pytest.mark.parametrize("broken", sorted(C.BROKEN_CACHES))
def test_a_broken_cache_of_the_students_leaves_the_step_re_checked_on_its_own(broken):
    """As in the checks: a correct step next to a broken KVCache keeps the step's cells in the re-check
    (which uses the course's cache for it); the cache's own cell is the one that fails."""
    ns = C.notebook(C.PLAIN_STEP, KVCache=C.BROKEN_CACHES[broken])
    assert trusted_failures(KV_NB, ns, 0, STEP_CELLS) == set()
    assert trusted_failures(KV_NB, ns, 0, ("test_kv_cache",)) == {"test_kv_cache"}


@pytest.mark.parametrize("variant", sorted(STEP_VARIANTS))
def test_step_variants_fail_the_re_check_as_before_with_an_own_cache(variant):
    """Each wrong step, defined in a notebook whose own KVCache is correct (with helpers), so that the checks
    and the probe hand it that cache, fails exactly the cells it fails with the course's cache, in the
    checks and in the re-check alike."""
    from checktable import failed_checks

    fn, fails = STEP_VARIANTS[variant]
    ns = C.notebook(_variant=fn)
    exec("def cached_attention_step(x_new, cache, mha):\n    return _variant(x_new, cache, mha)\n", ns)
    step = ns["cached_attention_step"]
    assert C.C.step_cache(step).cls is ns["KVCache"]  # C.C: the checks module
    assert failed_checks(C.STEP_CHECKS, step) == fails
    cells = {"test_one_token_at_a_time": {"one_token"}, "test_prompt_then_tokens": {"prompt"},
             "test_step_gradients": {"step_grads"}}
    want = {gid for gid, checks in cells.items() if checks & fails}
    assert trusted_failures(KV_NB, ns, 1, cells) == want
