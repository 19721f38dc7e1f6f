"""Every check of project_qkv and dot_product_scores accepts right answers and
rejects typical wrong ones.

Each check is run against the reference and other correct implementations
(all must pass) and against a catalogue of buggy variants: the package's named
mistakes plus wrong answers that cannot be "named" (calls the reference,
detached, numpy, in-place, ...). The tables say exactly which checks each
variant must fail; every check must reject at least five variants. The seed's
own projections (nn.Linear, y = x W^T) are tried as an answer too, through a
wrapper that feeds them this exercise's (d_model, d_out) weights.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from checktable import (
    assert_passes,
    expectations_test,
    naming_by_piece_test,
    outcome,
    rejections_by_piece_test,
    variants_by_piece_test,
)
from seeds import seed_namespace

from course import as_student_code
from firstprinciples import examples, reference
from firstprinciples.checks import qkv as C

PROJECT_CHECKS = {
    "worked": C.check_projection_worked_example,
    "shapes": C.check_projection_shapes,
    "random": C.check_projection_random,
    "grads": C.check_projection_gradients_and_inputs,
}
SCORES_CHECKS = {
    "worked": C.check_scores_worked_example,
    "batched": C.check_scores_batched,
    "random": C.check_scores_random,
    "grads": C.check_scores_gradients_and_inputs,
}
P_ALL = set(PROJECT_CHECKS)
S_ALL = set(SCORES_CHECKS)

project_correct = as_student_code(reference.project_qkv)
scores_correct = as_student_code(reference.dot_product_scores)


# ================================================================ project_qkv
def project_with_linear(x, W_q, W_k, W_v):
    return F.linear(x, W_q.T), F.linear(x, W_k.T), F.linear(x, W_v.T)


def project_with_einsum(x, W_q, W_k, W_v):
    return tuple(torch.einsum("btm,md->btd", x, W) for W in (W_q, W_k, W_v))


def project_one_product(x, W_q, W_k, W_v):
    """One product with the three weights side by side, then split."""
    d_k = W_q.shape[1]
    QKV = x @ torch.cat([W_q, W_k, W_v], dim=1)  # (B, T, 2 d_k + d_v)
    return QKV[..., :d_k], QKV[..., d_k : 2 * d_k], QKV[..., 2 * d_k :]


def project_like_the_seed(x, W_q, W_k, W_v):
    """The seed's MultiHeadAttention projects with nn.Linear(bias=False); give it our weights."""
    seed = seed_namespace("MultiHeadAttention")["MultiHeadAttention"]
    d_model = x.shape[-1]
    mha = seed(d_model, 1).to(x.dtype)
    out = []
    for layer, W in ((mha.W_q, W_q), (mha.W_k, W_k), (mha.W_v, W_v)):
        layer.weight = torch.nn.Parameter(W.T, requires_grad=False)  # nn.Linear stores (d_out, d_model)
        out.append(layer(x))
    return tuple(out)


PROJECT_CORRECT = {
    "reference": project_correct,
    "F.linear": project_with_linear,
    "einsum": project_with_einsum,
    "one product, then split": project_one_product,
}


def project_calls_reference(x, W_q, W_k, W_v):
    return reference.project_qkv(x, W_q, W_k, W_v)


def project_calls_reference_and_hides_it(x, W_q, W_k, W_v):
    try:
        reference.project_qkv(x, W_q, W_k, W_v)
    except Exception:
        pass
    return project_correct(x, W_q, W_k, W_v)


def project_in_place(x, W_q, W_k, W_v):
    x.mul_(1.0)  # touches the caller's tensor (a no-op in value)...
    x.add_(1.0)  # ...and then changes it
    return project_correct(x - 1.0, W_q, W_k, W_v)


def project_detached(x, W_q, W_k, W_v):
    return project_correct(x.detach(), W_q.detach(), W_k.detach(), W_v.detach())


def project_numpy(x, W_q, W_k, W_v):
    return tuple(t.detach().numpy() for t in project_correct(x, W_q, W_k, W_v))


def project_casts(x, W_q, W_k, W_v):
    return tuple(t.float() for t in project_correct(x, W_q, W_k, W_v))


def project_returns_stacked(x, W_q, W_k, W_v):
    return torch.stack(project_correct(x, W_q, W_k, W_v))  # one tensor, not a tuple (and an error if d_k != d_v)


def project_q_only(x, W_q, W_k, W_v):
    return x @ W_q


_EXAMPLE_QKV = [t.tolist() for t in project_correct(*C.worked_projection())]


def project_hard_coded(x, W_q, W_k, W_v):
    return tuple(torch.tensor(t, dtype=x.dtype) for t in _EXAMPLE_QKV)


PROJECT_OTHER = {
    "calls the reference": (project_calls_reference, P_ALL),
    "calls the reference and hides it": (project_calls_reference_and_hides_it, P_ALL),
    "modifies its inputs": (project_in_place, P_ALL),
    "detached": (project_detached, {"grads"}),
    "returns numpy": (project_numpy, P_ALL),
    "casts to float32": (project_casts, P_ALL),
    "returns one stacked tensor": (project_returns_stacked, P_ALL),
    "returns Q only": (project_q_only, P_ALL),
    "hard-coded worked example": (project_hard_coded, P_ALL - {"worked"}),
}

PROJECT_MISTAKE_FAILS = {
    # No gradient reaches W_k or W_v.
    "W_q used for all three": P_ALL,
    "K and V projections swapped": {"worked", "shapes", "random"},
    "Q and K projections swapped": {"worked", "shapes", "random"},
    # In the worked example (3 x 2 weights) x @ W.T cannot run: an error, not a name.
    "weights transposed": {"worked", "shapes", "random"},
}

PROJECT_VARIANTS = {m.label: (m.fn, PROJECT_MISTAKE_FAILS[m.label]) for m in C.PROJECT_MISTAKES}
PROJECT_VARIANTS.update(PROJECT_OTHER)


# ================================================================ dot_product_scores
def scores_with_mT(Q, K):
    return Q @ K.mT


def scores_with_einsum(Q, K):
    return torch.einsum("...id,...jd->...ij", Q, K)


def scores_with_matmul_and_swapaxes(Q, K):
    return torch.matmul(Q, torch.swapaxes(K, -1, -2))


def scores_by_broadcasting(Q, K):
    return (Q.unsqueeze(-2) * K.unsqueeze(-3)).sum(-1)  # (..., T_q, T_k, d_k) summed over d_k


SCORES_CORRECT = {
    "reference": scores_correct,
    "K.mT": scores_with_mT,
    "einsum": scores_with_einsum,
    "matmul + swapaxes": scores_with_matmul_and_swapaxes,
    "broadcast and sum": scores_by_broadcasting,
}


def scores_calls_reference(Q, K):
    return reference.dot_product_scores(Q, K)


def scores_calls_reference_and_hides_it(Q, K):
    try:
        reference.dot_product_scores(Q, K)
    except Exception:
        pass
    return scores_correct(Q, K)


def scores_in_place(Q, K):
    K.transpose_(-2, -1)  # transposes the caller's K in place
    return Q @ K


def scores_detached(Q, K):
    return scores_correct(Q.detach(), K.detach())


def scores_numpy(Q, K):
    return scores_correct(Q, K).detach().numpy()


def scores_casts(Q, K):
    return scores_correct(Q, K).float()


def scores_returns_tuple(Q, K):
    return scores_correct(Q, K), K


_EXAMPLE_SCORES = scores_correct(*examples.cat_sat_mat(torch.float64, all_queries=True)[:2]).tolist()


def scores_hard_coded(Q, K):
    return torch.tensor(_EXAMPLE_SCORES, dtype=Q.dtype)


SCORES_OTHER = {
    "calls the reference": (scores_calls_reference, S_ALL),
    "calls the reference and hides it": (scores_calls_reference_and_hides_it, S_ALL),
    "modifies its inputs": (scores_in_place, S_ALL),
    "detached": (scores_detached, {"grads"}),
    "returns numpy": (scores_numpy, S_ALL),
    "casts to float32": (scores_casts, S_ALL),
    "returns a tuple": (scores_returns_tuple, S_ALL),
    "hard-coded worked example": (scores_hard_coded, S_ALL - {"worked"}),
}

SCORES_MISTAKE_FAILS = {
    # Right for (T, d) inputs, as in the worked example; the grads check uses
    # shapes where it runs, and judges only its (honest) gradients.
    "K.T on batched input": {"batched", "random"},
    "Q^T K instead of Q K^T": {"worked", "batched", "random"},
    # Raises an IndexError on the (T, d) inputs of the worked example.
    "scores over the wrong pair of dims": {"worked", "batched", "random"},
    "scores transposed (K Q^T)": {"worked", "batched", "random"},
    # No gradient reaches K.
    "queries compared with queries": S_ALL,
    "same-position pairs only": {"worked", "batched", "random"},
    "scaled by 1/sqrt(d_k)": {"worked", "batched", "random"},
}

SCORES_VARIANTS = {m.label: (m.fn, SCORES_MISTAKE_FAILS[m.label]) for m in C.SCORES_MISTAKES}
SCORES_VARIANTS.update(SCORES_OTHER)

PIECES = {"project_qkv": PROJECT_CHECKS, "dot_product_scores": SCORES_CHECKS}
CORRECT = {"project_qkv": PROJECT_CORRECT, "dot_product_scores": SCORES_CORRECT}
VARIANTS = {("project_qkv", v): entry for v, entry in PROJECT_VARIANTS.items()}
VARIANTS.update({("dot_product_scores", v): entry for v, entry in SCORES_VARIANTS.items()})


test_every_mistake_has_an_expectation = expectations_test(
    (PROJECT_MISTAKE_FAILS, C.PROJECT_MISTAKES), (SCORES_MISTAKE_FAILS, C.SCORES_MISTAKES)
)


@pytest.mark.parametrize("piece, answer", [(p, a) for p, answers in CORRECT.items() for a in sorted(answers)])
def test_correct_answers_pass(piece, answer):
    for name, check in PIECES[piece].items():
        assert_passes(check, CORRECT[piece][answer], f"{piece}: the correct answer '{answer}' fails {name}")


@pytest.mark.parametrize("piece, name", [(p, n) for p in PIECES for n in ("random", "grads")])
def test_visible_parts_pass_the_reference(piece, name):
    ok, err = outcome(lambda fn: PIECES[piece][name](fn, full=False), CORRECT[piece]["reference"])
    assert ok, err


# (not "grads": the seed's projections are nn.Linear layers with weights of their own, so no
# gradient reaches the W_q, W_k, W_v the test passes in, which is what that test checks)
@pytest.mark.parametrize("name", sorted(set(PROJECT_CHECKS) - {"grads"}))
def test_the_seeds_projections_pass(name):
    ok, err = outcome(PROJECT_CHECKS[name], project_like_the_seed)
    assert ok, f"the seed's nn.Linear projections fail {name}: {err}"


test_variant_fails_exactly_the_expected_checks = variants_by_piece_test(PIECES, VARIANTS)
test_each_check_rejects_at_least_five_variants = rejections_by_piece_test(PIECES, VARIANTS)
test_failure_names_the_mistake = naming_by_piece_test(
    PIECES,
    VARIANTS,
    [
        ("project_qkv", "W_q used for all three", "worked"),
        ("project_qkv", "K and V projections swapped", "worked"),
        ("project_qkv", "K and V projections swapped", "shapes"),
        ("project_qkv", "Q and K projections swapped", "worked"),
        ("project_qkv", "weights transposed", "shapes"),
        ("dot_product_scores", "Q^T K instead of Q K^T", "worked"),
        ("dot_product_scores", "Q^T K instead of Q K^T", "batched"),
        ("dot_product_scores", "K.T on batched input", "batched"),
        ("dot_product_scores", "scores over the wrong pair of dims", "batched"),
        ("dot_product_scores", "scores transposed (K Q^T)", "worked"),
        ("dot_product_scores", "queries compared with queries", "worked"),
        ("dot_product_scores", "same-position pairs only", "worked"),
        ("dot_product_scores", "scaled by 1/sqrt(d_k)", "worked"),
    ],
)


def test_visible_random_case_names_transposed_projection_weights():
    # The visible part of the torch comparison has square weights.
    ok, err = outcome(lambda fn: C.check_projection_random(fn, full=False), PROJECT_VARIANTS["weights transposed"][0])
    assert not ok and "weights transposed" in str(err), str(err)


def test_forbidden_call_messages_are_clear():
    ok, err = outcome(C.check_projection_worked_example, project_calls_reference)
    assert "firstprinciples.reference.project_qkv" in str(err) and "scores 0" in str(err)
    ok, err = outcome(C.check_scores_worked_example, scores_calls_reference)
    assert "firstprinciples.reference.dot_product_scores" in str(err) and "scores 0" in str(err)


def test_worked_examples_report_the_token():
    ok, err = outcome(C.check_projection_worked_example, PROJECT_VARIANTS["K and V projections swapped"][0])
    assert "the key of 'Cat'" in str(err), str(err)
    ok, err = outcome(C.check_scores_worked_example, SCORES_VARIANTS["scaled by 1/sqrt(d_k)"][0])
    assert "Cat's score for 'Cat'" in str(err) and "1.10" in str(err), str(err)


def test_worked_projection_reproduces_the_attention_chapters_vectors():
    Q, K, V = reference.project_qkv(*C.worked_projection())
    for got, want in zip((Q, K, V), examples.cat_sat_mat(torch.float64, all_queries=True)):
        torch.testing.assert_close(got[0], want, atol=1e-12, rtol=0)


def test_scores_are_zero_for_perpendicular_and_negative_for_opposite_vectors():
    q = torch.tensor([[2.0, 0.0]], dtype=torch.float64)
    K = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]], dtype=torch.float64)
    assert reference.dot_product_scores(q, K).tolist() == [[2.0, 0.0, -2.0]]
