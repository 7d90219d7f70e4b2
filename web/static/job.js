// A job's page, live: one chart per metric (from /jobs/{id}/chart-data, downsampled on the
// server), then one Server-Sent Event stream (/jobs/{id}/events) that appends new points and log
// lines and says when the summary (state, attempts, checkpoints) changed. Without JavaScript the
// page still shows everything but the charts.
(function () {
  "use strict";
  const root = document.getElementById("charts");
  if (!root) return;
  const jobId = root.dataset.job;
  const note = document.getElementById("charts-note");
  const status = document.getElementById("live-status");
  const smoothing = document.getElementById("smoothing");
  const logs = document.getElementById("job-logs");
  const logRank = document.getElementById("log-rank");
  const follow = document.getElementById("log-follow");
  const MAX_LOG_LINES = 5000;
  const charts = new Map(); // metric name -> {chart, rank}
  let cursor = 0;
  let logCursor = Number(root.dataset.logCursor || 0);
  let attempts = document.querySelectorAll("#attempts tbody tr").length;
  let source = null;

  function setStatus(text, on) {
    status.innerHTML = '<span class="live' + (on ? " on" : "") + '"></span>';
    status.appendChild(document.createTextNode(text));
  }

  function chartFor(name, rank, steps, values) {
    const box = document.createElement("div");
    box.className = "chart";
    box.dataset.metric = name;
    root.appendChild(box);
    const chart = new PhalanxCharts.Chart(box, {
      title: name + (rank ? " (rank " + rank + ")" : ""),
      series: [{ label: name }],
      xs: steps,
      ys: [values],
      smoothing: Number(smoothing.value),
    });
    charts.set(name, { chart, rank });
    return charts.get(name);
  }

  async function loadCharts() {
    const response = await fetch("/jobs/" + jobId + "/chart-data", { credentials: "same-origin" });
    if (!response.ok) throw new Error("chart data: HTTP " + response.status);
    const body = await response.json();
    cursor = body.cursor;
    for (const s of body.series) {
      const known = charts.get(s.name);
      if (known) known.chart.replace(s.steps, [s.values]);
      else chartFor(s.name, s.rank, s.steps, s.values);
    }
    if (body.series.length && note) note.remove();
    root.dataset.drawn = String(performance.now()); // when the charts were drawn (tests, benchmark)
  }

  // the summary's "latest" line, kept current from the stream (the summary itself is re-read
  // only when the job's state, events or checkpoints change)
  const latest = new Map();
  let latestStep = null;
  function showLatest(name, point) {
    latest.set(name, point[1]);
    latestStep = latestStep == null ? point[0] : Math.max(latestStep, point[0]);
    const code = document.getElementById("job-latest");
    if (!code) return;
    const values = [...latest.keys()].sort().map((k) => k + "=" + PhalanxCharts.formatValue(latest.get(k)));
    code.textContent = "step " + latestStep + ": " + values.join(" ");
  }

  function appendPoints(update) {
    cursor = update.cursor;
    for (const [name, byRank] of Object.entries(update.points)) {
      let entry = charts.get(name);
      if (!entry) {
        const rank = Math.min(...Object.keys(byRank).map(Number));
        entry = chartFor(name, rank, [], []);
        if (note) note.remove();
      }
      const points = byRank[String(entry.rank)] || [];
      const xs = entry.chart.xs;
      const last = xs.length ? xs[xs.length - 1] : -Infinity;
      const fresh = points.filter((p) => p[0] > last); // a step once, in order
      entry.chart.append(fresh.map((p) => p[0]), [fresh.map((p) => p[1])]);
      if (fresh.length) showLatest(name, fresh[fresh.length - 1]);
    }
  }

  function showRank(span) {
    const chosen = logRank.value;
    span.hidden = chosen !== "" && span.dataset.rank !== chosen;
  }

  function appendLogs(lines) {
    const empty = document.getElementById("no-logs");
    if (empty) empty.remove();
    const fragment = document.createDocumentFragment();
    for (const line of lines) {
      const span = document.createElement("span");
      span.className = line.stream;
      span.dataset.rank = line.rank == null ? "" : String(line.rank);
      span.textContent = "[" + (line.stream === "setup" ? "setup" : line.rank == null ? "launcher" : "rank " + line.rank) + "] " + line.line + "\n";
      showRank(span);
      fragment.appendChild(span);
      logCursor = line.id;
    }
    logs.appendChild(fragment);
    while (logs.childElementCount > MAX_LOG_LINES) logs.firstElementChild.remove();
    if (follow.checked) logs.scrollTop = logs.scrollHeight;
  }

  async function refreshSummary() {
    const response = await fetch("/jobs/" + jobId, { credentials: "same-origin" });
    if (!response.ok) return;
    const page = new DOMParser().parseFromString(await response.text(), "text/html");
    for (const id of ["job-summary", "job-history"]) {
      const fresh = page.getElementById(id);
      if (fresh) document.getElementById(id).replaceWith(fresh);
    }
    const now = document.querySelectorAll("#attempts tbody tr").length;
    if (now !== attempts) {
      attempts = now;
      await loadCharts(); // a new attempt re-does steps after its checkpoint: reload what counts
    }
  }

  function connect() {
    const url = "/jobs/" + jobId + "/events?metrics_after=" + cursor + "&logs_after=" + logCursor;
    source = new EventSource(url);
    source.onopen = () => setStatus("live", true);
    source.addEventListener("metrics", (e) => appendPoints(JSON.parse(e.data)));
    source.addEventListener("logs", (e) => appendLogs(JSON.parse(e.data)));
    source.addEventListener("summary", () => refreshSummary());
    source.addEventListener("end", () => {
      source.close();
      setStatus("finished", false);
      refreshSummary();
    });
    source.onerror = () => {
      // reconnect from where we are, not from the cursors in the first URL
      source.close();
      setStatus("reconnecting…", false);
      setTimeout(connect, 2000);
    };
  }

  smoothing.addEventListener("change", () => {
    for (const { chart } of charts.values()) chart.setSmoothing(Number(smoothing.value));
  });
  logRank.addEventListener("change", () => {
    for (const span of logs.querySelectorAll("span[data-rank]")) showRank(span);
  });
  if (follow.checked) logs.scrollTop = logs.scrollHeight;

  loadCharts()
    .then(() => {
      if (root.dataset.live === "true") connect();
    })
    .catch((error) => setStatus(String(error), false));
  window.phalanxJob = { charts };
})();
