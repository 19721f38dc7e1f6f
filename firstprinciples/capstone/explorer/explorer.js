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
    return { config: cfg, vocab: exported.vocab, index: index, params: params };
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

  /* The corpus's tokenizer (Vocab.split): lower-case, split on white space, and a
   * "." stuck to the end of a word is its own token; then <bos> in front.
   * Returns { words, ids, unknown } where unknown lists words not in the vocabulary. */
  function tokenize(model, sentence) {
    var words = [], unknown = [];
    String(sentence).toLowerCase().trim().split(/\s+/).forEach(function (w) {
      if (!w) return;
      if (w.length > 1 && w.charAt(w.length - 1) === ".") words.push(w.slice(0, -1), ".");
      else words.push(w);
    });
    var prefix = model.config.prepend ? [model.config.prepend] : [];
    words = prefix.concat(words);
    var ids = words.map(function (w) {
      if (Object.prototype.hasOwnProperty.call(model.index, w)) return model.index[w];
      if (unknown.indexOf(w) < 0) unknown.push(w);
      return -1;
    });
    return { words: words, ids: ids, unknown: unknown };
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

  /* Fill `container` with the explorer for the exported data { model, examples, trained }. */
  function mount(container, data) {
    var model = loadModel(data.model);
    var id = "fp-explorer-" + (++uid);
    var state = { words: [], ids: [], result: null, query: -1 };
    container.textContent = "";
    container.classList.add("fp-explorer");

    if (data.trained === false) {
      container.appendChild(el("p", { className: "fp-note", role: "note",
        text: "These are the weights of an untrained model (random initialisation): the trained weights were not available when the book was built." }));
    }

    // -- input
    var inputId = id + "-sentence", msgId = id + "-message";
    var input = el("input", { id: inputId, type: "text", className: "fp-sentence", autocomplete: "off",
      spellcheck: "false", "aria-describedby": msgId, size: 60 });
    var form = el("form", { className: "fp-form", "aria-label": "Sentence" }, [
      el("label", { "for": inputId, text: "Sentence (words from the corpus vocabulary)" }),
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
      el("summary", { text: "Vocabulary (" + vocabWords.length + " words)" }),
      el("p", { className: "fp-vocab-words", text: vocabWords.join("  ") }),
    ]));

    // -- tokens, prediction and heads
    var tokenBar = el("div", { className: "fp-tokens", role: "toolbar", "aria-label": "Tokens: choose one to see where it attends" });
    var summary = el("p", { className: "fp-summary", "aria-live": "polite" });
    var prediction = el("p", { className: "fp-prediction" });
    var grid = el("div", { className: "fp-grid" });
    container.appendChild(tokenBar);
    container.appendChild(summary);
    container.appendChild(prediction);
    container.appendChild(grid);

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
      state.result = null;
      state.query = -1;
      tokenBar.textContent = "";
      summary.textContent = "";
      prediction.textContent = "";
      prediction.removeAttribute("data-top-token");
      grid.textContent = "";
      container.removeAttribute("data-query");
    }

    function fail(text, status) {
      clearResults();
      say(text, true);
      container.setAttribute("data-status", status);
      return false;
    }

    function run() {
      var tok = tokenize(model, input.value);
      if (tok.words.length <= (model.config.prepend ? 1 : 0)) {
        return fail("Type a sentence first, or pick one of the examples.", "empty");
      }
      if (tok.unknown.length) {
        return fail("Not in the vocabulary: " + tok.unknown.map(function (w) { return "\u201c" + w + "\u201d"; }).join(", ") +
          ". The model knows only the corpus's " + vocabWords.length + " words (see the vocabulary list); nothing was computed.",
          "unknown-words");
      }
      if (tok.ids.length > model.config.max_len) {
        return fail("That is " + tok.ids.length + " tokens; the model reads at most " + model.config.max_len + ".", "too-long");
      }
      state.words = tok.words;
      state.ids = tok.ids;
      state.result = forward(model, tok.ids);
      say(tok.words.length + " tokens (the model's " + (model.config.prepend || "") + " start token included). Choose a token.", false);
      container.setAttribute("data-status", "ok");
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
      state.words.forEach(function (w, i) {
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
      drawHeads();
      drawPrediction();
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

    function drawHeads() {
      var i = state.query, words = state.words, cfg = model.config;
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
    return { model: model, run: run, select: select, state: state };
  }

  /* The "Cat sat mat" example, step by step, computed with attend(). */
  function mountCatSatMat(container, ex) {
    var tokens = ex.tokens, q = Float64Array.from(ex.query), K = ex.keys.map(function (r) { return Float64Array.from(r); });
    var V = ex.values.map(function (r) { return Float64Array.from(r); });
    var res = attend([q], K, V, false);
    var raw = res.scores[0], scaled = res.scaled[0], w = res.weights[0], out = res.output[0];
    var dk = q.length;
    container.textContent = "";
    container.classList.add("fp-csm");

    function num(step, j, value, digits) {
      return el("span", { className: "fp-num", "data-step": step, "data-index": j, "data-value": String(value), text: fmt(value, digits) });
    }
    function vec(r) {
      return "[" + Array.prototype.map.call(r, function (x) { return fmt(x, 1); }).join(", ") + "]";
    }
    /* Compare with the chapter's figures (firstprinciples.examples: each exact value
     * rounded once, to `digits` decimals): agreement means within one unit of their
     * last decimal. */
    function check(step, values, digits) {
      var exp = ex.expected[step];
      if (!exp) return null;
      var unit = Math.pow(10, -digits);
      var ok = values.every(function (v, j) { return Math.abs(v - exp[j]) <= unit + 1e-12; });
      return el("p", { className: "fp-check", "data-step": step, "data-agrees": ok ? "true" : "false",
        text: (ok ? "\u2713 Agrees, within " + fmt(unit, digits) + ", with the chapter's figures: "
          : "\u2717 Differs from the chapter's figures: ") + exp.map(function (v) { return fmt(v, digits); }).join(", ") + "." });
    }
    function table(head, rows) {
      return el("table", { className: "fp-csm-table" }, [
        el("thead", null, [el("tr", null, head.map(function (t) { return el("th", { scope: "col", text: t }); }))]),
        el("tbody", null, rows.map(function (cells) {
          return el("tr", null, cells.map(function (c, k) { return el(k ? "td" : "th", k ? null : { scope: "row" }, [c]); }));
        })),
      ]);
    }
    var qv = vec(q);
    var expSum = 0, exps = Array.prototype.map.call(scaled, function (z) { var e = Math.exp(z); expSum += e; return e; });
    var steps = [
      ["Step 1: scores. The dot product of " + tokens[0] + "'s query " + qv + " with each key.",
        table(["key of", "key", "query \u00b7 key", "score"], tokens.map(function (t, j) {
          var terms = Array.prototype.map.call(q, function (x, c) { return "(" + fmt(x, 1) + " \u00d7 " + fmt(K[j][c], 1) + ")"; }).join(" + ");
          return [t, vec(K[j]), terms, num("raw", j, raw[j], 2)];
        })), check("raw_scores", Array.from(raw), 2)],
      ["Step 2: scale. Divide each score by \u221ad_k = \u221a" + dk + " \u2248 " + fmt(Math.sqrt(dk), 3) + ".",
        table(["key of", "score", "score / \u221a" + dk], tokens.map(function (t, j) {
          return [t, fmt(raw[j], 2), num("scaled", j, scaled[j], 3)];
        })), check("scaled_scores", Array.from(scaled), 3)],
      ["Step 3: softmax. Exponentiate, then divide by the sum (" + fmt(expSum, 3) + ") so the weights add up to 1.",
        table(["key of", "scaled", "exp(scaled)", "weight"], tokens.map(function (t, j) {
          return [t, fmt(scaled[j], 3), num("exp", j, exps[j], 3), num("weights", j, w[j], 4)];
        })), check("weights", Array.from(w), 3)],
      ["Step 4: weighted sum. " + tokens[0] + "'s new vector is the sum of the values, each times its weight.",
        table(["value of", "weight", "value", "weight \u00d7 value"], tokens.map(function (t, j) {
          return [t, fmt(w[j], 4), vec(V[j]), "[" + Array.prototype.map.call(V[j], function (x) { return fmt(w[j] * x, 3); }).join(", ") + "]"];
        }).concat([[tokens[0] + " (new)", "", "", el("span", null, ["[",
          num("output", 0, out[0], 3), ", ", num("output", 1, out[1], 3), "]"])]])), check("output", Array.from(out), 3)],
    ];
    steps.forEach(function (s, k) {
      var box = el("section", { className: "fp-csm-step", "data-step-number": k + 1 }, [el("p", { className: "fp-csm-title", text: s[0] }), s[1]]);
      if (s[2]) box.appendChild(s[2]);
      container.appendChild(box);
    });
    container.setAttribute("data-ready", "true");
    return res;
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
