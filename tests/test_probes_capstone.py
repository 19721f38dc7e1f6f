"""The trusted re-check of the capstone's notebook: the trained model agrees with its checks, and the
declared decoder (``exercises.capstone``) is judged with the notebook's own classes.

The trained model's answers are bundles (tests/test_checks_capstone.py: ``trained_answer()``), so the
namespace of a run is the bundle itself; the agreement is ``probetable.agreement_test``'s: per test
cell, the trusted re-check fails exactly when the cell's checks fail, over every variant of the
trained table and three secret seeds. (StudentGPT and generate_cached are declared: the generic
harness runs them through both runners, tests/exercises/test_declarations.py.)
"""
from __future__ import annotations

import math

import nbformat
import numpy as np
import pytest
import torch
from probetable import agreement_params, expected_failures, trusted_failures

import test_checks_capstone as T
from course import SOLUTIONS
from firstprinciples.exercises import capstone as D
from firstprinciples.grading import declared, observe, probes, wire
from firstprinciples.grading.runtime import report

NOTEBOOK = "capstone/capstone.ipynb"

TRAINED_CELLS = {"test_trained": {"trained"}, "test_resolves_it": {"resolves"},
                 "test_generate_trained": {"generate_trained"}}

TRAINED_DIFFERENCES = {
    # The probe of ``model`` cannot see which class the notebook calls TransformerBlock.
    "blocks of another class": (set(), "the probe cannot see the notebook's TransformerBlock"),
    # The re-check judges test_generate_trained's decoder on random models of the notebook's StudentGPT
    # (exercises.capstone's elsewhere), not the trained model (issue 42): the course's TinyGPT handed in as
    # the trained model loses the two cells that judge the model; the kernel's decoding of it calls the
    # course's pieces, which loses the third there.
    "the reference TinyGPT": ({"test_trained", "test_resolves_it"}, "the decoder's cell judges the decoder"),
}


def namespace(bundle) -> dict:
    ns = dict(vars(bundle))
    if isinstance(ns.get("model"), str):
        ns["model"] = T.trained(ns["model"])
    return ns


def agreement(cells, correct, variants, differences):
    @pytest.mark.parametrize("bundle, fails, name, seed", agreement_params(correct, variants))
    def test(bundle, fails, name, seed):
        got = trusted_failures(NOTEBOOK, namespace(bundle), seed, cells)
        want = differences[name][0] if name in differences else expected_failures(cells, fails)
        assert got == want, f"{name} (seed {seed}): trusted re-check fails {sorted(got)}, the checks fail {sorted(want)}"

    return test


test_trained_agrees = agreement(TRAINED_CELLS, {"trained": T.trained_answer()}, T.TRAINED_VARIANTS, TRAINED_DIFFERENCES)


def test_differences_are_variants():
    assert set(TRAINED_DIFFERENCES) <= set(T.TRAINED_VARIANTS)


# ====================================================================== the notebook's own answers (kernel-like globals)
def solution_namespace() -> dict:
    """The solution notebook's import and answer cells run in one dict, as in a kernel: the answers'
    ``__globals__`` is the namespace (so the decoder's probe finds StudentGPT and KVCache there)."""
    nb = nbformat.read(SOLUTIONS / NOTEBOOK, as_version=4)
    ns: dict = {}
    for cell in nb.cells:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if cell.cell_type == "code" and (meta.get("solution") or meta.get("grade_id") == "imports"):
            exec(compile(cell.source, meta.get("grade_id", "cell"), "exec"), ns)
    ns["corpus"] = T.the_corpus()
    ns["model"] = T.trained("correct")
    return ns


MODEL_CELLS = ("test_model_structure", "test_model_forward", "test_model_causal", "test_generate_cached")
check = declared.check_for("capstone")


def verdicts(ns, seed=0, cells=(*MODEL_CELLS, *TRAINED_CELLS)):
    return trusted_failures(NOTEBOOK, ns, seed, cells)


def test_solution_passes_through_its_globals():
    ns = solution_namespace()
    assert verdicts(ns) == set()


RESTART = '''
def generate_cached(model, ids, n_new):
    caches = [KVCache() for _ in model.blocks]
    new, steps = ids, []
    with torch.no_grad():
        for _ in range(n_new):
            x = model.tok(new) + model.pos(torch.arange(new.shape[1]))  # positions restart at 0
            for block, cache in zip(model.blocks, caches):
                a, _ = cached_attention_step(block.ln1(x), cache, block.attn)
                x = x + a
                x = x + block.ffn(block.ln2(x))
            logits = model.head(model.ln_f(x[:, -1]))
            steps.append(logits)
            new = logits.argmax(-1, keepdim=True)
            ids = torch.cat([ids, new], dim=1)
    return ids, torch.stack(steps, dim=1)
'''

NO_KVCACHE = '''
def generate_cached(model, ids, n_new):
    """Right values, its own (K, V) tensors instead of the notebook's KVCache: the test counts no cache."""
    H = model.blocks[0].attn.n_heads
    kv = [None] * len(model.blocks)
    new, steps, seen = ids, [], 0
    with torch.no_grad():
        for _ in range(n_new):
            x = model.tok(new) + model.pos(torch.arange(seen, seen + new.shape[1]))
            for i, block in enumerate(model.blocks):
                h = block.ln1(x)
                q, k, v = (split_heads(W(h), H) for W in (block.attn.W_q, block.attn.W_k, block.attn.W_v))
                if kv[i] is not None:
                    k, v = torch.cat([kv[i][0], k], -2), torch.cat([kv[i][1], v], -2)
                kv[i] = (k, v)
                T_new, T_all = q.shape[-2], k.shape[-2]
                mask = torch.triu(torch.full((T_new, T_all), float("-inf"), dtype=h.dtype), diagonal=T_all - T_new + 1)
                out, _ = scaled_dot_product_attention(q, k, v, mask)
                x = x + block.attn.W_o(merge_heads(out))
                x = x + block.ffn(block.ln2(x))
            logits = model.head(model.ln_f(x[:, -1]))
            steps.append(logits)
            seen += new.shape[1]
            new = logits.argmax(-1, keepdim=True)
            ids = torch.cat([ids, new], dim=1)
    return ids, torch.stack(steps, dim=1)
'''


@pytest.mark.parametrize("source, fails", [
    (RESTART, {"test_generate_cached", "test_generate_trained"}),
    (NO_KVCACHE, {"test_generate_cached", "test_generate_trained"}),
], ids=["positions restart at 0", "no KVCache"])
def test_decoder_variants_through_the_globals(source, fails):
    """The decoder's adapter uses the notebook's StudentGPT and counts the notebook's KVCache, in the kernel
    (the decoder's globals) as in the re-check (the runner's namespace)."""
    from firstprinciples.checks import capstone as C

    ns = solution_namespace()
    exec(source, ns)
    with pytest.raises(AssertionError):
        check("test_generate_cached", ns["generate_cached"])
    with pytest.raises(AssertionError):
        C.check_generate_trained(ns["generate_cached"], ns["model"], ns["corpus"], ns["KVCache"])
    assert verdicts(ns) == fails


def test_the_decoder_probe_uses_the_notebooks_model_class():
    """A decoder relying on an attribute of the student's own attention (not in the spec) passes: the
    adapter builds the notebook's StudentGPT, not a model of its own."""
    ns = solution_namespace()
    exec("_Base = MultiHeadAttention\n"
         "class MultiHeadAttention(_Base):\n"
         "    def __init__(self, d_model, n_heads):\n"
         "        super().__init__(d_model, n_heads)\n"
         "        self.width_of_a_head = d_model // n_heads\n", ns)
    exec(RESTART.replace("torch.arange(new.shape[1])", "torch.arange(len(caches[0]), len(caches[0]) + new.shape[1])")
         .replace("                x = x + a\n", "                x = x + a * (block.attn.width_of_a_head > 0)\n"), ns)
    check("test_generate_cached", ns["generate_cached"])
    assert verdicts(ns, cells=("test_generate_cached",)) == set()


# ====================================================================== sizes, time, forging
def encoded_results(name, ns, seed=0):
    probe = probes.load()[name]
    cases = [probes.encode_case(c) for c in probe.cases(np.random.default_rng([seed, 7]))]
    return cases, report(ns, name, cases)


@pytest.mark.parametrize("name", ["model"])
def test_results_are_small(name):
    ns = solution_namespace()
    _, rep = encoded_results(name, ns)
    probe = probes.load()[name]
    table = observe.forbidden_python(**probe.watch())
    assert all("outputs" in r for r in rep["results"]), rep["results"]
    assert not [hits for r in rep["results"]
                if (hits := observe.judge(observe.expand(r["seen"], rep["codes"]), probe.watch()["torch_patterns"], table))]
    assert len(wire.dumps(rep)) < 200_000  # (the outputs and what the watch saw, raw: a few hundred functions)


def test_model_judge_uses_the_checks_numbers():
    """The judge's loss and accuracy are the checks' (held_out_loss, accuracy) for the trained model."""
    from firstprinciples.capstone.train import accuracy, held_out_loss
    from firstprinciples.grading.probes import capstone as P

    model = T.trained("correct")
    corpus = T.the_corpus()
    cases = P.model_cases(np.random.default_rng(0))
    loss_case, resolve_case = (probes.decode_case(probes.encode_case(c)) for c in cases[:2])
    logp = P.run_model(model, loss_case)["logp"].double()
    assert math.isclose(-logp.mean().item(), held_out_loss(model, corpus.held_out), rel_tol=1e-5)
    pred = P.run_model(model, resolve_case)["pred"]
    answers = torch.tensor([ex.ids[ex.answer_index] for ex in corpus.held_out])
    assert math.isclose((pred == answers).double().mean().item(), accuracy(model, corpus.held_out), abs_tol=1e-9)


def test_forged_model_results_are_judged_in_the_grader():
    """Whatever the kernel ships is judged by the grader's thresholds: a malformed or too-good report fails."""
    from firstprinciples.grading.probes import capstone as P

    cases = [probes.decode_case(probes.encode_case(c)) for c in P.model_cases(np.random.default_rng(0))]
    loss_case = cases[0]
    n = int((loss_case["ids"][:, 1:] != loss_case["pad"]).sum())
    def enc(v):
        return {"logp": wire.encode(v)}

    assert P.judge_model(loss_case, enc(torch.full((n,), -0.1))) is not None  # below the leak threshold
    assert P.judge_model(loss_case, enc(torch.full((n - 1,), -0.6))) is not None  # wrong size
    assert P.judge_model(loss_case, enc(torch.full((n,), 0.5))) is not None  # not log-probabilities
    assert P.judge_model(loss_case, {"logp": {"type": "builtins.str", "value": "0.6"}}) is not None
    assert P.judge_model(loss_case, enc(torch.full((n,), -0.6))) is None


# ====================================================================== the student's own KVCache with helper methods
HELPER_CACHE = '''
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
    T_new, T_past = x_new.shape[1], len(cache)
    q = split_heads(mha.W_q(x_new), mha.n_heads)
    cache.extend(split_heads(mha.W_k(x_new), mha.n_heads), split_heads(mha.W_v(x_new), mha.n_heads))
    K, V = cache.keys_and_values()
    mask = None
    if T_new > 1:
        mask = torch.triu(torch.full((T_new, T_past + T_new), float("-inf"), dtype=x_new.dtype), diagonal=T_past + 1)
    out, weights = scaled_dot_product_attention(q, K, V, mask)
    return mha.W_o(merge_heads(out)), weights
'''


def test_a_step_using_helpers_of_its_own_cache_gets_every_cell():
    """The capstone's step calls helpers of the notebook's own KVCache and never its append: the step's recap
    gets the notebook's cache, and cached decoding counts the caches used through any of their methods
    (not append only), in the checks and in the re-check."""
    from firstprinciples.checks import capstone as C

    ns = solution_namespace()
    exec(HELPER_CACHE, ns)
    check("recap_kv_cache", ns["KVCache"])
    check("test_cached_attention_step", ns["cached_attention_step"])
    check("test_generate_cached", ns["generate_cached"])
    C.check_generate_trained(ns["generate_cached"], ns["model"], ns["corpus"], ns["KVCache"])
    cells = (*MODEL_CELLS, *TRAINED_CELLS, "recap_kv_cache", "test_cached_attention_step")
    assert verdicts(ns, cells=cells) == set()


def test_caches_are_counted_through_any_method_and_the_class_is_restored():
    C = D
    ns = solution_namespace()
    exec(HELPER_CACHE, ns)
    Cache = ns["KVCache"]
    before = dict(vars(Cache))
    used, undo = C.recording_caches(Cache)
    a, b = Cache(), Cache()
    a.extend(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))
    b.keys_and_values()
    len(Cache())  # special methods are not a use
    a.append(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))
    undo()
    assert len(used) == 2 and used[0] is a and used[1] is b
    assert dict(vars(Cache)) == before

    class Sub(Cache):  # methods of a base: patched on the class, removed afterwards
        pass

    used, undo = C.recording_caches(Sub)
    Sub().extend(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))
    undo()
    assert len(used) == 1 and "extend" not in vars(Sub) and vars(Cache)["extend"] is before["extend"]


def test_the_decoder_probe_takes_its_classes_from_the_namespace():
    """``generate_cached`` needs StudentGPT, KVCache and cached_attention_step: the runner's namespace, else
    the decoder's globals; the reference side binds them to TinyGPT and the course's KVCache and step."""
    from firstprinciples.capstone.model import TinyGPT, generate_greedy
    from firstprinciples.reference import KVCache, cached_attention_step

    probe = probes.load()["generate_cached"]
    assert probe.needs == ("StudentGPT", "KVCache", "cached_attention_step")
    assert probes.reference_namespace(probe) == {"StudentGPT": TinyGPT, "KVCache": KVCache,
                                                 "cached_attention_step": cached_attention_step}
    ns = solution_namespace()
    assert D.looked_up(generate_greedy, "StudentGPT", ns) is ns["StudentGPT"]
    assert D.looked_up(generate_greedy, "KVCache", ns) is KVCache  # (where the decoder was defined, first)
    assert D.looked_up(ns["generate_cached"], "StudentGPT") is ns["StudentGPT"]  # through the globals
    assert D.looked_up(generate_greedy, "StudentGPT") is None  # (the adapter's own model stands in)
