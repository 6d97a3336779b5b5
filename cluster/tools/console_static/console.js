// RayMQ console: each page is drawn from the JSON of /api/<page>; actions POST with the
// access token `raymq console` printed (asked once, kept for this browser tab).
"use strict";

const TOKEN_KEY = "raymq-console-token";
let session = { read_only: true, token_header: "X-RayMQ-Token" };
let timer = null;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "onclick") node.addEventListener("click", v);
    else if (v !== undefined && v !== null) node.setAttribute(k, v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined) continue;
    node.appendChild(typeof c === "string" || typeof c === "number" ?
      document.createTextNode(String(c)) : c);
  }
  return node;
}

function notice(text, isError) {
  const n = document.getElementById("notice");
  n.textContent = text || "";
  n.className = isError ? "error" : "";
}

async function api(path) {
  const r = await fetch("/api/" + path);
  const body = await r.json();
  if (!r.ok) throw new Error(body.error || r.statusText);
  return body;
}

async function act(path, payload) {
  let token = sessionStorage.getItem(TOKEN_KEY);
  if (!token) {
    token = window.prompt("Access token (printed by `raymq console` when it started):");
    if (!token) return null;
    sessionStorage.setItem(TOKEN_KEY, token);
  }
  const r = await fetch("/api/" + path, {
    method: "POST",
    headers: { [session.token_header]: token, "Content-Type": "application/json" },
    body: payload === undefined ? undefined : JSON.stringify(payload),
  });
  const body = await r.json();
  if (r.status === 401 || r.status === 403) sessionStorage.removeItem(TOKEN_KEY);
  if (!r.ok) { notice(body.error || r.statusText, true); return null; }
  notice(path + ": " + JSON.stringify(body.result !== undefined ? body.result : body));
  route();
  return body;
}

function actionButton(label, path, payload, confirmText) {
  if (session.read_only) return null;
  const id = payload && payload.ids ? path + "#" + payload.ids.join(",") : path;
  return el("button", { "data-action": id, onclick: () => {
    if (!confirmText || window.confirm(confirmText)) act(path, payload);
  } }, label);
}

// "1h", "30m", "2d", "45s", "500ms" (or plain ms) -> ms; null when it is none of them
function durationMs(text) {
  const m = /^\s*(\d+)\s*(ms|s|m|h|d)?\s*$/.exec(text || "");
  if (!m) return null;
  return Number(m[1]) * { ms: 1, s: 1000, m: 60000, h: 3600000, d: 86400000 }[m[2] || "ms"];
}

// A group's reset-offsets action (as `raymq group reset-offsets`): a preview (dry run)
// and the reset itself, refused by the cluster while the group has live members.
function resetForm(group) {
  if (session.read_only) return null;
  const path = `groups/${encodeURIComponent(group)}/reset-offsets`;
  const topic = el("input", { name: "reset-topic", placeholder: "topic" });
  const to = el("select", { name: "reset-to" },
    ["earliest", "latest", "datetime", "duration", "offset"].map(v => el("option", { value: v }, v)));
  const value = el("input", { name: "reset-value",
                              placeholder: "2026-11-27T10:00Z, 1h or an offset" });
  const payload = dry => {
    const text = value.value.trim();
    const v = { datetime: Date.parse(text), duration: durationMs(text),
                offset: /^\d+$/.test(text) ? Number(text) : NaN }[to.value];
    if (v !== undefined && (v === null || Number.isNaN(v))) {
      notice(`reset to ${to.value} needs a value (a time, a duration such as 1h, an offset)`, true);
      return null;
    }
    return { topic: topic.value.trim(), to: to.value, value: v === undefined ? null : v,
             dry_run: dry };
  };
  const run = (dry, sure) => { const p = payload(dry); if (p && sure(p)) act(path, p); };
  return el("div", { class: "reset" }, "Reset offsets on ", topic, " to ", to, value,
    el("button", { "data-action": path + "#dry-run", onclick: () => run(true, () => true) },
       "Preview"),
    el("button", { "data-action": path, onclick: () => run(false, p => window.confirm(
      `Move group ${group}'s offsets on ${p.topic} to ${p.to}?`)) }, "Reset"));
}

function table(columns, rows, empty) {
  if (!rows.length) return el("p", { class: "empty" }, empty || "none");
  return el("table", {},
    el("tr", {}, columns.map(c => el("th", {}, c[0]))),
    rows.map(r => el("tr", {}, columns.map(c => {
      const v = c[1](r);
      return el("td", { class: typeof v === "number" ? "num" : null }, v);
    }))));
}

function fmtBytes(n) {
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : String(n)) + " " + u[i];
}

function age(ms) { return ms === null || ms === undefined ? "-" : (ms / 1000).toFixed(1) + " s"; }
function when(ms) { return ms ? new Date(ms).toISOString().replace("T", " ").slice(0, 23) : "-"; }
function short(id) { return id ? String(id).slice(0, 12) : "-"; }

const COLORS = ["#3465a4", "#cc0000", "#4e9a06", "#f57900", "#75507b", "#c4a000"];

// A time-series chart of series {t: [s], name: [values]}; data-points counts the points.
function lineChart(title, series, names) {
  const div = el("div", { class: "chart", "data-chart": title });
  const data = [series.t || []].concat(names.map(n => series[n] || []));
  div.setAttribute("data-points", String((series.t || []).length * names.length));
  const opts = {
    title, width: 640, height: 220,
    series: [{}].concat(names.map((n, i) => ({ label: n, stroke: COLORS[i % COLORS.length],
                                               width: 2 }))),
  };
  requestAnimationFrame(() => new uPlot(opts, data, div));
  return div;
}

// A bar chart of [{label, value}] (uPlot's bars path over a category axis).
function barChart(title, items) {
  const div = el("div", { class: "chart", "data-chart": title });
  div.setAttribute("data-points", String(items.length));
  const xs = items.map((_, i) => i);
  const opts = {
    title, width: 640, height: 220,
    scales: { x: { time: false, range: [-0.5, items.length - 0.5] } },
    axes: [{ values: (_u, ticks) => ticks.map(t => (items[t] || {}).label || "") }, {}],
    series: [{}, { label: "count", stroke: COLORS[0], fill: COLORS[0] + "88",
                   paths: uPlot.paths.bars({ size: [0.6, 80] }) }],
  };
  requestAnimationFrame(() => new uPlot(opts, [xs, items.map(x => x.value)], div));
  return div;
}

// Replicated groups: leader, epoch, in-sync set, who could be elected now and why the
// others could not (the controller's candidacy), each replica's role, liveness and lag.
function replicaTable(title, groups) {
  if (!groups.length) return [];
  return [el("h2", {}, title), table([
    ["group", g => g.group], ["leader", g => `${g.leader || "-"} (node ${short(g.leader_node)})`],
    ["epoch", g => g.epoch], ["in sync", g => g.in_sync_replicas.join(", ") || "-"],
    ["electable now", g => g.electable.join(", ") || "none"],
    ["cannot lead", g => Object.entries(g.not_electable).map(([r, why]) => `${r}: ${why}`)
      .join("; ") || "-"],
    ["replicas", g => g.replicas.map(x => `${x.name} ${short(x.node)} ${x.role}` +
      `${x.alive ? "" : " DEAD"} lag ${x.lag_bytes === null ? "?" : x.lag_bytes}`).join("; ")],
  ], groups)];
}

// ------------------------------------------------------------------------ pages
const PAGES = {
  async overview() {
    const d = await api("overview");
    return [
      el("h2", {}, "Shards"),
      table([["shard", s => s.shard], ["node", s => short(s.node)],
             ["alive", s => s.alive ? "yes" : "NO: " + s.error],
             ["log", s => fmtBytes(s.log_bytes)],
             ["disk used", s => s.disk_bytes === null ? "-" : fmtBytes(s.disk_bytes)],
             ["oldest segment kept by", s => s.oldest_held_by ?
               `${s.oldest_held_by} (${fmtBytes(s.oldest_held_bytes)})` : "-"],
             ["in msgs/s", s => s.in_per_s],
             ["out msgs/s", s => s.out_per_s]], d.shards),
      ...replicaTable("Replicas", d.replicas),
      ...replicaTable("Coordinator replicas", d.coordinator_replicas || []),
      lineChart("messages per second (in, out)", d.throughput, ["in", "out"]),
      el("h2", {}, "Actors"),
      table([["name", a => a.name], ["kind", a => a.kind],
             ["alive", a => a.alive ? "yes" : "NO: " + a.error]], d.actors),
      el("h2", {}, "Ray nodes"),
      table([["node", n => short(n.node)], ["address", n => n.address],
             ["head", n => n.head ? "yes" : ""], ["alive", n => n.alive ? "yes" : "NO"],
             ["CPU", n => n.resources.CPU || 0]], d.nodes),
    ];
  },

  async topics() {
    const d = await api("topics");
    const out = [];
    const user = Object.entries(d.topics).filter(([, t]) => !t.system);
    const names = Object.keys(d.throughput).filter(k => k !== "t");
    out.push(lineChart("messages in per second, by topic", d.throughput, names));
    for (const [name, t] of user.concat(Object.entries(d.topics).filter(([, t]) => t.system))) {
      out.push(el("h2", {}, name + (t.system ? " (system)" : "")));
      if (t.retention_ms)
        out.push(el("p", {}, `retention ${(t.retention_ms / 3600000).toFixed(1)} h, ` +
                    (t.retention_bytes > 0 ? `${t.retention_bytes} bytes per queue`
                                           : "no size limit")));
      out.push(table([["queue", q => q.queue], ["shard", q => q.shard],
                      ["log start", q => q.min_offset], ["max offset", q => q.max_offset],
                      ["lag by group", q => Object.entries(q.lag).map(([g, l]) => `${g}: ${l}`)
                        .join(", ") || "-"]], t.queues, "no queue holds a message yet"));
    }
    return out;
  },

  async message(params) {
    const form = el("form", { id: "lookup" },
      el("input", { name: "id", placeholder: "message id", size: 28, value: params.id || "" }),
      " or ",
      el("input", { name: "topic", placeholder: "topic", value: params.topic || "" }),
      el("input", { name: "key", placeholder: "key", value: params.key || "" }),
      el("button", { type: "submit" }, "Look up"));
    form.addEventListener("submit", e => {
      e.preventDefault();
      const q = new URLSearchParams();
      for (const f of ["id", "topic", "key"]) if (form[f].value) q.set(f, form[f].value);
      location.hash = "message?" + q.toString();
    });
    const out = [form];
    if (!params.id && !(params.topic && params.key)) return out;
    const q = new URLSearchParams(params).toString();
    const d = await api("message?" + q);
    out.push(el("p", {}, `${d.found} message(s) found`));
    for (const m of d.messages) {
      out.push(el("h2", {}, m.id));
      out.push(table([["field", r => r[0]], ["value", r => r[1]]], [
        ["topic / queue / offset", `${m.topic} / ${m.queue_id} / ${m.queue_offset}`],
        ["shard", String(m.shard)], ["stored id", m.stored_id], ["key", m.key || "-"],
        ["tags", m.tags || "-"], ["born", when(m.born_ms)], ["stored", when(m.store_ms)],
        ["redeliveries", String(m.reconsume_count)],
        ["properties", JSON.stringify(m.properties)]]));
      out.push(el("pre", { class: "body" }, `${m.body.kind}, ${m.body.bytes} bytes` +
        (m.body.truncated ? " (first part)" : "") + "\n" + m.body.text));
      out.push(table([["step", s => s.step], ["group", s => s.group || ""],
                      ["at", s => when(s.at_ms)], ["detail", s => s.detail]], m.trace));
    }
    return out;
  },

  async halves() {
    const d = await api("halves");
    const cols = [["id", h => h.id], ["state", h => h.state], ["group", h => h.group],
                  ["topic", h => h.topic], ["age", h => age(h.age_ms)],
                  ["checks", h => h.checks], ["transaction", h => h.transaction_id || "-"],
                  ["", h => el("span", {},
                    actionButton("Commit", `halves/${h.id}/commit`),
                    actionButton("Roll back", `halves/${h.id}/rollback`))]];
    return [el("h2", {}, `Pending (${d.pending.length})`), table(cols, d.pending),
            el("h2", {}, `Check-expired (${d.expired.length})`), table(cols, d.expired)];
  },

  async transactions(params) {
    const d = await api("transactions");
    const out = [el("h2", {}, `Transactional ids (${d.transactions.length})`),
      table([["transactional id", t => el("a", { href: "#transactions?id=" +
               encodeURIComponent(t.transactional_id) }, t.transactional_id)],
             ["state", t => t.state], ["producer", t => t.producer_id], ["epoch", t => t.epoch],
             ["age", t => age(t.age_ms)],
             ["queues", t => t.queues.map(q => `${q[1]}/${q[2]}`).join(", ") || "-"],
             ["", t => t.state === "ONGOING" ? actionButton("Abort",
               `transactions/${encodeURIComponent(t.transactional_id)}/abort`, undefined,
               `Abort the open transaction of ${t.transactional_id}?`) : null]],
            d.transactions),
      el("h2", {}, `Hanging: open transactions holding a queue's LSO (${d.hanging.length})`),
      table([["queue", h => h.queue], ["shard", h => h.shard], ["LSO", h => h.lso],
             ["end", h => h.end], ["behind", h => h.behind], ["age", h => age(h.age_ms)],
             ["transactional id", h => h.transactional_id || "?"], ["state", h => h.state || "?"]],
            d.hanging)];
    if (params.id) {
      const t = await api("transactions/" + encodeURIComponent(params.id));
      out.push(el("h2", {}, params.id), el("pre", { class: "describe" },
                                           JSON.stringify(t, null, 2)));
    }
    return out;
  },

  async timers() {
    const d = await api("timers");
    return [
      barChart("scheduled messages by due time",
               d.histogram.map(b => ({ label: b.due, value: b.count }))),
      el("h2", {}, "Lateness"),
      table([["shard", l => l.shard], ["delivery lag", l => l.lag_ms + " ms"],
             ["max lateness", l => l.max_lateness_ms + " ms"]], d.lateness),
      el("h2", {}, `Soonest (${d.soonest.length})`),
      table([["id", t => t.msg_id], ["topic / queue", t => `${t.topic}/${t.queue_id}`],
             ["due", t => when(t.due_ms)], ["in", t => age(t.due_ms - d.now_ms)],
             ["key", t => t.key || "-"],
             ["", t => actionButton("Cancel", `timers/${t.msg_id}/cancel`, undefined,
                                    `Cancel ${t.msg_id}?`)]], d.soonest),
    ];
  },

  async groups(params) {
    const d = await api("groups");
    const names = Object.keys(d.lag_history).filter(k => k !== "t");
    const out = [lineChart("lag by group", d.lag_history, names),
      table([["group", g => el("a", { href: "#groups?group=" + encodeURIComponent(g[0]) }, g[0])],
             ["members", g => Object.keys(g[1].members).length],
             ["assigned queues", g => Object.entries(g[1].members).map(([m, i]) =>
               `${m}: ${i.queues.map(q => q.join("/")).join(", ") || "-"}`).join("; ") || "-"],
             ["lag", g => g[1].lag]], Object.entries(d.groups))];
    if (params.group) {
      const dl = await api(`groups/${encodeURIComponent(params.group)}/dead-letters`);
      out.push(el("h2", {}, `Offsets of ${params.group}`), resetForm(params.group),
        el("h2", {}, `Dead letters of ${params.group} (${dl.dead_letters.length})`),
        actionButton("Resend all", `groups/${encodeURIComponent(params.group)}/dead-letters/resend`),
        table([["id", m => m.stored_id], ["origin", m => m.id], ["topic", m => m.topic],
               ["redeliveries", m => m.reconsume_count], ["reason", m => m.reason],
               ["body", m => m.body.text.slice(0, 60)],
               ["", m => actionButton("Resend", `groups/${encodeURIComponent(params.group)}` +
                                      "/dead-letters/resend", { ids: [m.stored_id] })]],
              dl.dead_letters));
    }
    return out;
  },
};

async function route() {
  const [name, query] = (location.hash.slice(1) || "overview").split("?");
  const page = PAGES[name] ? name : "overview";
  const params = Object.fromEntries(new URLSearchParams(query || ""));
  for (const a of document.querySelectorAll("#nav a"))
    a.classList.toggle("active", a.getAttribute("href") === "#" + page);
  const main = document.getElementById("page");
  try {
    const parts = await PAGES[page](params);
    main.replaceChildren(el("div", { "data-page": page }, parts));
  } catch (err) {
    main.replaceChildren(el("p", { class: "bad", "data-page": page }, String(err.message || err)));
  }
}

async function start() {
  session = await api("session");
  document.getElementById("mode").textContent = session.read_only ?
    "read-only" : "actions need the access token";
  window.addEventListener("hashchange", () => { notice(""); route(); });
  await route();
}

start();
