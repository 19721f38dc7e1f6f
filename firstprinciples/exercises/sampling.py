"""sample_next_token(logits, temperature=1.0, top_k=None, top_p=None, generator=None): the
exercise's tests, declared once.

logits (..., V) -> int64 tokens (...). A correct sampler may draw other tokens than the course's
from the same generator (``torch.multinomial``, an inverse CDF on ``torch.rand``, Gumbel-max, ...),
so no token is compared with the reference's: every test compares only type, dtype and shape with
it (``values=False``) and judges the rest by properties on plain data.

Decisions stated once:

- **Exact where the contract is exact.** ``temperature=0`` must return the argmax and draw
  nothing: the generator's state and torch's global random state are compared before and after the
  call (``test_greedy``). A token outside the top-k or top-p set must never be drawn (a count of 0,
  not "rarely"). The same generator seed must give the same tokens, another seed other tokens, and
  the call must not touch torch's global random state (``test_generator``).
- **Statistical elsewhere, with a stated false-failure probability.** Each frequency case draws
  ``N_DRAWS`` = 10,000 tokens in one call from a batch of copies of one row, each copy with its
  entries in an order of its own (``permutations``: a sampler that reads only the first row draws
  the wrong words for the others and fails; issue 38 asks for distinct rows), from a seeded
  generator, and compares every word's count c with its probability p (the reference's
  ``next_token_probabilities`` in float64: stored as data for the visible cases, computed in the
  trusted grader for the secret ones, never in the re-check's runner). The count of a correct sampler is Binomial(N, p); Bernstein's inequality
  bounds P(|c - N p| >= t) by 2 exp(-t^2 / (2 (N p (1 - p) + t / 3))), and t
  (``examples.sampling.allowed_deviation``) makes that ``DELTA`` = 1e-9. The notebook and the
  re-check together run fewer than 400 such word tests, so a correct sampler fails one with
  probability below 4e-7, whatever way it draws. With N = 10,000, t is at most about 2.9
  percentage points of frequency, and every named mistake moves some word by more than 10 points
  on these inputs.
- The inputs have no ties (random rows keep every gap at least 0.02), and every top-p threshold is
  at least 0.009 away from a cumulative probability (0.01 on random rows; the chapter's top_k=3,
  top_p=0.85 is 0.0098 below 0.8598), so that correct answers that order their arithmetic
  differently (which moves a float32 sum by about 1e-7) keep the same tokens.
- A mistake is named when the answer's counts and the mistake's own counts (same rows, same seed)
  look drawn from one distribution (``counts_agree``), and the mistake is wrong on the case. With
  both top_k and top_p a top-k mistake and a top-p mistake can keep the same tokens, so the adapter
  also reports the draws with top_k alone, and a mistake is kept only if it agrees there too.
- The course's ``sample_next_token`` and ``next_token_probabilities`` are forbidden: an answer that
  calls them scores 0.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..examples.sampling import DELTA, LOGITS, N_DRAWS, WORDS, allowed_deviation
from . import Exercise, Mistake, Test, case

PARAMS = ("temperature", "top_k", "top_p")
# The parameters of the frequency tests on the chapter's logits (the re-check draws the same ones
# on the chapter's logits permuted, and more on fresh random rows).
TEMPERATURE_CASES = ({"temperature": 1.0}, {"temperature": 0.5}, {"temperature": 2.0})
TOP_K_CASES = ({"top_k": 1}, {"top_k": 3}, {"top_k": 6}, {"temperature": 0.5, "top_k": 2})
TOP_P_CASES = ({"top_p": 0.9}, {"top_p": 0.5}, {"top_k": 3, "top_p": 0.85}, {"temperature": 0.5, "top_p": 0.9})
# The reference's probabilities of the chapter's logits for each of those parameter sets, stored as
# data: a notebook's test cell judges the visible draws without any implementation of the sampler
# (tests/exercises/test_sampling.py checks them against the reference).
EXAMPLE_PROBABILITIES = {
    (("temperature", 1.0),): (0.5572745643630722, 0.205009855316946, 0.12434476279297876, 0.07541891100863633,
                              0.027745066835615874, 0.010206839682750683),
    (("temperature", 0.5),): (0.8290140284163349, 0.11219484834284997, 0.04127417811068237, 0.015183921578168405,
                              0.0020549203274239365, 0.00027810322454059134),
    (("temperature", 2.0),): (0.3564754717839912, 0.21621330307251643, 0.16838708974333078, 0.13113999735122095,
                              0.07954042910814903, 0.04824370894079159),
    (("top_k", 1),): (1.0, 0.0, 0.0, 0.0, 0.0, 0.0),
    (("top_k", 3),): (0.6285317192117624, 0.23122389762214907, 0.14024438316608848, 0.0, 0.0, 0.0),
    (("top_k", 6),): (0.5572745643630722, 0.205009855316946, 0.12434476279297876, 0.07541891100863633,
                      0.027745066835615874, 0.010206839682750683),
    (("temperature", 0.5), ("top_k", 2)): (0.8807970779778823, 0.11920292202211755, 0.0, 0.0, 0.0, 0.0),
    (("top_p", 0.9),): (0.5792585299413737, 0.21309730428862378, 0.12925004855316274, 0.07839411721683971, 0.0, 0.0),
    (("top_p", 0.5),): (1.0, 0.0, 0.0, 0.0, 0.0, 0.0),
    (("top_k", 3), ("top_p", 0.85)): (0.7310585786300048, 0.2689414213699951, 0.0, 0.0, 0.0, 0.0),
    (("temperature", 0.5), ("top_p", 0.9)): (0.8807970779778824, 0.11920292202211756, 0.0, 0.0, 0.0, 0.0),
}
ALONE = "tokens with top_k alone"
UNCHANGED = "logits unchanged by the call"


# ---------------------------------------------------------------- the adapter
def permutations(seed: int, n: int, V: int) -> np.ndarray:
    """(n, V): row i is an order of 0..V-1 of its own, from ``seed`` (the same in every process)."""
    return np.argsort(np.random.default_rng([int(seed), 7919]).random((n, V)), axis=-1)


def batch_of(case: dict):
    """The logits the piece is called with: a case's ``logits``, or with ``batch`` the copies of its
    row (V,) shaped (*batch, V), ``batch[i] = row[perms[i]]`` (``permutations`` of the case's seed)."""
    logits = case["logits"]
    if "batch" not in case:
        return logits, None
    shape = tuple(int(s) for s in case["batch"])
    V = logits.shape[-1]
    perms = permutations(case["seed"], math.prod(shape), V)
    return logits[torch.from_numpy(perms)].reshape(*shape, V).contiguous(), perms


RUNS_AT_ONE = "It runs with temperature 1 on the same logits, so temperature 0 is what fails."


def adapter(fn, case: dict) -> dict:
    """Call ``fn`` on the case's logits with its parameters and a generator seeded by its ``seed``
    (none with ``no_generator``, under a forked global random state), and report: the tokens, whether
    the logits are unchanged by the call (a flag, not the 10,000 rows: the expected results stored
    for the notebook and the runner's report stay small), whether the generator's state moved and whether torch's global one stayed;
    with ``again`` the tokens of two more calls (the same seed, another seed); with top_k
    and top_p the tokens of a call with top_k alone (to tell a top-k mistake from a top-p one).

    At temperature 0 an error of ``fn`` is raised as it is, with one sentence added to its text when
    ``fn`` runs at temperature 1 on the same logits: temperature 0 is then what fails."""
    kwargs = {k: case[k] for k in PARAMS if k in case}
    logits, _ = batch_of(case)
    seed = int(case["seed"])

    def call(x, extra, seed_):
        return fn(x, **extra, generator=torch.Generator().manual_seed(seed_))

    gen = torch.Generator().manual_seed(seed)
    state, global_state = gen.get_state(), torch.random.get_rng_state()
    seen = logits.clone()
    try:
        if case.get("no_generator"):
            with torch.random.fork_rng(devices=[]):
                tokens = fn(seen, **kwargs)
        else:
            tokens = fn(seen, **kwargs, generator=gen)
    except Exception as err:
        if kwargs.get("temperature") == 0 and len(err.args) == 1 and isinstance(err.args[0], str):
            try:
                call(logits.clone(), {**kwargs, "temperature": 1.0}, seed)
            except Exception:  # noqa: BLE001 (it fails at temperature 1 too: not about temperature 0)
                pass
            else:
                err.args = (f"{err.args[0]}\n{RUNS_AT_ONE}",)
        raise
    out = {"tokens": tokens, UNCHANGED: torch.tensor(torch.equal(seen, logits)),
           "drew from the generator": torch.tensor(not torch.equal(gen.get_state(), state)),
           "left the global random state": torch.tensor(torch.equal(torch.random.get_rng_state(), global_state))}
    if case.get("again") and not case.get("no_generator"):
        out["tokens, the same seed again"] = call(logits.clone(), kwargs, seed)
        out["tokens, another seed"] = call(logits.clone(), kwargs, seed + 1)
    if kwargs.get("top_k") is not None and kwargs.get("top_p") is not None and kwargs.get("temperature") != 0:
        out[ALONE] = call(logits.clone(), {k: v for k, v in kwargs.items() if k != "top_p"}, seed)
    return out


# ---------------------------------------------------------------- typical mistakes
def _sampler(*, temp_on_probs=False, temp_multiplies=False, k_shift=0, k_fill=float("-inf"), p_drops_crossing=False,
             p_unnormalised=False, p_before_temp=False, inverse_cdf_unnormalised=False, greedy_draws=False,
             global_rng=False, keeps_last_dim=False, zero_divides=False):
    """A sampler with one (or more) of the typical mistakes switched on."""

    def top_p_drop(probs, top_p, crossing_dropped):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(-1)
        drop_sorted = cum > top_p if crossing_dropped else (cum - sorted_p) >= top_p
        if crossing_dropped:
            drop_sorted[..., 0] = False  # keeps at least one token
        return torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)

    def sample(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
        V = logits.shape[-1]
        g = None if global_rng else generator
        if temperature == 0 and not greedy_draws and not zero_divides:
            return logits.argmax(-1)
        t = 1.0 if temperature == 0 and not zero_divides else temperature
        x = logits
        if p_before_temp and top_p is not None:  # the top-p set of the logits at temperature 1
            y = x
            if top_k is not None and top_k < V:
                y = y.masked_fill(y < y.topk(top_k, dim=-1).values[..., -1:], float("-inf"))
            x = x.masked_fill(top_p_drop(torch.softmax(y, dim=-1), top_p, False), float("-inf"))
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
            probs = probs.masked_fill(top_p_drop(base, top_p, p_drops_crossing), 0.0)
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


STATS = frozenset({"test_temperature", "test_top_k", "test_top_p"})
ALL = frozenset({"test_greedy", "test_shapes", "test_generator"}) | STATS
MISTAKES = (
    Mistake("temperature applied to the probabilities",
            "divide the logits by the temperature before the softmax; dividing the probabilities by it "
            "changes nothing once they are renormalised.", _sampler(temp_on_probs=True), STATS),
    Mistake("logits multiplied by the temperature",
            "divide the logits by the temperature: a temperature below 1 must sharpen the distribution.",
            _sampler(temp_multiplies=True), STATS),
    Mistake("top-k keeps k + 1 tokens",
            "keep exactly the k largest logits: the k-th largest is topk(k).values[..., -1].", _sampler(k_shift=1),
            frozenset({"test_top_k", "test_top_p"})),
    Mistake("top-k keeps k - 1 tokens",
            "keep exactly the k largest logits, the k-th included.", _sampler(k_shift=-1),
            frozenset({"test_top_k"}), frozenset({"test_top_p"})),
    Mistake("top-k sets the other logits to 0",
            "a logit of 0 is still a likely token; set the logits outside the top k to -inf so that their "
            "probability is exactly 0.", _sampler(k_fill=0.0), frozenset({"test_top_k", "test_top_p"})),
    Mistake("top-p drops the token that crosses the threshold",
            "keep the smallest set whose total is at least top_p: the token that takes the running total "
            "past top_p is kept (keep a token when the mass of the tokens before it is below top_p).",
            _sampler(p_drops_crossing=True), frozenset({"test_top_p"})),
    Mistake("top-p on the probabilities before top-k",
            "choose the top-p set from the top-k tokens' probabilities renormalised to sum to 1 (a softmax of the "
            "logits after top-k has set the others to -inf): the running total of the whole distribution, or of "
            "the top-k probabilities left as they were, reaches top_p later and keeps too many tokens.",
            _sampler(p_unnormalised=True), frozenset({"test_top_p"})),
    Mistake("top-p chosen before the temperature",
            "divide by the temperature first, then choose the top-p set from that distribution.",
            _sampler(p_before_temp=True), frozenset({"test_top_p"})),
    Mistake("inverse CDF on unnormalised probabilities",
            "after setting the removed tokens' probabilities to 0, renormalise before you compare a uniform "
            "number with the cumulative sum: otherwise a number above the kept mass lands on a removed token.",
            _sampler(inverse_cdf_unnormalised=True), frozenset({"test_top_k", "test_top_p"})),
    Mistake("temperature 0 divides the logits",
            "temperature 0 means greedy decoding: return the argmax of each row before dividing by the temperature "
            "(logits / 0 are infinite or NaN, and no distribution can be drawn from them).",
            _sampler(zero_divides=True), frozenset({"test_greedy"})),
    Mistake("greedy draws a random number",
            "with temperature 0 return the argmax without drawing anything from the generator.",
            _sampler(greedy_draws=True), frozenset({"test_greedy"})),
    Mistake("generator ignored",
            "pass generator=generator to torch.multinomial (or torch.rand): every random number must come "
            "from the generator, so that the same seed gives the same tokens.", _sampler(global_rng=True),
            frozenset({"test_generator"})),
    Mistake("an extra last dimension of size 1",
            "torch.multinomial returns (N, 1): drop that dimension, so that logits (..., V) give tokens (...).",
            _sampler(keeps_last_dim=True), ALL - {"test_greedy"}),
)


def _hint(label: str) -> str:
    """A mistake's hint as a sentence that names it (for the messages that already know the mistake)."""
    m = next(m for m in MISTAKES if m.label == label)
    return f"This is a typical mistake, {label}: {m.hint}"


# ---------------------------------------------------------------- properties (plain data)
def _shape(case) -> tuple:
    return tuple(int(s) for s in case["batch"]) if "batch" in case else tuple(case["logits"].shape[:-1])


def _kwargs(case) -> dict:
    return {k: case[k] for k in PARAMS if k in case}


def _describe_kwargs(kwargs) -> str:
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in kwargs.items()) or "the defaults"


def unchanged(case, out, want):
    """The logits are left as they were (the adapter compares them after the call, exactly)."""
    if UNCHANGED in out and not bool(out[UNCHANGED]):
        return ("your function changed the logits in place. Build new tensors instead (x = x / t, not x /= t or "
                "x.div_(t)).")
    return None


def valid_tokens(case, out, want):
    """Every result of tokens: int64 token ids of shape (...) (one per row), in 0..V-1."""
    V, shape = case["logits"].shape[-1], _shape(case)
    for key in ("tokens", "tokens, the same seed again", "tokens, another seed", ALONE):
        tokens = out.get(key)
        if tokens is None:  # not an array: the comparison says what it is
            continue
        what = "the tokens" if key == "tokens" else f"the {key}"
        if tokens.dtype != np.int64:
            return (f"{what} have dtype {tokens.dtype}; they should be torch.int64 token ids (what argmax and "
                    "torch.multinomial return).")
        if tokens.shape != shape:
            hint = f" {_hint('an extra last dimension of size 1')}" if tokens.shape == (*shape, 1) else ""
            return (f"{what} have shape {tokens.shape} but should have shape {shape}: one token per row of the "
                    f"logits.{hint}")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= V):
            bad = int(tokens.min()) if tokens.min() < 0 else int(tokens.max())
            return f"a token is {bad}, outside 0..{V - 1}."
    return None


def greedy(case, out, want):
    """temperature 0: exactly the argmax of every row, and nothing drawn from the generator or from
    torch's global random state."""
    tokens = out["tokens"]
    argmax = case["logits"].argmax(-1)
    if not np.array_equal(tokens, argmax):
        if case["show"]:
            return f"the tokens should be the argmax of each row, {argmax.tolist()}, but they are {tokens.tolist()}."
        return f"the tokens are not the argmax of each row ({int((tokens != argmax).sum())} of {argmax.size} differ)."
    if bool(out["drew from the generator"]) or not bool(out["left the global random state"]):
        return f"your function returned the argmax but drew a random number. {_hint('greedy draws a random number')}"
    return None


def seeded(case, out, want):
    """Random numbers come from the generator only: torch's global random state is untouched, the
    same seed gives the same tokens and another seed other tokens."""
    if not bool(out["left the global random state"]):
        return ("your function changed torch's global random state: it draws from the global generator instead "
                f"of the one it is given. {_hint('generator ignored')}")
    if case.get("no_generator"):
        return None
    first, again, other = out["tokens"], out["tokens, the same seed again"], out["tokens, another seed"]
    if not np.array_equal(first, again):
        return (f"two generators with the same seed gave different tokens ({int((first != again).sum())} of "
                f"{first.size} differ). {_hint('generator ignored')}")
    if np.array_equal(first, other):
        return (f"generators with different seeds gave exactly the same {first.size} tokens: your draws do not "
                f"come from the generator. {_hint('generator ignored')}")
    return None


def _counts(case, tokens) -> np.ndarray:
    """(V,): how often each word of the case's row was drawn (through the rows' permutations)."""
    perms = permutations(case["seed"], math.prod(_shape(case)), case["logits"].shape[-1]) if "batch" in case else None
    flat = tokens.reshape(-1).astype(np.int64)
    words = flat if perms is None else perms[np.arange(flat.size), flat]
    return np.bincount(words, minlength=case["logits"].shape[-1])


def probabilities(row, kwargs) -> np.ndarray:
    """The reference's probabilities of ``row`` (V,) in float64, for the secret cases: imported here, in
    the trusted grader only (the visible cases carry theirs as data, ``EXAMPLE_PROBABILITIES``)."""
    from ..reference import next_token_probabilities

    return next_token_probabilities(torch.from_numpy(np.asarray(row, dtype=np.float64)), **kwargs).numpy()


def frequencies_agree(counts, p, n) -> bool:
    return all((c == 0) if q == 0 else abs(c - n * q) <= allowed_deviation(n, q) for c, q in zip(counts, p))


NEVER_AGAINST = 30  # a word never drawn in one sample and this often in the other: not the same distribution


def counts_agree(ours, theirs, n) -> bool:
    """Two samples of n tokens look drawn from one distribution: every count within twice Bernstein's
    bound of the other's, and no word drawn NEVER_AGAINST times or more in one and never in the other
    (with probability q, n draws miss it with probability (1 - q)^n, about 1e-13 for q = 30 / 10,000)."""
    return all(abs(int(a) - int(b)) <= 2 * allowed_deviation(n, max(b / n, 1 / n))
               and not (min(a, b) == 0 and max(a, b) >= NEVER_AGAINST) for a, b in zip(ours, theirs))


def _their_results(m, case):
    """A mistake's results on ``case`` (plain data), through the adapter; None if it fails there."""
    inputs = {k: torch.from_numpy(np.array(v)) if isinstance(v, np.ndarray) else v
              for k, v in case.items() if k not in ("label", "tags", "show")}
    try:
        with torch.random.fork_rng(devices=[]):
            got = adapter(m.fn, inputs)
        return {k: v.numpy() for k, v in got.items() if isinstance(v, torch.Tensor)}
    except Exception:  # noqa: BLE001
        return None


def matching_mistakes(case, out, p) -> list:
    """The named mistakes whose own counts (same rows, same seed) agree with the answer's, and that
    are wrong on this case; with top_k and top_p, only those that also agree with top_k alone."""
    n = math.prod(_shape(case))
    ours = _counts(case, out["tokens"])
    found = []
    for m in MISTAKES:
        theirs = _their_results(m, case)
        if theirs is None or valid_tokens(case, theirs, None):
            continue
        counts = _counts(case, theirs["tokens"])
        if frequencies_agree(counts, p, n) or not counts_agree(ours, counts, n):
            continue  # right on this case, or not what the answer drew
        if ALONE in out and not counts_agree(_counts(case, out[ALONE]), _counts(case, theirs[ALONE]), n):
            continue
        found.append(m)
    return found


def _table(counts, p, n, words) -> str:
    rows = []
    for j, (c, q) in enumerate(zip(counts, p)):
        name = words[j] if words else f"token {j}"
        t = allowed_deviation(n, q) if q > 0 else 0.0
        allowed = "never" if q == 0 else f"{100 * max(q - t / n, 0):.1f}%-{100 * min(q + t / n, 1):.1f}%"
        rows.append(f"    {name:>8}: drawn {c:>6} times ({100 * c / n:5.1f}%), probability {100 * q:5.1f}% "
                    f"(allowed: {allowed})")
    return "\n".join(rows)


def frequencies(case, out, want):
    """Each word's count: exactly 0 where its probability is 0, within Bernstein's bound of N p
    elsewhere (false-failure probability ``DELTA`` per word)."""
    tokens = out["tokens"]
    n = tokens.size
    counts = _counts(case, tokens)
    p = np.asarray(case["p"]) if "p" in case else probabilities(case["logits"], _kwargs(case))
    words = case.get("words")
    show = case["show"]
    problem, worst, excess = None, None, 1.0
    for j, (c, q) in enumerate(zip(counts, p)):
        name = repr(words[j]) if words else f"token {j}"
        if q == 0 and c > 0:
            kept = _describe_kwargs(_kwargs(case))
            problem = (f"{name} was drawn {c} times, but it is outside the tokens that {kept} "
                       "keeps: its probability is exactly 0, so it must never be drawn.")
            break
        if q > 0 and abs(c - n * q) / allowed_deviation(n, q) > excess:  # the word furthest off, in bounds
            worst, excess = j, abs(c - n * q) / allowed_deviation(n, q)
    if problem is None and worst is not None:
        c, q = counts[worst], p[worst]
        name = repr(words[worst]) if words else f"token {worst}"
        problem = (f"{name} was drawn {c} times out of {n} ({100 * c / n:.1f}%), but its probability is "
                   f"{100 * q:.1f}%: a correct sampler lands that far off with probability below {DELTA:g}.")
        if not show:
            problem = (f"a token was drawn {c} times out of {n} ({100 * c / n:.1f}%), further from its probability "
                       f"than a correct sampler lands but with probability below {DELTA:g}.")
    if problem is None:
        return None
    found = matching_mistakes(case, out, p)
    diagnosis = ("\nYour draws match a typical mistake:\n" + "\n".join(f"  - {m.label}: {m.hint}" for m in found)
                 if found else "")
    table = f"\nYour counts against the probabilities:\n{_table(counts, p, n, words)}" if show else ""
    return f"sampling {n} tokens, {problem}{table}{diagnosis}"


# ---------------------------------------------------------------- the cases
def _label(shape, dtype, kwargs, what="logits") -> str:
    return f"for {what} of shape {tuple(shape)} ({dtype}), {_describe_kwargs(kwargs)}"


def _greedy(logits, seed, **extra):
    """A temperature-0 case (``extra``: top_k, top_p, which greedy decoding ignores)."""
    label = f"with temperature 0, for logits of shape {tuple(logits.shape)} ({logits.dtype})"
    return case(label + "".join(f", {k}={v}" for k, v in extra.items()), "greedy", logits=logits, seed=seed,
                temperature=0.0, **extra)


def _draws(tag, row, params, seed, shape=(N_DRAWS,), words=None):
    row = np.asarray(row)
    what = "the chapter's logits (2, 1, 0.5, 0, -1, -2)" if words else f"a row of {row.shape[-1]} logits"
    label = (f"for {math.prod(shape)} draws from {what} ({row.dtype}), "
             f"each row in its own order, shaped {tuple(shape)}, {_describe_kwargs(params)}")
    extra = {}
    if words:  # the chapter's logits: its words, and its probabilities stored as data
        extra = {"words": tuple(words), "p": np.array(EXAMPLE_PROBABILITIES[tuple(sorted(params.items()))])}
    return case(label, tag, logits=row, seed=int(seed), batch=tuple(shape), **params, **extra)


def _example(dtype="float32"):
    return np.array(LOGITS, dtype=dtype)


def _visible() -> tuple:
    g = np.random.default_rng(3)
    normal = lambda *shape: g.standard_normal(shape).astype("float32")  # noqa: E731
    cases = [_greedy(_example(), 11), _greedy(normal(4, 6), 11), _greedy(normal(2, 3, 6), 11, top_k=2),
             _greedy(normal(5, 6), 11, top_p=0.5)]
    g = np.random.default_rng(5)
    cases += [case(_label(s, "float32", {}), "shapes", logits=g.standard_normal(s).astype("float32"), seed=0)
              for s in ((6,), (3, 6), (2, 3, 6))]
    cases.append(case("for 1000 draws from the chapter's logits (float32), each row in its own order, with the "
                      "defaults: twice with seed 1234, once with seed 1235", "generator", logits=_example(), seed=1234,
                      batch=(1000,), again=True))
    for tag, params, base in (("temperature", TEMPERATURE_CASES, 100), ("top_k", TOP_K_CASES, 200),
                              ("top_p", TOP_P_CASES, 300)):
        cases += [_draws(tag, _example(), dict(kw), base + i, words=WORDS) for i, kw in enumerate(params)]
    return tuple(cases)


def random_row(rng, V: int, dtype="float32", scale=1.5) -> np.ndarray:
    """Logits without near-ties (every gap at least 0.02)."""
    while True:
        row = rng.standard_normal(V) * scale
        s = np.sort(row)
        if V < 2 or (s[1:] - s[:-1]).min() >= 0.02:
            return row.astype(dtype)


def safe_top_p(rng, row, kwargs):
    """A top_p for ``row`` at least 0.01 away from every cumulative probability of the distribution
    left by ``kwargs`` (temperature, top_k), crossing at a token of probability >= 0.06; None if none."""
    p = np.sort(probabilities(row, kwargs))[::-1]
    cum = np.cumsum(p)
    choices = [i for i in range(1, int((p > 0).sum())) if p[i] >= 0.06 and cum[i - 1] <= 0.97]
    if not choices:
        return None
    i = choices[int(rng.integers(len(choices)))]
    return round(float(cum[i - 1] + p[i] / 2), 4)  # between the mass before token i and the mass with it


def secret(rng: np.random.Generator) -> list:
    """The re-check's cases, drawn in the grader: the visible situations and the old hidden tier
    (more shapes, float64, V = 1, no generator, random rows, top_p = 1) on fresh inputs."""
    seed = lambda: int(rng.integers(2**31 - 2))  # noqa: E731
    out = []
    for shape, extra in (((6,), {}), ((4, 6), {}), ((2, 3, 6), {"top_k": 2}), ((5, 6), {"top_p": 0.5}),
                         ((3, 50), {}), ((2, 2, 2, 9), {"top_k": 3, "top_p": 0.8}), ((7, 1), {})):
        dtype = "float64" if shape == (3, 50) else "float32"
        out.append(_greedy(rng.standard_normal(shape).astype(dtype), seed(), **extra))
    for shape, extra in (((6,), {}), ((3, 6), {}), ((2, 3, 6), {}), ((1, 1, 8), {}), ((4, 1), {}),
                         ((2, 5, 7), {"temperature": 0.7}), ((3, 2, 10), {"top_k": 4, "top_p": 0.6})):
        dtype = "float64" if shape == (2, 5, 7) else "float32"
        out.append(case(_label(shape, dtype, extra), "shapes", logits=rng.standard_normal(shape).astype(dtype),
                        seed=seed(), **extra))

    def permuted(dtype="float32"):
        return _example(dtype)[rng.permutation(len(LOGITS))]

    for shape, dtype, extra in (((1000,), "float32", {}), ((40, 25), "float64", {"temperature": 1.5}),
                                ((1000,), "float32", {"top_k": 4, "top_p": 0.9})):
        out.append(case(f"for {math.prod(shape)} draws of shape {shape} ({dtype}), {_describe_kwargs(extra)}: twice "
                        "with one seed and once with another", "generator", logits=permuted(dtype), seed=seed(),
                        batch=shape, again=True, **extra))
    out.append(case("for 10 draws (float32) without a generator", "generator", logits=permuted(), seed=seed(),
                    batch=(10,), no_generator=True))
    for params in TEMPERATURE_CASES:
        out.append(_draws("temperature", permuted(), dict(params), seed()))
    out.append(_draws("temperature", random_row(rng, 10), {"temperature": round(float(rng.uniform(0.25, 0.9)), 3)},
                      seed()))
    out.append(_draws("temperature", random_row(rng, 10, "float64"),
                      {"temperature": round(float(rng.uniform(1.2, 1.8)), 3)}, seed(), shape=(2, N_DRAWS // 2)))
    for params in TOP_K_CASES:
        out.append(_draws("top_k", permuted("float64" if "temperature" in params else "float32"), dict(params), seed()))
    out.append(_draws("top_k", random_row(rng, 12), {"top_k": int(rng.integers(2, 10))}, seed()))
    out.append(_draws("top_k", random_row(rng, 12, "float64"),
                      {"temperature": 0.8, "top_k": int(rng.integers(2, 10))}, seed()))
    out.append(_draws("top_k", random_row(rng, 12), {"top_k": 1}, seed()))
    for params in TOP_P_CASES:
        out.append(_draws("top_p", permuted(), dict(params), seed()))
    out.append(_draws("top_p", permuted("float64"), {"top_p": 1.0}, seed()))
    # top-p keeps all four top-k tokens (cumulative 0.58, 0.79, 0.92, 1): top-k's own mistakes show here
    out.append(_draws("top_p", permuted(), {"top_k": 4, "top_p": 0.95}, seed()))
    added = 0
    for extra in ({}, {"temperature": 0.7}, {"top_k": 6}, {"temperature": 1.3, "top_k": 8}, {}, {"top_k": 5}):
        if added == 3:
            break
        row = random_row(rng, 10, "float64" if added % 2 else "float32")
        top_p = safe_top_p(rng, row, extra)
        if top_p is not None:
            out.append(_draws("top_p", row, {**extra, "top_p": top_p}, seed()))
            added += 1
    return out


# every test judges draws by properties, never the reference's own draws: its stored expected results
# keep their type, dtype and shape only
DRAWS = dict(values=False, structure_only=True)

EXERCISE = Exercise(
    name="sampling",
    piece="sample_next_token",
    call="sample_next_token(logits)",
    adapter=adapter,
    reference="firstprinciples.reference:sample_next_token",
    names={"tokens": "the tokens"},
    visible=_visible(),
    secret=secret,
    tests={
        "test_greedy": Test(2, frozenset({"greedy"}), first=(unchanged, valid_tokens, greedy), **DRAWS),
        "test_shapes": Test(1, frozenset({"shapes"}), first=(unchanged, valid_tokens,), **DRAWS),
        "test_generator": Test(2, frozenset({"generator"}), first=(unchanged, valid_tokens, seeded), **DRAWS),
        "test_temperature": Test(2, frozenset({"temperature"}), first=(unchanged, valid_tokens,), then=(frequencies,),
                                 **DRAWS),
        "test_top_k": Test(2, frozenset({"top_k"}), first=(unchanged, valid_tokens,), then=(frequencies,), **DRAWS),
        "test_top_p": Test(3, frozenset({"top_p"}), first=(unchanged, valid_tokens,), then=(frequencies,), **DRAWS),
    },
    forbidden=dict(pieces=("sample_next_token", "next_token_probabilities"), what="the sampler"),
    mistakes=MISTAKES,
    hints=(
        (RUNS_AT_ONE, _hint("temperature 0 divides the logits")),
        ("probability tensor contains", "torch.multinomial was given probabilities that are NaN, infinite or "
                                        "negative: look for a division by 0 or a -inf that became NaN."),
    ),
)
