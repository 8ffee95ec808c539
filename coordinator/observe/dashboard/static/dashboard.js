// coord's dashboard: draws the daemon's dashboard document (coordinator/dashboard/document.py),
// sent over server-sent events whenever it changes. Read-only. Every string from the daemon is
// set as text, never as HTML (a node's name, an event's message or an error may hold anything).
"use strict";

const params = new URLSearchParams(location.search);
const tokenQuery = params.get("token") ? "?token=" + encodeURIComponent(params.get("token")) : "";
const SVG = "http://www.w3.org/2000/svg";
const ATTEMPT_COLOURS = ["#3867d6", "#e67e22", "#16a085", "#8e44ad", "#c0392b", "#2c3e50"];
let selectedRun = null;
let charts = {};
let chartShape = "";

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v; else node.setAttribute(k, v);
  }
  for (const child of children) {
    node.append(child instanceof Node ? child : document.createTextNode(child == null ? "" : String(child)));
  }
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text != null) node.textContent = text;
  return node;
}

function bytes(n) {
  if (n == null) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i >= 3 ? n.toFixed(1) : Math.round(n)) + " " + units[i];
}

function age(seconds) {
  if (seconds == null) return "-";
  if (seconds < 90) return Math.round(seconds) + " s";
  if (seconds < 5400) return Math.round(seconds / 60) + " min";
  return (seconds / 3600).toFixed(1) + " h";
}

// A value JSON cannot hold (a diverged run's NaN loss) comes as the word "nan", "inf" or "-inf": shown as it is.
function number(x, digits) { return x == null ? "-" : typeof x === "string" ? x : Number(x).toFixed(digits); }

function fillBody(table, rows) {
  const body = document.querySelector(table + " tbody");
  body.replaceChildren(...rows);
}

function renderNodes(doc) {
  fillBody("#nodes", doc.nodes.map(n => el("tr", {},
    el("td", {}, n.name),
    n.needs_reboot ? el("td", { class: "state-down", title: n.needs_reboot }, n.state + ", needs reboot")
      : el("td", { class: "state-" + n.state, title: n.reason || "" }, n.state),
    el("td", {}, n.chip || "-"),
    el("td", {}, (n.memory_used_bytes != null ? bytes(n.memory_used_bytes) + " of " : "") + bytes(n.memory_bytes)),
    el("td", {}, n.gpu_utilization == null ? "-" : Math.round(n.gpu_utilization) + "%"),
    el("td", {}, n.power_watts == null ? "-" : n.power_watts.toFixed(1) + " W"), el("td", {}, n.os || "-"),
    el("td", {}, n.python || "-"), el("td", {}, n.mlx || "-"), el("td", {}, n.mlx_lm || "-"))));
}

function gbits(bps) {
  return bps >= 1e9 ? (bps / 1e9).toFixed(1) + " Gb/s" : (bps / 1e6).toFixed(0) + " Mb/s";
}

function renderTopology(doc, job) {
  const box = document.getElementById("topology");
  const nodes = doc.nodes;
  const cx = 210, cy = 145, r = nodes.length > 1 ? 100 : 0;
  const at = {};
  nodes.forEach((n, i) => {
    const a = -Math.PI / 2 + (2 * Math.PI * i) / Math.max(1, nodes.length);
    at[n.name] = [cx + r * Math.cos(a), cy + r * Math.sin(a)];
  });
  const parts = [];
  const backend = job && job.backend;
  const running = job && job.state === "running" ? new Set(job.nodes) : new Set();
  if (backend) {
    let links = backend.links || [];
    const ring = backend.ring || (backend.backend === "ring" ? job.nodes : null);
    if (!links.length && ring && ring.length > 1) {  // a ring whose links were not measured (one machine)
      const pairs = ring.length === 2 ? [[ring[0], ring[1]]] : ring.map((a, i) => [a, ring[(i + 1) % ring.length]]);
      links = pairs.map(([a, b]) => ({ a, b, kind: backend.transport }));
    }
    for (const link of links) {
      if (!at[link.a] || !at[link.b]) continue;
      const [x1, y1] = at[link.a], [x2, y2] = at[link.b];
      parts.push(svg("line", { x1, y1, x2, y2, stroke: "#9aa5b1", "stroke-width": 2 }));
      const label = [link.kind, link.speed_gbps ? link.speed_gbps + " Gb/s" : null].filter(Boolean).join(" ");
      // A level link's label goes under the line, clear of the two boxes it joins.
      const below = Math.abs(y1 - y2) < 10 ? 34 : -4;
      if (label) parts.push(svg("text", { x: (x1 + x2) / 2, y: (y1 + y2) / 2 + below, "text-anchor": "middle", fill: "#6b7580" }, label));
    }
    parts.push(svg("text", { x: 6, y: 292, fill: "#6b7580" },
      `${job.name}: ${backend.backend || "?"}${backend.transport ? " over " + backend.transport : ""}`));
  }
  // Each link's last figure from coord doctor against its baseline, coloured by its verdict.
  const verdictColours = { ok: "#1f9d55", slow: "#d69e2e", down: "#d64545", "wrong-route": "#d64545" };
  for (const link of doc.links || []) {
    if (!at[link.a] || !at[link.b]) continue;
    const [x1, y1] = at[link.a], [x2, y2] = at[link.b];
    const colour = verdictColours[link.verdict] || "#9aa5b1";
    parts.push(svg("line", { x1, y1, x2, y2, stroke: colour, "stroke-width": 2, "stroke-dasharray": "4 3" }));
    const rates = [link.bits_per_second, link.reverse_bits_per_second].filter((v) => v != null);
    const now = rates.length ? gbits(Math.min(...rates)) : "-";
    const base = link.baseline_bits_per_second != null ? " of " + gbits(link.baseline_bits_per_second) : "";
    parts.push(svg("text", { x: (x1 + x2) / 2, y: (y1 + y2) / 2 + 16, "text-anchor": "middle", fill: colour },
      `${link.verdict} ${now}${base}`));
  }
  const colours = { up: "#1f9d55", down: "#d64545" };
  for (const n of nodes) {
    const [x, y] = at[n.name];
    const g = svg("g", { class: "node" });
    g.append(svg("rect", { x: x - 72, y: y - 24, width: 144, height: 48, rx: 6, fill: "#fff",
      stroke: colours[n.state] || "#d69e2e", "stroke-width": running.has(n.name) ? 3 : 1.5 }));
    g.append(svg("text", { x, y: y - 8, "text-anchor": "middle", "font-weight": 600 }, n.name));
    g.append(svg("text", { x, y: y + 6, "text-anchor": "middle", fill: "#6b7580" }, (n.chip || "").slice(0, 20)));
    g.append(svg("text", { x, y: y + 19, "text-anchor": "middle", fill: "#6b7580" },
      `${bytes(n.memory_bytes)} · mlx ${n.mlx || "?"}`));
    parts.push(g);
  }
  box.replaceChildren(...parts);
}

function stepCell(job) {
  const text = job.total_steps ? `${job.step}/${job.total_steps}` : String(job.step);
  const cell = el("td", {}, text);
  if (job.total_steps) {
    const bar = el("span", { class: "progress" }, el("span", {}));
    bar.firstChild.style.width = Math.min(100, (100 * job.step) / job.total_steps) + "%";
    cell.append(bar);
  }
  return cell;
}

function renderJobs(doc) {
  fillBody("#jobs", doc.jobs.map(job => {
    const queued = job.state === "queued" && job.queue_position ? `queued #${job.queue_position}` : job.state;
    // A run that goes on while coord waits something out (the head cut off from its nodes) says so by its state.
    const state = job.note ? queued + ", " + job.note.split(":")[0].replace("_", " ") : queued;
    const row = el("tr", { class: "job" + (job.run_id === selectedRun ? " selected" : ""),
                           title: job.note || job.error || job.warning || job.run_id },
      el("td", {}, job.name), el("td", { class: "state-" + job.state }, state), stepCell(job),
      el("td", {}, job.eta_s == null ? "-" : age(job.eta_s)), el("td", {}, number(job.loss, 4)),
      el("td", {}, job.tokens_per_second == null ? "-" : Math.round(job.tokens_per_second)),
      el("td", {}, `${job.restarts}/${job.max_restarts}`), el("td", {}, (job.nodes || []).join(", ")));
    row.addEventListener("click", () => { selectedRun = job.run_id; render(lastDoc); });
    return row;
  }));
}

// A run's history (coordinator/metrics/history.py: columnar train points and the attempts) as
// uPlot data: x = step, one series per attempt (a resumed attempt continues the curve in another
// colour). The store already dropped the points a failed attempt made past the step the next
// one resumed from.
function seriesOf(history, field) {
  const train = (history && history.train) || {};
  const steps = train.step || [], attemptOf = train.attempt || [], values = train[field] || [];
  // A NaN or infinite value (sent as a word) is a gap in the line; the job's row says "nan" beside it.
  const rows = steps.map((step, i) => ({ step, attempt: attemptOf[i], value: values[i] }))
    .filter(r => r.value != null && typeof r.value === "number");
  const attempts = [...new Set(rows.map(r => r.attempt))].sort((a, b) => a - b);
  const xs = [...new Set(rows.map(r => r.step))].sort((a, b) => a - b);
  const index = new Map(xs.map((s, i) => [s, i]));
  const data = [xs];
  for (const attempt of attempts) {
    const ys = new Array(xs.length).fill(null);
    for (const r of rows) if (r.attempt === attempt) ys[index.get(r.step)] = r.value;
    data.push(ys);
  }
  return { data, attempts };
}

// The steps restarts resumed from: every attempt after the first starts at one.
function restartsOf(history) {
  return ((history && history.attempts) || []).filter(a => a.attempt > 0).map(a => ({ step: a.start_step, attempt: a.attempt }));
}

function restartLines(restarts) {
  return {
    hooks: {
      draw: [u => {
        const ctx = u.ctx;
        ctx.save();
        ctx.strokeStyle = "#d64545";
        ctx.setLineDash([4, 4]);
        for (const r of restarts) {
          const x = u.valToPos(r.step, "x", true);
          if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) continue;
          ctx.beginPath(); ctx.moveTo(x, u.bbox.top); ctx.lineTo(x, u.bbox.top + u.bbox.height); ctx.stroke();
        }
        ctx.restore();
      }],
    },
  };
}

function drawChart(id, title, history, field) {
  const { data, attempts } = seriesOf(history, field);
  const target = document.getElementById(id);
  target.hidden = data[0].length === 0;  // a script that reports no tokens/s has no such chart
  if (target.hidden) {
    if (charts[id]) { charts[id].plot.destroy(); delete charts[id]; }
    return 0;
  }
  const width = Math.max(300, target.clientWidth || 440);
  const restarts = restartsOf(history);
  const shape = id + ":" + attempts.join(",") + ":" + width + ":" + restarts.map(r => r.step).join(",");
  if (charts[id] && charts[id].shape === shape) {
    charts[id].plot.setData(data);
    return data[0].length;
  }
  if (charts[id]) charts[id].plot.destroy();
  const opts = {
    title, width, height: 180, plugins: [restartLines(restarts)],
    scales: { x: { time: false } },
    series: [{ label: "step" }, ...attempts.map((a, i) => ({
      label: "attempt " + a, stroke: ATTEMPT_COLOURS[i % ATTEMPT_COLOURS.length], width: 2, spanGaps: false }))],
  };
  charts[id] = { shape, plot: new uPlot(opts, data, target) };
  return data[0].length;
}

// A finished run's curves are not in every document: fetched once when the run is shown.
const finishedHistory = new Map();

function historyOf(job) {
  if (!job) return null;
  if (job.history) return job.history;
  if (!finishedHistory.has(job.run_id)) {
    finishedHistory.set(job.run_id, null);
    fetch("api/history?run=" + encodeURIComponent(job.run_id) + tokenQuery.replace("?", "&"))
      .then(answer => answer.ok ? answer.json() : null)
      .then(doc => {
        const run = doc && doc.runs && doc.runs.find(r => r.run_id === job.run_id);
        if (run) { finishedHistory.set(job.run_id, run); if (lastDoc) render(lastDoc); }
      })
      .catch(() => finishedHistory.delete(job.run_id));
  }
  return finishedHistory.get(job.run_id);
}

function renderCurves(job) {
  document.getElementById("curves-job").textContent = job ? `${job.name} (${job.run_id})` : "";
  const history = historyOf(job);
  const n = drawChart("loss-chart", "loss", history, "loss") + drawChart("tps-chart", "tokens/s", history, "tokens_per_second");
  document.getElementById("curves-empty").hidden = n > 0;
}

function renderMemory(doc, job) {
  const box = document.getElementById("rank-memory");
  const memory = (job && job.rank_memory_bytes) || {};
  const ranks = Object.keys(memory).sort((a, b) => a - b);
  const top = Math.max(1, ...ranks.map(r => memory[r]));
  box.replaceChildren(...(ranks.length ? ranks.map(r => {
    const fill = el("span", { class: "fill" });
    fill.style.width = Math.round((200 * memory[r]) / top) + "px";
    const node = job.nodes ? job.nodes[Number(r)] : null;
    return el("div", { class: "bar" }, el("span", {}, `rank ${r}${node ? " on " + node : ""}`), fill, el("span", {}, bytes(memory[r])));
  }) : [el("p", { class: "muted" }, "no rank running")]));
}

function heatColour(score) {
  // 1 (the step's median) and below: pale; 1.5 (a straggler) and above: deep red.
  const t = Math.max(0, Math.min(1, (score - 1) / 0.75));
  return `rgb(${Math.round(245 - 31 * t)}, ${Math.round(247 - 178 * t)}, ${Math.round(250 - 181 * t)})`;
}

function renderHeatmap(job) {
  const box = document.getElementById("heatmap");
  const heat = (job && job.compute_heat) || [];
  const ranks = heat.length ? heat[heat.length - 1][1].length : 0;
  const cell = 8, left = 56, rowH = 14;
  box.setAttribute("viewBox", `0 0 ${left + Math.max(1, heat.length) * cell} ${Math.max(1, ranks) * rowH + 14}`);
  const parts = [];
  for (let r = 0; r < ranks; r++) {
    const node = job.nodes ? job.nodes[r] : null;
    parts.push(svg("text", { x: 0, y: r * rowH + 10 }, `rank ${r}${node ? " " + node : ""}`.slice(0, 12)));
  }
  heat.forEach(([step, values], c) => {
    const known = values.filter(v => v != null).sort((a, b) => a - b);
    const median = known.length ? known[Math.floor((known.length - 1) / 2)] : null;
    values.forEach((v, r) => {
      if (v == null || !median) return;
      const rect = svg("rect", { x: left + c * cell, y: r * rowH, width: cell - 1, height: rowH - 2, fill: heatColour(v / median) });
      rect.append(svg("title", {}, `step ${step}, rank ${r}: ${(v * 1000).toFixed(1)} ms (${(v / median).toFixed(2)}x)`));
      parts.push(rect);
    });
  });
  if (heat.length) parts.push(svg("text", { x: left, y: ranks * rowH + 12 }, `steps ${heat[0][0]} to ${heat[heat.length - 1][0]}`));
  box.replaceChildren(...parts);
  const named = (job && job.stragglers) || [];
  document.getElementById("heat-stragglers").replaceChildren(...(named.length ? named.map(s =>
    el("div", { class: "state-down" }, `straggler: rank ${s.rank} on ${s.node}, ${Number(s.score).toFixed(1)}x; ${s.cause}`))
    : [el("span", { class: "muted" }, heat.length ? "no straggler" : "no compute times yet (coord's trainer, or coord_script.report(step, compute_seconds=...) on every rank)")]));
}

function renderCheckpoints(job) {
  const rows = (job && job.checkpoints) || [];
  fillBody("#checkpoints", rows.map(c => el("tr", {},
    el("td", {}, c.step), el("td", {}, age(c.age_s)), el("td", { class: c.valid ? "state-up" : "state-down" }, c.valid ? "valid" : "invalid"),
    el("td", {}, c.copies.map(copy => `${copy.node} (${copy.role}${copy.valid ? "" : ", invalid"})`).join(", ")))));
}

// With a checkpoint store (coordinator/jobs/durability.py): how far the run's checkpoints are off the
// cluster, as coord status says it; nothing for a run whose checkpoints stay on the cluster.
function renderStore(job) {
  const durable = job && job.durability;
  const box = document.getElementById("checkpoint-store");
  if (!durable) { box.replaceChildren(); return; }
  const parts = [(durable.durable_step == null ? "nothing durable yet" : `durable up to step ${durable.durable_step}`)
    + " in " + durable.store, `lag ${durable.lag_steps} steps (${age(durable.lag_seconds)})`];
  if (durable.bytes_per_s != null) parts.push(bytes(durable.bytes_per_s) + "/s to the store");
  box.replaceChildren(el("div", {}, parts.join(", ")),
    ...(durable.error ? [el("div", { class: "state-down" }, "last upload failed: " + durable.error)] : []));
}

function renderEvents(doc) {
  const items = doc.events.slice().reverse().map(e => el("li", {},
    new Date(e.ts * 1000).toLocaleTimeString() + " ", el("span", { class: "kind" }, e.kind), " " + e.message));
  document.getElementById("events").replaceChildren(...items);
}

let lastDoc = null;

function render(doc) {
  lastDoc = doc;
  document.getElementById("cluster").textContent = doc.cluster;
  document.getElementById("updated").textContent = "updated " + new Date(doc.time * 1000).toLocaleTimeString();
  if (!doc.jobs.some(j => j.run_id === selectedRun)) {
    const running = doc.jobs.find(j => j.state === "running") || doc.jobs[0];
    selectedRun = running ? running.run_id : null;
  }
  const job = doc.jobs.find(j => j.run_id === selectedRun) || null;
  renderNodes(doc);
  renderTopology(doc, job);
  renderJobs(doc);
  renderCurves(job);
  renderMemory(doc, job);
  renderHeatmap(job);
  renderCheckpoints(job);
  renderStore(job);
  renderEvents(doc);
  document.body.dataset.rendered = String(Number(document.body.dataset.rendered || 0) + 1);
}

function setConnection(text, live) {
  const pill = document.getElementById("connection");
  pill.textContent = text;
  pill.className = "pill" + (live ? " live" : "");
}

function connect() {
  const stream = new EventSource("api/stream" + tokenQuery);
  stream.onopen = () => setConnection("live", true);
  stream.onmessage = e => render(JSON.parse(e.data));
  stream.onerror = () => setConnection("reconnecting…", false);  // EventSource retries by itself
}

// The first document is fetched before the page counts as loaded (a synchronous request, once):
// the page is whole at its load event, for a person and for a headless browser taking a
// picture of it alike. Every later document comes over the event stream.
function firstDocument() {
  const request = new XMLHttpRequest();
  try {
    request.open("GET", "api/dashboard" + tokenQuery, false);
    request.send();
  } catch (e) {
    setConnection("cannot reach coordd", false);
    return;
  }
  if (request.status === 200) render(JSON.parse(request.responseText));
  else setConnection(request.status === 401 ? "token needed: open this page with ?token=..." : "error " + request.status, false);
}

firstDocument();
connect();
