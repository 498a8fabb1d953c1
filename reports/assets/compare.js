/* probe compare's page: maps A and B, each on its own colour scale titled with its unit (a signed map on a
   diverging scale centred on 0), and beside them B - A (maps of one kind of score) or rank B - rank A (different
   kinds), on a diverging scale centred on 0. Registered for probe.js's start(); every number comes from the page's
   JSON. */
(function () {
  "use strict";
  var SEQUENTIAL = [[0, "#f7fbff"], [0.25, "#c6dbef"], [0.5, "#6baed6"], [0.75, "#2171b5"], [1, "#08306b"]];
  var DIVERGING = [[0, "#2166ac"], [0.25, "#92c5de"], [0.5, "#f7f7f7"], [0.75, "#f4a582"], [1, "#b2182b"]];

  function range(z) {  // one map's own range: a map never borrows another's scale
    var low = Infinity, high = -Infinity;
    z.forEach(function (row) {
      row.forEach(function (value) {
        if (value !== null) { low = Math.min(low, value); high = Math.max(high, value); }
      });
    });
    return low <= high ? [low, high] : [0, 1];
  }

  function colours(trace, z, scale) {
    var extent = range(z);
    if (scale.signed) {  // centred on 0: a negative value never looks like a zero
      var reach = Math.max(Math.abs(extent[0]), Math.abs(extent[1])) || 1;
      trace.colorscale = DIVERGING; trace.zmin = -reach; trace.zmax = reach; trace.zmid = 0;
    } else {
      trace.colorscale = SEQUENTIAL; trace.zmin = extent[0];
      trace.zmax = extent[1] > extent[0] ? extent[1] : extent[0] + 1;
    }
    trace.zauto = false;
  }

  function grid(node, data, z, scale) {
    var trace = {
      type: "heatmap", z: z, x: data.head_axis, y: data.layer_axis, xgap: 1, ygap: 1, hoverongaps: false,
      colorbar: {thickness: 12, len: 0.8, title: {text: scale.title + "<br>" + scale.unit, side: "top"}},
      hovertemplate: "layer %{y}, " + data.unit + " %{x}: " + scale.title + " %{z:.4~f} " + scale.unit +
        "<extra></extra>"
    };
    colours(trace, z, scale);
    var layout = window.probeReports.headGridLayout(data);
    layout.width = Math.max(260, 22 * data.n_heads + 140);
    layout.xaxis.title.text = data.unit;
    return Plotly.newPlot(node, [trace], layout, window.probeReports.config);
  }

  function comparePage(id) {
    var root = document.getElementById(id);
    try {
      var data = JSON.parse(document.getElementById(id + "-data").textContent);
      return Promise.all([
        grid(root.querySelector(".probe-compare-a"), data, data.a, data.scales.a),
        grid(root.querySelector(".probe-compare-b"), data, data.b, data.scales.b),
        grid(root.querySelector(".probe-compare-third"), data, data.third, data.scales.third)
      ]).then(function () { root.dataset.state = "ready"; })
        .catch(function (error) { window.probeReports.fail(root, error); });
    } catch (error) {
      window.probeReports.fail(root, error);
    }
  }

  window.probeExtraPages = window.probeExtraPages || {};
  window.probeExtraPages.compare = comparePage;
})();
