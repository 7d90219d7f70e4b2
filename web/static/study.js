// The study page's two uPlot charts: optimisation history (each finished trial's objective by
// trial number, pruned ones hollow and orange, the best so far as a step line) and intermediate
// values (one line per trial by step, pruned ones dashed orange). Their data is the page's JSON
// (#history-data, #intermediate-data). htmx swaps #study-body in on the study's `changed` events
// (see study.html); the charts are drawn again from the new JSON after each swap.
(function () {
  "use strict";

  const TRIAL_COLORS = ["#2e5bff", "#1a7f37", "#9c36b5", "#0b7285", "#5f3dc4", "#a61e4d", "#364fc7", "#2b8a3e", "#862e9c", "#1864ab"];
  const PRUNED = "#e8590c";
  const INCREMENTS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5, 5e5, 1e6];
  const LEGEND_MAX = 12; // more trials than this: a one-line readout of the hovered one instead
  const plots = [];
  let live = null; // null: not connected yet; true: connected; false: lost, htmx reconnects

  function format(v) {
    if (window.PhalanxCharts) return PhalanxCharts.formatValue(v);
    return v == null ? "–" : +v.toPrecision(5) + "";
  }

  function readJSON(id) {
    const el = document.getElementById(id);
    if (!el) return null;
    try {
      return JSON.parse(el.textContent);
    } catch (e) {
      return null;
    }
  }

  function axes(xLabel, yLabel) {
    return [
      { label: xLabel, size: 40, incrs: INCREMENTS, values: (u, ticks) => ticks.map((t) => t + "") },
      { label: yLabel, size: 64, values: (u, ticks) => ticks.map(format) },
    ];
  }

  function pointsOnly(color, hollow, size) {
    return {
      stroke: color,
      width: 1.5,
      paths: () => null,
      points: { show: true, size: size || 7, stroke: color, fill: hollow ? "#fff" : color, width: hollow ? 1.75 : 1 },
      value: (u, v) => format(v),
    };
  }

  function mount(container, title, build) {
    const heading = container.querySelector("h3");
    container.innerHTML = "";
    if (heading) container.appendChild(heading);
    const target = document.createElement("div");
    container.appendChild(target);
    const width = () => Math.max(container.clientWidth - 24, 240);
    const plot = build(target, width());
    const resize = new ResizeObserver(() => {
      const w = width();
      if (Math.abs(w - plot.width) > 2) plot.setSize({ width: w, height: plot.height });
    });
    resize.observe(container);
    plots.push({ plot, resize });
    return target;
  }

  function drawHistory(container, data) {
    if (!data || !data.numbers.length) return;
    mount(container, "history", (target, width) => {
      const series = [
        { label: "trial", value: (u, v) => (v == null ? "–" : "#" + v) },
        { label: "complete", ...pointsOnly("#2e5bff") },
        { label: "pruned", ...pointsOnly(PRUNED, true) },
      ];
      const columns = [data.numbers, data.complete, data.pruned];
      if (data.multi) {
        series.push({ label: "Pareto front", ...pointsOnly(PRUNED, true, 13) });
        columns.push(data.front);
      } else {
        series.push({
          label: "best so far",
          stroke: "#1a7f37",
          width: 2,
          spanGaps: true,
          points: { show: false },
          paths: uPlot.paths.stepped({ align: 1 }),
          value: (u, v) => format(v),
        });
        columns.push(data.best);
      }
      const opts = {
        width,
        height: 240,
        series,
        // one trial alone: a narrow range around it (uPlot's own would run 0..100)
        scales: { x: { time: false, range: (u, min, max) => (min === max ? [min - 1, max + 1] : [min, max]) } },
        axes: axes("trial", data.metric + " (" + data.direction + ")"),
        cursor: { drag: { x: true, y: false }, points: { size: 9 } },
        legend: { live: true },
      };
      return new uPlot(opts, columns, target);
    });
  }

  function drawIntermediate(container, data) {
    if (!data || !data.trials.length) return;
    const many = data.trials.length > LEGEND_MAX;
    let readout = null;
    let focused = null;
    const target = mount(container, "intermediate", (target, width) => {
      const series = [{ label: "step", value: (u, v) => (v == null ? "–" : v) }];
      let colour = 0;
      for (const t of data.trials) {
        const color = t.pruned ? PRUNED : TRIAL_COLORS[colour++ % TRIAL_COLORS.length];
        series.push({
          label: t.label,
          stroke: color,
          width: t.best ? 2.75 : t.pruned ? 1.25 : 1.5,
          dash: t.pruned ? [6, 4] : undefined,
          spanGaps: true,
          points: { size: 5, fill: color },
          value: (u, v) => format(v),
        });
      }
      const update = (u) => {
        if (!readout) return;
        const i = u.cursor.idx;
        if (focused == null || i == null) {
          readout.textContent = "Hover a line: its trial and value here. Dashed orange: pruned.";
          return;
        }
        readout.textContent = data.trials[focused - 1].label + " · step " + data.steps[i] + ": " + format(u.data[focused][i]);
      };
      const opts = {
        width,
        height: 240,
        series,
        scales: { x: { time: false } },
        axes: axes("step", data.metric),
        cursor: { drag: { x: true, y: false }, focus: { prox: 24 } },
        focus: { alpha: 0.25 },
        legend: { show: !many, live: true },
        hooks: {
          setSeries: [(u, i, o) => { if (o && o.focus != null) focused = o.focus ? i : null; update(u); }],
          setCursor: [update],
        },
      };
      return new uPlot(opts, [data.steps, ...data.trials.map((t) => t.values)], target);
    });
    if (many) {
      readout = document.createElement("div");
      readout.className = "readout";
      readout.textContent = data.trials.length + " trials. Hover a line: its trial and value here. Dashed orange: pruned.";
      target.after(readout);
    }
  }

  function showLive() {
    const status = document.querySelector("#study-body .live-status");
    if (!status || live === null) return;
    status.hidden = false;
    status.querySelector(".live").classList.toggle("on", live);
    status.querySelector(".live-text").textContent = live ? "live" : "reconnecting…";
    status.title = live ? "Updates as the study's trials report" : "The live connection dropped; retrying";
  }

  function draw() {
    while (plots.length) {
      const { plot, resize } = plots.pop();
      resize.disconnect();
      plot.destroy();
    }
    if (typeof uPlot === "undefined") return;
    const history = document.getElementById("history-chart");
    const intermediate = document.getElementById("intermediate-chart");
    if (history) drawHistory(history, readJSON("history-data"));
    if (intermediate) drawIntermediate(intermediate, readJSON("intermediate-data"));
    showLive();
  }

  // htmx fires it on the swapped-in elements (the new #study-body for an outerHTML swap)
  document.addEventListener("htmx:afterSwap", (e) => {
    if (e.target && (e.target.id === "study-body" || e.target.id === "study-live")) draw();
  });
  document.addEventListener("htmx:sseOpen", () => { live = true; showLive(); });
  document.addEventListener("htmx:sseError", () => { live = false; showLive(); });

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", draw);
  else draw();
})();
