/* probe compare's page: maps A and B on one colour scale and their difference B - A on a diverging one, side by
   side. Registered for probe.js's start(); every number comes from the page's JSON. */
(function () {
  "use strict";
  var SEQUENTIAL = [[0, "#f7fbff"], [0.25, "#c6dbef"], [0.5, "#6baed6"], [0.75, "#2171b5"], [1, "#08306b"]];
  var DIVERGING = [[0, "#2166ac"], [0.25, "#92c5de"], [0.5, "#f7f7f7"], [0.75, "#f4a582"], [1, "#b2182b"]];

  function range(data) {  // one scale for A and B, so that equal colours mean equal values
    var low = Infinity, high = -Infinity;
    [data.a, data.b].forEach(function (grid) {
      grid.forEach(function (row) {
        row.forEach(function (value) {
          if (value !== null) { low = Math.min(low, value); high = Math.max(high, value); }
        });
      });
    });
    return low <= high ? [low, high] : [0, 1];
  }

  function grid(node, data, z, title, scale) {
    var trace = {
      type: "heatmap", z: z, x: data.head_axis, y: data.layer_axis, xgap: 1, ygap: 1, hoverongaps: false,
      colorbar: {thickness: 12, len: 0.8, title: {text: title, side: "top"}},
      hovertemplate: "layer %{y}, " + data.unit + " %{x}: " + title + " %{z:.4f}<extra></extra>"
    };
    if (scale) {
      trace.colorscale = SEQUENTIAL; trace.zmin = scale[0]; trace.zmax = scale[1]; trace.zauto = false;
    } else {
      trace.colorscale = DIVERGING; trace.zmid = 0;
    }
    var layout = window.probeReports.headGridLayout(data);
    layout.width = Math.max(260, 22 * data.n_heads + 140);
    layout.xaxis.title.text = data.unit;
    return Plotly.newPlot(node, [trace], layout, window.probeReports.config);
  }

  function comparePage(id) {
    var root = document.getElementById(id);
    try {
      var data = JSON.parse(document.getElementById(id + "-data").textContent);
      var scale = range(data);
      return Promise.all([
        grid(root.querySelector(".probe-compare-a"), data, data.a, "A", scale),
        grid(root.querySelector(".probe-compare-b"), data, data.b, "B", scale),
        grid(root.querySelector(".probe-compare-difference"), data, data.difference, "B - A", null)
      ]).then(function () { root.dataset.state = "ready"; })
        .catch(function (error) { window.probeReports.fail(root, error); });
    } catch (error) {
      window.probeReports.fail(root, error);
    }
  }

  window.probeExtraPages = window.probeExtraPages || {};
  window.probeExtraPages.compare = comparePage;
})();
