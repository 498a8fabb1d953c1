/* What a reader would see as a layout fault on a drawn probe page: one line per fault, none on a good page.
   Not part of any page: tests/test_page_layout.py and docs/_build/screenshots.py evaluate it in Chromium (at 1000
   and 1400 px) once the page is drawn. Checks: the page failed to draw or runs past the window; a section with
   nothing in it; text clipped by its box (HTML text wider than its element, plotly labels past their plot); boxes
   that overlap (plotly's mode bar over the plot area, a plot over a table or a heading); a section whose plots and
   tables use less than 60% of the content width; a word broken inside a header; an x axis running far past its
   data; a raw newline shown as a line break in text. */
() => {
  const faults = [], root = document.querySelector('.probe-page');
  const say = (what, node) => faults.push(what + (node ? ': ' + name(node) : ''));
  const name = node => (node.textContent || node.className || node.tagName).toString().trim().slice(0, 60);
  const box = node => node.getBoundingClientRect();
  const shown = node => { const r = box(node); return r.width > 0 && r.height > 0 && node.offsetParent !== null; };
  const seen = node => {  // its box as far as a scrolling or clipping ancestor shows it
    const r = box(node), out = {left: r.left, top: r.top, right: r.right, bottom: r.bottom};
    for (let up = node.parentElement; up && up !== root; up = up.parentElement) {
      if (getComputedStyle(up).overflow === 'visible') continue;
      const c = box(up);
      out.left = Math.max(out.left, c.left); out.top = Math.max(out.top, c.top);
      out.right = Math.min(out.right, c.right); out.bottom = Math.min(out.bottom, c.bottom);
    }
    return out;
  };
  const overlap = (a, b) => Math.max(0, Math.min(a.right, b.right) - Math.max(a.left, b.left))
    * Math.max(0, Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top));
  if (!root) return ['no .probe-page on the page'];
  if (root.dataset.state === 'error') say('the page failed to draw: ' + root.innerText.slice(-200));
  if (document.documentElement.scrollWidth > document.documentElement.clientWidth + 1)
    say('the page is wider than the window');
  const style = getComputedStyle(root);
  const content = {left: box(root).left + parseFloat(style.paddingLeft),
                   right: box(root).right - parseFloat(style.paddingRight)};

  // a section with nothing in it
  root.querySelectorAll('.probe-section').forEach(section => {
    if (!shown(section)) return;
    const text = Array.from(section.children).filter(c => !/^H[1-4]$/.test(c.tagName))
      .map(c => c.innerText.trim()).join('');
    if (!section.querySelector('svg, table, canvas, img') && !text)
      say('an empty section', section.querySelector('h2, h3') || section);
  });

  // text clipped by its box
  root.querySelectorAll('*').forEach(node => {
    if (!shown(node) || /^(SELECT|INPUT|OPTION|TEXTAREA|svg)$/i.test(node.tagName) || node.closest('svg')) return;
    const css = getComputedStyle(node);
    if (css.display.startsWith('inline') && node.tagName !== 'TD' || /auto|scroll/.test(css.overflowX)) return;
    const text = Array.from(node.childNodes).some(c => c.nodeType === 3 && c.textContent.trim());
    if (text && node.scrollWidth > node.clientWidth + 1) say('text wider than its box', node);
  });
  root.querySelectorAll('.js-plotly-plot').forEach(plot => {
    if (!shown(plot)) return;
    const outer = box(plot), svg = plot.querySelector('.main-svg');
    if (svg && box(svg).right > content.right + 1) say('a plot runs past the right edge of the content', plot);
    plot.querySelectorAll('.main-svg text').forEach(label => {
      if (label.closest('.hoverlayer') || !label.textContent.trim()) return;
      const r = box(label);
      if (r.width && (r.left < outer.left - 1 || r.right > outer.right + 1 || r.top < outer.top - 1
                      || r.bottom > outer.bottom + 1))
        say('a label cut by its plot', label);
    });
  });

  // overlapping boxes: the mode bar over the plot area; plots, tables and headings over each other
  root.querySelectorAll('.js-plotly-plot').forEach(plot => {
    const bar = plot.querySelector('.modebar');
    if (!shown(plot) || !bar || !box(bar).width) return;
    plot.querySelectorAll('.draglayer .nsewdrag').forEach(area => {
      if (overlap(box(bar), box(area)) > 4) say('the plotly mode bar covers the plot area', plot.parentElement);
    });
  });
  const solid = Array.from(root.querySelectorAll('.js-plotly-plot, table, canvas, h1, h2, h3, .probe-overview'))
    .filter(node => shown(node) && !node.parentElement.closest('.js-plotly-plot, table, .probe-overview'));
  solid.forEach((a, i) => solid.slice(i + 1).forEach(b => {
    if (!a.contains(b) && !b.contains(a) && overlap(seen(a), seen(b)) > 4)
      say('two boxes overlap: ' + name(a) + ' and', b);
  }));

  // the width the plots, tables and rows under each heading use (a plot's box is its drawing, not its div)
  const drawn = node => node.classList.contains('js-plotly-plot') ? node.querySelector('.main-svg') || node : node;
  const measured = Array.from(root.querySelectorAll('.js-plotly-plot, table:not(.probe-kv):not(.probe-static-table), '
    + '.probe-overview, .probe-tokens, .probe-row > *'))
    .filter(node => shown(node) && !node.parentElement.closest('.js-plotly-plot, table, .probe-overview, svg'));
  const headings = Array.from(root.querySelectorAll('h2')).filter(shown);
  const groups = new Map();
  measured.forEach(node => {  // a row counts as one block, under the heading above it
    let unit = node;
    for (let row = node.closest('.probe-row'); row; row = row.parentElement.closest('.probe-row')) unit = row;
    const before = headings.filter(h => h.compareDocumentPosition(unit) & Node.DOCUMENT_POSITION_FOLLOWING);
    const group = before.length ? before[before.length - 1] : root;
    if (!groups.has(group)) groups.set(group, []);
    groups.get(group).push(box(drawn(node)));
  });
  groups.forEach((boxes, group) => {
    const used = Math.max(...boxes.map(r => r.right)) - Math.min(...boxes.map(r => r.left));
    const share = used / (content.right - content.left);
    if (share < 0.6) say(`plots and tables use ${Math.round(100 * share)}% of the width`, group === root ? null
                                                                                                    : group);
  });

  // a word broken inside a header
  root.querySelectorAll('th, h1, h2, h3, table.probe-kv td:first-child, .probe-grid-label').forEach(node => {
    if (!shown(node)) return;
    const walker = document.createTreeWalker(node, NodeFilter.SHOW_TEXT);
    for (let text = walker.nextNode(); text; text = walker.nextNode()) {
      for (const match of text.textContent.matchAll(/\S+/g)) {
        const range = document.createRange();
        range.setStart(text, match.index);
        range.setEnd(text, match.index + match[0].length);
        const tops = new Set(Array.from(range.getClientRects()).filter(r => r.width > 0).map(r => Math.round(r.top)));
        if (tops.size > 1) say('a word broken inside a header: ' + match[0]);
      }
    }
  });

  // an x axis that runs far past its data (on plots of lines and points only: a heatmap sets its own range)
  root.querySelectorAll('.js-plotly-plot').forEach(plot => {
    const axis = plot._fullLayout && plot._fullLayout.xaxis;
    if (!shown(plot) || !axis || axis.type !== 'linear' || !axis.range) return;
    if ((plot.data || []).some(t => t.type !== 'scatter')) return;
    const xs = [].concat(...(plot.data || []).filter(t => t.type === 'scatter' && Array.isArray(t.x))
      .map(t => t.x.filter(x => typeof x === 'number')));
    if (xs.length < 2) return;
    const span = Math.max(...xs) - Math.min(...xs), range = Math.abs(axis.range[1] - axis.range[0]);
    if (span > 0 && span < 0.5 * range)
      say(`an x axis spans ${+range.toPrecision(3)} while its data spans ${+span.toPrecision(3)}`, plot.parentElement);
  });

  // a raw newline shown as a line break
  const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
  for (let text = walker.nextNode(); text; text = walker.nextNode()) {
    const parent = text.parentElement;
    if (!parent || parent.closest('script, style, svg') || !shown(parent) || !/\n/.test(text.textContent.trim()))
      continue;
    if (/^pre|break-spaces/.test(getComputedStyle(parent).whiteSpace)) say('a raw newline in the text', parent);
  }
  return Array.from(new Set(faults));
}
