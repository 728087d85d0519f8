// The Libra dashboard page's script (libra dashboard): reads the view from /api/events (one Server-Sent
// Event per poll; /api/status while the stream is down) and draws it. Text from the broker goes into the
// page as text, never as markup. Charts: uPlot (static/uPlot.iife.min.js, vendored; static/NOTICE).
"use strict";

const token = new URLSearchParams(location.search).get("token");
const api = (path) => path + (token ? "?token=" + encodeURIComponent(token) : "");
const COLORS = ["#2563eb", "#dc2626", "#059669", "#7c3aed", "#d97706", "#0891b2", "#db2777", "#4b5563"];
const charts = {};

function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined) continue;
    if (k === "class") e.className = v; else if (k === "style") e.style.cssText = v; else e.setAttribute(k, v);
  }
  for (const k of kids.flat()) {
    if (k === null || k === undefined || k === false) continue;
    e.append(k instanceof Node ? k : document.createTextNode(String(k)));
  }
  return e;
}

function fill(id, ...kids) { const n = document.getElementById(id); n.replaceChildren(...kids.flat()); return n; }
const fmt = (x, d = 1) => (x === null || x === undefined || Number.isNaN(x)) ? "-" : Number(x).toFixed(d);
const gib = (b) => (b / 2 ** 30).toFixed(1);
const hms = (t) => new Date(t * 1000).toLocaleTimeString([], { hour12: false });
const roleClass = (r) => (r || "idle").split(",")[0];

function table(head, rows, numeric) {
  const num = new Set(numeric || []);
  return [el("thead", {}, el("tr", {}, head.map((h, i) => el("th", { class: num.has(i) ? "num" : null }, h)))),
          el("tbody", {}, rows.map((r) => el("tr", {}, r.map((c, i) => el("td", { class: num.has(i) ? "num" : null }, c)))))];
}

// One uPlot per div id; rebuilt when its series change, else given the new data.
function chart(id, x, series, opts) {
  const node = document.getElementById(id);
  const names = series.map((s) => s.label).join("|");
  const width = Math.max(280, node.clientWidth || node.parentNode.clientWidth - 24);
  const data = [x, ...series.map((s) => s.values)];
  const have = charts[id];
  if (have && have.names === names && have.width === width) { have.u.setData(data); return; }
  if (have) have.u.destroy();
  const u = new uPlot({
    width, height: (opts && opts.height) || 150,
    scales: { x: { time: !(opts && opts.steps) } }, legend: { live: false },
    axes: [{ label: opts && opts.steps ? "step" : null }, { size: 50 }],
    series: [{ label: opts && opts.steps ? "step" : "time" },
             ...series.map((s, i) => ({ label: s.label, stroke: s.color || COLORS[i % COLORS.length], width: 1.5,
                                        spanGaps: true, points: { show: !!(opts && opts.steps) } }))],
  }, data, node);
  charts[id] = { u, names, width };
}

function renderHeader(v) {
  fill("broker", v.broker);
  const conn = document.getElementById("conn");
  conn.textContent = v.error ? "broker unreachable" : (v.polls ? "live" : "waiting for the broker");
  conn.className = "pill " + (v.error ? "bad" : (v.polls ? "ok" : ""));
  conn.title = v.error || "";
  fill("clock", v.poll_t ? "last poll " + hms(v.poll_t) : "");
  const s = v.snapshot.stats || {};
  fill("counters", ["submitted", "completed", "failed", "inflight", "clients"]
    .filter((k) => k in s).map((k) => `${k} ${s[k]}`).join(" · "));
}

function gpuCell(g) {
  if (!g || !g.memory_total_bytes) return "-";
  const pct = 100 * g.memory_used_bytes / g.memory_total_bytes;
  return el("span", {}, el("span", { class: "bar" }, el("span", { style: `width:${pct.toFixed(0)}%` })),
            `${gib(g.memory_used_bytes)}/${gib(g.memory_total_bytes)} GiB, ${fmt(g.utilization_pct, 0)}%`);
}

function renderActors(v) {
  const actors = v.snapshot.actors || [];
  fill("actors-count", `(${actors.length})`);
  const hosts = {};
  for (const a of actors) (hosts[a.host] = hosts[a.host] || []).push(a);
  const blocks = Object.keys(hosts).sort().map((h) => el("div", { class: "host" }, el("h3", {}, `host ${h}`),
    el("table", {}, table(["slot", "actor", "role", "state", "work", "GPU memory, util", "done"],
      hosts[h].sort((a, b) => String(a.slot).localeCompare(String(b.slot), undefined, { numeric: true })).map((a) => {
        const role = v.roles[a.id] || "idle";
        const work = a.load ? `${a.load}/${a.capacity} ${(a.kinds || []).join(",")}` : `0/${a.capacity}`;
        return [a.slot, a.id, el("span", { class: "role " + roleClass(role), "data-actor": a.id }, role), a.state,
                work, gpuCell(a.gpu), String(a.completed)];
      }), [6]))));
  fill("actors", blocks.length ? blocks : el("p", { class: "muted" }, "no actors connected"));
}

function renderTimeline(v) {
  const note = v.audit_visible ? "" : "The broker's audit trail is not visible to this dashboard's key (an operator's " +
    "key sees it); the jobs' decision records are shown instead.";
  fill("timeline-note", note);
  const labels = { directive: "role switch", role_switch: "role switch", plan: "re-plan", decision: "planner",
                   buckets: "buckets", job_start: "job start", job_cancel: "job cancel" };
  const items = v.timeline.slice().reverse().map((e) => {
    const gain = e.gain_s === null || e.gain_s === undefined ? null :
      el("span", { class: "gain" }, `predicted gain ${fmt(e.gain_s, 2)} s/step` +
        (e.gain_ratio === null ? "" : ` (${fmt(100 * e.gain_ratio, 1)} %)`));
    const by = e.by === "unchecked" ? "a peer without CURVE" : e.by;
    const detail = [by ? `by ${by}` : null, e.reason && e.what !== "decision" ? e.reason : null]
      .filter(Boolean).join(" · ");
    return el("li", { class: "tl-entry", "data-what": e.what, "data-switch": e.switch ? "1" : "0",
                      "data-actor": e.actor || null },
      el("time", {}, hms(e.t)), el("span", { class: "tl-what" }, labels[e.what] || e.what),
      el("span", { class: "tl-text" }, e.text), el("span", { class: "tl-detail" }, detail, gain ? " · " : "", gain));
  });
  fill("timeline", items.length ? items : el("li", { class: "muted" }, "no role switch or re-plan yet"));
}

function renderJobs(v) {
  const names = Object.keys(v.jobs).sort();
  if (!names.length) return;
  const box = document.getElementById("jobs");
  if (!box.classList.contains("jobs") || box.dataset.names !== names.join("|")) {
    box.className = "jobs"; box.dataset.names = names.join("|");
    box.replaceChildren(...names.map((n, i) => el("div", { class: "job", "data-job": n },
      el("h3", {}, `job ${n} `, el("span", { class: "muted", id: `job-state-${i}` })),
      el("div", { class: "pair" }, el("div", { class: "chart", id: `job-reward-${i}` }),
         el("div", { class: "chart", id: `job-tput-${i}` })))));
    for (const k of Object.keys(charts)) if (k.startsWith("job-")) { charts[k].u.destroy(); delete charts[k]; }
  }
  names.forEach((n, i) => {
    const j = v.jobs[n], s = j.state || {};
    fill(`job-state-${i}`, `${s.state || "?"}, step ${s.steps_done ?? "?"}/${s.steps ?? "?"}, weights v${s.version ?? "?"}, ` +
      `${s.episodes_running ?? 0} episodes running` + (s.error ? `, error: ${s.error}` : ""));
    chart(`job-reward-${i}`, j.step, [{ label: "reward (mean)", values: j.reward_mean },
                                      { label: "accuracy", values: j.accuracy }], { steps: true });
    chart(`job-tput-${i}`, j.step, [{ label: "generated tokens/s (step)", values: j.tokens_per_s },
                                    { label: "tokens/s (window)", values: j.window_tokens_per_s }], { steps: true });
  });
}

function renderSeries(v) {
  const t = v.series.t;
  chart("roles-chart", t, ["generate", "train", "action", "episode"].map((k, i) =>
    ({ label: k === "generate" ? "rollout" : k, values: v.series["actors_" + k] || [],
       color: ["#2563eb", "#dc2626", "#059669", "#7c3aed"][i] })), { height: 130 });
  chart("rate-chart", t, [{ label: "completed/s", values: v.series.completed_per_s || [] },
                          { label: "submitted/s", values: v.series.submitted_per_s || [] }], { height: 130 });
  const qs = Object.keys(v.queues);
  chart("queue-chart", t, qs.map((k) => ({ label: k, values: v.queues[k] })));
  const depths = v.snapshot.queues || {};
  fill("queues", table(["queue (kind:name)", "depth"], Object.keys(depths).sort().map((k) => [k, String(depths[k])]), [1]));
  chart("migration-chart", t, [{ label: "migrations/s", values: v.series.migrations_per_s || [] }], { height: 110 });
  chart("cores-chart", t, [{ label: "cores free", values: v.series.cores_free || [] },
                           { label: "cores total", values: v.series.cores_total || [] },
                           { label: "actions running", values: v.series.actions_running || [] }], { height: 120 });
}

function renderRouter(v) {
  fill("buckets", table(["bucket", "turns queued", "rollout actors", "load"],
    v.buckets.map((b) => [b.bucket, String(b.queued), b.actors.join(", ") || "-", `${b.load}/${b.capacity}`]), [1]));
  const r = v.snapshot.stats.router;
  fill("router-info", r ? Object.entries(r).map(([k, x]) => `${k} ${typeof x === "number" ? +x.toFixed(3) : x}`)
    .join(" · ") : "no rollout router state");
}

function renderActions(v) {
  const a = v.snapshot.stats.actions;
  if (!a) { fill("actions-info", "first come, first served (no action scheduler)"); fill("cores"); return; }
  const services = Object.entries(a.services || {}).map(([k, x]) => `${k}: ${JSON.stringify(x)}`).join("; ");
  fill("actions-info", `${a.scheduler}: ${a.running} running` + (services ? ` · services ${services}` : " · no GPU service resident"));
  fill("cores", table(["actor", "cores free", "cores"], Object.entries(a.cores || {}).sort()
    .map(([id, c]) => [id, String(c.free ?? "-"), String(c.cores ?? "-")]), [1, 2]));
}

function renderPlanner(v) {
  const p = v.snapshot.stats.planner;
  if (!p) return;
  const plan = p.plan ? `train ${p.plan.n_train} of ${p.plan.n_gpus} GPUs, rollout TPs ${JSON.stringify(p.plan.rollout_tps)}`
    : "no plan deployed";
  const last = (p.decisions || []).slice(-1)[0];
  fill("planner", el("table", {}, table(["", ""], [
    ["allocation", `${p.allocation} (${p.hardware}/${p.model}, a round every ${p.interval_s} s)`],
    ["rounds / plans applied", `${p.rounds} / ${p.plans_applied}`], ["deployed", plan],
    ["last decision", last ? `round ${last.round}: ${last.reason}` : "-"],
    ["measured", p.measured_costs ? `rollout ${fmt(p.measured_costs.rollout_tok_s_per_instance, 0)} tok/s/instance, ` +
      `train ${fmt(p.measured_costs.train_tok_s_per_rank, 0)} tok/s/rank` : "-"]])));
}

function render(v) {
  window.libraView = v;  // for a look from the browser's console
  for (const f of [renderHeader, renderActors, renderTimeline, renderJobs, renderSeries, renderRouter, renderActions,
                   renderPlanner]) {
    try { f(v); } catch (err) { console.error(f.name, err); }
  }
  document.body.dataset.polls = String(v.polls);
}

let fallback = null;
async function pollOnce() {
  try { const r = await fetch(api("api/status")); if (r.ok) render(await r.json()); } catch (err) { /* next time */ }
}
function connect() {
  const es = new EventSource(api("api/events"));
  es.onmessage = (e) => { if (fallback) { clearInterval(fallback); fallback = null; } render(JSON.parse(e.data)); };
  es.onerror = () => {
    const conn = document.getElementById("conn");
    conn.textContent = "reconnecting"; conn.className = "pill bad";
    if (!fallback) fallback = setInterval(pollOnce, 2000);
  };
}
connect();
