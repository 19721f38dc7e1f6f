"""Every sampling check accepts right answers and rejects typical wrong ones.

Correct answers: the reference, an inverse CDF on ``torch.rand``, the Gumbel-max trick and a
draw among the sorted probabilities; they draw different tokens from the same generator, and all must pass. Wrong
answers: the package's named mistakes plus a few more (dividing by a zero temperature, calling
the reference, float tokens, ignoring top_p). Each must fail exactly the checks listed.
"""
from __future__ import annotations

import torch
from checktable import (assert_names_the_mistake, correct_answers_test, outcome, expectations_test, messages_test, naming_test, rejections_test,
                        variants_test)

from course import as_student_code
from firstprinciples import reference
from firstprinciples.checks import sampling as S

CHECKS = {"greedy": S.check_greedy, "shapes": S.check_shapes, "generator": S.check_generator,
          "temperature": S.check_temperature, "top_k": S.check_top_k, "top_p": S.check_top_p}
ALL = set(CHECKS)

correct = as_student_code(reference.sample_next_token)


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


CORRECT = {"reference": correct, "inverse CDF": inverse_cdf, "Gumbel-max": gumbel_max, "in sorted order": in_sorted_order}


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


MISTAKE_FAILS = {
    "temperature applied to the probabilities": {"temperature", "top_k", "top_p"},
    "logits multiplied by the temperature": {"temperature", "top_k", "top_p"},
    "top-k keeps k + 1 tokens": {"top_k", "top_p"},
    "top-k keeps k - 1 tokens": {"top_k"},
    "top-k sets the other logits to 0": {"top_k", "top_p"},
    "top-p drops the token that crosses the threshold": {"top_p"},
    "top-p on the probabilities before top-k": {"top_p"},
    "top-p chosen before the temperature": {"top_p"},
    "inverse CDF on unnormalised probabilities": {"top_k", "top_p"},
    "temperature 0 divides the logits": {"greedy"},
    "greedy draws a random number": {"greedy"},
    "generator ignored": {"generator"},
    "an extra last dimension of size 1": ALL - {"greedy"},
}
VARIANTS = {m.label: (m.fn, MISTAKE_FAILS[m.label]) for m in S.MISTAKES}
VARIANTS.update({
    "divides by a temperature of 0": (divides_by_zero, {"greedy", "top_k", "top_p"}),
    "calls the reference": (calls_reference, ALL),
    "stops on non-finite probabilities": (stops_on_non_finite, {"greedy"}),
    "top-p before top-k (a student's)": (top_p_before_top_k, {"top_p"}),
    "float tokens": (float_tokens, ALL),
    "top_p ignored": (top_p_ignored, {"top_p"}),
    "reads only the first row": (first_row_only, {"temperature", "top_k", "top_p"}),
})

test_every_mistake_has_an_expectation = expectations_test((MISTAKE_FAILS, S.MISTAKES))
test_correct_answers_pass = correct_answers_test(CHECKS, CORRECT)
test_variant_fails_exactly_the_expected_checks = variants_test(CHECKS, VARIANTS)
test_each_check_rejects_at_least_five_variants = rejections_test(
    {k: v for k, v in CHECKS.items() if k in ("temperature", "top_k", "top_p")}, VARIANTS)
test_failure_names_the_mistake = naming_test(CHECKS, VARIANTS, [
    ("temperature applied to the probabilities", "temperature"),
    ("logits multiplied by the temperature", "temperature"),
    ("top-k keeps k + 1 tokens", "top_k"),
    ("top-p drops the token that crosses the threshold", "top_p"),
    ("top-p on the probabilities before top-k", "top_p"),
    ("top-p chosen before the temperature", "top_p"),
])
test_messages = messages_test(CHECKS, VARIANTS, [
    ("greedy draws a random number", "greedy", ["drew a random number"]),
    ("generator ignored", "generator", ["global random state"]),
    ("an extra last dimension of size 1", "shapes", ["(N, 1)"]),
    ("top-k sets the other logits to 0", "top_k", ["must never be drawn"]),
    ("calls the reference", "greedy", ["scores 0"]),
    # torch's own error at temperature 0 comes with the mistake that causes it
    ("divides by a temperature of 0", "greedy", ["With temperature 0", "raised RuntimeError in your code",
                                                 "temperature 0 divides the logits"]),
    ("stops on non-finite probabilities", "greedy", ["the probabilities are not finite",
                                                     "It runs with temperature 1 on the same logits"]),
    ("top-p before top-k (a student's)", "top_p", ["top-p on the probabilities before top-k"]),
])


def test_greedy_and_generator_checks_reject_few_but_exactly():
    """greedy, generator and shapes test one property each: fewer than five variants break it, on purpose."""
    for name in ("greedy", "generator", "shapes"):
        assert sum(name in f for _, f in VARIANTS.values()) >= 3, name


def test_bound_is_bernstein():
    t = S.allowed_deviation(10_000, 0.3)
    assert 300 < t < 350  # about 6.6 standard deviations of 45.8
    import math
    assert math.isclose(2 * math.exp(-t * t / (2 * (10_000 * 0.21 + t / 3))), S.DELTA, rel_tol=1e-9)


def test_reference_matches_an_independent_filter():
    g = torch.Generator().manual_seed(0)
    for kwargs in (*S.TEMPERATURE_CASES, *S.TOP_K_CASES, *S.TOP_P_CASES):
        logits = torch.randn(5, 9, generator=g, dtype=torch.float64)
        want = _filtered(logits, kwargs.get("temperature", 1.0), kwargs.get("top_k"), kwargs.get("top_p"))
        assert torch.allclose(reference.next_token_probabilities(logits, **kwargs), want, atol=1e-12)


def test_top_p_before_top_k_is_not_called_top_k_keeping_k_plus_1():
    """With top_k=3, top_p=0.85 both keep the same 3 tokens; the student's top_k alone is right."""
    ok, err = outcome(CHECKS["top_p"], top_p_before_top_k)
    assert not ok and "k + 1" not in str(err), str(err)
    # nor a sampler that draws, 177 times in 10,000, tokens this one never draws
    assert "inverse CDF" not in str(err), str(err)


def test_top_k_keeping_k_plus_1_is_still_named_in_the_top_p_test():
    assert_names_the_mistake(CHECKS["top_p"], VARIANTS["top-k keeps k + 1 tokens"][0], "top-k keeps k + 1 tokens")
