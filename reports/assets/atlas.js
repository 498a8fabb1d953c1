/* probe atlas's page: the head finder (a scatter of any two per-head metrics coloured by class, the layer x head
   grid, a sortable and searchable table, filters by class and evidence) and one dashboard per head, whose data is
   inflated only when it opens. Registered for probe.js's start(); it computes no results, and strings reach the
   page through textContent and plotly only. */
(function () {
  "use strict";
  var PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf",
                 "#bcbd22", "#7f7f7f"];
  var NONE = "#c7c7c7";

  function fmt(value, digits) {
    if (value === null || value === undefined) return "\u2013";
    return (value >= 0 ? "+" : "") + value.toFixed(digits === undefined ? 4 : digits);
  }

  function colours(data) {
    var out = {};
    data.classes.forEach(function (name, i) { out[name] = PALETTE[i % PALETTE.length]; });
    return out;
  }

  function first(row) { return row.classes.length ? row.classes[0][0] : null; }

  function metricNames(data) {
    var names = [];
    data.classes.forEach(function (name) { names.push(name + "_score"); });
    return names.concat(Object.keys(data.metrics));
  }

  function describe(data, name) {
    if (data.metrics[name]) return data.metrics[name];
    var cls = name.replace(/_score$/, "");
    return data.class_info[cls] ? cls + " score: " + data.class_info[cls].summary : name;
  }

  // ----------------------------------------------------------------------------------------------------------
  // the dashboard of one head

  function section(box, make, title) {
    var node = make("div", "probe-section");
    node.appendChild(make("h3", "", title));
    box.appendChild(node);
    return node;
  }

  function classesPart(node, make, entry) {
    if (!entry.classes.length) {
      node.appendChild(make("p", "probe-small", "No class: no score passes its threshold."));
      return;
    }
    entry.classes.forEach(function (label) {
      var evidence = label.evidence, line = make("div", "");
      line.appendChild(make("span", "atlas-badge atlas-" + evidence.status, label["class"]));
      line.appendChild(make("span", "", " score " + label.score.toFixed(3) + " > " + label.threshold +
        " on the " + label.probe_set + " probe set: " + evidence.text));
      var list = make("ul", "probe-small");
      Object.keys(evidence.kinds).forEach(function (kind) {
        var verdict = evidence.kinds[kind], item = make("li", "");
        item.appendChild(make("span", verdict === null ? "" : (verdict.supports ? "atlas-yes" : "atlas-no"),
          kind + (verdict === null ? ": not measured" : (verdict.supports ? " \u2713 " : " \u2717 "))));
        if (verdict !== null) item.appendChild(make("span", "", verdict.why));
        list.appendChild(item);
      });
      line.appendChild(list);
      node.appendChild(line);
    });
  }

  function examplesPart(node, make, entry) {
    entry.examples.forEach(function (example) {
      var line = make("div", "atlas-example");
      line.appendChild(make("span", "probe-small", (example.decile === 1 ? "top" : "decile " + example.decile) +
        ", norm " + example.norm.toFixed(3) + ", sequence " + example.sequence + " position " + example.position +
        ":  "));
      example.spans.forEach(function (span, s) {
        if (s > 0 || span.first > 0) line.appendChild(make("span", "probe-small", " \u2026 "));
        span.tokens.forEach(function (token, i) {
          var position = span.first + i, weight = span.weights[i] || 0;
          var cell = make("span", "atlas-token" + (position === example.position ? " atlas-query" : ""), token);
          cell.style.background = "rgba(33, 113, 181, " + Math.min(1, weight).toFixed(3) + ")";
          if (weight > 0.5) cell.style.color = "#fff";
          cell.title = position + ": attention " + weight.toFixed(3);
          line.appendChild(cell);
        });
      });
      node.appendChild(line);
    });
  }

  function writesPart(node, make, entry) {
    if (!entry.writes) {
      node.appendChild(make("p", "probe-small", "No embedding or LM head to read the OV circuit through."));
      return;
    }
    if (!entry.writes.length) {
      node.appendChild(make("p", "probe-small", "Its top examples attend to the first key only."));
    }
    entry.writes.forEach(function (write) {
      var line = make("div", "atlas-example");
      line.appendChild(make("span", "", "attends to \u201c" + write.token + "\u201d \u2192 raises "));
      line.appendChild(make("span", "", write.promotes.map(function (p) {
        return "\u201c" + p.token + "\u201d " + p.logit.toFixed(2);
      }).join(", ")));
      node.appendChild(line);
    });
  }

  function partnersPart(node, make, entry, open) {
    [["feeders", "Earlier heads feeding it (K: its keys, Q: its queries, V: its values)"],
     ["readers", "Later heads reading it"]].forEach(function (pair) {
      var line = make("div", "");
      line.appendChild(make("span", "probe-small", pair[1] + ": "));
      var partners = entry.partners[pair[0]];
      if (!partners.length) line.appendChild(make("span", "probe-small", "none"));
      partners.forEach(function (p) {
        var link = make("span", "atlas-link", p.layer + "." + p.head);
        link.addEventListener("click", function () { open(p.layer, p.head); });
        line.appendChild(link);
        line.appendChild(make("span", "", " " + p.kind.toUpperCase() + " " + p.score.toFixed(3) + "   "));
      });
      node.appendChild(line);
    });
  }

  function causePart(node, make, entry) {
    var effects = entry.effects || {}, metrics = entry.metrics;
    var facts = [["mean \u0394 loss (natural text)", fmt(metrics.delta) + (effects.estimated ? " (estimated)" : "")],
                 ["specificity", metrics.specificity === null ? "\u2013" : metrics.specificity.toFixed(3)],
                 ["largest token \u0394", fmt(metrics.max_token_delta)],
                 ["second-copy \u0394 (repeated)", fmt(metrics.second_repeat_delta)],
                 ["task \u0394", fmt(metrics.task_delta)], ["DLA (next token)", fmt(metrics.dla)],
                 ["copying score", fmt(metrics.copying, 3)]];
    if (entry.self_repair) {  // --self-repair: what the rest of the model gives back (log-likelihood)
      var repair = entry.self_repair;
      facts.push(["Δ log-likelihood: total / direct", fmt(repair.total) + " / " + fmt(repair.direct)]);
      facts.push(["self-repair (total − direct)", fmt(repair.self_repair)]);
      facts.push(["covered by (Δ DLA)", repair.compensating.map(function (c) {
        return c.layer + "." + c.head + " " + fmt(c.value, 3); }).join(", ") || "–"]);
    }
    var table = make("table", "probe-kv");
    facts.forEach(function (fact) {
      var row = make("tr", "");
      row.appendChild(make("td", "", fact[0]));
      row.appendChild(make("td", "", fact[1]));
      table.appendChild(row);
    });
    node.appendChild(table);
    (effects.top_tokens || []).forEach(function (token) {
      var context = String(token.context), cut = context.lastIndexOf("["), line = make("div", "atlas-example");
      line.appendChild(make("span", "probe-small", "\u0394 " + fmt(token.delta) + "  "));
      var visible = window.probeReports.visible;  // a newline in the text shown as \u21b5, as the heatmaps do
      line.appendChild(make("span", "", visible(cut >= 0 ? context.slice(0, cut) : context)));
      line.appendChild(make("b", "", visible(cut >= 0 ? context.slice(cut) : "")));
      node.appendChild(line);
    });
  }

  function patternPart(node, tools, data, entry) {
    var spec = data.patterns[entry.pattern];
    if (!spec) {
      node.appendChild(tools.make("p", "probe-small", "No pattern on this page."));
      return Promise.resolve();
    }
    var block = tools.patternBlock(spec), index = block.find(entry.layer, entry.head);
    var plot = tools.make("div", "atlas-pattern");
    node.appendChild(tools.make("p", "probe-small", "On the first sequence of the " + entry.pattern + " probe set."));
    node.appendChild(plot);
    var cls = entry.classes.length ? entry.classes[0]["class"] : null;
    var diagonal = {induction: 1, duplicate_token: 0}[cls];
    return block.rows(index).then(function (rows) {
      var figure = tools.patternFigure(spec, rows, entry.layer + "." + entry.head, false, 560, diagonal);
      return Plotly.newPlot(plot, figure.data, figure.layout, tools.config);
    });
  }

  function dashboard(root, data, index, open) {
    var tools = window.probeReports, make = tools.make, box = root.querySelector(".atlas-dashboard");
    var row = data.rows[index];
    return tools.inflate(data.dashboards[index]).then(function (bytes) {
      var entry = JSON.parse(new TextDecoder().decode(bytes));
      box.textContent = "";
      box.hidden = false;
      box.appendChild(make("h2", "", "Head " + row.label + " (layer " + entry.layer + ", head " + entry.head + ")"));
      var top = box.appendChild(make("div", "probe-row")), side = make("div", "probe-main");
      var pattern = patternPart(section(top, make, "Pattern"), tools, data, entry);
      top.appendChild(side);  // the pattern beside its classes and causal effects
      classesPart(section(side, make, "Classes and their evidence"), make, entry);
      causePart(section(side, make, "Causal effects (zero ablation)"), make, entry);
      examplesPart(section(box, make, "Top examples, and a few from lower deciles (query outlined, attention shaded)"),
                   make, entry);
      writesPart(section(box, make, "What it writes (OV circuit through the unembedding)"), make, entry);
      partnersPart(section(box, make, "Composition partners"), make, entry, open);
      return pattern.then(function () { root.dataset.dashboard = row.label; });
    });
  }

  // ----------------------------------------------------------------------------------------------------------
  // the head finder

  function legend(node, data, palette) {  // what each colour of the scatter and the grid means
    var make = window.probeReports.make;
    data.classes.concat([null]).forEach(function (name) {
      var item = make("span", "atlas-legend-item");
      var swatch = item.appendChild(make("span", "atlas-swatch"));
      swatch.style.background = name === null ? NONE : palette[name];
      item.appendChild(make("span", "", name === null ? "no class" : name));
      item.dataset.colour = name === null ? NONE : palette[name];
      node.appendChild(item);
    });
  }

  function fill(select, options, chosen) {
    options.forEach(function (option) {
      var node = window.probeReports.make("option", "", option[1]);
      node.value = option[0];
      select.appendChild(node);
    });
    select.value = chosen;
  }

  function visible(data, state) {
    var query = state.search.trim().toLowerCase();
    return data.rows.map(function (row, i) {
      var names = row.classes.map(function (c) { return c[0]; });
      var ok = (state.cls === "all" || (state.cls === "none" ? !names.length : names.indexOf(state.cls) >= 0)) &&
        (state.evidence === "all" || row.status === state.evidence);
      if (ok && query) {
        var text = (row.label + " " + names.join(" ") + " " + data.statuses[row.status]).toLowerCase();
        ok = query.split(/\s+/).every(function (word) { return text.indexOf(word) >= 0; });
      }
      return ok ? i : -1;
    }).filter(function (i) { return i >= 0; });
  }

  function scatterTrace(data, shown, x, y, palette) {
    return {
      type: "scatter", mode: "markers", customdata: shown,
      x: shown.map(function (i) { return data.rows[i].metrics[x]; }),
      y: shown.map(function (i) { return data.rows[i].metrics[y]; }),
      text: shown.map(function (i) {
        var row = data.rows[i];
        return row.label + ": " + (row.classes.map(function (c) { return c[0]; }).join(", ") || "no class") +
          " (" + data.statuses[row.status] + ")";
      }),
      marker: {size: 9, line: {width: 1.5},
               color: shown.map(function (i) { var c = first(data.rows[i]); return c ? palette[c] : NONE; }),
               symbol: shown.map(function (i) {
                 var s = data.rows[i].status;
                 if (s === "pattern_only" || s === "unchecked") return "circle-open";
                 return s === "partial" ? "diamond" : "circle";
               })},
      hovertemplate: "%{text}<br>x %{x:.4f}, y %{y:.4f}<extra></extra>"
    };
  }

  function gridTrace(data, shown, palette) {
    return {
      type: "scatter", mode: "markers", customdata: shown,
      x: shown.map(function (i) { return data.rows[i].head; }),
      y: shown.map(function (i) { return data.rows[i].layer; }),
      text: shown.map(function (i) { return data.rows[i].label + ": " + (first(data.rows[i]) || "no class"); }),
      marker: {symbol: "square", size: 13, color: shown.map(function (i) {
        var c = first(data.rows[i]); return c ? palette[c] : NONE;
      }), opacity: shown.map(function (i) { return data.rows[i].status === "pattern_only" ? 0.45 : 1; })},
      hovertemplate: "%{text}<extra></extra>"
    };
  }

  function tableHead(root, data, state, redraw) {
    var make = window.probeReports.make, head = root.querySelector(".atlas-table thead"), line = make("tr", "");
    [["label", "head"], ["classes", "classes (evidence)"]].concat(data.table_metrics.map(function (m) {
      return [m, m.replace(/_/g, " ")];
    })).forEach(function (column) {
      var arrow = state.sort === column[0] ? (state.descending ? " \u25bc" : " \u25b2") : "";
      var cell = make("th", "", column[1] + arrow);
      cell.dataset.column = column[0];
      cell.title = data.metrics[column[0]] || "";
      cell.addEventListener("click", function () {
        state.descending = state.sort === column[0] ? !state.descending : column[0] !== "label";
        state.sort = column[0];
        redraw();
      });
      line.appendChild(cell);
    });
    head.textContent = "";
    head.appendChild(line);
  }

  function sortKey(row, column) {
    if (column === "label") return row.layer * 10000 + row.head;
    if (column === "classes") return row.classes.map(function (c) { return c[0]; }).join(",");
    var value = row.metrics[column];
    return value === null || value === undefined ? -Infinity : value;
  }

  function tableBody(root, data, state, shown, open) {
    var make = window.probeReports.make, body = root.querySelector(".atlas-table tbody");
    var order = shown.slice().sort(function (a, b) {
      var ka = sortKey(data.rows[a], state.sort), kb = sortKey(data.rows[b], state.sort);
      var c = ka < kb ? -1 : (ka > kb ? 1 : a - b);
      return state.descending ? -c : c;
    });
    body.textContent = "";
    order.forEach(function (i) {
      var row = data.rows[i], line = make("tr", "atlas-row");
      line.dataset.head = row.label;
      line.appendChild(make("td", "", row.label));
      var cell = make("td", "");
      row.classes.forEach(function (c) { cell.appendChild(make("span", "atlas-badge atlas-" + c[1], c[0])); });
      line.appendChild(cell);
      data.table_metrics.forEach(function (m) {
        var value = row.metrics[m];
        line.appendChild(make("td", "", value === null || value === undefined ? "\u2013" : value.toFixed(4)));
      });
      line.addEventListener("click", function () { open(row.layer, row.head); });
      body.appendChild(line);
    });
  }

  function atlasPage(id) {
    var tools = window.probeReports, root = document.getElementById(id);
    try {
      var data = JSON.parse(document.getElementById(id + "-data").textContent);
      var palette = colours(data), names = metricNames(data);
      legend(root.querySelector(".atlas-legend"), data, palette);
      var state = {x: data.metrics.delta ? "delta" : names[0], y: data.metrics.specificity ? "specificity" : names[1],
                   cls: "all", evidence: "all", search: "", sort: "label", descending: false};
      var scatter = root.querySelector(".atlas-scatter"), grid = root.querySelector(".atlas-grid");
      var index = function (layer, head) {
        for (var i = 0; i < data.rows.length; i++) {
          if (data.rows[i].layer === layer && data.rows[i].head === head) return i;
        }
        return -1;
      };
      var open = function (layer, head) {
        root.dataset.selected = layer + "." + head;
        return dashboard(root, data, index(layer, head), open).catch(function (error) { tools.fail(root, error); });
      };
      var byPoint = function (event) {
        var i = event.points[0].customdata;
        open(data.rows[i].layer, data.rows[i].head);
      };
      var redraw = function () {
        var shown = visible(data, state);
        root.querySelector(".atlas-count").textContent = shown.length + " of " + data.rows.length + " heads";
        tableHead(root, data, state, redraw);
        tableBody(root, data, state, shown, open);
        root.dataset.x = state.x;
        root.dataset.y = state.y;
        root.dataset.shown = String(shown.length);
        var layout = {height: 440, width: 560, margin: {l: 70, r: 10, t: 10, b: 50}, hovermode: "closest",
                      xaxis: {title: {text: describe(data, state.x)}}, yaxis: {title: {text: describe(data, state.y)}}};
        var gridLayout = tools.headGridLayout(data);
        gridLayout.xaxis.range = [-0.5, data.n_heads - 0.5];
        gridLayout.yaxis.range = [data.n_layers - 0.5, -0.5];
        gridLayout.yaxis.autorange = false;
        gridLayout.hovermode = "closest";
        return Promise.all([Plotly.react(scatter, [scatterTrace(data, shown, state.x, state.y, palette)], layout,
                                         tools.config),
                            Plotly.react(grid, [gridTrace(data, shown, palette)], gridLayout, tools.config)]);
      };
      var options = names.map(function (n) { return [n, n.replace(/_/g, " ")]; });
      fill(root.querySelector(".atlas-x"), options, state.x);
      fill(root.querySelector(".atlas-y"), options, state.y);
      var classOptions = data.classes.map(function (c) { return [c, c]; });
      fill(root.querySelector(".atlas-class"), [["all", "all"]].concat(classOptions)
        .concat([["none", "no class"]]), "all");
      fill(root.querySelector(".atlas-evidence"), [["all", "all"]].concat(Object.keys(data.statuses).map(function (s) {
        return [s, data.statuses[s]];
      })), "all");
      var menus = [["atlas-x", "x"], ["atlas-y", "y"], ["atlas-class", "cls"], ["atlas-evidence", "evidence"]];
      menus.forEach(function (p) {
        root.querySelector("." + p[0]).addEventListener("change", function (event) {
          state[p[1]] = event.target.value;
          redraw();
        });
      });
      root.querySelector(".atlas-search").addEventListener("input", function (event) {
        state.search = event.target.value; redraw();
      });
      return redraw().then(function () {
        scatter.on("plotly_click", byPoint);
        grid.on("plotly_click", byPoint);
        root.dataset.state = "ready";
      }).catch(function (error) { tools.fail(root, error); });
    } catch (error) {
      tools.fail(root, error);
    }
  }

  window.probeExtraPages = window.probeExtraPages || {};
  window.probeExtraPages.atlas = atlasPage;
})();
