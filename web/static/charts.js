// Line charts for the dashboard, on uPlot (vendored). One chart per metric: x = step, hover shows
// the values (uPlot's legend), drag to zoom, double-click to zoom out. Optional smoothing is the
// debiased exponential moving average that TensorBoard and W&B use; the raw series stays visible,
// faint, behind it. A NaN or an infinity arrives as the string "NaN", "Infinity" or "-Infinity" (as
// every Phalanx answer writes them): the line breaks there, and hovering the break names the value.
(function () {
  "use strict";

  // Buttons that change something ask first: <form data-confirm="question">. A listener, not an
  // inline onsubmit, so that the Content-Security-Policy can forbid inline script.
  document.addEventListener("submit", function (event) {
    const question = event.target.dataset && event.target.dataset.confirm;
    if (question && !window.confirm(question)) event.preventDefault();
  });

  // steps are whole numbers: ticks at 1, 2, 5 x 10^k only
  const STEP_INCREMENTS = [];
  for (let k = 1; k <= 1e9; k *= 10) STEP_INCREMENTS.push(k, 2 * k, 5 * k);

  const PALETTE = ["#2e5bff", "#e8590c", "#1a7f37", "#9c36b5", "#c0362c", "#0b7285", "#5f3dc4", "#a61e4d"];

  function smooth(values, weight) {
    if (!weight) return values;
    const out = new Array(values.length);
    let last = 0, debias = 0;
    for (let i = 0; i < values.length; i++) {
      const v = values[i];
      if (v == null || !isFinite(v)) { out[i] = v; continue; }
      last = last * weight + (1 - weight) * v;
      debias = debias * weight + (1 - weight);
      out[i] = last / debias;
    }
    return out;
  }

  function formatValue(v) {
    if (v == null) return "–";
    if (typeof v === "string") return v; // "NaN", "Infinity", "-Infinity"
    const a = Math.abs(v);
    return a !== 0 && (a < 1e-3 || a >= 1e5) ? v.toExponential(3) : +v.toPrecision(5) + "";
  }

  // What uPlot draws for a value: null (a break in the line) for NaN and the infinities, undefined
  // (bridged) where a series has no point.
  function plotted(values) {
    return values.map((v) => (typeof v === "string" ? null : v == null ? undefined : v));
  }

  // A chart of several series over one shared x (steps). `series`: [{label, color}], `ys`: one
  // array per series (null where a series has no point at that x; "NaN", "Infinity" or
  // "-Infinity" where it reported one). `kind`: "line" or "points".
  class Chart {
    constructor(container, { title, xLabel = "step", series, xs = [], ys = null, smoothing = 0, kind = "line", height = 220 }) {
      this.container = container;
      this.series = series;
      this.kind = kind;
      this.smoothing = smoothing;
      this.xs = xs.slice();
      this.ys = ys ? ys.map((a) => a.slice()) : series.map(() => []);
      this.height = height;
      this.xLabel = xLabel;
      container.innerHTML = "";
      if (title) {
        const h = document.createElement("h3");
        h.textContent = title;
        container.appendChild(h);
      }
      this.target = document.createElement("div");
      container.appendChild(this.target);
      this.plot = new uPlot(this.options(this.xLabel), this.data(), this.target);
      this.resize = new ResizeObserver(() => this.fit());
      this.resize.observe(container);
      container.dataset.points = String(this.xs.length);
    }

    options(xLabel) {
      const smoothed = this.kind === "line" && this.smoothing > 0;
      const uSeries = [{ label: xLabel, value: (u, v) => (v == null ? "–" : v) }];
      this.series.forEach((s, i) => {
        const color = s.color || PALETTE[i % PALETTE.length];
        const line = {
          label: s.label,
          stroke: color,
          width: this.kind === "points" ? 0 : 1.5,
          // at a break the legend names what was reported there
          value: (u, v, _series, idx) => {
            const raw = idx == null ? null : this.ys[i][idx];
            return typeof raw === "string" ? raw : formatValue(v);
          },
          spanGaps: false, // only NaN and infinities are null (see plotted): the line breaks there
          points: this.kind === "points" ? { show: true, size: 6, fill: color } : { show: false },
        };
        if (smoothed) {
          uSeries.push({ ...line, label: s.label + " (raw)", stroke: color + "40", width: 1 });
          uSeries.push({ ...line, label: s.label + " (smoothed)" });
        } else {
          uSeries.push(line);
        }
      });
      return {
        width: Math.max(this.container.clientWidth - 24, 200),
        height: this.height,
        series: uSeries,
        scales: { x: { time: false } },
        axes: [
          { label: xLabel, size: 40, incrs: STEP_INCREMENTS },
          { size: 60, values: (u, ticks) => ticks.map(formatValue) },
        ],
        cursor: { drag: { x: true, y: false } },
        legend: { live: true },
      };
    }

    data() {
      const columns = [this.xs];
      for (const raw of this.ys) {
        const y = plotted(raw);
        if (this.kind === "line" && this.smoothing > 0) columns.push(y, smooth(y, this.smoothing));
        else columns.push(y);
      }
      return columns;
    }

    // New points at the end (live updates): `xs` ascending, `ys` one array per series.
    append(xs, ys) {
      if (!xs.length) return;
      this.xs.push(...xs);
      ys.forEach((y, i) => this.ys[i].push(...y));
      this.plot.setData(this.data());
      this.container.dataset.points = String(this.xs.length);
    }

    replace(xs, ys) {
      this.xs = xs.slice();
      this.ys = ys.map((a) => a.slice());
      this.plot.setData(this.data());
      this.container.dataset.points = String(this.xs.length);
    }

    setSmoothing(weight) {
      if (this.kind !== "line" || weight === this.smoothing) return;
      this.smoothing = weight;
      this.plot.destroy();
      this.target.innerHTML = "";
      this.plot = new uPlot(this.options(this.xLabel), this.data(), this.target);
    }

    fit() {
      const width = Math.max(this.container.clientWidth - 24, 200);
      if (Math.abs(width - this.plot.width) > 2) this.plot.setSize({ width, height: this.height });
    }
  }

  window.PhalanxCharts = { Chart, smooth, formatValue, plotted, PALETTE };
})();
