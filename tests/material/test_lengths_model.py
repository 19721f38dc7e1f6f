"""The position-length experiment: the stored weights reproduce the stored histories and the
chapter's findings, and training is deterministic.

Nothing here retrains the reference run (five variants, 600 steps each). The stored weights are
loaded and evaluated on the evaluation windows, which are rebuilt from their seed: each variant's
losses at 1x, 2x and 4x the training length equal the last entry of its stored history, and the
orderings that the chapter states hold. Determinism is checked on a few steps: two runs give the
same losses and weights, bit for bit.
"""
from __future__ import annotations

import pytest
import torch

from firstprinciples.lengths import TRAIN_LEN, VARIANTS, LengthGPT, eval_windows, load_checkpoint, load_trained
from firstprinciples.lengths import split_windows, streams
from firstprinciples.lengths.model import WEIGHTS
from firstprinciples.lengths.train import CONFIG, LENGTHS, length_losses, position_losses, train_variant


@pytest.fixture(scope="module")
def models():
    return load_trained()


@pytest.fixture(scope="module")
def data():
    train_stream, eval_stream = streams(seed=0)
    return train_stream, eval_windows(eval_stream)


@pytest.fixture(scope="module")
def losses(models, data):
    return {name: length_losses(m, data[1]) for name, m in models.items()}


def test_weights_file_is_small_and_plain():
    assert WEIGHTS.stat().st_size < 2_500_000
    ckpt = torch.load(WEIGHTS, weights_only=True)  # tensors, str, numbers, lists and dicts only
    assert set(ckpt) == {"state_dicts", "configs", "history"}
    assert set(ckpt["state_dicts"]) == set(VARIANTS) == set(ckpt["history"]["variants"])
    assert ckpt["history"]["config"] == CONFIG
    for name in VARIANTS:
        h = ckpt["history"]["variants"][name]
        assert len(h["loss"]) == CONFIG["steps"] and h["eval_step"][-1] == CONFIG["steps"]
        assert ckpt["configs"][name]["position"] == name and ckpt["configs"][name]["max_len"] == 4 * TRAIN_LEN


def test_stored_weights_reproduce_the_stored_histories(losses):
    history = load_checkpoint()["history"]["variants"]
    for name in VARIANTS:
        for T in LENGTHS:
            assert losses[name][T] == pytest.approx(history[name][f"len_{T}"][-1], abs=1e-5), (name, T)


def test_the_chapters_findings(models, data, losses):
    at1 = [losses[n][32] for n in VARIANTS]
    assert max(at1) - min(at1) < 0.05
    assert losses["alibi"][128] < losses["alibi"][32] + 0.02
    for name in ("sinusoidal", "learned"):
        assert losses[name][128] > losses[name][32] + 0.9
    assert abs(losses["rope"][64] - losses["rope"][32]) < 0.02  # RoPE holds at 2x ...
    assert losses["rope"][128] > losses["rope"][32] + 0.1  # ... not at 4x
    assert losses["rope"][128] > losses["none"][128] - 0.05
    rope = position_losses(models["rope"], data[1], 128)
    assert rope[96:].mean() > rope[8:32].mean() + 0.3


def test_the_same_targets_at_every_length(data):
    windows = data[1]
    for T in LENGTHS:
        X = split_windows(windows, T)
        assert X.shape == (len(windows) * 128 // T, T + 1)
        assert torch.equal(X[:, 1:].reshape(len(windows), -1), windows[:, 1:])  # the same next tokens


def test_the_variants_start_from_the_same_weights():
    nets = {}
    for name in VARIANTS:
        torch.manual_seed(0)
        nets[name] = LengthGPT(45, name)
    base = nets["none"].state_dict()
    for name, net in nets.items():
        for k, v in net.state_dict().items():
            if k in base:
                assert torch.equal(v, base[k]), (name, k)
    assert nets["learned"].pos.weight.shape == (4 * TRAIN_LEN, CONFIG["d_model"])


def test_only_the_learned_table_is_limited_and_every_variant_is_causal():
    torch.manual_seed(0)
    x = torch.randint(3, 45, (2, 40))
    y = x.clone()
    y[:, 25:] = torch.randint(3, 45, (2, 15))
    for name in VARIANTS:
        net = LengthGPT(45, name, max_len=32).eval()
        if name == "learned":
            with pytest.raises(ValueError):
                net(x)
            x_, y_ = x[:, :32], y[:, :32]
        else:
            x_, y_ = x, y
        with torch.no_grad():
            assert torch.equal(net(x_)[0][:, :25], net(y_)[0][:, :25]), name


def test_short_runs_are_identical_and_leave_global_settings_alone(data):
    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    train_stream, windows = data
    tiny = dict(steps=3, eval_every=3, batch_size=8)
    few = windows[:4]
    for name in ("rope", "alibi"):
        m1, h1 = train_variant(name, train_stream, few, tiny, seed=0)
        m2, h2 = train_variant(name, train_stream, few, tiny, seed=0)
        assert h1["loss"] == h2["loss"] and h1["len_128"] == h2["len_128"]
        assert all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values()))
        _, h3 = train_variant(name, train_stream, few, tiny, seed=1)
        assert h3["loss"] != h1["loss"]
    assert (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()) == (threads, det)
