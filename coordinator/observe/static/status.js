// The fedfleet status page: polls /api/status (same origin, same token) and redraws. No libraries.
"use strict";

const TOKEN = new URLSearchParams(location.search).get("token") || "";
const SVG = "http://www.w3.org/2000/svg";
const POLL_MS = 1000;

function el(tag, attrs = {}, text = null) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (text !== null) node.textContent = text;
  return node;
}

function svgEl(tag, attrs = {}, text = null) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (text !== null) node.textContent = text;
  return node;
}

function bytes(n) {
  if (n >= 2 ** 30) return (n / 2 ** 30).toFixed(2) + " GiB";
  if (n >= 2 ** 20) return (n / 2 ** 20).toFixed(2) + " MiB";
  if (n >= 2 ** 10) return (n / 2 ** 10).toFixed(1) + " KiB";
  return Math.round(n) + " B";
}

function ratio(value) {
  if (value === null || value === undefined) return "-";
  for (const den of [1, 2, 3, 4, 8, 16, 32]) {
    const num = Math.round(value * den);
    if (Math.abs(num / den - value) < 1e-9) return den === 1 ? String(num) : num + "/" + den;
  }
  return value.toFixed(3);
}

function cell(row, text, cls = "") {
  const td = el("td", cls ? { class: cls } : {}, text);
  row.appendChild(td);
  return td;
}

// Rounds missed in a row, and the backoff they earned (limits.backoff_after): "; missed 3 in a row, sits out to 6".
function missed(d) {
  if (!d.missed_in_a_row) return "";
  return "; missed " + d.missed_in_a_row + " in a row" + (d.sits_out_until ? ", sits out to " + d.sits_out_until : "");
}

// A count with its share of the rounds the device was drawn into: "3 (12 %)".
function rate(count, selected) {
  return selected ? count + " (" + Math.round((100 * count) / selected) + " %)" : String(count);
}

function renderFleet(devices) {
  const body = document.querySelector("#fleet tbody");
  body.replaceChildren();
  for (const d of devices) {
    const refused = Object.values(d.refused).reduce((a, b) => a + b, 0);
    const row = el("tr", { "data-device": d.id });
    cell(row, d.id);
    cell(row, d.device_class);
    if (d.refused_because) {
      // Another protocol version: the coordinator will not work with it, as the live terminal table says.
      cell(row, "refused", "refused");
      cell(row, d.refused_because, "detail");
    } else {
      cell(row, d.online ? "yes" : "no", d.online ? "online" : "offline");
      cell(row, d.agent_state);
    }
    cell(row, ratio(d.ratio), "num");
    cell(row, d.round_status || "-", d.round_status ? "status-" + d.round_status : "");
    cell(row, d.totals.last_round === null ? "-" : d.totals.last_round + " (" + d.totals.last_status + ")" + missed(d), "num last-round");
    cell(row, bytes(d.totals.bytes_up), "num");
    cell(row, bytes(d.totals.bytes_down), "num");
    cell(row, d.totals.train_seconds.toFixed(1), "num");
    cell(row, String(d.totals.accepted), "num");
    cell(row, rate(refused, d.totals.selected), "num");
    cell(row, rate(d.totals.clipped, d.totals.selected), "num");
    cell(row, String(d.step_downs), "num");
    body.appendChild(row);
  }
}

function renderOpenRound(open) {
  const box = document.getElementById("open-round");
  box.replaceChildren();
  if (!open) {
    box.className = "muted";
    box.textContent = "no round open";
    return;
  }
  box.className = "";
  const done = (open.statuses.accepted || 0) + (open.statuses.rejected || 0) + (open.statuses.failed || 0);
  const bar = el("span", { class: "progress" });
  const filled = el("span");
  filled.style.width = (100 * done / Math.max(1, open.selected)).toFixed(0) + "%"; // CSSOM: allowed by the CSP
  bar.appendChild(filled);
  const parts = Object.entries(open.statuses).map(([s, n]) => n + " " + s).join(", ");
  box.append(
    el("strong", {}, "round " + open.round + ": "),
    bar,
    document.createTextNode(
      " " + done + "/" + open.selected + " answered (" + parts + "), " + open.elapsed_s.toFixed(0) +
      " s in, deadline in " + Math.max(0, open.deadline_in_s).toFixed(0) + " s"
    ),
  );
}

// Async mode (docs/async.md): the newest model version, the buffer toward the next one, who trains, and the
// run's staleness histogram (one bar per staleness, versions published while the update trained).
function renderVersions(view, last) {
  const box = document.getElementById("open-round");
  box.replaceChildren();
  box.className = "";
  const bar = el("span", { class: "progress" });
  const filled = el("span");
  filled.style.width = (100 * view.buffered / Math.max(1, view.buffer)).toFixed(0) + "%";
  bar.appendChild(filled);
  box.append(
    el("strong", {}, "version " + view.version + ": "),
    bar,
    document.createTextNode(
      " " + view.buffered + "/" + view.buffer + " updates toward version " + (view.version + 1) + ", " +
      view.training + " devices training" + (view.concurrency !== null ? " (at most " + view.concurrency + ")" : "") +
      (last && last.updates !== null ? "; version " + last.round + " folded " + last.updates + " updates" : "")
    ),
  );
  const counts = Object.entries(view.staleness).map(([s, n]) => [Number(s), n]);
  const most = Math.max(1, ...counts.map(([, n]) => n));
  const table = el("table", { id: "staleness" });
  table.appendChild(el("caption", {}, "staleness of folded updates (max " + view.max_staleness + ", " +
    view.too_stale + " refused too stale)"));
  for (const [staleness, n] of counts) {
    const row = el("tr");
    cell(row, String(staleness), "num");
    const bars = el("td");
    const histogramBar = el("span", { class: "progress" });
    const part = el("span");
    part.style.width = (100 * n / most).toFixed(0) + "%";
    histogramBar.appendChild(part);
    bars.appendChild(histogramBar);
    row.appendChild(bars);
    cell(row, String(n), "num");
    table.appendChild(row);
  }
  box.appendChild(table);
}

// A line chart in hand-written SVG: x = round, one path per series, y axis from yMin to yMax.
function lineChart(svg, rounds, series, yMin, yMax, format) {
  svg.replaceChildren();
  const W = 480, H = 220, left = 72, right = 12, top = 12, bottom = 30;
  const xMax = Math.max(2, ...rounds);
  const x = (r) => left + ((r - 1) / (xMax - 1)) * (W - left - right);
  const y = (v) => top + (1 - (v - yMin) / (yMax - yMin || 1)) * (H - top - bottom);
  const empty = !series.some((s) => s.values.length);
  for (let i = 0; i <= 4; i++) {
    const v = yMin + ((yMax - yMin) * i) / 4;
    svg.appendChild(svgEl("line", { class: "grid", x1: left, x2: W - right, y1: y(v), y2: y(v) }));
    // No figures on an axis with no data under it: before round 1 the scale is only a placeholder.
    if (!empty) svg.appendChild(svgEl("text", { x: left - 6, y: y(v) + 4, "text-anchor": "end" }, format(v)));
  }
  if (empty) {
    const middle = { x: (left + W - right) / 2, y: (top + H - bottom) / 2, "text-anchor": "middle", class: "waiting" };
    svg.appendChild(svgEl("text", middle, "no round closed yet"));
  }
  svg.appendChild(svgEl("line", { class: "axis", x1: left, x2: left, y1: top, y2: H - bottom }));
  svg.appendChild(svgEl("line", { class: "axis", x1: left, x2: W - right, y1: H - bottom, y2: H - bottom }));
  const step = Math.max(1, Math.ceil(xMax / 10));
  for (let r = 1; r <= xMax; r += step) {
    svg.appendChild(svgEl("text", { x: x(r), y: H - bottom + 16, "text-anchor": "middle" }, String(r)));
  }
  series.forEach((s, i) => {
    if (!s.values.length) return;
    const d = s.values.map((v, j) => (j ? "L" : "M") + x(rounds[j]).toFixed(1) + " " + y(v).toFixed(1)).join(" ");
    svg.appendChild(svgEl("path", { class: "line " + s.cls, d: d, "data-points": String(s.values.length) }));
    s.values.forEach((v, j) => svg.appendChild(svgEl("circle", { class: "dot-" + s.cls, cx: x(rounds[j]), cy: y(v), r: 2.5 })));
    svg.appendChild(svgEl("text", { x: W - right - 4, y: H - bottom - 8 - 14 * i, "text-anchor": "end", class: "key-" + s.cls }, s.name));
  });
}

function renderCharts(history) {
  const rounds = history.map((r) => r.round);
  const accuracy = [];
  if (history.length && history.every((r) => r.accuracy !== null)) {
    accuracy.push({ name: "global model", cls: "accuracy", values: history.map((r) => r.accuracy) });
  }
  if (history.length && history.every((r) => r.federated_accuracy !== null)) {
    accuracy.push({ name: "federated (received)", cls: "federated", values: history.map((r) => r.federated_accuracy) });
  }
  if (history.length && history.every((r) => r.personalized_accuracy !== null)) {
    accuracy.push({ name: "devices' own (mean)", cls: "local", values: history.map((r) => r.personalized_accuracy) });
  }
  lineChart(document.getElementById("accuracy-chart"), rounds, accuracy, 0, 1, (v) => v.toFixed(2));
  const most = 1.2 * Math.max(1, ...history.map((r) => Math.max(r.bytes_up, r.bytes_down))); // room for the key
  lineChart(document.getElementById("bytes-chart"), rounds, [
    { name: "up", cls: "up", values: history.map((r) => r.bytes_up) },
    { name: "down", cls: "down", values: history.map((r) => r.bytes_down) },
  ], 0, most, bytes);
}

function renderRefusals(refusals) {
  const body = document.querySelector("#refusals tbody");
  body.replaceChildren();
  if (!refusals.length) {
    const row = el("tr");
    cell(row, "none", "muted").setAttribute("colspan", "5");
    body.appendChild(row);
    return;
  }
  for (const r of refusals.slice().reverse()) {
    const row = el("tr");
    cell(row, new Date(r.time * 1000).toLocaleTimeString());
    cell(row, r.device);
    cell(row, String(r.round), "num");
    cell(row, r.reason);
    cell(row, r.detail, "detail");
    body.appendChild(row);
  }
}

// The server's accuracy and loss, the devices' federated accuracy, or both (a coordinator may have no test data).
function figures(last) {
  const parts = [];
  if (last.accuracy !== null) parts.push("accuracy " + last.accuracy.toFixed(3) + ", loss " + last.loss.toFixed(3));
  if (last.federated_accuracy !== null) parts.push("federated accuracy " + last.federated_accuracy.toFixed(3));
  const evaluated = parts.join(", ") || "not evaluated";
  // fleet.yaml privacy: the run's user-level epsilon after this round (docs/privacy.md).
  return last.epsilon != null ? evaluated + ", epsilon " + last.epsilon.toFixed(3) + " (delta " + last.delta + ")" : evaluated;
}

// A round with no accepted update, or fewer than the quorum of its selected devices (coordinator.run.metrics.is_failed).
function roundFailed(r, quorum) {
  return r.participants === 0 || r.participants < Math.ceil(quorum * r.selected);
}

function render(s) {
  document.title = "fedfleet " + s.fleet;
  document.getElementById("title").textContent = "fleet " + s.fleet + " — run " + s.run_id;
  const last = s.history[s.history.length - 1];
  const online = s.devices.filter((d) => d.online).length;
  const refused = s.devices.filter((d) => d.refused_because).length;
  const failed = s.history.filter((r) => roundFailed(r, s.quorum)).length;
  const unit = s.asynchronous ? "versions published" : "rounds done";
  document.getElementById("summary").textContent =
    s.history.length + "/" + s.rounds_planned + " " + unit + (failed ? " (" + failed + " FAILED)" : "") + ", " +
    online + "/" + s.devices.length + " devices online" +
    (refused ? ", " + refused + " refused" : "") +
    (last ? "; round " + last.round + (roundFailed(last, s.quorum) ? " FAILED: " : ": ") + figures(last) + ", " + last.participants + "/" + last.selected + " updates, " + last.stragglers + " stragglers, " +
      last.seconds.toFixed(1) + " s" : "");
  if (s.asynchronous) renderVersions(s.asynchronous, last);
  else renderOpenRound(s.open_round);
  renderFleet(s.devices);
  renderCharts(s.history);
  renderRefusals(s.refusals);
}

async function poll() {
  const status = document.getElementById("connection");
  try {
    const answer = await fetch("api/status?token=" + encodeURIComponent(TOKEN), { cache: "no-store" });
    if (!answer.ok) throw new Error("HTTP " + answer.status);
    const snapshot = await answer.json();
    if (!snapshot.waiting) render(snapshot);
    status.textContent = "updated " + new Date().toLocaleTimeString();
  } catch (error) {
    status.textContent = "no answer from the coordinator (" + error.message + "); the run may have ended";
  }
  setTimeout(poll, POLL_MS);
}

poll();
