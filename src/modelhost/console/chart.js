// Small SVG charts: a line plot with axes and a legend, and a sparkline. No library.

const NS = "http://www.w3.org/2000/svg";

function svg(tag, attrs = {}, text) {
  const node = document.createElementNS(NS, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (text !== undefined) node.textContent = text;
  return node;
}

function ticks(max) {
  if (!(max > 0)) return [0, 1];
  const step = 10 ** Math.floor(Math.log10(max));
  const nice = [1, 2, 5, 10].map((m) => m * step).find((s) => max / s <= 5) || step * 10;
  const out = [];
  for (let v = 0; v <= max + nice * 0.001; v += nice) out.push(v);
  if (out[out.length - 1] < max) out.push(out[out.length - 1] + nice);
  return out;
}

// `series`: [{name, points: [[x, y]...], axis: "left"|"right"}]; x values are shared labels.
export function linePlot(series, { title, xLabel, leftLabel, rightLabel, width = 520, height = 240 } = {}) {
  const pad = { left: 52, right: rightLabel ? 52 : 16, top: 28, bottom: 40 };
  const plotW = width - pad.left - pad.right;
  const plotH = height - pad.top - pad.bottom;
  const xs = [...new Set(series.flatMap((s) => s.points.map((p) => p[0])))].sort((a, b) => a - b);
  const xAt = (x) => pad.left + (xs.length < 2 ? plotW / 2 : (xs.indexOf(x) / (xs.length - 1)) * plotW);
  const root = svg("svg", { viewBox: `0 0 ${width} ${height}`, class: "plot", role: "img" });
  root.append(svg("title", {}, title || "plot"));
  const axes = {};
  for (const side of ["left", "right"]) {
    const values = series.filter((s) => (s.axis || "left") === side).flatMap((s) => s.points.map((p) => p[1]));
    if (!values.length) continue;
    const marks = ticks(Math.max(...values.filter((v) => v !== null)));
    const top = marks[marks.length - 1] || 1;
    axes[side] = (y) => pad.top + plotH - (y / top) * plotH;
    for (const mark of marks) {
      const y = axes[side](mark);
      if (side === "left") root.append(svg("line", { x1: pad.left, x2: pad.left + plotW, y1: y, y2: y, class: "grid" }));
      const x = side === "left" ? pad.left - 6 : pad.left + plotW + 6;
      root.append(svg("text", { x, y: y + 4, class: `tick ${side}` }, String(+mark.toPrecision(3))));
    }
  }
  for (const x of xs) {
    root.append(svg("text", { x: xAt(x), y: pad.top + plotH + 16, class: "tick bottom" }, String(x)));
  }
  if (xLabel) root.append(svg("text", { x: pad.left + plotW / 2, y: height - 6, class: "label" }, xLabel));
  if (leftLabel) root.append(svg("text", { x: 4, y: 14, class: "label start" }, leftLabel));
  if (rightLabel) root.append(svg("text", { x: width - 4, y: 14, class: "label end" }, rightLabel));
  series.forEach((s, index) => {
    const scale = axes[s.axis || "left"];
    const points = s.points.filter((p) => p[1] !== null && p[1] !== undefined);
    if (!scale || !points.length) return;
    const d = points.map((p, i) => `${i ? "L" : "M"}${xAt(p[0]).toFixed(1)},${scale(p[1]).toFixed(1)}`).join(" ");
    root.append(svg("path", { d, class: `series s${index}` }));
    for (const p of points) {
      const dot = svg("circle", { cx: xAt(p[0]), cy: scale(p[1]), r: 3.5, class: `dot s${index}` });
      dot.append(svg("title", {}, `${s.name} at ${p[0]}: ${+Number(p[1]).toPrecision(4)}`));
      root.append(dot);
    }
    root.append(svg("text", { x: pad.left + 8 + index * 150, y: 14, class: `legend s${index}` }, `● ${s.name}`));
  });
  return root;
}

// A tiny trend line of the last values (e.g. tokens per second each few seconds).
export function sparkline(values, { width = 120, height = 28, label = "trend" } = {}) {
  const root = svg("svg", { viewBox: `0 0 ${width} ${height}`, class: "spark", role: "img" });
  root.append(svg("title", {}, label));
  if (values.length < 2) return root;
  const top = Math.max(1, ...values);
  const step = width / (values.length - 1);
  const d = values.map((v, i) => `${i ? "L" : "M"}${(i * step).toFixed(1)},${(height - 2 - (v / top) * (height - 4)).toFixed(1)}`).join(" ");
  root.append(svg("path", { d, class: "series s0" }));
  return root;
}
