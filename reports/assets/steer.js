/* probe steer's page: the metric against the intervention's value, one line per head (the model as it is dotted), and
   --find's largest changes as bars. Registered for probe.js's start(); every number comes from the page's JSON,
   strings reach the page through plotly only (escaped for its markup by the report). */
(function () {
  "use strict";
  var COLOURS = ["#d62728", "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
  var CONFIG = {displaylogo: false, responsive: true};

  function curvePlot(node, data) {
    var traces = data.lines.map(function (line, index) {
      return {type: "scatter", mode: "lines+markers", x: line.setting, y: line.value, name: line.label,
              line: {color: COLOURS[index % COLOURS.length], width: 2},
              hovertemplate: line.name + ": " + data.metric + " %{y:.4f} at " + data.parameter + " %{x}<extra></extra>"};
    });
    var shapes = [{type: "line", xref: "paper", x0: 0, x1: 1, y0: data.baseline, y1: data.baseline,
                   line: {color: "#444", dash: "dot", width: 1}}];
    return Plotly.newPlot(node, traces, {
      height: 360, margin: {l: 70, r: 20, t: 10, b: 45}, shapes: shapes, hovermode: "closest",
      xaxis: {title: {text: data.intervention + ": " + data.parameter}}, yaxis: {title: {text: data.metric}}
    }, CONFIG);
  }

  function findPlot(node, data) {
    return Plotly.newPlot(node, [{type: "bar", x: data.bars.labels, y: data.bars.delta,
                                  marker: {color: "#2166ac"},
                                  hovertemplate: "%{x}: change %{y:+.4f}<extra></extra>"}], {
      height: 320, margin: {l: 70, r: 20, t: 10, b: 60}, xaxis: {type: "category", title: {text: "head"}},
      yaxis: {title: {text: "change at " + data.parameter + " " + data.bars.setting}}
    }, CONFIG);
  }

  function steerPage(id) {
    var root = document.getElementById(id);
    try {
      var data = JSON.parse(document.getElementById(id + "-data").textContent);
      var jobs = [], curves = root.querySelector(".probe-steer-curves"), find = root.querySelector(".probe-steer-find");
      if (curves) jobs.push(curvePlot(curves, data));
      if (find) jobs.push(findPlot(find, data));
      return Promise.all(jobs).then(function () { root.dataset.state = "ready"; })
        .catch(function (error) { window.probeReports.fail(root, error); });
    } catch (error) {
      window.probeReports.fail(root, error);  // probe.js's: one line on the page, state "error"
    }
  }

  window.probeExtraPages = window.probeExtraPages || {};
  window.probeExtraPages.steer = steerPage;
})();
