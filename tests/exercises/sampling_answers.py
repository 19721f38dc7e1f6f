"""sampling: the answers the generic harness (test_declarations.py) runs besides the declaration's own
mistakes. Correct answers draw other tokens than the course's from the same generator (an inverse CDF
on ``torch.rand``, the Gumbel-max trick, a draw among the sorted probabilities, ...): all must pass,
since the tests judge frequencies, not tokens. Wrong answers that no mistake names (a zero
temperature divided by, the reference called, float tokens, top_p ignored, only the first row read,
...) each fail exactly the test cells listed, in the notebook and in the re-check."""
from __future__ import annotations

import torch

from course import as_student_code
from firstprinciples import reference

correct = as_student_code(reference.sample_next_token)  # what a correct student writes

G, SH, GEN, T, K, P = "test_greedy", "test_shapes", "test_generator", "test_temperature", "test_top_k", "test_top_p"
ALL = {G, SH, GEN, T, K, P}


def _filtered(logits, temperature, top_k, top_p):
    """The kept distribution, written independently of the reference (a loop over sorted tokens)."""
    x = logits / temperature
    V = x.shape[-1]
    if top_k is not None and top_k < V:
        order = x.argsort(dim=-1, descending=True)
        drop = torch.ones_like(x, dtype=torch.bool).scatter(-1, order[..., :top_k], False)
        x = x.masked_fill(drop, float("-inf"))
    p = torch.exp(x - x.amax(-1, keepdim=True))
    p = p / p.sum(-1, keepdim=True)
    if top_p is not None:
        sorted_p, order = p.sort(dim=-1, descending=True)
        exclusive = torch.cat([torch.zeros_like(sorted_p[..., :1]), sorted_p.cumsum(-1)[..., :-1]], dim=-1)
        keep = torch.zeros_like(p, dtype=torch.bool).scatter(-1, order, exclusive < top_p)
        p = torch.where(keep, p, torch.zeros_like(p))
        p = p / p.sum(-1, keepdim=True)
    return p


def inverse_cdf(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    if temperature == 0:
        return logits.argmax(-1)
    p = _filtered(logits, temperature, top_k, top_p)
    u = torch.rand(p.shape[:-1] + (1,), generator=generator, dtype=p.dtype)
    cdf = p.cumsum(-1)
    tokens = (cdf < u * cdf[..., -1:]).sum(-1)
    return tokens.clamp(max=p.shape[-1] - 1)


def gumbel_max(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    if temperature == 0:
        return logits.argmax(-1)
    p = _filtered(logits, temperature, top_k, top_p)
    u = torch.rand(p.shape, generator=generator, dtype=torch.float64).clamp_min(1e-300)
    return (p.double().log() - (-u.log()).log()).argmax(-1)


def in_sorted_order(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """Draws a rank among the sorted probabilities, then looks the token up."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    p = _filtered(logits, temperature, top_k, top_p)
    sorted_p, order = p.reshape(-1, p.shape[-1]).sort(dim=-1, descending=True)
    rank = torch.multinomial(sorted_p, 1, generator=generator)  # (N, 1)
    return order.gather(-1, rank)[:, 0].reshape(logits.shape[:-1])


def exponential_race(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """Each kept token waits an exponential time of rate p_j; the first to arrive is drawn (the
    minimum of E_j / p_j picks j with probability p_j). top-k and top-p by a Python loop over the
    ranks, keeping a running total."""
    if temperature == 0:
        return logits.argmax(-1)
    x = (logits / temperature).double()
    p = torch.exp(x - x.amax(-1, keepdim=True))
    sorted_p, order = p.sort(dim=-1, descending=True)
    keep = torch.zeros_like(sorted_p, dtype=torch.bool)
    total = torch.zeros_like(sorted_p[..., 0])
    mass = sorted_p.sum(-1)
    if top_k is not None:
        mass = sorted_p[..., :top_k].sum(-1)
    for rank in range(sorted_p.shape[-1]):
        still = torch.ones_like(total, dtype=torch.bool) if top_p is None else total < top_p
        if top_k is not None:
            still = still & torch.tensor(rank < top_k)
        keep[..., rank] = still
        total = total + sorted_p[..., rank] / mass
    p = torch.zeros_like(p).scatter(-1, order, torch.where(keep, sorted_p, torch.zeros_like(sorted_p)))
    e = -torch.log1p(-torch.rand(p.shape, generator=generator, dtype=torch.float64))  # Exp(1) times
    return (e / p).argmin(-1)  # p = 0 gives an infinite wait


def cumulative_search(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """The kept mass as log-probabilities with logsumexp, top-p decided on the sorted log-probabilities,
    and the token found by torch.searchsorted in the cumulative sums."""
    if temperature == 0:
        return torch.argmax(logits, -1)
    z = logits.to(torch.float64) / temperature
    if top_k is not None:
        kth = torch.sort(z, dim=-1, descending=True).values[..., min(top_k, z.shape[-1]) - 1:min(top_k, z.shape[-1])]
        z = torch.where(z >= kth, z, torch.full_like(z, -torch.inf))
    logp = z - torch.logsumexp(z, -1, keepdim=True)
    if top_p is not None:
        s, order = torch.sort(logp, dim=-1, descending=True)
        before = torch.cat([torch.zeros_like(s[..., :1]), torch.cumsum(s.exp(), -1)[..., :-1]], -1)
        s = torch.where(before < top_p, s, torch.full_like(s, -torch.inf))
        logp = torch.full_like(logp, -torch.inf).scatter(-1, order, s)
    cdf = torch.cumsum(torch.softmax(logp, -1), -1)
    u = torch.rand((*cdf.shape[:-1], 1), generator=generator, dtype=cdf.dtype) * cdf[..., -1:]
    return torch.searchsorted(cdf.contiguous(), u, right=True).squeeze(-1).clamp(max=cdf.shape[-1] - 1)


CORRECT = {"reference": correct, "inverse CDF": inverse_cdf, "Gumbel-max": gumbel_max,
           "in sorted order": in_sorted_order, "exponential race, a loop over ranks": exponential_race,
           "log-probabilities and searchsorted": cumulative_search}


def divides_by_zero(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator).reshape(logits.shape[:-1])


def stops_on_non_finite(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """An inverse CDF that refuses probabilities that are not finite: at temperature 0 it raises an
    error of its own, not torch's."""
    p = _filtered(logits, temperature, top_k, top_p)
    if not bool(torch.isfinite(p).all()):
        raise ValueError("the probabilities are not finite")
    u = torch.rand(p.shape[:-1] + (1,), generator=generator, dtype=p.dtype)
    cdf = p.cumsum(-1)
    return (cdf < u * cdf[..., -1:]).sum(-1).clamp(max=p.shape[-1] - 1)


def top_p_before_top_k(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """A student's sampler that chooses the top-p set from the whole distribution and the top-k set from
    the logits, and keeps the tokens in both."""
    if temperature == 0:
        return logits.argmax(-1)
    x = logits / temperature
    p = torch.softmax(x, dim=-1)
    keep = torch.ones_like(p, dtype=torch.bool)
    if top_k is not None:
        keep &= x >= x.topk(min(top_k, x.shape[-1]), dim=-1).values[..., -1:]
    if top_p is not None:
        sorted_p, order = p.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p
        keep &= torch.zeros_like(keep).scatter(-1, order, before < top_p)
    p = torch.where(keep, p, torch.zeros_like(p))
    flat = p.reshape(-1, p.shape[-1])
    return torch.multinomial(flat, 1, generator=generator)[:, 0].reshape(logits.shape[:-1])


def calls_reference(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    return reference.sample_next_token(logits, temperature, top_k, top_p, generator)


def float_tokens(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    return correct(logits, temperature, top_k, top_p, generator).float()


def top_p_ignored(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    return correct(logits, temperature, top_k, None, generator)


def first_row_only(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """Draws every token from the first row's distribution: right on a batch of identical rows."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    flat = logits.reshape(-1, logits.shape[-1])
    p = _filtered(flat[:1], temperature, top_k, top_p)[0]  # (V,)
    return torch.multinomial(p, flat.shape[0], replacement=True, generator=generator).reshape(logits.shape[:-1])


def always_greedy(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """The argmax whatever the temperature: reproducible, but every seed gives the same tokens."""
    return logits.argmax(-1)


def flattens_the_batch(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """One token per row, but as a flat (N,) tensor, whatever the leading dimensions."""
    if temperature == 0:
        return logits.reshape(-1, logits.shape[-1]).argmax(-1)
    return correct(logits, temperature, top_k, top_p, generator).reshape(-1)


def squeezes(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """Drops multinomial's last dimension with squeeze(): right for (V,) and (N, V) only."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)  # (top-k and top-p left out: not what is tested here)
    if top_k is not None or top_p is not None:
        return correct(logits, temperature, top_k, top_p, generator)
    return torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator).squeeze()


def scales_in_place(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """Divides the caller's logits by the temperature in place."""
    if temperature == 0:
        return logits.argmax(-1)
    logits /= temperature
    return correct(logits, 1.0, top_k, top_p, generator)


WRONG = {
    "divides by a temperature of 0": (divides_by_zero, {G, K, P}, {G, K, P}),
    "calls the reference": (calls_reference, ALL, ALL),
    "stops on non-finite probabilities": (stops_on_non_finite, {G}, {G}),
    "top-p before top-k (a student's)": (top_p_before_top_k, {P}, {P}),
    "float tokens": (float_tokens, ALL, ALL),
    "top_p ignored": (top_p_ignored, {P}, {P}),
    "reads only the first row": (first_row_only, {T, K, P}, {T, K, P}),
    "always greedy": (always_greedy, {GEN, T, K, P}, {GEN, T, K, P}),
    "flattens the batch": (flattens_the_batch, {G, SH}, {G, SH, GEN, T}),
    "scales the logits in place": (scales_in_place, {T, K, P}, {SH, GEN, T, K, P}),
    "squeezes the tokens": (squeezes, {SH}, {SH, GEN, T}),
}
