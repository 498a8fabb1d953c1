/* probe qk's page: per view, the pair matrix (query-side components down, key-side across) as a heatmap, the
   key side's marginal above it and the query side's beside it. Registered for probe.js's start(); every number and
   label comes from the page's JSON (labels are set as text by Plotly, never as HTML). */
(function () {
  "use strict";
  var DIVERGING = [[0, "#2166ac"], [0.25, "#92c5de"], [0.5, "#f7f7f7"], [0.75, "#f4a582"], [1, "#b2182b"]];

  function matrix(node, view) {
    var rows = view.query_labels.length, cols = view.key_labels.length;
    var cells = [].concat.apply([], view.z).map(Math.abs);
    var extent = Math.max.apply(null, cells.concat([1e-12]));
    var traces = [
      {type: "heatmap", z: view.z, x: view.key_labels, y: view.query_labels, colorscale: DIVERGING,
       zmin: -extent, zmax: extent, xgap: 1, ygap: 1, hoverongaps: false,
       colorbar: {thickness: 12, len: 0.7, y: 0.38, title: {text: "pair", side: "top"}},
       hovertemplate: "query %{y} x key %{x}: %{z:+.4f}<extra></extra>"},
      {type: "bar", orientation: "h", x: view.query_marginal, y: view.query_labels, xaxis: "x2", yaxis: "y",
       marker: {color: "#4d4d4d"}, hovertemplate: "query side %{y}: %{x:+.4f}<extra></extra>"},
      {type: "bar", x: view.key_labels, y: view.key_marginal, xaxis: "x", yaxis: "y2",
       marker: {color: "#4d4d4d"}, hovertemplate: "key side %{x}: %{y:+.4f}<extra></extra>"}
    ];
    var layout = {
      height: Math.max(420, 26 * rows + 260), margin: {l: 90, r: 20, t: 20, b: 90}, showlegend: false,
      xaxis: {domain: [0, 0.78], tickangle: -45, automargin: true, title: {text: "key side", standoff: 12}},
      yaxis: {domain: [0, 0.76], autorange: "reversed", automargin: true, title: {text: "query side", standoff: 12}},
      xaxis2: {domain: [0.8, 1], zeroline: true, title: {text: "query-side sum"}},
      yaxis2: {domain: [0.8, 1], zeroline: true, title: {text: "key-side sum"}}
    };
    node.dataset.rows = String(rows);
    node.dataset.cols = String(cols);
    return Plotly.newPlot(node, traces, layout, window.probeReports.config);
  }

  function qkPage(id) {
    var root = document.getElementById(id);
    try {
      var data = JSON.parse(document.getElementById(id + "-data").textContent);
      var jobs = Array.prototype.map.call(root.querySelectorAll(".probe-qk-matrix"), function (node) {
        return matrix(node, data.views[node.dataset.view]);
      });
      return Promise.all(jobs).then(function () { root.dataset.state = "ready"; })
        .catch(function (error) { window.probeReports.fail(root, error); });
    } catch (error) {
      window.probeReports.fail(root, error);
    }
  }

  window.probeExtraPages = window.probeExtraPages || {};
  window.probeExtraPages.qk = qkPage;
})();
