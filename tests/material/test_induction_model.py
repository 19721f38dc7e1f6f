"""The induction-head model: the stored weights reproduce the chapter's numbers, and training is
deterministic.

Nothing here retrains the reference run (6000 steps). The stored weights are loaded and measured
on the evaluation sequences, which are regenerated from their seed: the losses equal the last
entry of the stored history, the named heads have the scores the chapter states, and ablating the
induction head sends the second-half loss back above a uniform guess. Determinism is checked on a
tiny configuration: two runs of a few steps give the same losses, bit for bit.
"""
from __future__ import annotations

import math

import pytest
import torch

from firstprinciples.induction import data, load_checkpoint, load_trained
from firstprinciples.induction.model import WEIGHTS, AttentionOnly, ablated, head_outputs
from firstprinciples.induction.train import CONFIG, eval_tokens, measure, phase_change, split_losses, train
from firstprinciples.reference import induction_score

PREVIOUS_HEAD = (0, 1)  # layer, head: the chapter's named heads
INDUCTION_HEAD = (1, 0)


@pytest.fixture(scope="module")
def model():
    return load_trained()


@pytest.fixture(scope="module")
def ids():
    return eval_tokens()


def test_weights_file_is_small_and_plain():
    assert WEIGHTS.stat().st_size < 500_000
    ckpt = torch.load(WEIGHTS, weights_only=True)  # tensors, str, numbers, lists and dicts only
    assert set(ckpt) == {"state_dict", "config", "history"}
    assert ckpt["config"] == {k: CONFIG[k] for k in ("vocab_size", "d_model", "n_heads", "n_layers", "max_len")}
    h = ckpt["history"]
    assert len(h["loss"]) == CONFIG["steps"] and h["eval_step"][-1] == CONFIG["steps"]
    assert h["config"] == {k: (list(v) if isinstance(v, tuple) else v) for k, v in CONFIG.items()}


def test_stored_weights_reproduce_the_stored_history(model, ids):
    h = load_checkpoint()["history"]
    m = measure(model, ids, CONFIG["eval_period"])
    assert m["first_half"] == pytest.approx(h["first_half"][-1], abs=1e-5)
    assert m["second_half"] == pytest.approx(h["second_half"][-1], abs=1e-5)
    assert torch.allclose(m["induction"], torch.tensor(h["induction"][-1]), atol=1e-5)


def test_the_loss_drops_in_a_phase_change():
    h = load_checkpoint()["history"]
    uniform = math.log(CONFIG["vocab_size"])
    assert h["second_half"][0] > uniform - 0.1 and h["second_half"][-1] < 0.6
    assert all(abs(v - uniform) < 0.3 for v in h["first_half"])  # the first copy stays unpredictable
    step = phase_change(h)
    assert 500 < step < CONFIG["steps"] - 500
    i = h["eval_step"].index(step)
    before, after = h["induction"][max(0, i - 25)], h["induction"][min(len(h["induction"]) - 1, i + 25)]
    l, k = INDUCTION_HEAD
    assert before[l][k] < 0.3 < 0.7 < after[l][k]  # the head forms with the drop


def test_named_heads(model, ids):
    m = measure(model, ids, CONFIG["eval_period"])
    assert m["induction"][INDUCTION_HEAD] > 0.85
    assert m["induction"].flatten().sort().values[-2] < 0.2  # no other head comes close
    assert m["previous"][PREVIOUS_HEAD] > 0.4 and m["previous"][PREVIOUS_HEAD] == m["previous"].max()


def test_ablating_the_induction_head_raises_the_loss(model, ids):
    period = CONFIG["eval_period"]
    with torch.no_grad():
        base = split_losses(model(ids)[0], ids, period)[1]
        mean = head_outputs(model, ids, INDUCTION_HEAD[0])[:, :, INDUCTION_HEAD[1]].mean((0, 1))
        for replacement in (None, mean):
            with ablated(model, *INDUCTION_HEAD, replacement):
                second = split_losses(model(ids)[0], ids, period)[1]
            assert base < 0.6 and second > math.log(CONFIG["vocab_size"]) - 0.5
    # the hook is gone afterwards
    with torch.no_grad():
        assert split_losses(model(ids)[0], ids, period)[1] == pytest.approx(base, abs=0)


def test_induction_score_of_the_models_heads(model):
    g = torch.Generator().manual_seed(3)
    for period in (8, 16, 24):
        x = data.repeated_tokens(32, period, CONFIG["vocab_size"], g)
        with torch.no_grad():
            weights = torch.stack(model(x)[1])  # (n_layers, B, n_heads, T, T)
        scores = induction_score(weights, period).mean(1)  # (n_layers, n_heads)
        assert scores[INDUCTION_HEAD] > 0.75, period


def test_training_batches_hold_one_repeat():
    g = torch.Generator().manual_seed(0)
    ids, repeat = data.training_batch(16, 48, (8, 24), 64, g)
    for row, rep in zip(ids, repeat):
        p = int(rep.sum())
        r = int(rep.nonzero()[0]) - p
        assert 8 <= p <= 24 and torch.equal(row[r:r + p], row[r + p:r + 2 * p])
        assert len(set(row[~rep].tolist())) == 48 - p  # every other token is distinct


def test_short_runs_are_identical_and_leave_global_settings_alone():
    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    tiny = dict(steps=5, eval_every=5, eval_size=8)
    m1, h1 = train(tiny, seed=0)
    m2, h2 = train(tiny, seed=0)
    assert h1["loss"] == h2["loss"] and h1["second_half"] == h2["second_half"]
    assert all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values()))
    _, h3 = train(tiny, seed=1)
    assert h3["loss"] != h1["loss"]
    assert (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()) == (threads, det)


def test_the_model_is_causal():
    torch.manual_seed(0)
    net = AttentionOnly().eval()
    x = torch.randint(0, 64, (2, 20))
    y = x.clone()
    y[:, 12:] = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        assert torch.equal(net(x)[0][:, :12], net(y)[0][:, :12])
