"""What is left of the capstone's checks: its trained model's cells.

``StudentGPT`` and ``generate_cached`` are declared in ``firstprinciples.exercises.capstone`` and the
notebook's cells call ``check(grade_id, piece)``. The trained model's cells are not declared yet
(``exercises.capstone.OLD_APPARATUS``): the notebook calls ``check_trained``, ``check_resolves_it``
and ``check_generate_trained`` below, and ``grading.probes.capstone`` (which imports the thresholds
and ``MODEL_FORBIDDEN``) re-checks the trained ``model``. Both go when those cells are declared.

- ``check_generate_trained`` decodes held-out prompts with the student's ``generate_cached`` and their
  trained model, and compares with greedy decoding of the same model without a cache, as the
  declaration's ``test_generate_cached`` does on random models (``exercises.capstone.decode`` and
  ``judge_decoding``), with the float32 tolerance ``TRAINED_LOGIT_TOL``: the trained float32 model's
  cached logits may differ from full recomputation by the rounding of sums taken in another order, a
  few 1e-6 for logits of size about 10, so 1e-4; every known mistake moves logits by more than 1e-2.

Training thresholds (measured on the course's corpus, seed 0): the held-out
cross-entropy of the unigram guess is 3.26 nats per token, of the bigram guess
(the previous word only) 1.24; the corpus's own randomness (which nouns,
adjective, template and verb) leaves at least about 0.47; the reference model
reaches 0.61 after the exercise's 300 steps. ``LOSS_THRESHOLD`` = 0.8 is well
below the bigram guess, and a held-out loss below ``LEAK_THRESHOLD`` = 0.35 is
impossible without seeing the next token (a missing causal mask).
"""
from __future__ import annotations

import math

import torch

from ..capstone.model import TinyGPT
from ..capstone.train import accuracy, held_out_loss
from ..exercises import capstone as declared
from ..exercises import plain
from ..guard import ForbiddenCall, call_without
from ._core import close
from ._student import describe, wrap_checks

MODEL_FORBIDDEN = dict(declared.FORBIDDEN, what="the model (with your own pieces)")
GENERATE_FORBIDDEN = dict(declared.FORBIDDEN, what="cached generation (with your own KVCache and cached_attention_step)")

LOSS_THRESHOLD = 0.8
LEAK_THRESHOLD = 0.35
ACCURACY_THRESHOLD = 0.9
TRAINED_LOGIT_TOL = 1e-4


def check_generate_trained(generate_cached, model, corpus, KVCache, n_examples=24):
    """Your trained model completes held-out prompts ending with the final "it" (two new tokens: the
    noun and "."), with your cache and without: the same ids, logits within TRAINED_LOGIT_TOL (float32)."""
    examples = corpus.held_out[:n_examples]
    by_length = {}
    for ex in examples:
        by_length.setdefault(ex.pronoun_index + 1, []).append(ex)
    right = 0
    worst = 0.0
    for T_p, group in sorted(by_length.items()):
        ids = torch.tensor([ex.ids[:T_p] for ex in group])
        label = f"(held-out prompts of {T_p} tokens, trained model)"
        out = call_without(declared.decode, (generate_cached, model, ids, 2, KVCache), **GENERATE_FORBIDDEN)
        if not torch.equal(out["ids after the call"], ids):
            raise AssertionError("generate_cached modified the prompt ids in place.")
        reason = declared.judge_decoding({k: plain(v) for k, v in out.items()}, len(group), T_p, 2, len(model.blocks),
                                         atol=TRAINED_LOGIT_TOL, rtol=0.0)
        if reason:
            found = []
            for m in declared.GENERATE_MISTAKES:
                try:
                    theirs = m.fn(model, ids, 2)[1]
                except Exception:
                    continue
                if close(out["logits"], theirs, TRAINED_LOGIT_TOL, 0.0) and \
                        not close(theirs, out["logits without a cache"], TRAINED_LOGIT_TOL, 0.0):
                    found.append(m)
            lines = "".join(f"\n  - {m.label}: {m.hint}" for m in found)
            raise AssertionError(f"generate_cached {label}: {reason}"
                                 + (f"\nYour answer matches a typical mistake:{lines}" if found else ""))
        logits, want = out["logits"].double(), out["logits without a cache"].double()
        worst = max(worst, (logits - want).abs().max().item())
        right += sum(int(out["ids"][j, T_p]) == ex.ids[ex.answer_index] for j, ex in enumerate(group))
    print(f"{len(examples)} held-out prompts: cached and uncached decoding pick the same tokens; "
          f"max |logit difference| = {worst:.3g} (tolerance {TRAINED_LOGIT_TOL:g}); "
          f"the referent is named in {right} of {len(examples)}.")


# ---------------------------------------------------------------- checks: training
def _student_model(model, TransformerBlock):
    if isinstance(model, TinyGPT):
        raise AssertionError("This is the course's TinyGPT, not your StudentGPT: train your own model.")
    blocks = getattr(model, "blocks", None)
    if blocks is None or not len(blocks) or not all(isinstance(b, TransformerBlock) for b in blocks):
        raise AssertionError("The trained model should be your StudentGPT, built from your own TransformerBlock.")


def _loss(model, corpus):
    try:
        with torch.no_grad():
            return call_without(held_out_loss, (model, corpus.held_out, corpus.vocab.pad), **MODEL_FORBIDDEN)
    except ForbiddenCall:
        raise
    except Exception as err:
        raise AssertionError(f"Your model failed on the held-out sentences: it {describe(err)}") from None


def check_trained(model, corpus, TransformerBlock):
    """Your trained StudentGPT's held-out loss (mean next-token cross-entropy) is below LOSS_THRESHOLD
    and above LEAK_THRESHOLD."""
    _student_model(model, TransformerBlock)
    loss = _loss(model, corpus)
    print(f"held-out loss {loss:.3f} nats per token (threshold {LOSS_THRESHOLD}; previous word only: 1.24; "
          "word frequencies only: 3.26)")
    if not math.isfinite(loss) or loss >= LOSS_THRESHOLD:
        raise AssertionError(
            f"The held-out loss of your trained model is {loss:.3f}, not below {LOSS_THRESHOLD}. A correct model "
            "reaches about 0.61 with this budget. Check the forward pass tests above, that you train the model "
            "you built (train(corpus, config, seed, model=model)) and that you did not change the budget."
        )
    if loss < LEAK_THRESHOLD:
        raise AssertionError(
            f"The held-out loss of your trained model is {loss:.3f}: below {LEAK_THRESHOLD}, which no model can reach "
            "from the words before each position alone. Your model sees the word it predicts: pass the causal mask."
        )


def check_resolves_it(model, corpus, TransformerBlock):
    """On held-out sentences, your trained model's greedy prediction after the final "it" is the correct noun
    at least ACCURACY_THRESHOLD of the time (always naming the first noun scores about 0.5)."""
    _student_model(model, TransformerBlock)
    try:
        acc = call_without(accuracy, (model, corpus.held_out), **MODEL_FORBIDDEN)
    except ForbiddenCall:
        raise
    except Exception as err:
        raise AssertionError(f"Your model failed on the held-out sentences: it {describe(err)}") from None
    print(f"held-out accuracy of resolving 'it': {acc:.3f} (threshold {ACCURACY_THRESHOLD})")
    if acc < ACCURACY_THRESHOLD:
        raise AssertionError(
            f"Your trained model names the right noun after the final 'it' in {acc:.1%} of the held-out sentences; "
            f"at least {ACCURACY_THRESHOLD:.0%} is expected (always naming the first noun gives about 50%). "
            "Check the training cell ran to the end with the stated budget."
        )


__all__ = ["check_generate_trained", "check_trained", "check_resolves_it", "LOSS_THRESHOLD", "LEAK_THRESHOLD",
           "ACCURACY_THRESHOLD", "TRAINED_LOGIT_TOL"]


wrap_checks(globals())  # student-facing failures: the student's own line first, their frames only
