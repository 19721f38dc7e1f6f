/* Attention explorer for the capstone's TinyGPT: the forward pass of the model
 * in plain JavaScript (no library), and the page that shows where each token
 * attends, per layer and head.
 *
 * The weights come from firstprinciples/capstone/export.py (written at build
 * time by the Sphinx extension sphinx_explorer.py as _static/explorer/model.js,
 * which sets window.FP_EXPLORER_DATA). Arithmetic is float64 throughout;
 * float32 parameters are restored exactly with Math.fround.
 *
 * Public API (window.FirstPrinciplesExplorer): erf, gelu, layerNorm, softmax,
 * attend, loadModel, forward, tokenize, mount, mountCatSatMat.
 */
(function (root) {
  "use strict";

  // ------------------------------------------------------------------ maths

  var TWO_OVER_SQRT_PI = 2 / Math.sqrt(Math.PI);

  /* erf(x) to about 1e-15: for |x| < 6 the series
   *   erf(x) = 2/sqrt(pi) exp(-x^2) sum_n 2^n x^(2n+1) / (1*3*5*...*(2n+1)),
   * whose terms are all positive (no cancellation); beyond 6, erf is +-1 in float64. */
  function erf(x) {
    if (x !== x) return NaN;
    var ax = Math.abs(x);
    if (ax >= 6) return x > 0 ? 1 : -1;
    var x2 = ax * ax, term = ax, sum = ax, n = 0;
    while (term > sum * 1e-17) {
      n += 1;
      term *= (2 * x2) / (2 * n + 1);
      sum += term;
    }
    var r = TWO_OVER_SQRT_PI * Math.exp(-x2) * sum;
    return x < 0 ? -r : r;
  }

  /* Exact GELU, as torch.nn.GELU(): x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2)). */
  function gelu(x) {
    return 0.5 * x * (1 + erf(x * Math.SQRT1_2));
  }

  /* y = W x + b for a torch Linear weight W of shape (nOut, nIn), stored row-major. */
  function linear(x, W, b, nIn, nOut) {
    var y = new Float64Array(nOut);
    for (var o = 0; o < nOut; o++) {
      var s = 0, row = o * nIn;
      for (var i = 0; i < nIn; i++) s += W[row + i] * x[i];
      y[o] = b ? s + b[o] : s;
    }
    return y;
  }

  /* LayerNorm over one vector: (x - mean) / sqrt(var + eps) * w + b, biased variance. */
  function layerNorm(x, w, b, eps) {
    var n = x.length, mean = 0, v = 0, i;
    for (i = 0; i < n; i++) mean += x[i];
    mean /= n;
    for (i = 0; i < n; i++) v += (x[i] - mean) * (x[i] - mean);
    v /= n;
    var inv = 1 / Math.sqrt(v + eps), y = new Float64Array(n);
    for (i = 0; i < n; i++) y[i] = (x[i] - mean) * inv * w[i] + b[i];
    return y;
  }

  /* Stable softmax of a row; -Infinity entries get exactly 0. */
  function softmax(row) {
    var n = row.length, m = -Infinity, i, s = 0, out = new Float64Array(n);
    for (i = 0; i < n; i++) if (row[i] > m) m = row[i];
    for (i = 0; i < n; i++) {
      out[i] = row[i] === -Infinity ? 0 : Math.exp(row[i] - m);
      s += out[i];
    }
    for (i = 0; i < n; i++) out[i] /= s;
    return out;
  }

  function dot(a, b) {
    var s = 0;
    for (var i = 0; i < a.length; i++) s += a[i] * b[i];
    return s;
  }

  /* Scaled dot-product attention, every step kept:
   *   scores = Q K^T, scaled = scores / sqrt(d_k) (+ causal mask), weights = softmax(scaled), output = weights V.
   * Q: T_q rows, K and V: T_k rows (arrays of Float64Array). With causal = true,
   * query i sees keys 0 .. i + (T_k - T_q); the others are -Infinity before the
   * softmax and weigh exactly 0. The model's forward pass and the "Cat sat mat"
   * walk-through both call this function. */
  function attend(Q, K, V, causal) {
    var Tq = Q.length, Tk = K.length, dk = Q[0].length, dv = V[0].length;
    var scale = Math.sqrt(dk), offset = Tk - Tq;
    var scores = [], scaled = [], weights = [], output = [];
    for (var i = 0; i < Tq; i++) {
      var s = new Float64Array(Tk), z = new Float64Array(Tk);
      for (var j = 0; j < Tk; j++) {
        s[j] = dot(Q[i], K[j]);
        z[j] = causal && j > i + offset ? -Infinity : s[j] / scale;
      }
      var w = softmax(z), o = new Float64Array(dv);
      for (j = 0; j < Tk; j++) {
        if (w[j] === 0) continue;
        for (var c = 0; c < dv; c++) o[c] += w[j] * V[j][c];
      }
      scores.push(s);
      scaled.push(z);
      weights.push(w);
      output.push(o);
    }
    return { scores: scores, scaled: scaled, weights: weights, output: output };
  }

  // ------------------------------------------------------------------ the model

  function requiredParams(cfg) {
    var names = ["tok.weight", "pos.weight", "ln_f.weight", "ln_f.bias", "head.weight"];
    for (var l = 0; l < cfg.n_layers; l++) {
      var p = "blocks." + l + ".";
      names.push(p + "ln1.weight", p + "ln1.bias", p + "ln2.weight", p + "ln2.bias",
        p + "attn.W_q.weight", p + "attn.W_k.weight", p + "attn.W_v.weight", p + "attn.W_o.weight",
        p + "ffn.net.0.weight", p + "ffn.net.0.bias", p + "ffn.net.2.weight", p + "ffn.net.2.bias");
    }
    return names;
  }

  /* The exported dictionary (export.py's export_model) -> a model ready for forward(). */
  function loadModel(exported) {
    var cfg = exported.config, params = {};
    Object.keys(exported.params).forEach(function (name) {
      var entry = exported.params[name], data = entry.data;
      var size = entry.shape.reduce(function (a, b) { return a * b; }, 1);
      if (data.length !== size) throw new Error("parameter " + name + " has " + data.length + " values, expected " + size);
      var arr = new Float64Array(size);
      // float32 values are written as their shortest decimal; fround gives back the exact float32.
      var f32 = entry.dtype === "float32";
      for (var i = 0; i < size; i++) arr[i] = f32 ? Math.fround(data[i]) : data[i];
      params[name] = arr;
    });
    var missing = requiredParams(cfg).filter(function (n) { return !(n in params); });
    if (missing.length) throw new Error("the exported model lacks " + missing.join(", "));
    if (cfg.gelu !== "erf") throw new Error("unsupported GELU variant: " + cfg.gelu);
    var index = {};
    exported.vocab.forEach(function (w, i) { index[w] = i; });
    if (!exported.tokenizer) throw new Error("the exported model has no tokenizer rules");
    return { config: cfg, vocab: exported.vocab, index: index, params: params, split: splitter(exported.tokenizer) };
  }

  function row(flat, r, n) {
    return flat.subarray(r * n, (r + 1) * n);
  }

  /* forward(model, ids) -> { attentions: [layer][head][query] Float64Array(T), logits: [T] Float64Array(V) } */
  function forward(model, ids) {
    var cfg = model.config, p = model.params;
    var d = cfg.d_model, H = cfg.n_heads, dk = d / H, dff = cfg.d_ff, V = cfg.vocab_size, eps = cfg.ln_eps;
    var T = ids.length;
    if (T < 1) throw new Error("no tokens");
    if (T > cfg.max_len) throw new Error(T + " tokens is more than the model's max_len of " + cfg.max_len);
    var x = [], t, l, h;
    for (t = 0; t < T; t++) {
      if (!(ids[t] >= 0 && ids[t] < V)) throw new Error("token id " + ids[t] + " is out of range");
      var e = new Float64Array(d), te = row(p["tok.weight"], ids[t], d), pe = row(p["pos.weight"], t, d);
      for (var c = 0; c < d; c++) e[c] = te[c] + pe[c];
      x.push(e);
    }
    var attentions = [];
    for (l = 0; l < cfg.n_layers; l++) {
      var pre = "blocks." + l + ".";
      // attention branch: x + W_o merge(attend(split(ln1(x))))
      var a = x.map(function (r) { return layerNorm(r, p[pre + "ln1.weight"], p[pre + "ln1.bias"], eps); });
      var q = a.map(function (r) { return linear(r, p[pre + "attn.W_q.weight"], null, d, d); });
      var k = a.map(function (r) { return linear(r, p[pre + "attn.W_k.weight"], null, d, d); });
      var v = a.map(function (r) { return linear(r, p[pre + "attn.W_v.weight"], null, d, d); });
      var merged = x.map(function () { return new Float64Array(d); });
      var heads = [];
      for (h = 0; h < H; h++) {
        var lo = h * dk, hi = lo + dk, sl = function (r) { return r.subarray(lo, hi); };
        var res = attend(q.map(sl), k.map(sl), v.map(sl), true);
        heads.push(res.weights);
        for (t = 0; t < T; t++) merged[t].set(res.output[t], lo);
      }
      attentions.push(heads);
      for (t = 0; t < T; t++) {
        var o = linear(merged[t], p[pre + "attn.W_o.weight"], null, d, d);
        for (c = 0; c < d; c++) x[t][c] += o[c];
      }
      // feed-forward branch: x + W2 gelu(W1 ln2(x) + b1) + b2
      for (t = 0; t < T; t++) {
        var f = linear(layerNorm(x[t], p[pre + "ln2.weight"], p[pre + "ln2.bias"], eps),
          p[pre + "ffn.net.0.weight"], p[pre + "ffn.net.0.bias"], d, dff);
        for (c = 0; c < dff; c++) f[c] = gelu(f[c]);
        var g = linear(f, p[pre + "ffn.net.2.weight"], p[pre + "ffn.net.2.bias"], dff, d);
        for (c = 0; c < d; c++) x[t][c] += g[c];
      }
    }
    var logits = x.map(function (r) {
      return linear(layerNorm(r, p["ln_f.weight"], p["ln_f.bias"], eps), p["head.weight"], p["head.bias"] || null, d, V);
    });
    return { attentions: attentions, logits: logits };
  }

  /* The page's tokenizer for free text: the rules of export.py's split_free_text,
   * from the exported model's "tokenizer" entry (punctuation, clitics, stems of n't).
   * Lower case; curly apostrophes read as "'"; each punctuation mark is a token,
   * except an apostrophe or hyphen between letters; "n't" is "not" as the corpus
   * writes it ("didn't" -> did not); other clitics are split off ("it's" -> it 's). */
  function splitter(rules) {
    var cls = rules.punctuation.replace(/[\\\]\[^-]/g, "\\$&");
    var piece = new RegExp("[^\\s" + cls + "]+(?:['-][^\\s" + cls + "]+)*|[" + cls + "]", "g");
    return function (text) {
      var words = [], found = String(text).toLowerCase().replace(/[\u2018\u2019]/g, "'").match(piece) || [];
      found.forEach(function (w) {
        var cut = w.lastIndexOf("'");
        if (w === "cannot") words.push("can", "not");
        else if (w.length > 3 && w.slice(-3) === "n't") {
          var stem = w.slice(0, -3);
          words.push(Object.prototype.hasOwnProperty.call(rules.not_stems, stem) ? rules.not_stems[stem] : stem, "not");
        } else if (cut >= 0 && rules.clitics.indexOf(w.slice(cut + 1)) >= 0) words.push(w.slice(0, cut), w.slice(cut));
        else words.push(w);
      });
      return words;
    };
  }

  /* tokenize(model, text) -> { pieces, words, ids, unknown } (export.py's encode_free_text):
   * pieces: every word of the text, { text, known, position } (position: its index in
   * the model's input, null if unknown); words and ids: the model's input, <bos> first,
   * unknown words left out (the model has no unknown-word token); unknown: each unknown word once. */
  function tokenize(model, sentence) {
    var prefix = model.config.prepend ? [model.config.prepend] : [];
    var words = prefix.slice(), pieces = [], unknown = [];
    model.split(sentence).forEach(function (w) {
      var known = w.charAt(0) !== "<" && Object.prototype.hasOwnProperty.call(model.index, w);
      pieces.push({ text: w, known: known, position: known ? words.length : null });
      if (known) words.push(w);
      else if (unknown.indexOf(w) < 0) unknown.push(w);
    });
    var ids = words.map(function (w) { return model.index[w]; });
    return { pieces: pieces, words: words, ids: ids, unknown: unknown };
  }

  // ------------------------------------------------------------------ the page

  var uid = 0;

  function el(tag, attrs, children) {
    var node = document.createElement(tag);
    if (attrs) {
      Object.keys(attrs).forEach(function (k) {
        if (attrs[k] === null || attrs[k] === undefined || attrs[k] === false) return;
        if (k === "text") node.textContent = attrs[k];
        else if (k === "className") node.className = attrs[k];
        else node.setAttribute(k, attrs[k] === true ? "" : String(attrs[k]));
      });
    }
    (children || []).forEach(function (c) {
      node.appendChild(typeof c === "string" ? document.createTextNode(c) : c);
    });
    return node;
  }

  function fmt(x, digits) {
    return x.toFixed(digits);
  }

  function probabilities(logits) {
    return softmax(logits);
  }

  /* SVG markup of one element, numbers and class names only; the HTML parser puts an
   * <svg> written into innerHTML in the SVG namespace. */
  function svgTag(tag, attrs, inner) {
    return "<" + tag + Object.keys(attrs).map(function (k) { return " " + k + '="' + attrs[k] + '"'; }).join("") +
      (inner === undefined ? "/>" : ">" + inner + "</" + tag + ">");
  }

  function quote(w) {
    return "\u201c" + w + "\u201d";
  }

  function pct(x) {
    return Math.round(x * 100) + "%";
  }

  /* Fill `container` with the explorer for the exported data
   * { model, examples, trained, heads, nouns, adjectives } (export.py's explorer_data). */
  function mount(container, data) {
    var model = loadModel(data.model), cfg = model.config;
    var id = "fp-explorer-" + (++uid);
    var state = { words: [], ids: [], pieces: [], result: null, query: -1, head: defaultHead() };
    var nouns = data.nouns || [], adjectives = data.adjectives || [], stats = data.heads || null;
    container.textContent = "";
    container.classList.add("fp-explorer");

    /* The head that first shows: the one whose final "it" most often favours the right noun. */
    function defaultHead() {
      var best = { l: cfg.n_layers - 1, h: 0 }, top = -1;
      if (data.heads && data.heads.final) {
        data.heads.final.forEach(function (r, l) {
          r.forEach(function (v, h) { if (v > top) { top = v; best = { l: l, h: h }; } });
        });
      }
      return best;
    }

    if (data.trained === false) {
      container.appendChild(el("p", { className: "fp-note", role: "note",
        text: "These are the weights of an untrained model (random initialisation): the trained weights were not available when the book was built." }));
    }

    // -- input
    var inputId = id + "-sentence", msgId = id + "-message";
    var input = el("input", { id: inputId, type: "text", className: "fp-sentence", autocomplete: "off",
      spellcheck: "false", "aria-describedby": msgId, size: 60 });
    var form = el("form", { className: "fp-form", "aria-label": "Sentence" }, [
      el("label", { "for": inputId, text: "Sentence (any text; words the model does not know are shown, and skipped)" }),
      el("div", { className: "fp-form-row" }, [input, el("button", { type: "submit", className: "fp-run", text: "Show attention" })]),
    ]);
    var message = el("p", { id: msgId, className: "fp-message", role: "status", "aria-live": "polite" });
    container.appendChild(form);
    container.appendChild(message);

    // -- examples
    var exList = el("ul", { className: "fp-examples" });
    (data.examples || []).forEach(function (ex, i) {
      var label = ex.split === "held_out" ? "held out" : "training";
      var b = el("button", { type: "button", className: "fp-example", "data-example": i, "data-split": ex.split }, [
        el("span", { className: "fp-split fp-split-" + ex.split, text: label }), " ", el("span", { text: ex.sentence }),
      ]);
      b.addEventListener("click", function () {
        input.value = ex.sentence;
        run();
      });
      exList.appendChild(el("li", null, [b]));
    });
    // Closed at first, so that the results are on screen as soon as the page opens.
    var examplesBox = el("details", { className: "fp-examples-box" }, [
      el("summary", { text: "Example sentences from the corpus (" + (data.examples || []).length + ", training and held out)" }), exList,
    ]);
    container.appendChild(examplesBox);

    var vocabWords = model.vocab.filter(function (w) { return w.charAt(0) !== "<"; });
    container.appendChild(el("details", { className: "fp-vocab" }, [
      el("summary", { text: "Vocabulary (" + vocabWords.length + " words; no token for unknown words)" }),
      el("p", { className: "fp-vocab-words", text: vocabWords.join("  ") }),
    ]));

    // -- tokens, prediction, all heads, the chosen head's matrix, and one table per head
    var tokenBar = el("div", { className: "fp-tokens", role: "toolbar", "aria-label": "Tokens: choose one to see where it attends" });
    var itNote = el("p", { className: "fp-it-note", role: "note", hidden: true });
    var prediction = el("p", { className: "fp-prediction" });
    var overview = el("div", { className: "fp-overview", role: "group", "aria-label": "All heads: choose one to see its whole attention matrix" });
    var matrixTitle = el("h3", { className: "fp-section-title" });
    var matrixBox = el("div", { className: "fp-matrix-box", tabindex: "0", role: "region", "aria-label": "Attention matrix of the chosen head (scrolls sideways)" });
    var readout = el("p", { className: "fp-readout" });
    var matrixHint = el("p", { className: "fp-help fp-scroll-hint", hidden: true, text: "\u2194 The matrix is wider than the screen: scroll it sideways to see every column." });
    var summary = el("p", { className: "fp-summary", "aria-live": "polite" });
    var grid = el("div", { className: "fp-grid" });
    var results = el("div", { className: "fp-results" }, [
      tokenBar, itNote, prediction,
      el("section", { className: "fp-overview-section", "aria-label": "All heads" }, [
        el("h3", { className: "fp-section-title", text: "All heads at once" }),
        el("p", { className: "fp-help", text: "One small attention matrix per head, layers as rows: each row of a matrix is a token, " +
          "each column a token it may attend to (the triangle above the diagonal is masked). The chosen token's row is outlined. Click a head to enlarge it below." }),
        overview,
      ]),
      el("section", { className: "fp-matrix-section", "aria-label": "The chosen head's attention matrix" }, [
        matrixTitle,
        el("p", { className: "fp-help", text: "Row: the token that attends (the query); column: the token attended to (the key). " +
          "The darker the cell, the larger the weight; point at a cell (or read the table above each layer) for its number. Click a row to choose that token." }),
        matrixBox, matrixHint,
        el("p", { className: "fp-legend", "aria-hidden": "true" }, [
          "weight 0", el("span", { className: "fp-legend-bar" }), "1", el("span", { className: "fp-legend-masked" }), "masked",
        ]),
        readout,
      ]),
      summary, grid,
    ]);
    container.appendChild(results);

    function say(text, isError) {
      message.textContent = text;
      message.setAttribute("data-state", isError ? "error" : "ok");
      message.setAttribute("role", isError ? "alert" : "status");
    }

    /* After an error nothing of the previous sentence stays on screen: its tokens,
     * prediction and heads would read as the results of the sentence just typed. */
    function clearResults() {
      state.words = [];
      state.ids = [];
      state.pieces = [];
      state.result = null;
      state.query = -1;
      tokenBar.textContent = "";
      summary.textContent = "";
      prediction.textContent = "";
      prediction.removeAttribute("data-top-token");
      itNote.hidden = true;
      itNote.textContent = "";
      overview.textContent = "";
      matrixTitle.textContent = "";
      matrixBox.textContent = "";
      readout.textContent = "";
      grid.textContent = "";
      results.hidden = true;
      container.removeAttribute("data-query");
      container.removeAttribute("data-unknown");
    }

    function fail(text, status) {
      clearResults();
      say(text, true);
      container.setAttribute("data-status", status);
      return false;
    }

    function run() {
      var tok = tokenize(model, input.value);
      if (!tok.pieces.length) {
        return fail("Type a sentence first, or pick one of the examples.", "empty");
      }
      if (tok.ids.length > cfg.max_len) {
        return fail("That is " + tok.ids.length + " tokens; the model reads at most " + cfg.max_len + ".", "too-long");
      }
      state.words = tok.words;
      state.ids = tok.ids;
      state.pieces = tok.pieces;
      state.result = forward(model, tok.ids);
      var text = tok.words.length + " tokens go into the model (its " + (cfg.prepend || "") + " start token included).";
      if (tok.unknown.length) {
        var n = tok.pieces.filter(function (p) { return !p.known; }).length;
        text += " Skipped, because they are not among its " + vocabWords.length + " words: " + tok.unknown.map(quote).join(", ") +
          " (" + n + (n === 1 ? " word" : " words") + ", struck through below). The model has no token for unknown words, so it reads the sentence without them.";
      }
      say(text + " Choose a token.", false);
      container.setAttribute("data-status", "ok");
      container.setAttribute("data-unknown", String(tok.unknown.length));
      results.hidden = false;
      drawTokens();
      var its = [];
      tok.words.forEach(function (w, i) { if (w === "it") its.push(i); });
      select(its.length ? its[its.length - 1] : tok.words.length - 1, false);
      return true;
    }

    form.addEventListener("submit", function (ev) {
      ev.preventDefault();
      run();
    });

    function drawTokens() {
      tokenBar.textContent = "";
      var items = (cfg.prepend ? [{ text: cfg.prepend, known: true, position: 0 }] : []).concat(state.pieces);
      items.forEach(function (piece) {
        if (!piece.known) {
          tokenBar.appendChild(el("span", { className: "fp-unknown", "data-unknown": piece.text,
            title: quote(piece.text) + " is not in the vocabulary: skipped" }, [
            el("span", { text: piece.text }), el("span", { className: "fp-sr-only", text: " (unknown word, skipped)" }),
          ]));
          return;
        }
        var i = piece.position, w = piece.text;
        var b = el("button", { type: "button", className: "fp-token", "data-index": i, "data-token": w,
          "aria-pressed": "false", tabindex: "-1", title: "token " + i + ": " + w, text: w });
        b.addEventListener("click", function () { select(i, true); });
        b.addEventListener("keydown", function (ev) {
          var next = null;
          if (ev.key === "ArrowRight") next = Math.min(i + 1, state.words.length - 1);
          else if (ev.key === "ArrowLeft") next = Math.max(i - 1, 0);
          else if (ev.key === "Home") next = 0;
          else if (ev.key === "End") next = state.words.length - 1;
          if (next !== null) {
            ev.preventDefault();
            select(next, true);
          }
        });
        tokenBar.appendChild(b);
      });
    }

    function select(i, focus) {
      state.query = i;
      container.setAttribute("data-query", i);
      var buttons = tokenBar.querySelectorAll(".fp-token");
      Array.prototype.forEach.call(buttons, function (b, j) {
        b.setAttribute("aria-pressed", j === i ? "true" : "false");
        b.setAttribute("tabindex", j === i ? "0" : "-1");
        b.classList.toggle("fp-selected", j === i);
      });
      if (focus && buttons[i]) buttons[i].focus();
      drawItNote();
      drawOverview();
      drawMatrix();
      drawHeads();
      drawPrediction();
    }

    function selectHead(l, h) {
      state.head = { l: l, h: h };
      drawOverview();
      drawMatrix();
      markHeadTables();
    }

    /* What an "it" can and cannot show: before the adjective, every head's weights are
     * the same whichever adjective follows (causal mask), so what a head does there is
     * a habit, measured over the held-out sentences (data.heads, from export.py). */
    function drawItNote() {
      var i = state.query, words = state.words;
      itNote.hidden = true;
      itNote.textContent = "";
      itNote.removeAttribute("data-kind");
      if (words[i] !== "it" || !stats) return;
      var adj = null, j;
      for (j = 0; j < i; j++) if (adjectives.indexOf(words[j]) >= 0) adj = words[j];
      var seen = [];
      for (j = 1; j < i; j++) if (nouns.indexOf(words[j]) >= 0) seen.push(j);
      if (!seen.length) return;
      var n = stats.n, l, h;
      if (adj === null) {
        // the head that pulls hardest towards a noun here
        var best = null;
        for (l = 0; l < cfg.n_layers; l++) for (h = 0; h < cfg.n_heads; h++) {
          seen.forEach(function (k) {
            var w = state.result.attentions[l][h][i][k];
            if (!best || w > best.w) best = { l: l, h: h, k: k, w: w };
          });
        }
        var habit = stats.first_noun[best.l][best.h], right = stats.referent[best.l][best.h];
        var maxRight = Math.max.apply(null, stats.referent.map(function (r) { return Math.max.apply(null, r); }));
        itNote.setAttribute("data-kind", "before-adjective");
        itNote.setAttribute("data-head", best.l + "." + best.h);
        itNote.textContent = "This \u201cit\u201d comes before the adjective. The causal mask hides every later word, so each head's weights here " +
          "are exactly the same whichever adjective follows: change it, and not one number here moves. The strongest pull towards a noun is head " +
          best.l + "." + best.h + "'s: " + fmt(best.w, 3) + " on " + quote(words[best.k]) + ". That is a fixed preference, not resolution: over the " + n +
          " held-out sentences, at this first \u201cit\u201d head " + best.l + "." + best.h + " favours the noun named first in " + pct(habit) +
          " of them, and the right noun in " + pct(right) + " (no head does better than " + pct(maxRight) + ", a coin toss). Choose the final \u201cit\u201d to see the heads that follow the adjective.";
      } else {
        var top = { l: 0, h: 0, v: -1 };
        stats.final.forEach(function (r, l2) { r.forEach(function (v, h2) { if (v > top.v) top = { l: l2, h: h2, v: v }; }); });
        itNote.setAttribute("data-kind", "after-adjective");
        itNote.setAttribute("data-head", top.l + "." + top.h);
        itNote.textContent = "This \u201cit\u201d comes after the adjective " + quote(adj) + ", so heads can use it. Over the " + n +
          " held-out sentences, at the final \u201cit\u201d head " + top.l + "." + top.h + " gives the right noun more weight than the other one in " +
          pct(top.v) + " of them: choose it in the overview below.";
      }
      itNote.hidden = false;
    }

    function drawPrediction() {
      var probs = probabilities(state.result.logits[state.query]);
      var order = [];
      for (var j = 0; j < probs.length; j++) order.push(j);
      order.sort(function (a, b) { return probs[b] - probs[a]; });
      var top = order.slice(0, 3).map(function (j) { return model.vocab[j] + " (" + fmt(probs[j], 3) + ")"; });
      prediction.textContent = "The model's next token after \u201c" + state.words[state.query] + "\u201d: " + top.join(", ") + ".";
      prediction.setAttribute("data-top-token", model.vocab[order[0]]);
    }

    /* Small multiples, as BertViz's model view: one T x T matrix per (layer, head). */
    function drawOverview() {
      var T = state.words.length, i = state.query;
      overview.textContent = "";
      overview.style.setProperty("--fp-heads", String(cfg.n_heads));
      for (var l = 0; l < cfg.n_layers; l++) {
        overview.appendChild(el("span", { className: "fp-overview-layer", "aria-hidden": "true", text: "layer " + l }));
        for (var h = 0; h < cfg.n_heads; h++) {
          var A = state.result.attentions[l][h];
          var cells = svgTag("rect", { x: 0, y: 0, width: T, height: T, "class": "fp-mini-bg" });
          for (var q = 0; q < T; q++) {
            for (var k = 0; k <= q; k++) {
              cells += svgTag("rect", { x: k, y: q, width: 1, height: 1, "class": "fp-mini-cell", "fill-opacity": A[q][k].toFixed(3) });
            }
          }
          cells += svgTag("rect", { x: 0.08, y: i + 0.08, width: i + 0.84, height: 0.84, "class": "fp-mini-row", "stroke-width": Math.max(0.16, T / 60).toFixed(3) });
          var pic = el("span", { className: "fp-mini-pic" });
          pic.innerHTML = svgTag("svg", { viewBox: "0 0 " + T + " " + T, "aria-hidden": "true", focusable: "false", preserveAspectRatio: "none" }, cells);
          var chosen = state.head.l === l && state.head.h === h;
          var b = el("button", { type: "button", className: "fp-mini" + (chosen ? " fp-mini-selected" : ""), "data-layer": l, "data-head": h,
            "aria-pressed": chosen ? "true" : "false", "aria-label": "head " + l + "." + h }, [
            pic, el("span", { className: "fp-mini-label", "aria-hidden": "true", text: l + "." + h }),
          ]);
          b.addEventListener("click", (function (l2, h2) { return function () { selectHead(l2, h2); }; })(l, h));
          overview.appendChild(b);
        }
      }
    }

    /* The chosen head's whole T x T attention matrix, as a table of tinted cells. */
    function drawMatrix() {
      var l = state.head.l, h = state.head.h, A = state.result.attentions[l][h], words = state.words, T = words.length, i = state.query;
      matrixTitle.textContent = "Head " + l + "." + h + ": the whole attention matrix";
      matrixBox.textContent = "";
      var head = el("tr", null, [el("td", { className: "fp-corner" })]);
      words.forEach(function (w, k) {
        head.appendChild(el("th", { scope: "col", className: "fp-col", "data-key": k, title: "token " + k + ": " + w }, [el("span", { text: w })]));
      });
      var body = el("tbody");
      for (var q = 0; q < T; q++) {
        var tr = el("tr", { className: q === i ? "fp-row-selected" : null, "data-query": q }, [
          el("th", { scope: "row", className: "fp-rowhead", "data-query": q, text: words[q] }),
        ]);
        for (var k = 0; k < T; k++) {
          var masked = k > q, w = A[q][k];
          var td = el("td", { className: masked ? "fp-cell fp-cell-masked" : "fp-cell", "data-query": q, "data-key": k,
            "data-weight": String(w), "data-masked": masked ? "true" : "false",
            title: masked ? words[q] + " \u2192 " + words[k] + ": masked" : words[q] + " \u2192 " + words[k] + ": " + fmt(w, 3) },
          [el("span", { className: "fp-sr-only", text: masked ? "masked" : fmt(w, 3) })]);
          if (!masked) td.style.setProperty("--w", w.toFixed(4));
          tr.appendChild(td);
        }
        body.appendChild(tr);
      }
      var table = el("table", { className: "fp-matrix", "data-layer": l, "data-head": h, "data-size": T }, [
        el("caption", { className: "fp-sr-only", text: "Head " + l + "." + h + ": attention weight of each row's token (query) to each column's token (key)" }),
        el("thead", null, [head]), body,
      ]);
      table.addEventListener("click", function (ev) {
        var cell = ev.target.closest ? ev.target.closest("[data-query]") : null;
        if (cell) select(+cell.getAttribute("data-query"), false);
      });
      table.addEventListener("mouseover", function (ev) {
        var cell = ev.target.closest ? ev.target.closest("td.fp-cell") : null;
        if (cell) readout.textContent = cell.getAttribute("title");
      });
      matrixBox.appendChild(table);
      showScrollHint();
      var best = 0;
      for (var j = 1; j <= i; j++) if (A[i][j] > A[i][best]) best = j;
      readout.textContent = "Row " + quote(words[i]) + " (the chosen token): its largest weight, " + fmt(A[i][best], 3) + ", is on " + quote(words[best]) + ".";
    }

    function showScrollHint() {
      matrixHint.hidden = !(matrixBox.scrollWidth > matrixBox.clientWidth + 1);
    }
    if (typeof window !== "undefined" && window.addEventListener) window.addEventListener("resize", showScrollHint);

    function drawHeads() {
      var i = state.query, words = state.words;
      grid.textContent = "";
      summary.textContent = "Where \u201c" + words[i] + "\u201d (token " + i + ") attends, in each of the " + cfg.n_layers +
        " layers and " + cfg.n_heads + " heads (counted from 0: head 1.2 is head 2 of layer 1). A bar's length and its number are the attention weight; the strongest target of each head is marked \u25c0. Tokens after it are hidden by the causal mask.";
      for (var l = 0; l < cfg.n_layers; l++) {
        var heads = el("div", { className: "fp-heads" });
        for (var h = 0; h < cfg.n_heads; h++) heads.appendChild(headTable(l, h, i));
        grid.appendChild(el("section", { className: "fp-layer", "data-layer": l, "aria-label": "Layer " + l }, [
          el("h3", { className: "fp-layer-title", text: "Layer " + l }), heads,
        ]));
      }
      markHeadTables();
    }

    function markHeadTables() {
      Array.prototype.forEach.call(grid.querySelectorAll("table.fp-head"), function (t) {
        t.classList.toggle("fp-head-selected", +t.getAttribute("data-layer") === state.head.l && +t.getAttribute("data-head") === state.head.h);
      });
    }

    /* Layers and heads are counted from 0, as in the Python code and the book: "1.2". */
    function headName(l, h) {
      return l + "." + h;
    }

    function headTable(l, h, i) {
      var w = state.result.attentions[l][h][i], words = state.words, best = 0;
      for (var j = 1; j <= i; j++) if (w[j] > w[best]) best = j;
      var body = el("tbody");
      for (j = 0; j < words.length; j++) {
        var masked = j > i;
        var pct = Math.round(w[j] * 1000) / 10;
        var bar = el("span", { className: "fp-bar-fill", style: "width:" + pct + "%" });
        var tr = el("tr", { className: "fp-weight" + (j === best ? " fp-top" : "") + (masked ? " fp-masked" : ""),
          "data-layer": l, "data-head": h, "data-query": i, "data-key": j, "data-token": words[j],
          "data-weight": String(w[j]), "data-masked": masked ? "true" : "false", "data-top": j === best ? "true" : "false",
          title: "head " + headName(l, h) + ": " + words[i] + " \u2192 " + words[j] + " = " + String(w[j]) },
        [
          el("th", { scope: "row", className: "fp-key", text: words[j] }),
          el("td", { className: "fp-num", text: masked ? "masked" : fmt(w[j], 3) }),
          el("td", { className: "fp-bar", "aria-hidden": "true" }, [bar, j === best ? el("span", { className: "fp-mark", text: "\u25c0" }) : ""]),
        ]);
        tr.style.setProperty("--fp-w", String(w[j]));
        body.appendChild(tr);
      }
      return el("table", { className: "fp-head", "data-layer": l, "data-head": h, "data-query": i }, [
        el("caption", null, [el("strong", { text: "head " + headName(l, h) }),
          " \u2192 " + words[best] + " " + fmt(w[best], 2)]),
        el("thead", null, [el("tr", null, [el("th", { scope: "col", text: "token" }), el("th", { scope: "col", text: "weight" }),
          el("th", { scope: "col", className: "fp-bar-head" }, [el("span", { className: "fp-sr-only", text: "weight as a bar" })])])]),
        body,
      ]);
    }

    // A first sentence, so that the page is never empty.
    var first = (data.examples || []).filter(function (e) { return e.split === "held_out"; })[0] || (data.examples || [])[0];
    if (first) {
      input.value = first.sentence;
      run();
    }
    container.setAttribute("data-ready", "true");
    return { model: model, run: run, select: select, selectHead: selectHead, state: state };
  }

  /* The "Cat sat mat" example, step by step, computed with attend(). The query and the
   * keys are number inputs: every step is recomputed as the reader edits them. */
  function mountCatSatMat(container, ex) {
    var tokens = ex.tokens, dk = ex.query.length;
    var original = { query: ex.query.slice(), keys: ex.keys.map(function (r) { return r.slice(); }) };
    var V = ex.values.map(function (r) { return Float64Array.from(r); });
    var id = "fp-csm-" + (++uid);
    container.textContent = "";
    container.classList.add("fp-csm");

    function num(step, j, value, digits) {
      return el("span", { className: "fp-num", "data-step": step, "data-index": j, "data-value": String(value), text: fmt(value, digits) });
    }
    /* An input as typed: up to 3 decimals, at least one ("1.0", "0.25"). */
    function short(x) {
      var s = String(Math.round(x * 1000) / 1000);
      return s.indexOf(".") < 0 && s.indexOf("e") < 0 ? s + ".0" : s;
    }
    function vec(r) {
      return "[" + Array.prototype.map.call(r, short).join(", ") + "]";
    }
    function table(head, rows, cls) {
      return el("table", { className: "fp-csm-table" + (cls ? " " + cls : "") }, [
        el("thead", null, [el("tr", null, head.map(function (t) { return el("th", { scope: "col", text: t }); }))]),
        el("tbody", null, rows.map(function (cells) {
          return el("tr", null, cells.map(function (c, k) { return el(k ? "td" : "th", k ? null : { scope: "row" }, [c]); }));
        })),
      ]);
    }
    function box(t) {
      return el("div", { className: "fp-csm-box" }, [t]);
    }

    // -- the inputs: Cat's query and the three keys (values shown, fixed)
    var inputs = [];
    function numberInput(role, row, coord, value, label) {
      var inp = el("input", { type: "number", step: "0.1", inputmode: "decimal", className: "fp-csm-input", value: short(value),
        "data-role": role, "data-row": row, "data-coord": coord, "aria-label": label });
      inp.addEventListener("input", update);
      inputs.push(inp);
      return inp;
    }
    var coords = [];
    for (var c = 0; c < dk; c++) coords.push("coordinate " + (c + 1));
    var inputRows = [[tokens[0] + "'s query"].concat(coords.map(function (lab, c) {
      return numberInput("query", 0, c, original.query[c], tokens[0] + "'s query, " + lab);
    }))].concat(tokens.map(function (t, j) {
      return ["key of " + t].concat(coords.map(function (lab, c) {
        return numberInput("key", j, c, original.keys[j][c], "key of " + t + ", " + lab);
      }));
    }));
    var reset = el("button", { type: "button", className: "fp-csm-reset", text: "Back to the chapter's numbers" });
    reset.addEventListener("click", function () {
      inputs.forEach(function (inp) {
        var r = +inp.getAttribute("data-row"), c2 = +inp.getAttribute("data-coord");
        inp.value = short(inp.getAttribute("data-role") === "query" ? original.query[c2] : original.keys[r][c2]);
      });
      update();
    });
    var valuesText = tokens.map(function (t, j) { return t + " " + vec(V[j]); }).join(", ");
    var status = el("p", { id: id + "-status", className: "fp-csm-status", role: "status", "aria-live": "polite" });
    container.appendChild(el("section", { className: "fp-csm-inputs", "aria-label": "Inputs of the worked example" }, [
      el("p", { className: "fp-csm-title", text: "Inputs. Edit " + tokens[0] + "'s query or any key; every step below is recomputed at once. " +
        "The values stay as in the chapter: " + valuesText + "." }),
      box(table(["vector"].concat(coords), inputRows, "fp-csm-inputs-table")),
      el("p", { className: "fp-csm-actions" }, [reset]), status,
    ]));
    var stepsBox = el("div", { className: "fp-csm-steps" });
    container.appendChild(stepsBox);
    var last = null;

    function read() {
      var q = new Float64Array(dk), K = tokens.map(function () { return new Float64Array(dk); }), ok = true;
      inputs.forEach(function (inp) {
        var v = inp.value.trim() === "" ? NaN : Number(inp.value);
        if (!isFinite(v)) ok = false;
        var r = +inp.getAttribute("data-row"), c2 = +inp.getAttribute("data-coord");
        if (inp.getAttribute("data-role") === "query") q[c2] = v; else K[r][c2] = v;
        inp.setAttribute("aria-invalid", isFinite(v) ? "false" : "true");
      });
      return ok ? { q: q, K: K } : null;
    }

    function same(a, b) {
      return Array.prototype.every.call(a, function (x, i) { return Math.abs(x - b[i]) < 1e-12; });
    }

    function update() {
      var x = read();
      if (!x) {
        status.textContent = "Every input needs a number; the steps below still show the last complete inputs.";
        container.setAttribute("data-valid", "false");
        return;
      }
      var edited = !same(x.q, original.query) || x.K.some(function (k, j) { return !same(k, original.keys[j]); });
      status.textContent = edited ? "Edited: the steps below use your numbers, not the chapter's." : "";
      container.setAttribute("data-valid", "true");
      container.setAttribute("data-edited", edited ? "true" : "false");
      draw(x.q, x.K, edited);
    }

    /* Compare with the chapter's figures (firstprinciples.examples: each exact value
     * rounded once, to `digits` decimals): agreement means within one unit of their
     * last decimal. With edited inputs the chapter's figures do not apply, and the line says so. */
    function check(step, values, digits, edited) {
      var exp = ex.expected[step];
      if (!exp) return null;
      var figures = exp.map(function (v) { return fmt(v, digits); }).join(", ");
      if (edited) {
        return el("p", { className: "fp-check", "data-step": step, "data-agrees": "edited",
          text: "(The chapter's figures, " + figures + ", are for its own inputs.)" });
      }
      var unit = Math.pow(10, -digits);
      var ok = values.every(function (v, j) { return Math.abs(v - exp[j]) <= unit + 1e-12; });
      return el("p", { className: "fp-check", "data-step": step, "data-agrees": ok ? "true" : "false",
        text: (ok ? "\u2713 Agrees, within " + fmt(unit, digits) + ", with the chapter's figures: "
          : "\u2717 Differs from the chapter's figures: ") + figures + "." });
    }

    function draw(q, K, edited) {
      var res = attend([q], K, V, false);
      last = res;
      var raw = res.scores[0], scaled = res.scaled[0], w = res.weights[0], out = res.output[0];
      var qv = vec(q);
      var expSum = 0, m = Math.max.apply(null, Array.from(scaled));
      // exp of the scaled scores as softmax computes them, less their maximum when that is large
      var shift = m > 20 ? m : 0;
      var exps = Array.prototype.map.call(scaled, function (z) { var e = Math.exp(z - shift); expSum += e; return e; });
      var expHead = shift ? "exp(scaled \u2212 " + fmt(shift, 3) + ")" : "exp(scaled)";
      var steps = [
        ["Step 1: scores. The dot product of " + tokens[0] + "'s query " + qv + " with each key.",
          table(["key of", "key", "query \u00b7 key", "score"], tokens.map(function (t, j) {
            var terms = Array.prototype.map.call(q, function (x, c2) { return "(" + short(x) + " \u00d7 " + short(K[j][c2]) + ")"; }).join(" + ");
            return [t, vec(K[j]), terms, num("raw", j, raw[j], 2)];
          })), check("raw_scores", Array.from(raw), 2, edited)],
        ["Step 2: scale. Divide each score by \u221ad_k = \u221a" + dk + " \u2248 " + fmt(Math.sqrt(dk), 3) + ".",
          table(["key of", "score", "score / \u221a" + dk], tokens.map(function (t, j) {
            return [t, fmt(raw[j], 2), num("scaled", j, scaled[j], 3)];
          })), check("scaled_scores", Array.from(scaled), 3, edited)],
        ["Step 3: softmax. Exponentiate, then divide by the sum (" + fmt(expSum, 3) + ") so the weights add up to 1.",
          table(["key of", "scaled", expHead, "weight"], tokens.map(function (t, j) {
            return [t, fmt(scaled[j], 3), num("exp", j, exps[j], 3), num("weights", j, w[j], 4)];
          })), check("weights", Array.from(w), 3, edited)],
        ["Step 4: weighted sum. " + tokens[0] + "'s new vector is the sum of the values, each times its weight.",
          table(["value of", "weight", "value", "weight \u00d7 value"], tokens.map(function (t, j) {
            return [t, fmt(w[j], 4), vec(V[j]), "[" + Array.prototype.map.call(V[j], function (x) { return fmt(w[j] * x, 3); }).join(", ") + "]"];
          }).concat([[tokens[0] + " (new)", "", "", el("span", null, ["["].concat(
            Array.prototype.reduce.call(out, function (acc, x, c2) { return acc.concat(c2 ? [", ", num("output", c2, x, 3)] : [num("output", c2, x, 3)]); }, []), ["]"]))]])),
          check("output", Array.from(out), 3, edited)],
      ];
      stepsBox.textContent = "";
      steps.forEach(function (s, k) {
        var sec = el("section", { className: "fp-csm-step", "data-step-number": k + 1 }, [el("p", { className: "fp-csm-title", text: s[0] }), box(s[1])]);
        if (s[2]) sec.appendChild(s[2]);
        stepsBox.appendChild(sec);
      });
    }

    update();
    container.setAttribute("data-ready", "true");
    return last;
  }

  function report(container, err) {
    container.textContent = "";
    container.appendChild(el("p", { className: "fp-message", "data-state": "error", role: "alert",
      text: "The explorer could not start: " + (err && err.message ? err.message : err) }));
    container.setAttribute("data-status", "error");
  }

  function boot() {
    var data = root.FP_EXPLORER_DATA;
    var explorers = document.querySelectorAll("[data-fp-explorer]");
    var csms = document.querySelectorAll("[data-fp-cat-sat-mat]");
    Array.prototype.forEach.call(explorers, function (c) {
      if (!data) return report(c, "the exported model (_static/explorer/model.js) was not loaded.");
      try { mount(c, data); } catch (err) { report(c, err); }
    });
    Array.prototype.forEach.call(csms, function (c) {
      if (!data || !data.cat_sat_mat) return report(c, "the Cat sat mat example was not exported.");
      try { mountCatSatMat(c, data.cat_sat_mat); } catch (err) { report(c, err); }
    });
  }

  root.FirstPrinciplesExplorer = {
    erf: erf, gelu: gelu, layerNorm: layerNorm, softmax: softmax, attend: attend, linear: linear,
    loadModel: loadModel, forward: forward, tokenize: tokenize, mount: mount, mountCatSatMat: mountCatSatMat,
  };

  if (typeof document !== "undefined") {
    if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", boot);
    else boot();
  }
})(typeof window !== "undefined" ? window : this);
