/* probe's report runtime: decodes a page's compact patterns and draws them with plotly.js.
   It computes no results: every number comes from the page's JSON, written by probe. Strings reach the page only
   through textContent and plotly (whose labels the report has entity-escaped), never through innerHTML. */
(function () {
  "use strict";
  if (window.probeReports) return;

  var SEQUENTIAL = [[0, "#f7fbff"], [0.1, "#deebf7"], [0.25, "#c6dbef"], [0.4, "#9ecae1"], [0.55, "#6baed6"],
                    [0.7, "#4292c6"], [0.85, "#2171b5"], [1, "#08306b"]];
  var DIVERGING = [[0, "#2166ac"], [0.25, "#92c5de"], [0.5, "#f7f7f7"], [0.75, "#f4a582"], [1, "#b2182b"]];
  var BLANK = "#e4e4e4";  // the masked (future) triangle: no data
  var CONFIG = {displaylogo: false, responsive: true};

  function make(tag, className, text) {
    var node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function nameLayers(axis, data) {
    // an encoder-decoder's layers carry names (enc0 encoder, dec0 decoder, x0 cross-attention): the axis shows them
    if (data.layer_names) {
      axis.tickvals = data.layer_axis;
      axis.ticktext = data.layer_names;
    }
    return axis;
  }

  function fail(root, error) {
    var box = root.querySelector(".probe-error") || root.insertBefore(make("p", "probe-error"), root.firstChild);
    box.textContent = "This page could not draw its plots: " + (error && error.message ? error.message : error);
    root.dataset.state = "error";
    if (window.console) console.error(error);
  }

  // ------------------------------------------------------------------------------------------------------------
  // decoding: base64 -> deflate -> byte planes -> integers

  function bytes(b64) {
    var text = atob(b64), out = new Uint8Array(text.length);
    for (var i = 0; i < text.length; i++) out[i] = text.charCodeAt(i);
    return out;
  }

  function inflate(b64) {
    if (typeof DecompressionStream === "undefined") {
      return Promise.reject(new Error("this browser has no DecompressionStream: open the page in a current " +
                                      "Chrome, Edge, Firefox or Safari"));
    }
    var stream = new Blob([bytes(b64)]).stream().pipeThrough(new DecompressionStream("deflate"));
    return new Response(stream).arrayBuffer().then(function (buffer) { return new Uint8Array(buffer); });
  }

  function unshuffle16(planes) {  // low bytes first, then high bytes: uint16 little-endian
    var n = planes.length >> 1, out = new Uint16Array(n);
    for (var i = 0; i < n; i++) out[i] = planes[i] | (planes[n + i] << 8);
    return out;
  }

  function patternBlock(spec) {
    var chunks = {};
    function chunk(c) {
      if (!chunks[c]) chunks[c] = inflate(spec.chunks[c]).then(unshuffle16);
      return chunks[c];
    }
    return {
      spec: spec,
      find: function (layer, head) {
        for (var i = 0; i < spec.heads.length; i++) {
          if (spec.heads[i][0] === layer && spec.heads[i][1] === head) return i;
        }
        return -1;
      },
      // rows of weights, queries down, keys across; null where a causal model masks the key
      rows: function (index) {
        var n = spec.n, per = spec.causal ? n * (n + 1) / 2 : n * n, scale = spec.scale;
        return chunk(Math.floor(index / spec.group)).then(function (values) {
          var base = (index % spec.group) * per, rows = new Array(n);
          for (var q = 0; q < n; q++) {
            var row = new Array(n), start = base + (spec.causal ? q * (q + 1) / 2 : q * n);
            for (var k = 0; k < n; k++) row[k] = (spec.causal && k > q) ? null : values[start + k] / scale;
            rows[q] = row;
          }
          return rows;
        });
      }
    };
  }

  // ------------------------------------------------------------------------------------------------------------
  // plots

  function patternSide(n, most) { return Math.max(360, Math.min(most || 740, n * 11)); }

  function withoutFirstKey(rows) {  // the largest weight on keys after the first (BOS, a sink): its own scale
    var most = 0;
    rows.forEach(function (row) {
      for (var k = 1; k < row.length; k++) if (row[k] !== null && row[k] > most) most = row[k];
    });
    return most || 1;
  }

  function repeatMarks(spec, diagonal) {  // the repeat boundary and the diagonal a head of this class attends along
    if (!spec.repeat || diagonal === undefined || diagonal === null) return [];
    var boundary = spec.offset + spec.repeat - spec.first, last = spec.n - 1, shift = diagonal - spec.repeat;
    var line = {color: "#d62728", width: 1.5}, marks = [];
    if (boundary > 0 && boundary < spec.n) {
      marks.push({type: "line", xref: "x", yref: "y", x0: -0.5, x1: last + 0.5, y0: boundary - 0.5,
                  y1: boundary - 0.5, line: line});
      marks.push({type: "line", xref: "x", yref: "y", x0: boundary - 0.5, x1: boundary - 0.5, y0: -0.5,
                  y1: last + 0.5, line: line});
    }
    var q0 = Math.max(boundary, -shift, 0);
    if (q0 <= last) {
      marks.push({type: "line", xref: "x", yref: "y", x0: q0 + shift, y0: q0, x1: last + shift, y1: last,
                  line: {color: "#d62728", width: 1.5, dash: "dot"}});
    }
    return marks;
  }

  function patternFigure(spec, rows, name, autoscale, most, diagonal) {
    var side = patternSide(spec.n, most), small = spec.n > 48;
    var trace = {
      type: "heatmap", z: rows, x: spec.labels, y: spec.labels, colorscale: SEQUENTIAL, hoverongaps: false,
      name: name, colorbar: {thickness: 12, len: 0.8, title: {text: "weight", side: "right"}},
      hovertemplate: "%{y} \u2192 %{x}: %{z:." + spec.decimals + "f}<extra>" + name + "</extra>"
    };
    if (autoscale === "nobos") { trace.zmin = 0; trace.zmax = withoutFirstKey(rows); trace.zauto = false; }
    else if (!autoscale) { trace.zmin = 0; trace.zmax = 1; trace.zauto = false; }
    var axis = {type: "category", automargin: true, showgrid: false, zeroline: false,
                tickfont: {size: small ? 9 : 11}, ticks: ""};
    var layout = {
      height: side + 150, width: side + 190, margin: {l: 10, r: 10, t: 10, b: 10}, plot_bgcolor: BLANK,
      xaxis: Object.assign({title: {text: "key"}, tickangle: -90, constrain: "domain"}, axis),
      yaxis: Object.assign({title: {text: "query"}, autorange: "reversed", scaleanchor: "x", constrain: "domain"},
                           axis),
      hoverlabel: {font: {family: "ui-monospace, monospace"}}, shapes: repeatMarks(spec, diagonal)
    };
    return {data: [trace], layout: layout};
  }

  function lut() {  // SEQUENTIAL sampled at 256 levels, as [r, g, b]
    var stops = SEQUENTIAL.map(function (s) {
      var h = s[1];
      return [s[0], parseInt(h.substr(1, 2), 16), parseInt(h.substr(3, 2), 16), parseInt(h.substr(5, 2), 16)];
    });
    var out = [];
    for (var v = 0; v < 256; v++) {
      var x = v / 255, j = 1;
      while (j < stops.length - 1 && stops[j][0] < x) j++;
      var a = stops[j - 1], b = stops[j], t = (x - a[0]) / (b[0] - a[0]);
      out.push([0, 1, 2].map(function (c) { return Math.round(a[c + 1] + t * (b[c + 1] - a[c + 1])); }));
    }
    return out;
  }

  function drawThumbnail(canvas, pixels, offset, t, causal, colors) {
    canvas.width = t; canvas.height = t;
    var context = canvas.getContext("2d"), image = context.createImageData(t, t);
    for (var q = 0; q < t; q++) {
      for (var k = 0; k < t; k++) {
        var p = (q * t + k) * 4, c = (causal && k > q) ? [228, 228, 228] : colors[pixels[offset + q * t + k]];
        image.data[p] = c[0]; image.data[p + 1] = c[1]; image.data[p + 2] = c[2]; image.data[p + 3] = 255;
      }
    }
    context.putImageData(image, 0, 0);
  }

  // the token-centred view (as bertviz's head view and CircuitsVis' attention patterns): the text as tokens; a click
  // on one shades every token by how much that query attends to it
  function tokens(box, strings, first) {
    var spans = [], rows = null, query = -1;
    if (box) {
      strings.forEach(function (token, i) {
        var span = make("span", "", token);
        span.dataset.position = String(first + i);
        span.addEventListener("click", function () { pick(i); });
        box.appendChild(span);
        spans.push(span);
      });
    }
    function paint() {
      if (!rows || query < 0) return;
      var row = rows[query], most = 0;
      row.forEach(function (w) { if (w !== null && w > most) most = w; });
      spans.forEach(function (span, k) {
        var w = row[k];
        span.classList.toggle("probe-query", k === query);
        span.dataset.weight = w === null ? "" : String(w);
        span.title = w === null ? "after the query (masked)" : "weight " + w;
        var alpha = w === null || !most ? 0 : w / most;
        span.style.backgroundColor = "rgba(8, 48, 107, " + (0.85 * alpha).toFixed(3) + ")";
        span.style.color = alpha > 0.5 ? "#fff" : "";
      });
      if (box) box.dataset.query = String(query);
    }
    function pick(i) { query = i; paint(); }
    return {pick: pick, rows: function (r) { rows = r; if (query < 0) query = r.length - 1; paint(); }};
  }

  // whitespace shown as the heatmap's labels show it (probe/patterns.py): a newline or a tab in a token's context
  // would otherwise break the line or vanish
  function visible(text) {
    return String(text).replace(/\r/g, "\u240d").replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5");
  }

  function layerName(layer, names) {
    return names ? names[layer] : String(layer);  // an encoder-decoder's layer_names: enc0, dec0, x0, ...
  }

  function headName(layer, head, count, names) {
    var shown = layerName(layer, names);
    return head === -1 ? "layer " + shown + ", mean of " + count + " heads" : "layer " + shown + ", head " + head;
  }

  // ------------------------------------------------------------------------------------------------------------
  // probe heatmap: one head at a time, chosen by selects or by clicking the overview

  function heatmapPage(id) {
    var root = document.getElementById(id);
    try {
      var data = JSON.parse(document.getElementById(id + "-data").textContent);
      var spec = data.patterns, block = patternBlock(spec);
      var layerSelect = root.querySelector(".probe-layer"), headSelect = root.querySelector(".probe-head");
      var scaleSelect = root.querySelector(".probe-scale"), plot = root.querySelector(".probe-plot");
      var title = root.querySelector(".probe-plot-title"), grid = root.querySelector(".probe-grid");
      var byLayer = {}, layers = [];
      spec.heads.forEach(function (pair) {
        if (!(pair[0] in byLayer)) { byLayer[pair[0]] = []; layers.push(pair[0]); }
        byLayer[pair[0]].push(pair[1]);
      });
      var realCount = function (layer) { return byLayer[layer].filter(function (h) { return h >= 0; }).length; };
      layers.forEach(function (layer) {
        layerSelect.appendChild(option(layer, "layer " + layerName(layer, spec.layer_names)));
      });
      var current = 0, thumbs = {};
      var tokenView = tokens(root.querySelector(".probe-tokens"), data.tokens || [], spec.first || 0);

      function option(value, text) { var node = make("option", "", text); node.value = String(value); return node; }

      function fillHeads(layer, head) {
        headSelect.textContent = "";
        byLayer[layer].forEach(function (h) {
          headSelect.appendChild(option(h, h === -1 ? "average over heads" : "head " + h));
        });
        headSelect.value = String(head);
      }

      function show(layer, head) {
        var ticket = ++current, index = block.find(layer, head);
        if (index < 0) return Promise.resolve();
        root.dataset.state = "loading";
        layerSelect.value = String(layer);
        if (headSelect.dataset.layer !== String(layer)) {
          fillHeads(layer, head);
          headSelect.dataset.layer = String(layer);
        }
        headSelect.value = String(head);
        return block.rows(index).then(function (rows) {
          if (ticket !== current) return null;
          var name = headName(layer, head, realCount(layer), spec.layer_names);
          var scale = scaleSelect.value === "fixed" ? false : scaleSelect.value === "auto" || scaleSelect.value;
          var figure = patternFigure(spec, rows, name, scale);
          title.textContent = name;
          plot.style.minWidth = figure.layout.width + "px";
          return Plotly.react(plot, figure.data, figure.layout, CONFIG).then(function () {
            if (ticket !== current) return;
            tokenView.rows(rows);
            if (!plot.dataset.clicks) {  // a click on a cell picks its query for the token view
              plot.dataset.clicks = "1";
              plot.on("plotly_click", function (event) {
                if (event.points && event.points.length) tokenView.pick(event.points[0].pointIndex[0]);
              });
            }
            Object.keys(thumbs).forEach(function (key) {
              thumbs[key].classList.toggle("selected", key === layer + "," + head);
            });
            root.dataset.layer = String(layer); root.dataset.head = String(head); root.dataset.state = "ready";
          });
        }).catch(function (error) { fail(root, error); });
      }

      layerSelect.addEventListener("change", function () {
        var layer = Number(layerSelect.value), head = Number(headSelect.value);
        show(layer, byLayer[layer].indexOf(head) >= 0 ? head : byLayer[layer][0]);
      });
      headSelect.addEventListener("change", function () { show(Number(layerSelect.value), Number(headSelect.value)); });
      scaleSelect.addEventListener("change", function () {
        show(Number(layerSelect.value), Number(headSelect.value));
      });

      if (!grid) return show(layers[0], byLayer[layers[0]][0]);
      // the overview: a layer x head grid of max-pooled thumbnails; a click shows that head
      var columns = 0;
      layers.forEach(function (layer) { columns = Math.max(columns, byLayer[layer].length); });
      grid.style.gridTemplateColumns = "auto repeat(" + columns + ", auto)";
      grid.appendChild(make("span", "probe-grid-label", ""));
      var headerHeads = byLayer[layers[0]];
      for (var c = 0; c < columns; c++) {
        var h = headerHeads[c];
        grid.appendChild(make("span", "probe-grid-label", h === undefined ? "" : h === -1 ? "avg" : String(h)));
      }
      var ready = spec.thumbs ? inflate(spec.thumbs.data) : Promise.resolve(null);
      var colors = lut();
      return ready.then(function (pixels) {
        layers.forEach(function (layer) {
          grid.appendChild(make("span", "probe-grid-label", layerName(layer, spec.layer_names)));
          for (var c = 0; c < columns; c++) {
            var head = byLayer[layer][c];
            if (head === undefined) { grid.appendChild(make("span")); continue; }
            var canvas = make("canvas", "probe-thumb" + (head === -1 ? " probe-thumb-avg" : ""));
            canvas.title = headName(layer, head, realCount(layer), spec.layer_names);
            canvas.dataset.layer = String(layer); canvas.dataset.head = String(head);
            if (pixels) {
              var t = spec.thumbs.t;
              drawThumbnail(canvas, pixels, block.find(layer, head) * t * t, t, spec.causal, colors);
            }
            canvas.addEventListener("click", (function (l, hd) { return function () { show(l, hd); }; })(layer, head));
            thumbs[layer + "," + head] = canvas;
            grid.appendChild(canvas);
          }
        });
        return show(layers[0], byLayer[layers[0]][0]);
      }).catch(function (error) { fail(root, error); });
    } catch (error) {
      fail(root, error);
    }
  }

  // ------------------------------------------------------------------------------------------------------------
  // probe classify: a layer x head grid per score with flagged heads marked; a flagged head's pattern on click

  function scoreFigure(section, data) {
    var heads = [], layers = [], values = [];
    section.flagged.forEach(function (f) { layers.push(f[0]); heads.push(f[1]); values.push(f[2]); });
    var grid = {
      type: "heatmap", z: section.z, colorscale: SEQUENTIAL, zmin: 0, zmax: 1, zauto: false, name: section.name,
      x: data.head_axis, y: data.layer_axis, xgap: 1, ygap: 1, colorbar: {thickness: 12, len: 0.8},
      hovertemplate: "layer %{y}, head %{x}: %{z:.3f}<extra></extra>"
    };
    var marks = {
      type: "scatter", mode: "markers", x: heads, y: layers, customdata: values, name: "flagged",
      showlegend: false, marker: {symbol: "x-thin", size: 9, line: {width: 2, color: "#d62728"}},
      hovertemplate: "layer %{y}, head %{x}: %{customdata:.3f}, flagged" +
                     (data.patterns && data.patterns[section.probe] ? " (click for its pattern)" : "") +
                     "<extra></extra>"
    };
    var layout = {
      height: Math.max(320, 16 * data.n_layers + 90), width: Math.max(300, 34 * data.n_heads + 150),
      margin: {l: 50, r: 10, t: 10, b: 40}, plot_bgcolor: BLANK,
      xaxis: {title: {text: "head"}, dtick: 1, zeroline: false, showgrid: false, range: [-0.5, data.n_heads - 0.5]},
      yaxis: {title: {text: "layer"}, range: [data.n_layers - 0.5, -0.5], dtick: data.n_layers > 40 ? 5 : 1,
              zeroline: false, showgrid: false}
    };
    nameLayers(layout.yaxis, data);
    return {data: [grid, marks], layout: layout};
  }

  function classificationPage(id) {
    var root = document.getElementById(id);
    try {
      var data = JSON.parse(document.getElementById(id + "-data").textContent);
      var blocks = {};
      Object.keys(data.patterns || {}).forEach(function (name) { blocks[name] = patternBlock(data.patterns[name]); });
      var jobs = [];
      data.scores.forEach(function (section, s) {
        var box = root.querySelector('[data-score-index="' + s + '"]');
        var scorePlot = box.querySelector(".probe-score-plot");
        if (!scorePlot) return;  // a class no head scores on (its section says so): nothing to draw
        var figure = scoreFigure(section, data);
        var block = blocks[section.probe];
        var select = box.querySelector(".probe-flagged"), plot = box.querySelector(".probe-plot");
        var title = box.querySelector(".probe-plot-title"), current = 0;

        function show(layer, head) {
          var ticket = ++current, index = block.find(layer, head);
          if (index < 0) return Promise.resolve();
          box.dataset.state = "loading";
          select.value = layer + "," + head;
          return block.rows(index).then(function (rows) {
            if (ticket !== current) return null;
            var name = headName(layer, head, 0, data.layer_names);
            var f = patternFigure(block.spec, rows, name, false, 560, section.diagonal);
            title.textContent = name;
            plot.style.minWidth = f.layout.width + "px";
            return Plotly.react(plot, f.data, f.layout, CONFIG).then(function () {
              if (ticket !== current) return;
              box.dataset.layer = String(layer); box.dataset.head = String(head); box.dataset.state = "ready";
            });
          }).catch(function (error) { fail(root, error); });
        }

        var drawn = Plotly.newPlot(scorePlot, figure.data, figure.layout, CONFIG).then(function () {
          box.dataset.scoreState = "ready";
          if (!block || !select) return null;
          scorePlot.on("plotly_click", function (event) {
            var point = event.points[0], layer = Number(point.y), head = Number(point.x);
            if (block.find(layer, head) >= 0) show(layer, head);
          });
          section.flagged.forEach(function (f) {
            var node = make("option", "", headName(f[0], f[1], 0, data.layer_names) + " \u2014 " + f[2].toFixed(3));
            node.value = f[0] + "," + f[1];
            select.appendChild(node);
          });
          select.addEventListener("change", function () {
            var parts = select.value.split(","); show(Number(parts[0]), Number(parts[1]));
          });
          return section.flagged.length ? show(section.flagged[0][0], section.flagged[0][1]) : null;
        });
        jobs.push(drawn);
      });
      return Promise.all(jobs).then(function () { root.dataset.state = "ready"; })
        .catch(function (error) { fail(root, error); });
    } catch (error) {
      fail(root, error);
    }
  }

  // ------------------------------------------------------------------------------------------------------------
  // probe ablate: deltas per head (diverging, centred on 0) and the heads that matter most

  function headGridLayout(data) {  // a layer x head map: one cell per head, layers down (named where they are)
    return {
      height: Math.max(320, 16 * data.n_layers + 90), width: Math.max(320, 34 * data.n_heads + 160),
      margin: {l: 50, r: 10, t: 10, b: 40}, plot_bgcolor: BLANK,
      xaxis: {title: {text: "head"}, dtick: 1, zeroline: false, showgrid: false},
      yaxis: nameLayers({title: {text: "layer"}, autorange: "reversed", dtick: data.n_layers > 40 ? 5 : 1,
                         zeroline: false, showgrid: false}, data)
    };
  }

  function ablationPage(id) {
    var root = document.getElementById(id);
    try {
      var data = JSON.parse(document.getElementById(id + "-data").textContent);
      var grid = {
        type: "heatmap", z: data.z, customdata: data.loss, x: data.head_axis, y: data.layer_axis,
        colorscale: DIVERGING, zmid: 0, xgap: 1, ygap: 1, hoverongaps: false, name: "delta",
        colorbar: {thickness: 12, len: 0.8, title: {text: "\u0394 loss", side: "top"}},
        hovertemplate: "layer %{y}, head %{x}: \u0394 loss %{z:+.4f} (loss %{customdata:.4f})<extra></extra>"
      };
      if (data.how) {  // an estimate: each value says whether it is estimated or ablated exactly
        grid.text = data.how;
        grid.hovertemplate = grid.hovertemplate.replace("<extra>", ", %{text}<extra>");
      }
      var gridLayout = headGridLayout(data);
      var bars = {
        type: "bar", orientation: "h", x: data.top.delta, y: data.top.label, customdata: data.top.loss,
        text: data.top.name, textposition: "none", marker: {color: data.top.color}, name: "delta",
        hovertemplate: "%{text}: \u0394 loss %{x:+.4f} (loss %{customdata:.4f})<extra></extra>"
      };
      if (data.top.how) {  // estimated bars hatched, exact ones solid
        bars.text = data.top.name.map(function (name, i) { return name + ", " + data.top.how[i]; });
        bars.marker.pattern = {shape: data.top.how.map(function (h) { return h === "estimated" ? "/" : ""; })};
      }
      var barLayout = {
        height: Math.max(300, 22 * data.top.label.length + 90), margin: {l: 90, r: 20, t: 10, b: 50},
        xaxis: {title: {text: "\u0394 loss when the head is ablated"}, zeroline: true, zerolinecolor: "#444"},
        yaxis: {type: "category", autorange: "reversed"}
      };
      return Promise.all([
        Plotly.newPlot(root.querySelector(".probe-delta-plot"), [grid], gridLayout, CONFIG),
        Plotly.newPlot(root.querySelector(".probe-bar-plot"), [bars], barLayout, CONFIG),
        effectsScatter(root, data.effects)
      ]).then(function () { root.dataset.state = "ready"; }).catch(function (error) { fail(root, error); });
    } catch (error) {
      fail(root, error);
    }
  }

  // ------------------------------------------------------------------------------------------------------------
  // probe prune: loss against the share of heads pruned, one line per ordering, random seeds as a band

  function prunePage(id) {
    var root = document.getElementById(id);
    try {
      var data = JSON.parse(document.getElementById(id + "-data").textContent);
      var hover = "%{fullData.name}: %{x:.0%} pruned, loss %{y:.4f}<extra></extra>";
      var traces = [];
      if (data.band) {
        traces.push({type: "scatter", mode: "lines", x: data.band.share, y: data.band.low, line: {width: 0},
                     hoverinfo: "skip", showlegend: false, name: "random (lowest)"});
        traces.push({type: "scatter", mode: "lines", x: data.band.share, y: data.band.high, line: {width: 0},
                     fill: "tonexty", fillcolor: "rgba(150,150,150,0.3)", name: data.band.name,
                     hovertemplate: hover});
      }
      data.lines.forEach(function (line) {
        traces.push({type: "scatter", mode: "lines+markers", x: line.share, y: line.loss, name: line.name,
                     line: {color: line.color, dash: line.dash}, hovertemplate: hover});
      });
      var shapes = data.limits.map(function (limit) {
        return {type: "line", xref: "paper", x0: 0, x1: 1, y0: limit.value, y1: limit.value,
                line: {color: limit.color, dash: "dot", width: 1}};
      });
      var most = 0;  // the axis runs to the furthest step any curve reached, not to 100%
      traces.forEach(function (trace) { trace.x.forEach(function (x) { if (x > most) most = x; }); });
      var layout = {
        height: 480, margin: {l: 70, r: 20, t: 10, b: 50}, shapes: shapes, legend: {orientation: "h", y: -0.15},
        xaxis: {title: {text: "share of " + data.units + " pruned"}, tickformat: ".0%",
                range: [0, Math.min(1, most || 1) * 1.02]},
        yaxis: {title: {text: data.metric}, type: data.log ? "log" : "linear"}
      };
      return Plotly.newPlot(root.querySelector(".probe-prune-plot"), traces, layout, CONFIG)
        .then(function () { root.dataset.state = "ready"; }).catch(function (error) { fail(root, error); });
    } catch (error) {
      fail(root, error);
    }
  }

  // mean delta against specificity per head; a click shows that head's top affected tokens in their text
  function effectsScatter(root, effects) {
    if (!effects) return Promise.resolve();
    var plot = root.querySelector(".probe-scatter-plot");
    var points = {
      type: "scatter", mode: "markers", x: effects.delta, y: effects.specificity, text: effects.name,
      customdata: effects.max_token, marker: {size: 8, color: "#b2182b", opacity: 0.7}, name: "heads",
      hovertemplate: "%{text}: mean \u0394 %{x:+.4f}, specificity %{y:.3f}, max token \u0394 %{customdata:+.4f}" +
        "<extra></extra>"
    };
    var layout = {
      height: 380, width: 480, margin: {l: 60, r: 10, t: 10, b: 50}, hovermode: "closest",
      xaxis: {title: {text: "mean \u0394 when the head is ablated"}, zeroline: true, zerolinecolor: "#444"},
      yaxis: {title: {text: "specificity"}, rangemode: "tozero"}
    };
    function show(index) {
      var box = root.querySelector(".probe-tokens");
      root.querySelector(".probe-tokens-title").textContent = "Top affected tokens of " + effects.name[index];
      box.textContent = "";
      effects.tokens[index].forEach(function (token) {
        var line = make("div", "probe-token-line");
        line.appendChild(make("span", "probe-small", "\u0394 " + (token.delta >= 0 ? "+" : "") +
          token.delta.toFixed(4) + "  sequence " + token.sequence + ":  "));
        line.appendChild(make("span", "", visible(token.before)));
        line.appendChild(make("b", "probe-token", visible(token.token)));
        box.appendChild(line);
      });
      root.dataset.selected = effects.label[index];
    }
    var best = 0;
    effects.max_token.forEach(function (value, i) { if (value > effects.max_token[best]) best = i; });
    return Plotly.newPlot(plot, [points], layout, CONFIG).then(function () {
      plot.on("plotly_click", function (event) { show(event.points[0].pointIndex); });
      show(best);
    });
  }

  // ------------------------------------------------------------------------------------------------------------
  // probe kv-heads: the layer x KV-head map coloured by label, and the streaming curve against random orders

  function kvHeadsPage(id) {
    var root = document.getElementById(id);
    try {
      var data = JSON.parse(document.getElementById(id + "-data").textContent);
      var axis = [];
      for (var h = 0; h < data.n_kv_heads; h++) axis.push(h);
      var layers = [];
      for (var l = 0; l < data.n_layers; l++) layers.push(l);
      var map = {
        type: "heatmap", z: data.z, text: data.hover, x: axis, y: layers, zmin: 0, zmax: 1, showscale: false,
        colorscale: [[0, "#6baed6"], [0.5, "#6baed6"], [0.5, "#d6604d"], [1, "#d6604d"]], xgap: 2, ygap: 2,
        hovertemplate: "%{text}<extra></extra>"
      };
      var mapLayout = {  // as wide as its column: a model with few KV heads still gets cells one can point at
        height: Math.max(320, 16 * data.n_layers + 90),
        margin: {l: 50, r: 10, t: 10, b: 40},
        xaxis: {title: {text: "KV head"}, dtick: 1, zeroline: false, showgrid: false},
        yaxis: nameLayers({title: {text: "layer"}, autorange: "reversed", dtick: data.n_layers > 40 ? 5 : 1,
                           zeroline: false, showgrid: false}, data)
      };
      var jobs = [Plotly.newPlot(root.querySelector(".probe-kv-map"), [map], mapLayout, CONFIG)];
      if (data.curve) {
        ["loss_change", "needle_accuracy"].forEach(function (key) {
          var lines = Object.keys(data.curve.orders).map(function (name) {
            var probe = name === "probe";
            return {type: "scatter", mode: "lines+markers", name: probe ? "probe's order" : name.replace("_", " "),
                    x: data.curve.k, y: data.curve.orders[name][key],
                    line: {color: probe ? "#d62728" : "#999", width: probe ? 3 : 1}};
          });
          var title = key === "loss_change" ? "\u0394 loss on natural text" : "needle accuracy";
          var node = root.querySelector(key === "loss_change" ? ".probe-curve-loss" : ".probe-curve-needle");
          jobs.push(Plotly.newPlot(node, lines, {  // as wide as its column (.probe-grow)
            height: 340, margin: {l: 60, r: 10, t: 10, b: 50},
            xaxis: {title: {text: "KV heads streamed (k)"}}, yaxis: {title: {text: title}}
          }, CONFIG));
        });
      }
      return Promise.all(jobs).then(function () { root.dataset.state = "ready"; })
        .catch(function (error) { fail(root, error); });
    } catch (error) {
      fail(root, error);
    }
  }

  // ------------------------------------------------------------------------------------------------------------
  // probe patch: layer x head maps of the patch effect and the DLA; the top heads' effect by position

  function headGrid(node, data, z, title, hover) {  // as wide as its column (.probe-grow)
    var layout = headGridLayout(data);
    delete layout.width;
    var grid = {
      type: "heatmap", z: z, x: data.head_axis, y: data.layer_axis, colorscale: DIVERGING, zmid: 0, xgap: 1, ygap: 1,
      hoverongaps: false, colorbar: {thickness: 12, len: 0.8, title: {text: title, side: "top"}},
      hovertemplate: "layer %{y}, head %{x}: " + hover + " %{z:+.3f}<extra></extra>"
    };
    return Plotly.newPlot(node, [grid], layout, CONFIG);
  }

  function patchPage(id) {
    var root = document.getElementById(id);
    try {
      var data = JSON.parse(document.getElementById(id + "-data").textContent);
      var jobs = [headGrid(root.querySelector(".probe-patch-effect"), data, data.effect, "effect", "patch effect")];
      if (data.dla) jobs.push(headGrid(root.querySelector(".probe-patch-dla"), data, data.dla, "DLA", "DLA"));
      if (data.by_position) {
        var spot = data.by_position;
        jobs.push(Plotly.newPlot(root.querySelector(".probe-patch-position"), [{
          type: "heatmap", z: spot.z, x: spot.x, y: spot.heads, colorscale: DIVERGING, zmid: 0, xgap: 1, ygap: 1,
          hoverongaps: false, colorbar: {thickness: 12, len: 0.8, title: {text: "effect", side: "top"}},
          hovertemplate: "head %{y} at %{x}: patch effect %{z:+.3f}<extra></extra>"
        }], {
          height: Math.max(300, 22 * spot.heads.length + 140), margin: {l: 70, r: 10, t: 10, b: 40},
          xaxis: {type: "category", tickangle: -60, automargin: true},
          yaxis: {type: "category", autorange: "reversed", automargin: true}
        }, CONFIG));
      }
      if (data.paths) {
        var paths = data.paths;
        jobs.push(Plotly.newPlot(root.querySelector(".probe-patch-paths"), [{
          type: "heatmap", z: paths.z, x: paths.x, y: paths.y, colorscale: DIVERGING, zmid: 0, xgap: 1, ygap: 1,
          colorbar: {thickness: 12, len: 0.8, title: {text: "effect", side: "top"}},
          hovertemplate: "%{y} through %{x}'s " + paths.component + ": patch effect %{z:+.3f}<extra></extra>"
        }], {
          height: Math.max(260, 24 * paths.y.length + 120), width: Math.max(320, 48 * paths.x.length + 160),
          margin: {l: 70, r: 10, t: 10, b: 60}, xaxis: {type: "category", title: {text: "receiver"}},
          yaxis: {type: "category", autorange: "reversed", title: {text: "sender"}}
        }, CONFIG));
      }
      return Promise.all(jobs).then(function () { root.dataset.state = "ready"; })
        .catch(function (error) { fail(root, error); });
    } catch (error) {
      fail(root, error);
    }
  }

  // a page of tables only (probe circuits): nothing to draw
  function tablesPage(id) {
    document.getElementById(id).dataset.state = "ready";
  }

  // pages in notebooks may run before plotly.js has arrived: wait for it a little
  function start(kind, id) {
    var pages = {heatmap: heatmapPage, classification: classificationPage, ablation: ablationPage, prune: prunePage,
                 kv_heads: kvHeadsPage, patch: patchPage, circuits: tablesPage};
    var tries = 0;
    (function attempt() {
      if (window.Plotly) {
        var live = document.getElementById(id);
        if (live) live.classList.add("probe-live");  // the plots draw: the static summary steps aside
        (pages[kind] || (window.probeExtraPages || {})[kind])(id);
        return;
      }
      if (++tries < 100) { setTimeout(attempt, 100); return; }
      var root = document.getElementById(id);
      if (root) fail(root, new Error("plotly.js is not on this page: display the result again (each result " +
        "carries its own copy)."));
    })();
  }

  window.probeReports = {start: start, patternBlock: patternBlock, patternFigure: patternFigure, headGridLayout: headGridLayout,
                         inflate: inflate, make: make, fail: fail, config: CONFIG, visible: visible};
})();
