/* probe dla's page: the layer x head maps of each head's direct logit attribution and, where it was measured, its
   self-repair. Registered for probe.js's start(); every number comes from the page's JSON. */
(function () {
  "use strict";
  var DIVERGING = [[0, "#2166ac"], [0.25, "#92c5de"], [0.5, "#f7f7f7"], [0.75, "#f4a582"], [1, "#b2182b"]];

  function grid(node, data, z, title) {  // as wide as its column (.probe-grow)
    var layout = window.probeReports.headGridLayout(data);
    delete layout.width;
    return Plotly.newPlot(node, [{
      type: "heatmap", z: z, x: data.head_axis, y: data.layer_axis, colorscale: DIVERGING, zmid: 0, xgap: 1, ygap: 1,
      hoverongaps: false, colorbar: {thickness: 12, len: 0.8, title: {text: title, side: "top"}},
      hovertemplate: "layer %{y}, head %{x}: " + title + " %{z:+.3f}<extra></extra>"
    }], layout, window.probeReports.config);
  }

  function dlaPage(id) {
    var root = document.getElementById(id);
    try {
      var data = JSON.parse(document.getElementById(id + "-data").textContent);
      var jobs = [grid(root.querySelector(".probe-dla-grid"), data, data.dla, "DLA")];
      if (data.self_repair) jobs.push(grid(root.querySelector(".probe-dla-repair"), data, data.self_repair,
                                           "self-repair"));
      return Promise.all(jobs).then(function () { root.dataset.state = "ready"; })
        .catch(function (error) { window.probeReports.fail(root, error); });
    } catch (error) {
      window.probeReports.fail(root, error);
    }
  }

  window.probeExtraPages = window.probeExtraPages || {};
  window.probeExtraPages.dla = dlaPage;
})();
