/* probe syntax's page: a relation x head map (accuracy above the fixed-offset baseline) and, for a chosen head and
   sentence, the sentence's arcs drawn over its words, those the head gets right in green. Registered for probe.js's
   start(); strings reach the page through textContent only. */
(function () {
  "use strict";
  var SVG = "http://www.w3.org/2000/svg";
  var DIVERGING = [[0, "#2166ac"], [0.25, "#92c5de"], [0.5, "#f7f7f7"], [0.75, "#f4a582"], [1, "#b2182b"]];

  function svg(tag, attributes, text) {
    var node = document.createElementNS(SVG, tag);
    Object.keys(attributes).forEach(function (key) { node.setAttribute(key, attributes[key]); });
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function drawArcs(box, example, hits) {
    while (box.firstChild) box.removeChild(box.firstChild);
    var right = {};
    (hits || []).forEach(function (index) { right[index] = true; });
    var step = 14, x = 10, centres = [], height = 170, base = 140;
    var drawing = svg("svg", {height: height, width: 10, "class": "probe-arcs"});
    box.appendChild(drawing);  // in the page, so that each word's drawn width can be measured
    example.words.forEach(function (word, i) {
      var label = svg("text", {x: x, y: base + 18, "class": "probe-word", "data-index": i}, word);
      drawing.appendChild(label);
      var width = Math.max(12, label.getComputedTextLength());
      centres.push(x + width / 2);
      x += width + step;
    });
    drawing.setAttribute("width", x + 10);
    example.arcs.forEach(function (arc, i) {
      var a = centres[arc.query], b = centres[arc.target], lift = Math.min(120, 18 + Math.abs(b - a) / 3);
      var good = !!right[i];
      var path = svg("path", {d: "M" + a + "," + base + " Q" + (a + b) / 2 + "," + (base - 2 * lift) + " " + b + "," +
                               base, fill: "none", stroke: good ? "#1a9850" : "#bbbbbb",
                              "stroke-width": good ? 2.5 : 1, "stroke-dasharray": good ? "" : "4,3",
                              "class": good ? "probe-arc probe-arc-right" : "probe-arc"});
      path.appendChild(svg("title", {}, arc.relation + " " + arc.direction + ": " + example.words[arc.query] +
                                        " \u2192 " + example.words[arc.target]));
      drawing.appendChild(path);
      drawing.appendChild(svg("circle", {cx: b, cy: base, r: 3, fill: good ? "#1a9850" : "#bbbbbb"}));
      if (good) drawing.appendChild(svg("text", {x: (a + b) / 2, y: base - lift - 4, "text-anchor": "middle",
                                                 "class": "probe-arc-label"}, arc.relation));
    });
  }

  function syntaxPage(id) {
    var root = document.getElementById(id);
    try {
      var data = JSON.parse(document.getElementById(id + "-data").textContent);
      var headSelect = root.querySelector(".probe-syntax-head"), sentenceSelect = root.querySelector(".probe-sentence");
      data.head_order.forEach(function (pair) {
        var node = document.createElement("option");
        node.value = pair[0] + "," + pair[1];
        node.textContent = pair[0] + "." + pair[1] + (pair[2] ? " \u2014 " + pair[2] : "");
        headSelect.appendChild(node);
      });
      data.examples.forEach(function (example, i) {
        var node = document.createElement("option");
        node.value = String(i);
        node.textContent = example.words.join(" ").slice(0, 90);
        sentenceSelect.appendChild(node);
      });
      var arcsBox = root.querySelector(".probe-arcs-box"), count = root.querySelector(".probe-arc-count");
      function show() {
        var parts = headSelect.value.split(","), layer = Number(parts[0]), head = Number(parts[1]);
        var example = data.examples[Number(sentenceSelect.value)];
        if (!example) return;
        var hits = example.hits.length ? example.hits[layer * data.n_heads + head] : [];
        drawArcs(arcsBox, example, hits);
        count.textContent = hits.length + " of " + example.arcs.length + " arcs right";
        root.dataset.layer = String(layer); root.dataset.head = String(head); root.dataset.sentence = sentenceSelect.value;
      }
      headSelect.addEventListener("change", show);
      sentenceSelect.addEventListener("change", show);
      var grid = {type: "heatmap", z: data.grid.z, x: data.grid.heads, y: data.grid.rows, colorscale: DIVERGING,
                  zmid: 0, zmin: -1, zmax: 1, xgap: 1, ygap: 1, hoverongaps: false,
                  colorbar: {thickness: 12, title: {text: "accuracy \u2212 baseline", side: "right"}},
                  hovertemplate: "%{y}, head %{x}: %{z:+.3f} above the baseline<extra></extra>"};
      var layout = {height: Math.max(260, 18 * data.grid.rows.length + 120), margin: {l: 150, r: 10, t: 10, b: 60},
                    xaxis: {type: "category", title: {text: "head (layer.head)"}, tickangle: -90},
                    yaxis: {type: "category", autorange: "reversed"}};
      return Plotly.newPlot(root.querySelector(".probe-syntax-plot"), [grid], layout, {displaylogo: false})
        .then(function () { show(); root.dataset.state = "ready"; })
        .catch(function (error) { root.dataset.state = "error"; throw error; });
    } catch (error) {
      root.dataset.state = "error";
      var box = document.createElement("p"); box.className = "probe-error";
      box.textContent = "This page could not draw its plots: " + (error && error.message ? error.message : error);
      root.insertBefore(box, root.firstChild);
    }
  }

  window.probeExtraPages = window.probeExtraPages || {};
  window.probeExtraPages.syntax = syntaxPage;
})();
