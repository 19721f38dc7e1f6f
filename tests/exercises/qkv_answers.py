"""qkv: the answers the generic harness (test_declarations.py) runs besides the declaration's own
mistakes, per piece: unusual correct answers, which must pass everywhere, and wrong answers that no
mistake names (the reference called, a wrong type, an input changed), each with the test cells it
fails in the notebook (its visible cases) and in the trusted re-check (the secret ones)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from course import as_student_code
from firstprinciples import examples, reference
from firstprinciples.examples.qkv import worked_projection

PIECES = True

project_correct = as_student_code(reference.project_qkv)
scores_correct = as_student_code(reference.dot_product_scores)


# ================================================================ project_qkv: correct
def project_with_linear(x, W_q, W_k, W_v):
    return F.linear(x, W_q.T), F.linear(x, W_k.T), F.linear(x, W_v.T)


def project_with_einsum(x, W_q, W_k, W_v):
    return tuple(torch.einsum("btm,md->btd", x, W) for W in (W_q, W_k, W_v))


def project_one_product(x, W_q, W_k, W_v):
    """One product with the three weights side by side, then split."""
    d_k = W_q.shape[1]
    QKV = x @ torch.cat([W_q, W_k, W_v], dim=1)  # (B, T, 2 d_k + d_v)
    return QKV[..., :d_k], QKV[..., d_k : 2 * d_k], QKV[..., 2 * d_k :]


def project_with_tensordot(x, W_q, W_k, W_v):
    # contracts x's last axis with W's first: no @ at all
    return tuple(torch.tensordot(x, W, dims=([-1], [0])) for W in (W_q, W_k, W_v))


def project_token_by_token(x, W_q, W_k, W_v):
    # one (B, d_model) @ (d_model, d) product per position, stacked back along T
    out = []
    for W in (W_q, W_k, W_v):
        out.append(torch.stack([x[:, t, :].mm(W) for t in range(x.shape[1])], dim=1))
    return tuple(out)


# ================================================================ project_qkv: wrong
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


_EXAMPLE_QKV = [t.tolist() for t in project_correct(*worked_projection())]


def project_hard_coded(x, W_q, W_k, W_v):
    return tuple(torch.tensor(t, dtype=x.dtype) for t in _EXAMPLE_QKV)


P_ALL = {"test_project_worked_example", "test_project_shapes", "test_project_random", "test_project_gradients_and_inputs"}
P_GRADS = {"test_project_gradients_and_inputs"}

# name: (answer, the test cells it fails in the notebook, those it fails in the re-check)
PROJECT_WRONG = {
    "calls the reference": (project_calls_reference, P_ALL, P_ALL),
    "calls the reference and hides it": (project_calls_reference_and_hides_it, P_ALL, P_ALL),
    "modifies its inputs": (project_in_place, P_ALL, P_ALL),
    "detached": (project_detached, P_GRADS, P_GRADS),
    "returns numpy": (project_numpy, P_ALL, P_ALL),
    # (the notebook's random case is float32: the cast changes nothing there; the re-check's has float64 too)
    "casts to float32": (project_casts, P_ALL - {"test_project_random"}, P_ALL),
    "returns one stacked tensor": (project_returns_stacked, P_ALL, P_ALL),
    "returns Q only": (project_q_only, P_ALL, P_ALL),
    # (the re-check draws fresh numbers of the worked example's sizes: a typed-in result earns nothing there)
    "hard-coded worked example": (project_hard_coded, P_ALL - {"test_project_worked_example"}, P_ALL),
}


# ================================================================ dot_product_scores: correct
def scores_with_mT(Q, K):
    return Q @ K.mT


def scores_with_einsum(Q, K):
    return torch.einsum("...id,...jd->...ij", Q, K)


def scores_with_matmul_and_swapaxes(Q, K):
    return torch.matmul(Q, torch.swapaxes(K, -1, -2))


def scores_by_broadcasting(Q, K):
    return (Q.unsqueeze(-2) * K.unsqueeze(-3)).sum(-1)  # (..., T_q, T_k, d_k) summed over d_k


def scores_transposed_twice(Q, K):
    # (K Q^T)^T = Q K^T: the keys' scores against the queries, turned back
    return (K @ Q.transpose(-2, -1)).transpose(-2, -1)


def scores_flattened_bmm(Q, K):
    # every leading dimension folded into one batch for bmm, then unfolded
    lead, (T_q, d_k), T_k = Q.shape[:-2], Q.shape[-2:], K.shape[-2]
    q = Q.reshape(-1, T_q, d_k)
    k = K.reshape(-1, T_k, d_k)
    return torch.bmm(q, k.transpose(1, 2)).reshape(*lead, T_q, T_k)


# ================================================================ dot_product_scores: wrong
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


S_ALL = {"test_scores_worked_example", "test_scores_batched", "test_scores_random", "test_scores_gradients_and_inputs"}
S_GRADS = {"test_scores_gradients_and_inputs"}

SCORES_WRONG = {
    "calls the reference": (scores_calls_reference, S_ALL, S_ALL),
    "calls the reference and hides it": (scores_calls_reference_and_hides_it, S_ALL, S_ALL),
    "modifies its inputs": (scores_in_place, S_ALL, S_ALL),
    "detached": (scores_detached, S_GRADS, S_GRADS),
    "returns numpy": (scores_numpy, S_ALL, S_ALL),
    # (the notebook's random case is float32; the re-check's has float64 too)
    "casts to float32": (scores_casts, S_ALL - {"test_scores_random"}, S_ALL),
    "returns a tuple": (scores_returns_tuple, S_ALL, S_ALL),
    "hard-coded worked example": (scores_hard_coded, S_ALL - {"test_scores_worked_example"}, S_ALL),
}

CORRECT = {
    "project_qkv": {
        "reference": project_correct, "F.linear": project_with_linear, "einsum": project_with_einsum,
        "one product, then split": project_one_product, "tensordot": project_with_tensordot,
        "token by token": project_token_by_token,
    },
    "dot_product_scores": {
        "reference": scores_correct, "K.mT": scores_with_mT, "einsum": scores_with_einsum,
        "matmul + swapaxes": scores_with_matmul_and_swapaxes, "broadcast and sum": scores_by_broadcasting,
        "(K Q^T)^T": scores_transposed_twice, "flattened into bmm": scores_flattened_bmm,
    },
}
WRONG = {"project_qkv": PROJECT_WRONG, "dot_product_scores": SCORES_WRONG}
