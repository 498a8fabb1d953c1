/* probe track's page: each class's scores against the training step (one line per head, the flagged ones coloured,
   the phase change shaded), the in-context learning score and loss on the same step axis, and a step slider over
   the layer x head grid. Registered for probe.js's start(); every number comes from the page's JSON, and strings
   reach the page through textContent and plotly only. */
(function () {
  "use strict";
  var SEQUENTIAL = [[0, "#f7fbff"], [0.25, "#c6dbef"], [0.5, "#6baed6"], [0.75, "#2171b5"], [1, "#08306b"]];
  var COLOURS = ["#d62728", "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
  var CONFIG = {displaylogo: false, responsive: true};

  function band(change) {  // the phase change's interval, shaded
    if (!change) return [];
    return [{type: "rect", xref: "x", yref: "paper", x0: change[0], x1: change[1], y0: 0, y1: 1,
             fillcolor: "rgba(214,39,40,0.12)", line: {width: 0}}];
  }

  function classPlot(node, data, name) {
    var spec = data.classes[name], colour = 0, traces = [];
    spec.lines.forEach(function (line) {  // grey heads first, so that the flagged ones are drawn over them
      if (line.flagged) return;
      traces.push({type: "scatter", mode: "lines", x: data.steps, y: line.y, name: line.label, showlegend: false,
                   line: {color: "rgba(120,120,120,0.35)", width: 1}, text: data.names,
                   hovertemplate: line.name + ": %{y:.3f} at step %{x} (%{text})<extra></extra>"});
    });
    spec.lines.forEach(function (line) {
      if (!line.flagged) return;
      traces.push({type: "scatter", mode: "lines+markers", x: data.steps, y: line.y, name: line.label,
                   line: {color: COLOURS[colour++ % COLOURS.length], width: 2.5}, text: data.names,
                   hovertemplate: line.name + ": %{y:.3f} at step %{x} (%{text})<extra></extra>"});
    });
    var shapes = band(spec.change).concat([{type: "line", xref: "paper", x0: 0, x1: 1, y0: spec.threshold,
                                            y1: spec.threshold, line: {color: "#444", dash: "dot", width: 1}}]);
    return Plotly.newPlot(node, traces, {
      height: 320, margin: {l: 60, r: 20, t: 10, b: 45}, shapes: shapes, hovermode: "closest",
      xaxis: {title: {text: "training step"}}, yaxis: {title: {text: name + " score"}, rangemode: "tozero"}
    }, CONFIG);
  }

  function iclPlot(node, data) {
    var change = data.icl_change ? [data.icl_change.from_step, data.icl_change.to_step] : null;
    return Plotly.newPlot(node, [
      {type: "scatter", mode: "lines+markers", x: data.steps, y: data.icl, name: "in-context learning score",
       line: {color: "#d62728"}, text: data.names, hovertemplate: "ICL score %{y:.3f} at step %{x} (%{text})<extra></extra>"},
      {type: "scatter", mode: "lines+markers", x: data.steps, y: data.loss, name: "loss", yaxis: "y2",
       line: {color: "#1f77b4", dash: "dash"}, text: data.names,
       hovertemplate: "loss %{y:.3f} at step %{x} (%{text})<extra></extra>"}
    ], {
      height: 320, margin: {l: 60, r: 60, t: 10, b: 45}, shapes: band(change), legend: {orientation: "h", y: -0.25},
      xaxis: {title: {text: "training step"}}, yaxis: {title: {text: "ICL score (nats)"}},
      yaxis2: {title: {text: "loss (nats)"}, overlaying: "y", side: "right"}
    }, CONFIG);
  }

  function trackPage(id) {
    var root = document.getElementById(id);
    try {
      var data = JSON.parse(document.getElementById(id + "-data").textContent);
      var select = root.querySelector(".probe-track-select"), slider = root.querySelector(".probe-track-slider");
      var gridNode = root.querySelector(".probe-track-grid"), stepText = root.querySelector(".probe-track-step");
      var heads = [], layers = [];
      for (var h = 0; h < data.n_heads; h++) heads.push(h);
      for (var l = 0; l < data.n_layers; l++) layers.push(l);
      function showGrid() {
        var index = Number(slider.value), name = select.value;
        stepText.textContent = "step " + data.steps[index] + " (" + data.names[index] + ")";
        root.dataset.step = String(data.steps[index]);
        root.dataset.cls = name;
        return Plotly.react(gridNode, [{
          type: "heatmap", z: data.classes[name].grids[index], x: heads, y: layers, colorscale: SEQUENTIAL,
          zmin: 0, zmax: 1, xgap: 1, ygap: 1, hoverongaps: false,
          hovertemplate: "layer %{y}, head %{x}: " + name + " %{z:.3f}<extra></extra>"
        }], {height: Math.max(240, 40 * data.n_layers + 100),  // as wide as the page
             margin: {l: 60, r: 10, t: 10, b: 50}, xaxis: {title: {text: "head"}, dtick: 1},
             yaxis: {title: {text: "layer"}, autorange: "reversed", dtick: 1}}, CONFIG);
      }
      slider.addEventListener("input", showGrid);
      select.addEventListener("change", showGrid);
      var jobs = [iclPlot(root.querySelector(".probe-track-icl"), data), showGrid()];
      root.querySelectorAll(".probe-track-class").forEach(function (node) {
        jobs.push(classPlot(node, data, node.dataset.class));
      });
      return Promise.all(jobs).then(function () { root.dataset.state = "ready"; })
        .catch(function (error) { window.probeReports.fail(root, error); });
    } catch (error) {
      window.probeReports.fail(root, error);  // probe.js's: one line on the page, state "error"
    }
  }

  window.probeExtraPages = window.probeExtraPages || {};
  window.probeExtraPages.track = trackPage;
})();
