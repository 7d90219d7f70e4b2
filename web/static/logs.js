// The logs page in follow mode: new lines arrive over the job's event stream (logs only) and are
// appended; with "follow" checked the view stays at the bottom. Lines of other ranks are skipped
// when the page shows one rank.
(function () {
  "use strict";
  const logs = document.getElementById("logs");
  if (!logs || logs.dataset.live !== "true") return;
  const follow = document.getElementById("log-follow");
  const rank = logs.dataset.rank;
  let cursor = Number(logs.dataset.cursor || 0);
  if (follow.checked) logs.scrollTop = logs.scrollHeight;

  function append(lines) {
    const empty = document.getElementById("no-logs");
    const fragment = document.createDocumentFragment();
    for (const line of lines) {
      cursor = line.id;
      if (rank !== "" && String(line.rank) !== rank) continue;
      const span = document.createElement("span");
      span.className = line.stream;
      span.textContent = "[" + (line.stream === "setup" ? "setup" : line.rank == null ? "launcher" : "rank " + line.rank) + "] " + line.line + "\n";
      fragment.appendChild(span);
    }
    if (empty && fragment.childNodes.length) empty.remove();
    logs.appendChild(fragment);
    if (follow.checked) logs.scrollTop = logs.scrollHeight;
  }

  function connect() {
    const source = new EventSource("/jobs/" + logs.dataset.job + "/events?logs_after=" + cursor);
    source.addEventListener("logs", (e) => append(JSON.parse(e.data)));
    source.addEventListener("end", () => source.close());
    source.onerror = () => {
      source.close();
      setTimeout(connect, 2000);
    };
  }
  connect();
})();
