"""Checks for ``sample_next_token(logits, temperature=1.0, top_k=None, top_p=None, generator=None)``.

logits (..., V) -> int64 tokens (...). Visible checks (the student runs them) use
the chapter's six-word example; hidden checks (``full=True``) add seeded random
logits, other shapes and float64.

Decisions stated once:

- **Exact where the contract is exact.** ``temperature=0`` must return the argmax and
  draw nothing: the generator's state and torch's global random state are compared
  before and after the call. A token outside the top-k or top-p set must never be
  drawn (a count of 0, not "rarely"). The same generator seed must give the same
  tokens, and the call must not touch torch's global random state.
- **Statistical elsewhere, with a stated false-failure probability.** Each case draws
  ``N_DRAWS`` = 10,000 tokens in one call (a batch of copies of one row, each with its
  entries in an order of its own: ``permuted_batch``; a sampler that reads only the first row
  fails) from a seeded
  generator and compares every token's count c with its probability p (computed in
  float64 by the reference). The count of a correct sampler is Binomial(N, p);
  Bernstein's inequality bounds P(|c - N p| >= t) by 2 exp(-t^2 / (2 (N p (1 - p) + t / 3))),
  and t is chosen to make that ``DELTA`` = 1e-9. A notebook runs fewer than 400 such
  token tests, so a correct sampler fails one with probability below 4e-7, whatever
  way it draws (multinomial, inverse CDF on ``torch.rand``, Gumbel-max, ...). With
  N = 10,000, t is at most about 2.9 percentage points of frequency, and every named
  mistake moves some token by more than 10 points on these inputs.
- The inputs have no ties, and every top-p threshold is at least 0.01 away from a
  cumulative probability, so that correct answers that order their arithmetic
  differently keep the same tokens.
"""
from __future__ import annotations

import math

import torch

from ..examples.sampling import DELTA, LOGITS, N_DRAWS, WORDS, allowed_deviation
from ..guard import ForbiddenCall, call_without
from ..reference import next_token_probabilities, sample_next_token as reference
from ..reference.sampling import kept_probabilities
from ._student import describe, wrap_checks
from ._core import Mistake, expect_tensor

FORBIDDEN = dict(pieces=("sample_next_token", "next_token_probabilities"), what="the sampler")

# The parameter combinations of the temperature, top-k and top-p tests on the example
# (the trusted re-check uses the same ones, on the example's logits permuted).
TEMPERATURE_CASES = ({"temperature": 1.0}, {"temperature": 0.5}, {"temperature": 2.0})
TOP_K_CASES = ({"top_k": 1}, {"top_k": 3}, {"top_k": 6}, {"temperature": 0.5, "top_k": 2})
TOP_P_CASES = ({"top_p": 0.9}, {"top_p": 0.5}, {"top_k": 3, "top_p": 0.85}, {"temperature": 0.5, "top_p": 0.9})


# ---------------------------------------------------------------- mistakes
def _sampler(*, temp_on_probs=False, temp_multiplies=False, k_shift=0, k_fill=float("-inf"), p_drops_crossing=False,
             p_unnormalised=False, p_before_temp=False, inverse_cdf_unnormalised=False, greedy_draws=False,
             global_rng=False, keeps_last_dim=False, zero_divides=False):
    """A sampler with one (or more) of the typical mistakes switched on."""

    def sample(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
        V = logits.shape[-1]
        g = None if global_rng else generator
        if temperature == 0 and not greedy_draws and not zero_divides:
            return logits.argmax(-1)
        t = 1.0 if temperature == 0 and not zero_divides else temperature
        x = logits
        if p_before_temp and top_p is not None:
            keep = kept_probabilities(logits, 1.0, top_k, top_p) > 0
            x = x.masked_fill(~keep, float("-inf"))
            top_p = None
        if not temp_on_probs:
            x = x * t if temp_multiplies else x / t
        if p_unnormalised or inverse_cdf_unnormalised:  # the softmax of every token, then zeros: no renormalising
            probs = torch.softmax(x, dim=-1)
            if top_k is not None and top_k < V:
                kth = x.topk(top_k, dim=-1).values[..., -1:]
                probs = probs.masked_fill(x < kth, 0.0)
        else:
            if top_k is not None and top_k + k_shift < V:
                kth = x.topk(max(top_k + k_shift, 1), dim=-1).values[..., -1:]
                x = x.masked_fill(x < kth, k_fill)
            probs = torch.softmax(x, dim=-1)
        if temp_on_probs:
            probs = probs / t
        if top_p is not None:
            base = probs if (p_unnormalised or inverse_cdf_unnormalised) else probs / probs.sum(-1, keepdim=True)
            sorted_p, order = base.sort(dim=-1, descending=True)
            cum = sorted_p.cumsum(-1)
            drop_sorted = cum > top_p if p_drops_crossing else (cum - sorted_p) >= top_p
            if p_drops_crossing:
                drop_sorted[..., 0] = False  # keeps at least one token
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
        flat = probs.reshape(-1, V)
        if temperature == 0 and greedy_draws:  # the argmax, after a draw it does not need
            torch.multinomial(torch.softmax(flat, -1), 1, generator=g)
            return logits.argmax(-1)
        if inverse_cdf_unnormalised:
            u = torch.rand(flat.shape[0], 1, generator=g, dtype=flat.dtype)
            tokens = (flat.cumsum(-1) < u).sum(-1).clamp(max=V - 1)
        else:
            tokens = torch.multinomial(flat / flat.sum(-1, keepdim=True), 1, generator=g)[:, 0]
        shape = (*logits.shape[:-1], 1) if keeps_last_dim else logits.shape[:-1]
        return tokens.reshape(shape)

    return sample


MISTAKES = (
    Mistake("temperature applied to the probabilities",
            "divide the logits by the temperature before the softmax; dividing the probabilities by it "
            "changes nothing once they are renormalised.", _sampler(temp_on_probs=True)),
    Mistake("logits multiplied by the temperature",
            "divide the logits by the temperature: a temperature below 1 must sharpen the distribution.",
            _sampler(temp_multiplies=True)),
    Mistake("top-k keeps k + 1 tokens",
            "keep exactly the k largest logits: the k-th largest is topk(k).values[..., -1].", _sampler(k_shift=1)),
    Mistake("top-k keeps k - 1 tokens",
            "keep exactly the k largest logits, the k-th included.", _sampler(k_shift=-1)),
    Mistake("top-k sets the other logits to 0",
            "a logit of 0 is still a likely token; set the logits outside the top k to -inf so that their "
            "probability is exactly 0.", _sampler(k_fill=0.0)),
    Mistake("top-p drops the token that crosses the threshold",
            "keep the smallest set whose total is at least top_p: the token that takes the running total "
            "past top_p is kept (keep a token when the mass of the tokens before it is below top_p).",
            _sampler(p_drops_crossing=True)),
    Mistake("top-p on the probabilities before top-k",
            "choose the top-p set from the top-k tokens' probabilities renormalised to sum to 1 (a softmax of the "
            "logits after top-k has set the others to -inf): the running total of the whole distribution, or of "
            "the top-k probabilities left as they were, reaches top_p later and keeps too many tokens.",
            _sampler(p_unnormalised=True)),
    Mistake("top-p chosen before the temperature",
            "divide by the temperature first, then choose the top-p set from that distribution.",
            _sampler(p_before_temp=True)),
    Mistake("inverse CDF on unnormalised probabilities",
            "after setting the removed tokens' probabilities to 0, renormalise before you compare a uniform "
            "number with the cumulative sum: otherwise a number above the kept mass lands on a removed token.",
            _sampler(inverse_cdf_unnormalised=True)),
    Mistake("temperature 0 divides the logits",
            "temperature 0 means greedy decoding: return the argmax of each row before dividing by the temperature "
            "(logits / 0 are infinite or NaN, and no distribution can be drawn from them).",
            _sampler(zero_divides=True)),
    Mistake("greedy draws a random number",
            "with temperature 0 return the argmax without drawing anything from the generator.",
            _sampler(greedy_draws=True)),
    Mistake("generator ignored",
            "pass generator=generator to torch.multinomial (or torch.rand): every random number must come "
            "from the generator, so that the same seed gives the same tokens.", _sampler(global_rng=True)),
    Mistake("an extra last dimension of size 1",
            "torch.multinomial returns (N, 1): drop that dimension, so that logits (..., V) give tokens (...).",
            _sampler(keeps_last_dim=True)),
)


# ---------------------------------------------------------------- calling the answer
def _describe_kwargs(kwargs):
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in kwargs.items()) or "defaults"


def _label(logits, kwargs):
    return (f"for logits of shape {tuple(logits.shape)} ({str(logits.dtype).replace('torch.', '')}), "
            f"{_describe_kwargs(kwargs)}")


def _call(fn, logits, kwargs, generator):
    """The answer's tokens for ``logits`` (a copy), under the guard; checks type, dtype, shape, range."""
    copy = logits.clone()
    args = dict(kwargs)
    if generator is not None:
        args["generator"] = generator
    result = call_without(fn, (copy,), args, **FORBIDDEN)
    label = _label(logits, kwargs)
    if not torch.equal(copy, logits):
        raise AssertionError(f"Your function changed the logits in place {label}. Build new tensors instead "
                             "(x = x / t, not x /= t or x.div_(t)).")
    tokens = expect_tensor("sample_next_token(...)", result)
    want = tuple(logits.shape[:-1])
    if tokens.dtype != torch.int64:
        raise AssertionError(f"The tokens {label} have dtype {tokens.dtype}; they should be torch.int64 token ids "
                             "(what argmax and torch.multinomial return).")
    if tuple(tokens.shape) != want:
        hint = ""
        if tuple(tokens.shape) == (*want, 1):
            hint = " " + _hint("an extra last dimension of size 1")
        raise AssertionError(f"The tokens {label} have shape {tuple(tokens.shape)} but should have shape {want}: "
                             f"one token per row of the logits.{hint}")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= logits.shape[-1]):
        raise AssertionError(f"A token {label} is {int(tokens.max())}, outside 0..{logits.shape[-1] - 1}.")
    return tokens


def _hint(label):
    m = next(m for m in MISTAKES if m.label == label)
    return m.hint[0].upper() + m.hint[1:]


def permuted_batch(row, shape, seed: int):
    """(batch, perms): ``prod(shape)`` copies of ``row`` (V,), shaped (*shape, V), each with its
    entries in an order of its own (seeded by ``seed``): ``batch[i, j] = row[perms[i, j]]``. Every
    row has the same distribution over the words of ``row``, so the counts of the words drawn are
    Binomial as with identical rows; but a sampler that reads only some rows (the first, say)
    draws the wrong words for the others, and is seen."""
    row = torch.as_tensor(row)
    V = row.shape[-1]
    n = math.prod(shape)
    g = torch.Generator().manual_seed(int(seed) * 7919 + 13)
    perms = torch.argsort(torch.rand(n, V, generator=g, dtype=torch.float64), dim=-1)  # (n, V)
    return row[perms].reshape(*shape, V).contiguous(), perms


def _counts(tokens, V, perms=None):
    """How often each word of the row was drawn (``perms``: as in ``permuted_batch``)."""
    tokens = tokens.reshape(-1)
    if perms is not None:
        tokens = perms.gather(-1, tokens.reshape(-1, 1)).reshape(-1)  # (n,): the word each row drew
    return torch.bincount(tokens, minlength=V).tolist()


def _mistake_counts(m, batch, kwargs, seed, perms=None):
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            out = m.fn(batch.clone(), generator=torch.Generator().manual_seed(seed), **kwargs)
        if out.numel() != batch.shape[:-1].numel() or out.dtype != torch.int64:
            return None
        return _counts(out.reshape(-1), batch.shape[-1], perms)
    except Exception:
        return None


def _frequencies_agree(counts, p, n):
    return all((c == 0) if q == 0 else abs(c - n * q) <= allowed_deviation(n, q) for c, q in zip(counts, p))


NEVER_AGAINST = 30  # a token never drawn in one sample and this often in the other: not the same distribution


def _counts_agree(ours, theirs, n):
    """Two samples of n tokens look drawn from one distribution: every count within twice Bernstein's
    bound of the other's, and no token drawn NEVER_AGAINST times or more in one and never in the other
    (with probability q, n draws miss it with probability (1 - q)^n, about 1e-13 for q = 30 / 10,000)."""
    return all(abs(a - b) <= 2 * allowed_deviation(n, max(b / n, 1 / n))
               and not (min(a, b) == 0 and max(a, b) >= NEVER_AGAINST) for a, b in zip(ours, theirs))


def _matching_mistakes(counts, batch, kwargs, seed, p, perms=None, fn=None):
    """The named mistakes whose own counts (same inputs, same seed) agree with ``counts``.

    With both top_k and top_p, mistakes of different steps can keep the same tokens (top-k keeping
    k + 1 tokens, and top-p chosen before top-k: both keep 3 of the example's tokens with top_k=3,
    top_p=0.85), so a mistake found is kept only if the answer ``fn`` also agrees with it on top_k
    alone, on the same rows."""
    n = batch.shape[:-1].numel()
    found = []
    for m in MISTAKES:
        theirs = _mistake_counts(m, batch, kwargs, seed, perms)
        if theirs is None or _frequencies_agree(theirs, p, n):
            continue  # it crashes here, or is right on these inputs
        if _counts_agree(counts, theirs, n):
            found.append(m)
    if found and fn is not None and kwargs.get("top_k") is not None and kwargs.get("top_p") is not None:
        alone = {k: v for k, v in kwargs.items() if k != "top_p"}
        try:
            ours = _counts(_call(fn, batch, alone, torch.Generator().manual_seed(seed)), batch.shape[-1], perms)
        except Exception:  # noqa: BLE001 (the answer fails there too: nothing to confirm with)
            return found
        found = [m for m in found if (theirs := _mistake_counts(m, batch, alone, seed, perms)) is not None
                 and _counts_agree(ours, theirs, n)]
    return found


def _table(counts, p, n, words):
    rows = []
    for j, (c, q) in enumerate(zip(counts, p)):
        name = words[j] if words else f"token {j}"
        t = allowed_deviation(n, q) if q > 0 else 0.0
        allowed = "never" if q == 0 else f"{100 * max(q - t / n, 0):.1f}%-{100 * min(q + t / n, 1):.1f}%"
        rows.append(f"    {name:>8}: drawn {c:>6} times ({100 * c / n:5.1f}%), probability {100 * q:5.1f}% "
                    f"(allowed: {allowed})")
    return "\n".join(rows)


def _check_frequencies(fn, row, kwargs, *, seed, shape=(N_DRAWS,), words=None, what=""):
    """Draw prod(shape) tokens from copies of ``row`` (V,), each row in its own order
    (``permuted_batch``), in one call; compare the counts of the words drawn with the reference's
    probabilities: exactly 0 where the probability is 0, within Bernstein's bound elsewhere."""
    V = row.shape[-1]
    batch, perms = permuted_batch(row, shape, seed)  # (*shape, V)
    n = batch.shape[:-1].numel()
    tokens = _call(fn, batch, kwargs, torch.Generator().manual_seed(seed))
    counts = _counts(tokens, V, perms)
    p = next_token_probabilities(row.to(torch.float64), **kwargs).tolist()
    problem = None
    worst, excess = None, 1.0
    for j, (c, q) in enumerate(zip(counts, p)):
        name = repr(words[j]) if words else f"token {j}"
        if q == 0 and c > 0:
            problem = (f"{name} was drawn {c} times, but it is outside the tokens that {_describe_kwargs(kwargs)} "
                       "keeps: its probability is exactly 0, so it must never be drawn.")
            break
        if q > 0 and abs(c - n * q) / allowed_deviation(n, q) > excess:  # the token furthest off, in bounds
            worst, excess = j, abs(c - n * q) / allowed_deviation(n, q)
    if problem is None and worst is not None:
        c, q = counts[worst], p[worst]
        name = repr(words[worst]) if words else f"token {worst}"
        problem = (f"{name} was drawn {c} times out of {n} ({100 * c / n:.1f}%), but its probability is "
                   f"{100 * q:.1f}%: a correct sampler lands that far off with probability below {DELTA:g}.")
    if problem is None:
        return
    found = _matching_mistakes(counts, batch, kwargs, seed, p, perms, fn)
    diagnosis = ("\nYour draws match a typical mistake:\n" + "\n".join(f"  - {m.label}: {m.hint}" for m in found)
                 if found else "")
    raise AssertionError(
        f"Sampling {n} tokens {what or _label(batch, kwargs)}: {problem}\n"
        f"Your counts against the probabilities:\n{_table(counts, p, n, words)}{diagnosis}")


def _example(dtype=torch.float32):
    return torch.tensor(LOGITS, dtype=dtype)


def _random_row(g, V, dtype=torch.float32, scale=1.5):
    """Logits without near-ties (every gap at least 0.02)."""
    while True:
        row = torch.randn(V, generator=g, dtype=torch.float64) * scale
        s = row.sort().values
        if V < 2 or bool((s[1:] - s[:-1]).min() >= 0.02):
            return row.to(dtype)


def safe_top_p(row, kwargs, g):
    """A top_p for ``row`` at least 0.01 away from every cumulative probability of the distribution
    left by ``kwargs`` (temperature, top_k), crossing at a token of probability >= 0.06; None if none."""
    p = next_token_probabilities(row.to(torch.float64), **kwargs).sort(descending=True).values
    cum = p.cumsum(0)
    choices = [i for i in range(1, int((p > 0).sum())) if p[i] >= 0.06 and cum[i - 1] <= 0.97]
    if not choices:
        return None
    i = choices[int(torch.randint(len(choices), (1,), generator=g))]
    return round(float(cum[i - 1] + p[i] / 2), 4)  # between the mass before token i and the mass with it


# ---------------------------------------------------------------- visible
def check_greedy(fn, full=True):
    """temperature=0 returns the argmax of every row, exactly, whatever top_k and top_p say, and draws
    nothing: the generator's state and torch's global random state are unchanged by the call."""
    g = torch.Generator().manual_seed(3)
    cases = [(_example(), {}), (torch.randn(4, 6, generator=g), {}), (torch.randn(2, 3, 6, generator=g), {"top_k": 2}),
             (torch.randn(5, 6, generator=g), {"top_p": 0.5})]
    if full:
        cases += [(torch.randn(3, 50, generator=g, dtype=torch.float64), {}),
                  (torch.randn(2, 2, 2, 9, generator=g), {"top_k": 3, "top_p": 0.8}),
                  (torch.randn(7, 1, generator=g), {})]
    for logits, extra in cases:
        kwargs = {"temperature": 0.0, **extra}
        gen = torch.Generator().manual_seed(11)
        state = gen.get_state()
        global_state = torch.random.get_rng_state()
        label = _label(logits, kwargs)
        try:
            tokens = _call(fn, logits, kwargs, gen)
        except AssertionError:
            raise
        except Exception as err:  # (the answer's own error: say what temperature 0 asks for)
            why = _greedy_failure(fn, err, logits, kwargs)
            raise AssertionError(f"With temperature 0 {label} your function {describe(err)}"
                                 + (f"\n{why}" if why else "")) from None
        want = logits.argmax(-1)
        if not torch.equal(tokens, want):
            raise AssertionError(f"With temperature 0 the tokens {label} should be the argmax of each row, "
                                 f"{want.tolist()}, but they are {tokens.tolist()}.")
        if not torch.equal(gen.get_state(), state) or not torch.equal(torch.random.get_rng_state(), global_state):
            raise AssertionError(f"With temperature 0 ({label}) your function returned the argmax but drew a random "
                                 f"number. {_hint('greedy draws a random number')}")


def _greedy_failure(fn, err, logits, kwargs):
    """What an error raised at temperature 0 says: the named mistake that raises the same error on
    these logits, or, when the answer runs at temperature 1, that temperature 0 is the cause."""
    for m in MISTAKES:
        try:
            m.fn(logits.clone(), **kwargs)
        except Exception as theirs:  # noqa: BLE001
            if type(theirs) is type(err) and str(theirs).splitlines()[:1] == str(err).splitlines()[:1]:
                return f"Your code matches a typical mistake:\n  - {m.label}: {m.hint}"
    try:
        _call(fn, logits, {**kwargs, "temperature": 1.0}, torch.Generator().manual_seed(11))
    except Exception:  # noqa: BLE001 (it fails at temperature 1 too: the error is not about temperature 0)
        return ""
    return ("It runs with temperature 1 on the same logits, so temperature 0 is what fails: " +
            _hint("temperature 0 divides the logits"))


def check_shapes(fn, full=True):
    """Logits (..., V) give int64 tokens of shape (...) in 0..V-1: for (V,), (3, V) and (2, 3, V)
    (at grading also (1, 1, V), V = 1, float64 and top-k/top-p)."""
    g = torch.Generator().manual_seed(5)
    cases = [(torch.randn(6, generator=g), {}), (torch.randn(3, 6, generator=g), {}),
             (torch.randn(2, 3, 6, generator=g), {})]
    if full:
        cases += [(torch.randn(1, 1, 8, generator=g), {}), (torch.randn(4, 1, generator=g), {}),
                  (torch.randn(2, 5, 7, generator=g, dtype=torch.float64), {"temperature": 0.7}),
                  (torch.randn(3, 2, 10, generator=g), {"top_k": 4, "top_p": 0.6})]
    for logits, kwargs in cases:
        _call(fn, logits, kwargs, torch.Generator().manual_seed(0))


def check_generator(fn, full=True):
    """Random numbers come from ``generator`` only: two generators with the same seed give the same
    1,000 tokens, another seed gives other tokens, and torch's global random state is untouched
    (at grading also with top-k and top-p, and without a generator)."""
    cases = [(_example().expand(1000, 6).contiguous(), {})]
    if full:
        cases += [(_example(torch.float64).expand(40, 25, 6).contiguous(), {"temperature": 1.5}),
                  (_example().expand(1000, 6).contiguous(), {"top_k": 4, "top_p": 0.9})]
    for logits, kwargs in cases:
        label = _label(logits, kwargs)
        global_state = torch.random.get_rng_state()
        first = _call(fn, logits, kwargs, torch.Generator().manual_seed(1234))
        if not torch.equal(torch.random.get_rng_state(), global_state):
            raise AssertionError(f"Your function changed torch's global random state {label}: it draws from the "
                                 f"global generator instead of the one it is given. {_hint('generator ignored')}")
        again = _call(fn, logits, kwargs, torch.Generator().manual_seed(1234))
        if not torch.equal(first, again):
            raise AssertionError(f"Two generators with the same seed gave different tokens {label} "
                                 f"({int((first != again).sum())} of {first.numel()} differ). {_hint('generator ignored')}")
        other = _call(fn, logits, kwargs, torch.Generator().manual_seed(4321))
        if torch.equal(first, other):
            raise AssertionError(f"Generators with different seeds gave exactly the same {first.numel()} tokens "
                                 f"{label}: your draws do not come from the generator. {_hint('generator ignored')}")
    if full:  # no generator: torch's global one, and valid tokens
        with torch.random.fork_rng(devices=[]):
            _call(fn, _example().expand(10, 6).contiguous(), {}, None)


def check_temperature(fn, full=True):
    """The example's logits at temperatures 1, 0.5 and 2: 10,000 draws each, every token's frequency
    within Bernstein's bound of its probability (false-failure probability 1e-9 per token; see the module's
    docstring). At grading also random logits, float64 and a (2, 5000) batch."""
    for i, kwargs in enumerate(TEMPERATURE_CASES):
        _check_frequencies(fn, _example(), kwargs, seed=100 + i, words=WORDS,
                           what=f"from the example's logits with {_describe_kwargs(kwargs)}")
    if full:
        g = torch.Generator().manual_seed(7)
        for i, (t, dtype) in enumerate(((0.7, torch.float32), (1.5, torch.float64), (0.3, torch.float32))):
            _check_frequencies(fn, _random_row(g, 10, dtype), {"temperature": t}, seed=110 + i,
                               shape=(2, N_DRAWS // 2) if i == 1 else (N_DRAWS,))


def check_top_k(fn, full=True):
    """top_k keeps the k largest logits: tokens outside them are never drawn, and the others keep
    their renormalised probabilities (the example with k = 1, 3, 6, and k = 2 at temperature 0.5;
    10,000 draws each, tolerance as in the temperature test). At grading also random logits."""
    for i, kwargs in enumerate(TOP_K_CASES):
        _check_frequencies(fn, _example(), kwargs, seed=200 + i, words=WORDS,
                           what=f"from the example's logits with {_describe_kwargs(kwargs)}")
    if full:
        g = torch.Generator().manual_seed(8)
        for i, kwargs in enumerate(({"top_k": 4}, {"top_k": 1}, {"temperature": 0.8, "top_k": 5}, {"top_k": 9})):
            _check_frequencies(fn, _random_row(g, 12, torch.float64 if i % 2 else torch.float32), kwargs, seed=210 + i)


def check_top_p(fn, full=True):
    """top_p keeps the smallest set of most likely tokens whose total is at least top_p, the crossing
    token included, chosen after the temperature and from the top-k tokens renormalised: the example with
    top_p = 0.9, 0.5, top_k = 3 with top_p = 0.85, and temperature 0.5 with top_p = 0.9 (10,000 draws each,
    tolerance as in the temperature test). At grading also random logits and top_p = 1."""
    for i, kwargs in enumerate(TOP_P_CASES):
        _check_frequencies(fn, _example(), kwargs, seed=300 + i, words=WORDS,
                           what=f"from the example's logits with {_describe_kwargs(kwargs)}")
    if full:
        _check_frequencies(fn, _example(), {"top_p": 1.0}, seed=310, words=WORDS)
        g = torch.Generator().manual_seed(9)
        done = 0
        for i, extra in enumerate(({}, {"temperature": 0.7}, {"top_k": 6}, {}, {"temperature": 1.3, "top_k": 8})):
            row = _random_row(g, 10, torch.float64 if i % 2 else torch.float32)
            top_p = safe_top_p(row, extra, g)
            if top_p is not None:
                _check_frequencies(fn, row, {**extra, "top_p": top_p}, seed=320 + i)
                done += 1
        assert done >= 3, "internal: too few random top-p cases"


wrap_checks(globals())  # student-facing failures: the student's own line first, their frames only
