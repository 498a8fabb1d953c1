/* probe serve's page: asks the server's /api for every number and draws it. It computes no results. Strings reach
   the page only through textContent, and plotly only entity-escaped; the page's state lives in its address' hash. */
(function () {
  "use strict";
  var TOKEN = new URLSearchParams(location.search).get("token");  // where the page was opened with one (an IFrame)
  var state = {text: "", score: "", head: null, pos: 0, tok: null, heads: "", method: "zero", factor: 0};
  var info = null, data = null;
  var LIGHT_TO_DARK = [[0, "#f7fbff"], [0.25, "#c6dbef"], [0.5, "#6baed6"], [0.75, "#2171b5"], [1, "#08306b"]];

  function $(id) { return document.getElementById(id); }

  function make(tag, text, className) {
    var node = document.createElement(tag);
    if (text !== undefined) node.textContent = text;
    if (className) node.className = className;
    return node;
  }

  function plotlyText(text) {  // plotly reads a few HTML tags in labels: a token is shown as the text it is
    return String(text).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
  }

  function say(text, error) {
    $("status").textContent = text;
    $("status").className = error ? "probe-meta probe-error" : "probe-meta";
  }

  function api(path, body) {
    var headers = {"Content-Type": "application/json"};
    if (TOKEN) headers.Authorization = "Bearer " + TOKEN;
    var options = body === undefined ? {headers: headers} : {method: "POST", headers: headers,
                                                            body: JSON.stringify(body)};
    return fetch("api/" + path, options).then(function (response) {
      return response.json().then(function (payload) {
        if (!response.ok) throw new Error(payload.detail || response.statusText);
        return payload;
      });
    });
  }

  function failed(error) { say(error.message, true); }

  // -- the address -------------------------------------------------------------------------------------------

  function save() {
    var params = new URLSearchParams();
    Object.keys(state).forEach(function (key) {
      var value = state[key];
      if (value !== null && value !== "") params.set(key, Array.isArray(value) ? value.join(".") : value);
    });
    history.replaceState(null, "", "#" + params.toString());
  }

  function restore() {
    var params = new URLSearchParams(location.hash.slice(1));
    params.forEach(function (value, key) {
      if (!(key in state)) return;
      if (key === "head") state.head = value.split(".").map(Number);
      else if (key === "pos" || key === "tok" || key === "factor") state[key] = Number(value);
      else state[key] = value;
    });
  }

  // -- drawing -----------------------------------------------------------------------------------------------

  function row(table, cells, onClick, chosen) {
    var tr = make("tr");
    cells.forEach(function (cell) { tr.appendChild(make("td", String(cell))); });
    if (onClick) { tr.className = "probe-click"; tr.addEventListener("click", onClick); }
    if (chosen) tr.classList.add("probe-chosen");
    table.appendChild(tr);
  }

  function header(table, names) {
    table.textContent = "";
    var tr = make("tr");
    names.forEach(function (name) { tr.appendChild(make("th", name)); });
    table.appendChild(tr);
  }

  function shade(values, colour) {
    // losses (all positive) from their least to their largest; changes (signed) from 0 to the largest size
    var sizes = values.map(Math.abs), low = Math.min.apply(null, values), high = Math.max.apply(null, sizes);
    low = low > 0 ? low : 0;
    return values.map(function (value) {
      var alpha = high > low ? (Math.abs(value) - low) / (high - low) : 0;
      return colour(value) + Math.max(0.05, alpha).toFixed(3) + ")";
    });
  }

  function tokens(root, values, colour, onClick) {
    root.textContent = "";
    var colours = shade(values, colour);
    data.tokens.forEach(function (token, position) {
      var span = make("span", token);
      if (position > 0) span.style.background = colours[position - 1];
      span.title = position + ": " + (position > 0 ? values[position - 1].toFixed(3) : "(first token)");
      if (position === state.pos) span.className = "probe-query";
      if (onClick) span.addEventListener("click", function () { onClick(position); });
      root.appendChild(span);
    });
  }

  function drawGrid() {
    var z = data.scores[state.score];
    var trace = {type: "heatmap", z: z, colorscale: LIGHT_TO_DARK, zmin: 0, zmax: 1,
                 hovertemplate: "layer %{y} head %{x}: %{z:.3f}<extra></extra>"};
    var layout = {width: 360, height: Math.max(260, 18 * z.length + 90), margin: {t: 10, l: 50, r: 10, b: 40},
                  xaxis: {title: {text: "head"}, dtick: 1}, yaxis: {title: {text: "layer"}, autorange: "reversed", dtick: 1}};
    if (state.head) layout.shapes = [{type: "rect", x0: state.head[1] - 0.5, x1: state.head[1] + 0.5,
                                      y0: state.head[0] - 0.5, y1: state.head[0] + 0.5, line: {color: "#d62728"}}];
    Plotly.react($("grid"), [trace], layout, {displaylogo: false});
    if (!$("grid").dataset.wired) {  // plotly's events exist once the grid is drawn
      $("grid").on("plotly_click", function (event) { chooseHead(event.points[0].y, event.points[0].x); });
      $("grid").dataset.wired = "1";
    }
  }

  function drawNext() {
    $("position").textContent = state.pos + " (" + data.tokens[state.pos] + ")";
    header($("next"), ["token", "id", "p"]);
    data.next[state.pos].forEach(function (entry) {
      row($("next"), [entry.token, entry.id, entry.p.toFixed(4)], function () { chooseToken(entry.id); },
          entry.id === state.tok);
    });
  }

  function drawText() {
    $("model").textContent = info.model + " (" + info.dtype + "), mean loss " + data.mean_loss.toFixed(3) +
      " nats over " + data.tokens.length + " tokens";
    tokens($("tokens"), data.loss, function () { return "rgba(214, 39, 40, "; }, choosePosition);
    drawGrid();
    drawNext();
  }

  function drawAttention(head) {
    var labels = head.tokens.map(function (token, i) { return plotlyText(i + ":" + token); });
    var trace;
    if (head.weights) {
      trace = {type: "heatmap", z: head.weights, x: labels, y: labels, colorscale: LIGHT_TO_DARK, zmin: 0, zmax: 1,
               hovertemplate: "query %{y}<br>key %{x}<br>%{z:.3f}<extra></extra>"};
    } else {  // a long text: each query's top keys
      var x = [], y = [], c = [];
      head.top_keys_per_query.keys.forEach(function (keys, query) {
        keys.forEach(function (key, i) {
          x.push(key); y.push(query); c.push(head.top_keys_per_query.weights[query][i]);
        });
      });
      trace = {type: "scatter", mode: "markers", x: x, y: y, marker: {color: c, colorscale: LIGHT_TO_DARK, size: 3},
               hovertemplate: "query %{y}<br>key %{x}<extra></extra>"};
    }
    var size = Math.min(900, 200 + 14 * labels.length);
    Plotly.react($("attention"), [trace], {width: size, height: size, margin: {t: 10, l: 120, b: 120, r: 10},
      yaxis: {autorange: "reversed"}}, {displaylogo: false});
    $("attention").removeAllListeners("plotly_click");
    $("attention").on("plotly_click", function (event) {
      var point = event.points[0];
      var query = head.weights ? point.pointIndex[0] : point.y, key = head.weights ? point.pointIndex[1] : point.x;
      runQK(query, key);
    });
    header($("topkeys"), ["key", "token", "mean weight"]);
    head.top_keys.forEach(function (entry) { row($("topkeys"), [entry.position, entry.token, entry.mean_weight]); });
  }

  // -- actions -----------------------------------------------------------------------------------------------

  function run() {
    state.text = $("text").value;
    save();
    say("running ...");
    return api("text", {text: state.text}).then(function (payload) {
      data = payload;
      state.pos = Math.min(state.pos, data.tokens.length - 1);
      drawText();
      say(payload.cached ? "kept from before: no forward run" : "ran one forward");
      document.querySelector("main").dataset.state = "ready";
      if (state.head) chooseHead(state.head[0], state.head[1]);
    }).catch(failed);
  }

  function chooseHead(layer, head) {
    state.head = [layer, head];
    save();
    drawGrid();
    $("headview").hidden = false;
    $("headname").textContent = layer + "." + head;
    return api("head", {text: state.text, layer: layer, head: head}).then(function (payload) {
      drawAttention(payload);
      say(payload.cached ? "head " + layer + "." + head + ": kept from before, no forward run" :
          "head " + layer + "." + head);
      if (state.tok !== null) runDLA();
    }).catch(failed);
  }

  function choosePosition(position) {
    state.pos = position;
    state.tok = null;
    save();
    drawText();
  }

  function chooseToken(token) {
    state.tok = token;
    save();
    drawNext();
    runDLA();
  }

  function runQK(query, key) {
    if (key > query) { say("a causal head's query " + query + " sees no key " + key, true); return; }
    $("qkcell").textContent = "query " + query + ", key " + key;
    api("qk", {text: state.text, layer: state.head[0], head: state.head[1], query: query, key: key})
      .then(function (payload) {
        var score = payload.views.score, names = payload.components.map(function (c) { return c.name; });
        header($("qk"), ["query side", "key side", "share of the score"]);
        row($("qk"), ["(the score)", "", score.model_score.toFixed(4)]);
        score.top_pairs.forEach(function (pair) {
          row($("qk"), [names[pair.query], names[pair.key], pair.value.toFixed(4)]);
        });
      }).catch(failed);
  }

  function runDLA() {
    $("dlatarget").textContent = "toward token " + state.tok + " at position " + state.pos;
    api("dla", {text: state.text, position: state.pos, token: state.tok}).then(function (payload) {
      var mine = payload.heads.filter(function (h) { return state.head && h.layer === state.head[0] &&
                                                             h.head === state.head[1]; })[0];
      $("dlahead").textContent = payload.metric + ": " + payload.logit_diff.toFixed(4) +
        (mine ? "; head " + mine.layer + "." + mine.head + " writes " + mine.dla.toFixed(4) + " of it directly" : "");
      header($("dla"), ["head", "direct share"]);
      payload.heads.slice(0, 10).forEach(function (h) { row($("dla"), [h.layer + "." + h.head, h.dla.toFixed(4)]); });
    }).catch(failed);
  }

  function actedHeads() {
    state.heads = $("heads").value.trim();
    state.method = $("method").value;
    state.factor = Number($("factor").value);
    save();
    return state.heads.split(",").filter(Boolean).map(function (item) { return item.trim().split(".").map(Number); });
  }

  function ablate() {
    var heads = actedHeads();
    say("applying ...");
    api("ablate", {text: state.text, heads: heads, method: state.method, factor: state.factor, position: state.pos})
      .then(function (payload) {
        $("effect").textContent = payload.method + " on " + state.heads + ": mean loss change " +
          payload.mean_delta.toFixed(4) + " nats (red: the next token's loss rose, blue: it fell)";
        tokens($("delta"), payload.delta, function (v) {
          return v > 0 ? "rgba(214, 39, 40, " : "rgba(33, 102, 172, ";
        });
        header($("compare"), ["next token at " + state.pos, "p before", "p after", "", "top after", "p after"]);
        payload.next_before.forEach(function (before, i) {
          var after = payload.next_after[i];
          row($("compare"), [before.token, before.p.toFixed(4), before.p_after.toFixed(4), "", after.token,
                             after.p.toFixed(4)]);
        });
        say("applied; the model is restored");
      }).catch(failed);
  }

  function generate() {
    var heads = actedHeads();
    say("generating ...");
    api("generate", {text: state.text, heads: heads, factor: state.factor, max_new_tokens: 20})
      .then(function (payload) {
        header($("generations"), ["head", "factor", "continuation"]);
        row($("generations"), ["(as it is)", "1", payload.baseline]);
        payload.rows.forEach(function (r) { row($("generations"), [r.layer + "." + r.head, r.setting, r.text]); });
        say("generated");
      }).catch(failed);
  }

  function options(select, names) {
    names.forEach(function (name) { select.appendChild(make("option", name)).value = name; });
  }

  function start() {
    restore();
    api("info").then(function (payload) {
      info = payload;
      $("model").textContent = info.model + " (" + info.dtype + ")";
      options($("score"), Object.keys(info.scores));
      options($("method"), info.ablations.concat(info.steering));
      options($("preset"), Object.keys(info.presets));
      $("score").value = state.score || Object.keys(info.scores)[0];
      state.score = $("score").value;
      $("method").value = state.method;
      $("factor").value = state.factor;
      $("heads").value = state.heads;
      $("text").value = state.text;
      document.querySelector("main").dataset.state = "idle";
      if (state.text) run();
    }).catch(failed);
    $("run").addEventListener("click", run);
    $("preset").addEventListener("change", function () {
      if ($("preset").value) $("text").value = info.presets[$("preset").value];
    });
    $("score").addEventListener("change", function () {
      state.score = $("score").value;
      save();
      if (data) drawGrid();
    });
    $("add").addEventListener("click", function () {
      if (!state.head) return;
      var name = state.head.join(".");
      var items = $("heads").value.split(",").map(function (s) { return s.trim(); }).filter(Boolean);
      if (items.indexOf(name) < 0) items.push(name);
      $("heads").value = items.join(",");
    });
    $("ablate").addEventListener("click", ablate);
    $("generate").addEventListener("click", generate);
  }

  document.addEventListener("DOMContentLoaded", start);
})();
