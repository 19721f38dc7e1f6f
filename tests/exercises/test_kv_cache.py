"""kv_cache: what the generic harness does not cover: the messages a student reads, the student's own
KVCache handed to the step (helper methods, a broken cache), caching judged by what the answer computes
(the weights that change between calls; the red team's generation by ``layer.weight``), the honest
notebook in both runners, and the capstone's cells judged by this declaration (its recaps, run through
the capstone's declaration, and the cache as a part of its cached generation)."""
from __future__ import annotations

import functools

import nbformat
import numpy as np
import pytest
import torch

from course import SOLUTIONS, as_answer
from exercises import kv_cache_answers as A
from firstprinciples import exercises
from firstprinciples.exercises import kv_cache as D
from firstprinciples.grading import declared, trusted, wire
from firstprinciples.grading.runtime import report
from probetable import SEEDS, trusted_failures

CACHE, STEP, GENERATE = exercises.pieces("kv_cache")
KV_NB = "kv_cache/kv_cache.ipynb"
CAPSTONE_NB = "capstone/capstone.ipynb"
check = declared.check_for("kv_cache")


def mistake(exercise, label):
    return next(m.fn for m in exercise.mistakes if m.label == label)


def message(grade_id: str, answer) -> str:
    with pytest.raises(Exception) as err:
        check(grade_id, answer)
    return str(err.value)


@pytest.mark.parametrize("grade_id, answer, phrases", [
    ("test_kv_cache", mistake(CACHE, "cache not updated"), ["cache not updated", "self.K = torch.cat"]),
    ("test_kv_cache", mistake(CACHE, "appended along the feature dim"), ["appended along the feature dim", "dim=-2"]),
    ("test_kv_cache", mistake(CACHE, "appended along the head dim"), ["appended along the head dim"]),
    ("test_kv_cache", mistake(CACHE, "new entries prepended"), ["new entries prepended"]),
    ("test_kv_cache", mistake(CACHE, "len counts appends"),
     ["len(cache) is 1 after append 1", "holds 3 positions (K.shape[-2])", "len counts appends"]),
    ("test_kv_cache", A.EmptyLenFailsCache, ["len() of a new cache raised an error", "return 0 while K is None"]),
    ("test_kv_cache", A.ZeroesInputsCache, ["modified the keys it was given in place"]),
    ("test_kv_cache", A.DetachedCache, ["do not require grad", "no .detach()"]),
    ("test_kv_cache", A.Float32Cache, ["dtype float32", "float64"]),
    ("test_kv_cache", A.CallsReferenceCache, ["firstprinciples.reference.KVCache", "scores 0"]),
    ("test_kv_cache", A.GraderCache, ["the grader's own cache"]),
    ("test_one_token_at_a_time", mistake(STEP, "cache not updated"), ["cache not updated"]),
    ("test_one_token_at_a_time", mistake(STEP, "mask hides the cache"), ["mask hides the cache"]),
    ("test_prompt_then_tokens", mistake(STEP, "mask hides the cache"), ["mask hides the cache"]),
    ("test_prompt_then_tokens", mistake(STEP, "no mask within a chunk"), ["no mask within a chunk"]),
    ("test_prompt_then_tokens", mistake(STEP, "new token left out"), ["new token left out"]),
    ("test_one_token_at_a_time", mistake(STEP, "stale queries"), ["stale queries"]),
    ("test_one_token_at_a_time", mistake(STEP, "queries cached"),
     ["after call 1 the cache carries extra attributes", "Queries are never cached", "queries cached"]),
    ("test_one_token_at_a_time", mistake(STEP, "recomputing everything"), ["extra attributes", "recomputing everything"]),
    ("test_one_token_at_a_time", mistake(STEP, "heads split without the transpose"),
     ["heads split without the transpose", ".transpose(1, 2)"]),
    ("test_prompt_then_tokens", mistake(STEP, "heads split without the transpose"), ["heads split without the transpose"]),
    ("test_one_token_at_a_time", A.step_weights_averaged_over_heads,
     ["the weights of call 1 (tokens 0..0) have shape (2, 1, 1)", "expected (2, 2, 1, 1)"]),
    ("test_one_token_at_a_time", A.step_output_only, ["expected a pair (output, weights)"]),
    ("test_one_token_at_a_time", A.step_modifies_input, ["modified its input x_new in place"]),
    ("test_step_gradients", A.step_detached, ["no gradient of the last output reaches W_k"]),
    ("test_generate", mistake(GENERATE, "new cache every step"), ["new cache every step"]),
    ("test_generate", mistake(GENERATE, "first position fed back"), ["first position fed back"]),
    ("test_generate", mistake(GENERATE, "recomputing everything"),
     ["changed after every step", "recomputing everything"]),
    ("test_generate", A.generate_new_vectors_only, ["the sequence has shape (2, 4, 8); expected (2, 7, 8)"]),
    ("test_generate", A.generate_modifies_prompt, ["modified its input prompt in place"]),
    ("test_generate", A.generate_calls_mha, ["generate called mha(...) itself", "Use one KVCache"]),
])
def test_the_message_says_what_is_wrong(grade_id, answer, phrases):
    text = message(grade_id, answer)
    for phrase in phrases:
        assert phrase in text, f"{phrase!r} not in:\n{text}"


def test_calling_the_layer_itself_is_named():
    text = message("test_one_token_at_a_time", A.step_calls_mha)
    assert "must use the layers mha.W_q, mha.W_k, mha.W_v and mha.W_o, not call mha itself" in text, text
    text = message("test_one_token_at_a_time", A.step_calls_torch)
    assert "scaled_dot_product_attention" in text and "scores 0" in text, text


# ---------------------------------------------------------------- caching judged by what is computed
def test_reprojection_is_caught_by_the_changing_weights_not_by_counting():
    """A step that keeps its inputs away from the cache and multiplies by the layers' weights (no layer
    call to count) passes the cases with fixed weights and fails those where W_k and W_v change."""
    text = message("test_one_token_at_a_time", A.step_recomputes_elsewhere)
    assert "W_k and W_v changed after every call" in text and "is wrong" in text, text


def test_the_red_teams_uncached_generation_loses():
    """Issue 38: generation without a cache that multiplies by ``layer.weight`` (so that no hook counted
    its work) passed the old test; the drift case fails it, and names the mistake, in both runners."""
    text = message("test_generate", A.generate_uncached_by_the_weights)
    assert "changed after every step" in text and "recomputing everything" in text, text
    ns = {"generate": A.generate_uncached_by_the_weights}
    assert trusted_failures(KV_NB, ns, 0, ("test_generate",)) == {"test_generate"}


def test_the_clock_ticks_on_the_use_of_W_o_and_moves_W_k_and_W_v_at_their_next_use():
    case = declared.tensors(GENERATE.cases("test_generate")[1])
    assert "dW_k" in case
    mha = D._clocked_layers(case, "called")
    clock = mha.W_o.weight.clock  # (its plain tensors: reading them through the clock would use them)
    W_k = clock.W_k.clone()
    moved = W_k + case["dW_k"]
    x = torch.ones(1, mha.d_model, dtype=torch.float64)
    mha.W_o.weight.shape, mha.W_o.weight.dtype  # reading metadata uses no value: no tick
    mha.W_k(x)
    assert torch.equal(clock.W_k, W_k)
    x @ mha.W_o.weight.T  # a product with W_o's weight, by hand: a tick
    x @ mha.W_o.weight.T  # (used twice in a step: one tick all the same)
    assert torch.equal(clock.W_k, W_k)  # (moved at the next use of W_k or W_v)
    mha.W_v.weight.sum()
    assert torch.equal(clock.W_k, moved)
    assert type(mha.W_k(x)) is torch.Tensor  # results are plain tensors
    assert torch.equal(clock.W_k, moved)
    assert torch.equal(mha.W_k(x), x @ moved.T)  # the layer computes with the moved weight


def test_a_borrowed_correct_step_of_the_declarations_loses_in_the_re_check():
    """The generate mistakes are built on a correct step of the declaration's (``_correct_step``), which
    no adapter runs: the re-check forbids it to answers (the declarations' own code)."""
    ns = notebook(PLAIN_STEP, KVCache=A.CatCache, _borrowed=D._correct_step)
    exec("def cached_attention_step(x_new, cache, mha):\n    return _borrowed(x_new, cache, mha)\n", ns)
    nb = nbformat.read(SOLUTIONS / KV_NB, as_version=4)
    verdicts = trusted.local_verdicts(nb, ns, 0)
    for grade_id in STEP_IDS:
        assert "the course's own code" in (verdicts[grade_id] or ""), (grade_id, verdicts[grade_id])


# ---------------------------------------------------------------- the student's own cache, handed to the step
HONEST_NOTEBOOK = '''
import math
import torch


class KVCache:
    def __init__(self):
        self.K = None
        self.V = None

    def extend(self, k, v):
        self.K = k if self.K is None else torch.cat([self.K, k], dim=-2)
        self.V = v if self.V is None else torch.cat([self.V, v], dim=-2)
        self.extended = getattr(self, "extended", 0) + 1

    def keys_and_values(self):
        return self.K, self.V

    def append(self, k, v):
        self.extend(k, v)
        return self.keys_and_values()

    def __len__(self):
        return 0 if self.K is None else self.K.shape[-2]


def cached_attention_step(x_new, cache, mha):
    B, T_new, d = x_new.shape
    H = mha.n_heads
    T_past = len(cache)

    def split(t):
        return t.view(B, T_new, H, d // H).transpose(1, 2)

    cache.extend(split(mha.W_k(x_new)), split(mha.W_v(x_new)))
    K, V = cache.keys_and_values()
    scores = split(mha.W_q(x_new)) @ K.transpose(-2, -1) / math.sqrt(d // H)
    if T_new > 1:
        scores = scores + torch.triu(torch.full((T_new, T_past + T_new), float("-inf"), dtype=x_new.dtype),
                                     diagonal=T_past + 1)
    weights = torch.softmax(scores, dim=-1)
    return mha.W_o((weights @ V).transpose(1, 2).reshape(B, T_new, d)), weights


def generate(mha, prompt, n_new):
    cache, seq, x_new = KVCache(), prompt, prompt
    for _ in range(n_new):
        out, _ = cached_attention_step(x_new, cache, mha)
        x_new = out[:, -1:]
        seq = torch.cat([seq, x_new], dim=1)
    return seq
'''

# A correct step written against the contract only (append, len), for a notebook whose own KVCache is broken.
PLAIN_STEP = '''
import math
import torch


def cached_attention_step(x_new, cache, mha):
    B, T_new, d = x_new.shape
    H = mha.n_heads
    T_past = len(cache)

    def split(t):
        return t.view(B, T_new, H, d // H).transpose(1, 2)

    K, V = cache.append(split(mha.W_k(x_new)), split(mha.W_v(x_new)))
    scores = split(mha.W_q(x_new)) @ K.transpose(-2, -1) / math.sqrt(d // H)
    if T_new > 1:
        scores = scores + torch.triu(torch.full((T_new, T_past + T_new), float("-inf"), dtype=x_new.dtype),
                                     diagonal=T_past + 1)
    weights = torch.softmax(scores, dim=-1)
    return mha.W_o((weights @ V).transpose(1, 2).reshape(B, T_new, d)), weights
'''


def notebook(source=HONEST_NOTEBOOK, **names):
    """A kernel-like namespace: ``names``, then ``source`` run in it (its functions' globals are the namespace)."""
    ns = dict(names)
    exec(compile(source, "notebook", "exec"), ns)
    return ns


class UnansweredCache:
    """The exercise's KVCache before it is answered."""

    def __init__(self):
        raise NotImplementedError()


# (the reference's cache, subclassed or wrapped, is a working cache: its own cell fails, the step gets it)
BROKEN_CACHES = {name: cls for name, (cls, _, _) in A.CACHE_WRONG.items()
                 if name not in ("borrows the grader's cache", "subclasses the reference", "wraps the reference")}
BROKEN_CACHES.update({m.label: m.fn for m in CACHE.mistakes}, unanswered=UnansweredCache)
STEP_IDS = tuple(STEP.tests)
KV_IDS = (*CACHE.tests, *STEP.tests, *GENERATE.tests)


def test_the_honest_notebook_scores_full_marks_in_both_runners():
    """A step that calls helper methods of the notebook's own KVCache (extend, keys_and_values) passes
    every test cell of the notebook in the kernel (11/11) and in the re-check."""
    nb = nbformat.read(SOLUTIONS / KV_NB, as_version=4)
    ns = notebook(check=check)
    scored, total = 0, 0
    for cell in nb.cells:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if cell.cell_type == "code" and meta.get("grade") and not meta.get("solution"):
            total += meta["points"]
            exec(compile(cell.source, meta["grade_id"], "exec"), ns)  # raises if the cell fails
            scored += meta["points"]
    assert (scored, total) == (11, 11)
    for seed in SEEDS:
        assert trusted_failures(KV_NB, notebook(), seed, KV_IDS) == set(), seed


def test_the_step_gets_the_notebooks_cache_and_the_cache_keeps_its_own_state():
    ns = notebook()
    cls, own = D.step_cache(ns["cached_attention_step"])  # through the step's globals (the kernel)
    assert cls is ns["KVCache"] and own == {"extended"}
    assert D.step_cache(A.einsum_step, {"KVCache": ns["KVCache"]})[0] is ns["KVCache"]  # the runner's namespace
    assert D.step_cache(A.einsum_step) == (D.GivenCache, frozenset())  # no KVCache where it is defined
    assert D.step_cache(A.einsum_step, {"KVCache": "not a class"}) == (D.GivenCache, frozenset())
    with pytest.raises(AssertionError, match="raised AttributeError"):  # without its cache, a step using helpers
        check("test_one_token_at_a_time", notebook(PLAIN_STEP.replace("cache.append", "cache.extend"))
              ["cached_attention_step"])


@pytest.mark.parametrize("broken", sorted(BROKEN_CACHES))
def test_a_broken_cache_of_the_students_leaves_the_step_graded_on_its_own(broken, capsys):
    """When the notebook's own KVCache fails its small test, the step gets a correct cache (and the cell says
    so): a correct step passes in both runners, whatever is wrong with the cache."""
    ns = notebook(PLAIN_STEP, KVCache=BROKEN_CACHES[broken])
    for grade_id in STEP_IDS:
        check(grade_id, ns["cached_attention_step"])
    assert "Your KVCache fails its own test" in capsys.readouterr().out
    assert trusted_failures(KV_NB, ns, 0, STEP_IDS) == set()


def test_a_step_needing_a_broken_cache_of_its_own_fails_and_the_cell_says_why(capsys):
    class BrokenHelperCache(A.HelperCache):
        def __len__(self):  # len counts nothing: the cache fails its own test
            return 0

    ns = notebook(HONEST_NOTEBOOK)
    ns["KVCache"] = BrokenHelperCache
    with pytest.raises(Exception):
        check("test_one_token_at_a_time", ns["cached_attention_step"])
    out = capsys.readouterr().out
    assert "Your KVCache fails its own test (len(cache) is 0 after 2 positions)" in out, out
    assert "a correct cache instead" in out


STEP_VARIANTS = {**{label: (fn, k) for label, (fn, k, _) in A.STEP_WRONG.items()},
                 **{m.label: (m.fn, m.fails) for m in STEP.mistakes}}


@pytest.mark.parametrize("variant", sorted(STEP_VARIANTS))
@pytest.mark.parametrize("own", ["concatenating cache", "cache with helpers"])
def test_step_variants_fail_as_before_with_an_own_cache(variant, own):
    """With the notebook's own (correct) cache instead of the adapter's, every wrong step fails exactly the
    cells it fails with the adapter's (in the kernel): what the step leaves in the cache is still seen
    (queries, inputs), what the cache keeps by itself is not."""
    fn, fails = STEP_VARIANTS[variant]
    ns = notebook(PLAIN_STEP, KVCache=A.CORRECT["KVCache"][own], _variant=fn)
    exec("def cached_attention_step(x_new, cache, mha):\n    return _variant(x_new, cache, mha)\n", ns)
    step = ns["cached_attention_step"]
    assert D.step_cache(step)[0] is ns["KVCache"]
    failed = set()
    for grade_id in STEP_IDS:
        try:
            check(grade_id, step)
        except Exception:  # noqa: BLE001 (any failure fails the cell)
            failed.add(grade_id)
    assert failed == set(fails), variant


def test_the_checks_leave_the_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    check("test_one_token_at_a_time", A.einsum_step)
    check("test_generate", A.correct_generate)
    assert torch.equal(torch.rand(3), before)


# ---------------------------------------------------------------- the capstone's cells, judged by this declaration
def test_the_capstones_recaps_run_this_declaration(capsys):
    capstone = declared.check_for("capstone")
    capstone("recap_kv_cache", A.CatCache)
    capstone("test_cached_attention_step", notebook()["cached_attention_step"])
    with pytest.raises(AssertionError, match="len counts appends"):
        capstone("recap_kv_cache", mistake(CACHE, "len counts appends"))
    with pytest.raises(AssertionError, match="W_k and W_v changed after every call"):
        capstone("test_cached_attention_step", A.step_recomputes_elsewhere)


@functools.lru_cache(maxsize=None)
def _capstone_check(name, seed=0):
    plan = trusted.make_plan(nbformat.read(SOLUTIONS / CAPSTONE_NB, as_version=4), seed)
    return next(c for c in plan.checks if c.name == name)


def _reason(name, answer, grade_id):
    check_ = _capstone_check(name)
    found = trusted.outcome(check_, wire.loads(wire.dumps(report({name: answer}, name, check_.cases))))
    return found.reason(check_, check_.probe.cells[grade_id])


# A cache that cached generation can use: what append returns is right (len, gradients and the inputs
# left untouched are not what test_generate_cached / test_generate_trained judge).
CACHE_USABLE = {"detached", "len counts appends", "modifies its inputs", "len of an empty cache fails"}
CACHE_ANSWERS = {**{n: cls for n, (cls, _, _) in A.CACHE_WRONG.items()},
                 **{m.label: as_answer(m.fn) for m in CACHE.mistakes}}  # (a mistake as a student's own code)


@pytest.mark.parametrize("name", sorted(CACHE_ANSWERS) + sorted(f"correct:{n}" for n in A.CORRECT["KVCache"]))
def test_the_cache_as_a_part_of_the_capstones_cached_generation(name):
    answer = A.CORRECT["KVCache"][name[8:]] if name.startswith("correct:") else CACHE_ANSWERS[name]
    usable = name.startswith("correct:") or name in CACHE_USABLE
    for grade_id in ("test_generate_cached", "test_generate_trained"):
        reason = _reason("KVCache", answer, grade_id)
        assert (reason is None) == usable, (name, grade_id, reason)
    # the recap runs the value cases (no gradients): a detached cache passes it
    assert (_reason("KVCache", answer, "recap_kv_cache") is None) == (name.startswith("correct:") or name == "detached")


def test_the_capstones_step_recap_is_judged_as_test_one_token_at_a_time():
    assert _reason("cached_attention_step", A.einsum_step, "test_cached_attention_step") is None
    assert _reason("cached_attention_step", A.step_recomputes_elsewhere, "test_cached_attention_step") is not None
    assert _reason("cached_attention_step", mistake(STEP, "queries cached"), "test_cached_attention_step") is not None


def test_the_visible_cases_are_small():
    """The stored expected results stay small (the kernel reads them at every check)."""
    from firstprinciples.exercises import expected

    assert expected.path("kv_cache").stat().st_size < 120_000
    assert all(np.asarray(c["x"]).size <= 200 for c in STEP.visible)
