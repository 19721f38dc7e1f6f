"""The attention explorer: the export, the JavaScript forward pass and the page.

- The export is lossless: every tensor of the state dict, under its own name,
  reads back as exactly the same float32 values.
- Parity: the JavaScript forward pass (explorer.js), run in headless Chromium on
  a blank page served from 127.0.0.1, gives the same attention weights and
  logits as the Python model on training and held-out sentences.
- Free text: export.py's tokenizer splits the corpus's sentences as Vocab.split
  does, and the JavaScript tokenizer gives the same tokens as the Python one on
  sentences with punctuation, contractions and unknown words.
- The page: a minimal book (the intro and the explorer page, built with the
  repository's _config.yml and the explorer extension, its cells executed) opened
  in Chromium: a typed sentence, a click on "it", and the weights read back from
  the page equal the Python model's; the seed's sentence ("didn't", a comma) and
  "the cat sat on the mat" are read, their unknown words shown and skipped; the
  chosen head's matrix has T x T cells equal to the Python weights; the all-heads
  view has n_layers x n_heads panels and a click chooses that head; editing the
  worked example's query and a key gives torch's numbers; the first "it" is
  explained (a note in the page and the chapter's glued text); the keyboard
  works; at 390 px the page does not scroll sideways; no console error and no
  request to another host.

Tolerance (1e-5, absolute, as the issue asks): both sides start from the same
float32 weights (the JavaScript restores them exactly) and compute in float64,
so the only differences are float64 rounding in a different order of sums,
about 1e-15 (the test prints the largest difference measured). The float32
model itself, as trained, is also within 1e-5 of the page (about 5e-7).
Typical bugs are far above 1e-5 (measured by hand with deliberately broken
copies of explorer.js; set FP_EXPLORER_JS to a file to run the `js_` tests
against it): without the 1/sqrt(d_k) scaling the weights differ by 0.78, with
ReLU for GELU by 0.11, without the causal mask by 1.0; subtler ones still fail:
tanh-GELU by 7e-5, the layer norms' eps left out by 1.05e-5. The erf, GELU and
weight-loading tests are exact to 1e-14 and catch slips below 1e-5 (a 1e-7 erf
approximation, weights not restored to float32).
"""
from __future__ import annotations

import copy
import http.server
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from course import ROOT
from firstprinciples import examples as worked
from firstprinciples.capstone.corpus import HELD_OUT_PAIRS, make_corpus, make_example
from firstprinciples.capstone.export import (ASSETS, GLOBAL_NAME, encode_free_text, explorer_data, explorer_model,
                                             first_it_heads, split_free_text, write_explorer_assets)

TOL = 1e-5
EXPLORER_JS = Path(os.environ.get("FP_EXPLORER_JS", ASSETS / "explorer.js"))
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
_SCRIPT = Path(sys.executable).parent / "jupyter-book"
JUPYTER_BOOK = str(_SCRIPT) if _SCRIPT.exists() else shutil.which("jupyter-book")
EXTENSION = "firstprinciples.capstone.sphinx_explorer"
SCREENSHOTS = ROOT / "_build" / "screenshots"


# ---------------------------------------------------------------- the model and its export
@pytest.fixture(scope="module")
def trained():
    model, vocab, is_trained = explorer_model()
    assert is_trained, "firstprinciples/capstone/weights.pt is missing: the book would export an untrained model"
    return model, vocab


@pytest.fixture(scope="module")
def data(trained):
    model, vocab = trained
    return explorer_data(model, vocab)


@pytest.fixture(scope="module")
def corpus():
    return make_corpus(seed=0)


def python_forward(model, ids):
    """(attentions (L, H, T, T), logits (T, V)) of a float64 copy of the model."""
    m64 = copy.deepcopy(model).double().eval()
    with torch.no_grad():
        logits, attentions = m64(torch.tensor([ids]))
    return torch.stack([a[0] for a in attentions]), logits[0]


def parity_sequences(corpus, vocab, max_len):
    """Training and held-out sentences (with <bos> and <eos>), the source's pair, and
    one seeded sequence of max_len random tokens (every position embedding in use)."""
    seqs = [ex.ids for ex in corpus.train[:4] + corpus.held_out[:4]]
    seqs += [make_example(vocab, 0, "animal", "street", adj).ids for adj in ("tired", "wide")]
    g = torch.Generator().manual_seed(0)
    seqs.append(torch.randint(3, len(vocab.tokens), (max_len,), generator=g).tolist())
    return seqs


def test_export_is_lossless_and_follows_the_state_dict(trained, data):
    model, vocab = trained
    exported = data["model"]
    json.dumps(data, allow_nan=False)  # plain JSON: no NaN, no tensors
    state = model.state_dict()
    assert list(exported["params"]) == list(state), "parameter names must be the state dict's"
    for name, t in state.items():
        p = exported["params"][name]
        assert p["shape"] == list(t.shape), name
        assert p["dtype"] == "float32"
        back = np.asarray(p["data"], dtype=np.float32).reshape(p["shape"])
        assert np.array_equal(back, t.numpy()), f"{name} does not read back exactly"
    assert exported["vocab"] == list(vocab.tokens)
    cfg = exported["config"]
    assert (cfg["vocab_size"], cfg["d_model"], cfg["max_len"]) == (model.tok.num_embeddings, model.tok.embedding_dim,
                                                                    model.pos.num_embeddings)
    assert (cfg["n_layers"], cfg["n_heads"], cfg["ln_eps"], cfg["gelu"]) == (len(model.blocks), model.blocks[0].attn.n_heads,
                                                                            1e-5, "erf")


def test_example_sentences_are_corpus_sentences(data, corpus):
    vocab = corpus.vocab
    train = {ex.sentence for ex in corpus.train}
    splits = [ex["split"] for ex in data["examples"]]
    assert splits.count("train") >= 3 and splits.count("held_out") >= 3
    for ex in data["examples"]:
        ids = vocab.encode(ex["sentence"], bos=True)  # every word is in the vocabulary
        assert ids[ex["pronoun_index"]] == vocab.id("it")
        assert vocab.tokens[ids[ex["referent_index"]]] == ex["referent"]
        if ex["split"] == "train":
            assert ex["sentence"] in train
        else:
            assert (ex["referent"], ex["adjective"]) in HELD_OUT_PAIRS and ex["sentence"] not in train
    assert data["examples"][0]["sentence"].startswith("the animal did not cross the street because it was too tired")


def test_write_explorer_assets(tmp_path, trained, data):
    """What the Sphinx extension writes: by default, the stored trained model."""
    files = {f.name for f in write_explorer_assets(tmp_path)}
    assert files == {"explorer.js", "explorer.css", "model.json", "model.js"}
    text = (tmp_path / "model.js").read_text()
    prefix = f"window.{GLOBAL_NAME} = "
    assert text.startswith(prefix)
    written = json.loads((tmp_path / "model.json").read_text())
    assert json.loads(text[len(prefix):].rstrip().rstrip(";")) == written
    assert written["trained"] is True and written == json.loads(json.dumps(data))  # the model of load_trained()
    for name in ("explorer.js", "explorer.css"):
        body = (tmp_path / name).read_text()
        assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/", body, re.I), f"{name} names another host"


# ---------------------------------------------------------------- a real browser
class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def chromium():
    if not CHROMIUM:
        msg = "Debian's chromium is not installed (.ci/run installs it: apt-get install chromium)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def _serve(directory):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(_Quiet, directory=str(directory)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_port}"


def _open(browser, base, path):
    """A new page; returns (page, console errors, requests to other hosts)."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors, foreign = [], []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: foreign.append(r.url) if not r.url.startswith(base) and not r.url.startswith("data:") else None)
    page.goto(f"{base}/{path}", wait_until="load")
    return page, errors, foreign


@pytest.fixture(scope="module")
def js_page(chromium, data, tmp_path_factory):
    """A blank page with explorer.js loaded and the exported model in window.model."""
    root = tmp_path_factory.mktemp("blank")
    shutil.copyfile(EXPLORER_JS, root / "explorer.js")
    (root / "index.html").write_text('<!doctype html><html><head><meta charset="utf-8"><link rel="icon" href="data:,"><title>parity</title>'
                                     '<script src="explorer.js"></script></head><body></body></html>')
    server, base = _serve(root)
    page, errors, foreign = _open(chromium, base, "index.html")
    try:
        page.evaluate("(d) => { window.model = FirstPrinciplesExplorer.loadModel(d); }", data["model"])
        yield page
        assert not errors, f"console errors: {errors}"
        assert not foreign, f"requests to other hosts: {foreign}"
    finally:
        page.close()
        server.shutdown()


JS_FORWARD = """(ids) => {
  const out = FirstPrinciplesExplorer.forward(window.model, ids);
  return { attentions: out.attentions.map(L => L.map(H => H.map(r => Array.from(r)))),
           logits: out.logits.map(r => Array.from(r)) };
}"""


def test_js_forward_pass_matches_python(js_page, trained, corpus):
    model, vocab = trained
    worst_attention = worst_logit = worst_f32 = 0.0
    for ids in parity_sequences(corpus, vocab, model.pos.num_embeddings):
        attentions, logits = python_forward(model, ids)
        with torch.no_grad():
            _, att32 = model(torch.tensor([ids]))  # the model as trained and used by the chapters: float32
        out = js_page.evaluate(JS_FORWARD, ids)
        js_att = torch.tensor(out["attentions"], dtype=torch.float64)
        js_logits = torch.tensor(out["logits"], dtype=torch.float64)
        assert js_att.shape == attentions.shape and js_logits.shape == logits.shape
        d_att = (js_att - attentions).abs().max().item()
        d_logit = (js_logits - logits).abs().max().item()
        assert d_att <= TOL, f"attention differs by {d_att:.3g} on {vocab.decode(ids)!r}"
        assert d_logit <= TOL, f"logits differ by {d_logit:.3g} on {vocab.decode(ids)!r}"
        assert torch.equal(js_att.triu(1), torch.zeros_like(js_att)), "a future token got weight"
        # float32 rounding in the Python model (about 1e-7 relative) stays well inside the tolerance too
        d_f32 = (js_att - torch.stack([a[0] for a in att32]).double()).abs().max().item()
        assert d_f32 <= TOL, f"attention differs from the float32 model by {d_f32:.3g} on {vocab.decode(ids)!r}"
        worst_attention, worst_logit, worst_f32 = max(worst_attention, d_att), max(worst_logit, d_logit), max(worst_f32, d_f32)
    print(f"\nJS vs Python float64 model: max |attention diff| = {worst_attention:.3g}, max |logit diff| = {worst_logit:.3g};"
          f" vs the float32 model: max |attention diff| = {worst_f32:.3g}")


def test_js_reads_the_float32_weights_exactly(js_page, trained):
    model, _ = trained
    for name in ("tok.weight", "blocks.0.attn.W_q.weight", "blocks.0.ffn.net.2.bias", "head.weight"):
        js = js_page.evaluate("(n) => Array.from(window.model.params[n])", name)
        assert js == model.state_dict()[name].double().reshape(-1).tolist(), name


def test_js_erf_and_gelu(js_page):
    xs = [i / 16 for i in range(-160, 161)] + [-30.0, -6.5, 6.5, 30.0, 1e-9]
    erf = js_page.evaluate("(xs) => xs.map(FirstPrinciplesExplorer.erf)", xs)
    gelu = js_page.evaluate("(xs) => xs.map(FirstPrinciplesExplorer.gelu)", xs)
    assert max(abs(a - math.erf(x)) for a, x in zip(erf, xs)) < 1e-14
    expected = torch.nn.functional.gelu(torch.tensor(xs, dtype=torch.float64))
    assert (torch.tensor(gelu, dtype=torch.float64) - expected).abs().max().item() < 1e-14


# Free text: punctuation, contractions (straight and curly apostrophes), unknown words,
# characters outside ASCII, text that looks like a special token.
SEED_SENTENCE = "The animal didn't cross the street, because it was too tired."
FREE_TEXT = [
    SEED_SENTENCE,
    "The cat sat on the mat.",
    "It\u2019s a well-known fact: \"cats\" can't fly!!! Cannot...",
    "the dog couldn\u2019t reach the river; it wasn't too wide -- was it?",
    "<bos> the <eos>",
    "caf\u00e9 3.5 o'clock (the road) \u2026 \u201cquoted\u201d",
    "   ",
]


def test_free_text_splits_as_the_corpus_is_written(corpus):
    vocab = corpus.vocab
    for ex in corpus.train[:50] + corpus.held_out[:50]:
        assert split_free_text(ex.sentence) == vocab.split(ex.sentence)
    assert split_free_text(SEED_SENTENCE) == ["the", "animal", "did", "not", "cross", "the", "street", ",",
                                              "because", "it", "was", "too", "tired", "."]
    assert split_free_text("It\u2019s can't cannot wasn't") == ["it", "'s", "can", "not", "can", "not", "was", "not"]
    enc = encode_free_text(vocab, "The cat sat on the mat.")
    assert enc["words"] == ["<bos>", "the", "cat", "the", "."] and enc["unknown"] == ["sat", "on", "mat"]
    assert [p["position"] for p in enc["pieces"]] == [1, 2, None, None, 3, None, 4]
    assert encode_free_text(vocab, "<bos> the <eos>")["words"] == ["<bos>", "the"]  # specials cannot be typed


def test_js_tokenizer_matches_python(js_page, data, corpus):
    vocab = corpus.vocab
    tokenize = "(s) => FirstPrinciplesExplorer.tokenize(window.model, s)"
    for ex in data["examples"] + [{"sentence": "The dog did not CROSS the road because it was too tired."}]:
        out = js_page.evaluate(tokenize, ex["sentence"])
        assert out["ids"] == vocab.encode(ex["sentence"], bos=True) and out["unknown"] == []
    for text in FREE_TEXT:
        assert js_page.evaluate(tokenize, text) == encode_free_text(vocab, text), text
    out = js_page.evaluate(tokenize, "the unicorn crossed the moon")
    assert out["unknown"] == ["unicorn", "moon"]


def test_js_attention_on_cat_sat_mat(js_page):
    Q, K, V = worked.cat_sat_mat(torch.float64)
    out = js_page.evaluate("""([q, K, V]) => {
      const f = (r) => Float64Array.from(r);
      const res = FirstPrinciplesExplorer.attend([f(q)], K.map(f), V.map(f), false);
      return [res.scores[0], res.scaled[0], res.weights[0], res.output[0]].map(a => Array.from(a));
    }""", [Q[0].tolist(), K.tolist(), V.tolist()])
    raw = Q @ K.T
    weights = torch.softmax(raw / math.sqrt(2), dim=-1)
    for got, want in zip(out, (raw, raw / math.sqrt(2), weights, weights @ V)):
        assert torch.allclose(torch.tensor(got, dtype=torch.float64), want[0], atol=1e-12, rtol=0)
    # The book's figures (each exact value rounded once), within one unit of their last decimal.
    for got, want, digits in zip(out, (worked.RAW_SCORES, worked.SCALED_SCORES, worked.WEIGHTS, worked.OUTPUT), (2, 3, 3, 3)):
        assert all(abs(x - w) <= 10 ** -digits for x, w in zip(got, want)), (got, want)
    assert [round(x, 4) for x in out[2]] == [0.3797, 0.3537, 0.2666]


# ---------------------------------------------------------------- the page in a minimal book
@pytest.fixture(scope="module")
def book(tmp_path_factory):
    """intro + chapters/explorer, built with the repository's _config.yml plus the
    extension; the chapter's cells run (its prose glues numbers they compute), with an
    execution cache of its own."""
    src = tmp_path_factory.mktemp("explorer_book")
    (src / "chapters" / "images").mkdir(parents=True)
    shutil.copyfile(ROOT / "intro.md", src / "intro.md")
    shutil.copyfile(ROOT / "chapters" / "explorer.md", src / "chapters" / "explorer.md")
    shutil.copyfile(ROOT / "chapters" / "images" / "favicon.svg", src / "chapters" / "images" / "favicon.svg")
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    extensions = config.setdefault("sphinx", {}).setdefault("extra_extensions", [])
    if EXTENSION not in extensions:
        extensions.append(EXTENSION)
    config["execute"]["execute_notebooks"] = "cache"
    config["execute"]["cache"] = str(src / "_build" / ".jupyter_cache")
    (src / "_config.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    toc = {"format": "jb-book", "root": "intro", "parts": [{"caption": "Chapters", "chapters": [{"file": "chapters/explorer"}]}]}
    (src / "_toc.yml").write_text(yaml.safe_dump(toc, sort_keys=False))
    proc = subprocess.run([JUPYTER_BOOK, "build", ".", "--keep-going"], cwd=src, capture_output=True, text=True, timeout=600)
    html = src / "_build" / "html"
    assert proc.returncode == 0 and (html / "chapters" / "explorer.html").is_file(), \
        f"build failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return html


def test_assets_are_on_the_explorer_page_only(book):
    explorer = (book / "chapters" / "explorer.html").read_text()
    for name in ("model.js", "explorer.js", "explorer.css"):
        assert f"_static/explorer/{name}" in explorer, name
        assert (book / "_static" / "explorer" / name).is_file(), name
    assert "_static/explorer/" not in (book / "intro.html").read_text()


@pytest.fixture(scope="module")
def explorer_page(chromium, book):
    server, base = _serve(book)
    page, errors, foreign = _open(chromium, base, "chapters/explorer.html")
    try:
        page.wait_for_selector("[data-fp-explorer][data-ready='true']", timeout=20000)
        page.wait_for_selector("[data-fp-cat-sat-mat][data-ready='true']", timeout=20000)
        yield page, errors, foreign
    finally:
        page.close()
        server.shutdown()


def _rows(page):
    return page.evaluate("""() => Array.from(document.querySelectorAll('[data-fp-explorer] tr.fp-weight')).map(r => ({
      layer: +r.dataset.layer, head: +r.dataset.head, query: +r.dataset.query, key: +r.dataset.key,
      token: r.dataset.token, weight: parseFloat(r.dataset.weight), masked: r.dataset.masked === 'true',
      shown: r.querySelector('.fp-num').textContent }))""")


def test_type_a_sentence_click_it_and_read_the_weights(explorer_page, trained, data, corpus):
    page, errors, foreign = explorer_page
    model, vocab = trained
    listed = {e["sentence"] for e in data["examples"]}
    ex = next(e for e in corpus.held_out[10:] if e.sentence not in listed)  # typed, not picked from the list
    page.fill("[data-fp-explorer] input.fp-sentence", ex.sentence)
    page.press("[data-fp-explorer] input.fp-sentence", "Enter")
    words = page.eval_on_selector_all("[data-fp-explorer] .fp-token", "bs => bs.map(b => b.dataset.token)")
    assert words == ["<bos>"] + vocab.split(ex.sentence)
    # Click the final "it" (the recap, which has read the adjective).
    page.locator("[data-fp-explorer] .fp-token[data-token='it']").last.click()
    assert page.get_attribute("[data-fp-explorer]", "data-query") == str(ex.pronoun_index)
    assert page.get_attribute(f"[data-fp-explorer] .fp-token[data-index='{ex.pronoun_index}']", "aria-pressed") == "true"

    attentions, logits = python_forward(model, vocab.encode(ex.sentence, bos=True))
    L, H, T, _ = attentions.shape
    rows = _rows(page)
    assert len(rows) == L * H * T, "one row per (layer, head, token)"
    seen = set()
    for r in rows:
        want = attentions[r["layer"], r["head"], ex.pronoun_index, r["key"]].item()
        assert r["query"] == ex.pronoun_index and r["token"] == words[r["key"]]
        assert abs(r["weight"] - want) <= TOL, f"layer {r['layer']} head {r['head']} key {r['key']}: {r['weight']} vs {want}"
        assert r["masked"] == (r["key"] > ex.pronoun_index)
        assert r["shown"] == ("masked" if r["masked"] else f"{r['weight']:.3f}")
        seen.add((r["layer"], r["head"], r["key"]))
    assert len(seen) == L * H * T
    top = vocab.tokens[int(logits[ex.pronoun_index].argmax())]
    assert page.get_attribute("[data-fp-explorer] .fp-prediction", "data-top-token") == top
    assert not errors, f"console errors: {errors}"
    assert not foreign, f"requests to other hosts: {foreign}"
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "explorer_interactive.png"), full_page=True)


def test_keyboard_moves_the_chosen_token(explorer_page):
    page, errors, _ = explorer_page
    _pick_example(page)
    q = int(page.get_attribute("[data-fp-explorer]", "data-query"))
    page.focus(f"[data-fp-explorer] .fp-token[data-index='{q}']")
    page.keyboard.press("ArrowLeft")
    assert page.get_attribute("[data-fp-explorer]", "data-query") == str(q - 1)
    assert page.evaluate("() => document.activeElement.dataset.index") == str(q - 1)
    page.keyboard.press("Home")
    assert page.get_attribute("[data-fp-explorer]", "data-query") == "0"
    assert not errors, errors


def _pick_example(page):
    """Open the (folded) list of examples and choose the first one."""
    page.evaluate("() => { document.querySelector('[data-fp-explorer] details.fp-examples-box').open = true; }")
    page.locator("[data-fp-explorer] .fp-example").first.click()


def _results(page):
    """What the explorer shows of the last sentence: tokens, head rows, prediction."""
    return page.evaluate("""() => {
      const c = document.querySelector('[data-fp-explorer]');
      return { tokens: c.querySelectorAll('.fp-token').length, rows: c.querySelectorAll('tr.fp-weight').length,
               prediction: c.querySelector('.fp-prediction').textContent, summary: c.querySelector('.fp-summary').textContent,
               query: c.getAttribute('data-query') };
    }""")


def _type(page, text):
    page.fill("[data-fp-explorer] input.fp-sentence", text)
    page.press("[data-fp-explorer] input.fp-sentence", "Enter")


def _shown_tokens(page):
    """(the model's tokens, the unknown words shown) in the token bar, in order."""
    return page.evaluate("""() => {
      const bar = document.querySelector('[data-fp-explorer] .fp-tokens');
      return [Array.from(bar.querySelectorAll('.fp-token')).map(b => b.dataset.token),
              Array.from(bar.querySelectorAll('.fp-unknown')).map(b => b.dataset.unknown)];
    }""")


def test_free_text_with_punctuation_and_a_contraction(explorer_page, trained):
    """The seed's own sentence ("didn't", a comma): the contraction is read as the corpus
    writes it, the comma is shown and skipped, and the attention shown is the Python
    model's on the words it knows."""
    page, errors, _ = explorer_page
    model, vocab = trained
    _type(page, SEED_SENTENCE)
    enc = encode_free_text(vocab, SEED_SENTENCE)
    assert page.get_attribute("[data-fp-explorer]", "data-status") == "ok"
    assert _shown_tokens(page) == [enc["words"], [","]]
    assert page.get_attribute("[data-fp-explorer]", "data-unknown") == "1"
    message = page.locator("[data-fp-explorer] .fp-message")
    assert message.get_attribute("data-state") == "ok" and "\u201c,\u201d" in message.inner_text()
    q = len(enc["words"]) - 1 - enc["words"][::-1].index("it")  # the last "it" is chosen
    assert page.get_attribute("[data-fp-explorer]", "data-query") == str(q)
    attentions, _ = python_forward(model, enc["ids"])
    rows = _rows(page)
    assert len(rows) == attentions.shape[0] * attentions.shape[1] * len(enc["ids"])
    for r in rows:
        assert abs(r["weight"] - attentions[r["layer"], r["head"], q, r["key"]].item()) <= TOL, r
    # The book's "cat sat mat": three unknown words, struck through; the rest is computed.
    _type(page, "The cat sat on the mat.")
    assert _shown_tokens(page) == [["<bos>", "the", "cat", "the", "."], ["sat", "on", "mat"]]
    assert page.get_attribute("[data-fp-explorer]", "data-status") == "ok" and _results(page)["rows"] > 0
    assert not errors, errors


def test_errors_leave_no_stale_result(explorer_page):
    """Unknown words are not an error; an empty or too long sentence is, and then nothing of
    the previous sentence stays on screen (it would read as this one's result)."""
    page, errors, _ = explorer_page
    _pick_example(page)
    shown = _results(page)
    assert shown["tokens"] > 0 and shown["rows"] > 0 and shown["prediction"], shown
    _type(page, "the unicorn did not cross the street because it was too tired .")
    assert page.get_attribute("[data-fp-explorer]", "data-status") == "ok"
    assert _shown_tokens(page)[1] == ["unicorn"]
    assert "unicorn" in page.inner_text("[data-fp-explorer] .fp-message")
    for text, status in (("   ", "empty"), (" ".join(["the"] * 80), "too-long")):
        _pick_example(page)
        assert _results(page)["rows"] > 0
        _type(page, text)
        message = page.locator("[data-fp-explorer] .fp-message")
        assert message.get_attribute("data-state") == "error" and message.get_attribute("role") == "alert"
        assert page.get_attribute("[data-fp-explorer]", "data-status") == status
        after = _results(page)
        assert after == {"tokens": 0, "rows": 0, "prediction": "", "summary": "", "query": None}, after
        assert page.evaluate("() => document.querySelectorAll('[data-fp-explorer] .fp-matrix td, [data-fp-explorer] .fp-mini').length") == 0
    # A valid sentence brings results back.
    _pick_example(page)
    assert _results(page)["rows"] > 0 and page.get_attribute("[data-fp-explorer]", "data-status") == "ok"
    assert not errors, errors


MATRIX_JS = """() => {
  const t = document.querySelector('[data-fp-explorer] table.fp-matrix');
  return { layer: +t.dataset.layer, head: +t.dataset.head,
           cells: Array.from(t.querySelectorAll('td.fp-cell')).map(c => [+c.dataset.query, +c.dataset.key,
             parseFloat(c.dataset.weight), c.dataset.masked === 'true']) };
}"""


def _check_matrix(page, attentions, T):
    m = page.evaluate(MATRIX_JS)
    assert len(m["cells"]) == T * T, "one cell per (query, key)"
    assert {(q, k) for q, k, _, _ in m["cells"]} == {(q, k) for q in range(T) for k in range(T)}
    A = attentions[m["layer"], m["head"]]
    for q, k, w, masked in m["cells"]:
        assert masked == (k > q), (q, k)
        assert abs(w - A[q, k].item()) <= TOL, f"head {m['layer']}.{m['head']} ({q}, {k}): {w} vs {A[q, k].item()}"
    return m["layer"], m["head"]


def test_heatmap_is_the_whole_matrix_of_the_chosen_head(explorer_page, trained, data):
    page, errors, _ = explorer_page
    model, vocab = trained
    sentence = data["examples"][1]["sentence"]  # the "wide" sentence
    _type(page, sentence)
    ids = vocab.encode(sentence, bos=True)
    attentions, _ = python_forward(model, ids)
    final = torch.tensor(data["heads"]["final"])
    assert _check_matrix(page, attentions, len(ids)) == divmod(int(final.argmax()), final.shape[1])  # head 1.2 first
    assert not page.is_visible("[data-fp-explorer] .fp-scroll-hint"), "17 tokens fit at 1280 px: no scrolling to announce"
    # Clicking a row of the matrix chooses that token.
    page.click("[data-fp-explorer] table.fp-matrix th.fp-rowhead[data-query='3']")
    assert page.get_attribute("[data-fp-explorer]", "data-query") == "3"
    assert page.get_attribute("[data-fp-explorer] table.fp-matrix tr[data-query='3']", "class") == "fp-row-selected"
    assert not errors, errors


def test_all_heads_view_selects_a_head(explorer_page, trained, data):
    page, errors, _ = explorer_page
    model, vocab = trained
    _pick_example(page)
    ids = vocab.encode(data["examples"][0]["sentence"], bos=True)
    attentions, _ = python_forward(model, ids)
    L, H = attentions.shape[:2]
    panels = page.eval_on_selector_all("[data-fp-explorer] .fp-overview button.fp-mini",
                                       "bs => bs.map(b => [+b.dataset.layer, +b.dataset.head, b.getAttribute('aria-label')])")
    assert panels == [[l, h, f"head {l}.{h}"] for l in range(L) for h in range(H)]
    # Each panel draws its head's lower triangle: T (T + 1) / 2 cells.
    T = len(ids)
    cells = page.eval_on_selector_all("[data-fp-explorer] .fp-mini svg", "ss => ss.map(s => s.querySelectorAll('.fp-mini-cell').length)")
    assert cells == [T * (T + 1) // 2] * (L * H)
    for l, h in ((0, 1), (1, 3)):
        page.click(f"[data-fp-explorer] button.fp-mini[data-layer='{l}'][data-head='{h}']")
        pressed = page.eval_on_selector_all("[data-fp-explorer] button.fp-mini[aria-pressed='true']",
                                            "bs => bs.map(b => [+b.dataset.layer, +b.dataset.head])")
        assert pressed == [[l, h]]
        assert _check_matrix(page, attentions, T) == (l, h)
        assert page.inner_text("[data-fp-explorer] .fp-matrix-section h3") == f"Head {l}.{h}: the whole attention matrix"
        marked = page.eval_on_selector_all("[data-fp-explorer] table.fp-head.fp-head-selected",
                                           "ts => ts.map(t => [+t.dataset.layer, +t.dataset.head])")
        assert marked == [[l, h]]
    assert not errors, errors


def test_first_it_is_explained(explorer_page, book, trained, data):
    """The first "it" comes before the adjective: the page says that what a head does there
    is a fixed preference, with the numbers of the Python model, in the note and in the text."""
    page, errors, _ = explorer_page
    model, vocab = trained
    stats = first_it_heads(model, make_corpus(seed=0).held_out)
    notes = []
    for adjective in ("tired", "wide"):
        ex = make_example(vocab, 0, "animal", "street", adjective)
        _type(page, ex.sentence)
        page.click(f"[data-fp-explorer] .fp-token[data-index='{ex.sentence_pronoun_index}']")
        note = page.locator("[data-fp-explorer] .fp-it-note")
        assert note.is_visible() and note.get_attribute("data-kind") == "before-adjective"
        attentions, _ = python_forward(model, ex.ids)
        i = ex.sentence_pronoun_index
        W = attentions[:, :, i, [ex.referent_index, ex.distractor_index] if adjective == "tired" else [ex.distractor_index, ex.referent_index]]
        r, noun = divmod(int(W.reshape(-1, 2).argmax()), 2)  # the strongest weight on animal or street
        l, h = divmod(r, W.shape[1])
        assert note.get_attribute("data-head") == f"{l}.{h}"
        text = note.inner_text()
        for part in (f"{W[l, h, noun].item():.3f} on \u201c{('animal', 'street')[noun]}\u201d", "fixed preference",
                     f"in {round(stats['first_noun'][l, h].item() * 100)}%", f"right noun in {round(stats['referent'][l, h].item() * 100)}%"):
            assert part in text, (part, text)
        notes.append(text)
        # The final "it" has read the adjective: a different note.
        page.click(f"[data-fp-explorer] .fp-token[data-index='{ex.pronoun_index}']")
        assert note.get_attribute("data-kind") == "after-adjective"
    assert notes[0] == notes[1], "the first \"it\" cannot see the adjective: the same note in both sentences"
    # The chapter's own explanation, with the numbers glued from its code.
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", (book / "chapters" / "explorer.html").read_text()))
    assert "fixed preference" in text and "not resolution" in text
    assert f"head 0.1 still puts {W[0, 1, 0].item():.3f} on animal" in text.replace(" ,", ",")
    assert f"favours the noun named first in {stats['first_noun'][0, 1].item():.0%}" in text
    assert not errors, errors


def test_worked_example_can_be_edited(explorer_page):
    """Edit the query and a key: every step is recomputed, and equals torch's."""
    page, errors, _ = explorer_page
    root = "[data-fp-cat-sat-mat]"

    def values(step):
        return page.eval_on_selector_all(f"{root} .fp-num[data-step='{step}']", "ns => ns.map(n => parseFloat(n.dataset.value))")

    Q, K, V = worked.cat_sat_mat(torch.float64)
    edits = {("query", 0, 0): 2.0, ("query", 0, 1): -1.0, ("key", 2, 0): 1.5}
    for (role, row, coord), value in edits.items():
        page.fill(f"{root} input[data-role='{role}'][data-row='{row}'][data-coord='{coord}']", str(value))
        (Q if role == "query" else K)[row, coord] = value
    raw = Q @ K.T
    weights = torch.softmax(raw / math.sqrt(2), dim=-1)
    for step, want in (("raw", raw), ("scaled", raw / math.sqrt(2)), ("weights", weights), ("output", weights @ V)):
        got = torch.tensor(values(step), dtype=torch.float64)
        assert torch.allclose(got, want[0], atol=1e-12, rtol=0), (step, got, want[0])
    assert page.eval_on_selector_all(f"{root} .fp-check", "ns => ns.map(n => n.dataset.agrees)") == ["edited"] * 4
    assert page.inner_text(f"{root} .fp-num[data-step='raw'][data-index='0']") == f"{raw[0, 0].item():.2f}"
    # An empty input does not compute; the button brings the chapter's numbers back.
    page.fill(f"{root} input[data-role='key'][data-row='1'][data-coord='1']", "")
    assert page.get_attribute(root, "data-valid") == "false"
    page.click(f"{root} button.fp-csm-reset")
    assert values("weights") == pytest.approx(worked.WEIGHTS, abs=1e-3)
    assert page.eval_on_selector_all(f"{root} .fp-check", "ns => ns.map(n => n.dataset.agrees)") == ["true"] * 4
    assert not errors, errors


def test_results_are_on_screen_when_the_page_opens(chromium, book):
    """The example list starts folded, so the results (tokens, then all heads at once)
    sit right below the sentence box instead of below a long list."""
    server, base = _serve(book)
    page, errors, _ = _open(chromium, base, "chapters/explorer.html")
    try:
        page.wait_for_selector("[data-fp-explorer][data-ready='true']", timeout=20000)
        assert page.evaluate("() => document.querySelector('[data-fp-explorer] details.fp-examples-box').open") is False
        gap = page.evaluate("""() => {
          const c = document.querySelector('[data-fp-explorer]');
          return c.querySelector('.fp-overview').getBoundingClientRect().top - c.querySelector('input.fp-sentence').getBoundingClientRect().top;
        }""")
        assert gap < 520, f"the all-heads view is {gap:.0f} px below the sentence box"
        assert not errors, errors
    finally:
        page.close()
        server.shutdown()


def test_cat_sat_mat_numbers_on_the_page(explorer_page):
    page, errors, _ = explorer_page

    def shown(step):
        return page.eval_on_selector_all(f"[data-fp-cat-sat-mat] .fp-num[data-step='{step}']", "ns => ns.map(n => n.textContent)")

    assert shown("raw") == ["1.10", "1.00", "0.60"]
    assert shown("scaled") == ["0.778", "0.707", "0.424"]
    assert shown("weights") == ["0.3797", "0.3537", "0.2666"]
    assert shown("output") == ["1.026", "0.974"]
    checks = page.eval_on_selector_all("[data-fp-cat-sat-mat] .fp-check", "ns => ns.map(n => [n.dataset.agrees, n.textContent])")
    assert [a for a, _ in checks] == ["true"] * 4
    weights = ", ".join(f"{w:.3f}" for w in worked.WEIGHTS)  # the book's figures: computed, rounded once
    assert weights == "0.380, 0.354, 0.267" and weights in checks[2][1]
    assert not errors, errors


def test_usable_at_390_px(chromium, book, trained):
    """On a phone the page never scrolls sideways: the all-heads view fits the screen and
    the longest sentence's matrix scrolls inside its own box."""
    _, vocab = trained
    server, base = _serve(book)
    page = chromium.new_page(viewport={"width": 390, "height": 844})
    try:
        page.goto(f"{base}/chapters/explorer.html", wait_until="load")
        page.wait_for_selector("[data-fp-explorer][data-ready='true']", timeout=20000)
        words = ("the animal did not cross the street because it was too tired . it animal . " * 3).split()[:31]
        _type(page, " ".join(words))
        assert page.evaluate("() => document.querySelectorAll('[data-fp-explorer] table.fp-matrix td.fp-cell').length") == 32 * 32
        sizes = page.evaluate("""() => {
          const box = document.querySelector('[data-fp-explorer] .fp-matrix-box');
          const right = Math.max(...Array.from(document.querySelectorAll('[data-fp-explorer] .fp-mini, [data-fp-cat-sat-mat] input'))
                                 .map(b => b.getBoundingClientRect().right));
          return { page: document.documentElement.scrollWidth - document.documentElement.clientWidth,
                   main: document.querySelector('main').scrollWidth - document.querySelector('main').clientWidth,
                   box: box.scrollWidth - box.clientWidth, overflow: getComputedStyle(box).overflowX, right: right,
                   width: document.documentElement.clientWidth };
        }""")
        assert sizes["page"] <= 0 and sizes["main"] <= 1, sizes
        assert sizes["box"] > 0 and sizes["overflow"] == "auto", sizes  # the matrix scrolls in its box
        assert page.is_visible("[data-fp-explorer] .fp-scroll-hint"), "no sign that the matrix scrolls"
        assert sizes["right"] <= sizes["width"], sizes
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / "explorer_390.png"), full_page=True)
    finally:
        page.close()
        server.shutdown()
