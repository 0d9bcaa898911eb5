// toolgate console: reads the admin API every second, renders the fleet, and sets or lifts
// operator overrides. Every value shown comes from etcd or from operators, so the page is
// built with textContent only (never innerHTML).
"use strict";

const POLL_MS = 1000;
// Kept for this tab only: sessionStorage dies with the tab and is never in the URL.
const TOKEN_KEY = "toolgate.admin-token";
const STATE_ORDER = { DOWN: 0, UNHEALTHY: 1, SUSPECT: 2, UNKNOWN: 3, UP: 4 };
const STATE_SYMBOL = { UP: "●", SUSPECT: "◐", UNHEALTHY: "▲", DOWN: "✖", UNKNOWN: "?" };

const view = {
  registry: null,
  breakers: [],
  overrides: [],
  envoys: [],
  virtuals: [],
  auth: null,
  limits: null,
  lastOk: null,
  failure: null,
  sort: { instances: { key: "service", dir: 1 }, tools: { key: "service", dir: 1 } },
  filter: "",
};

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function token() {
  return sessionStorage.getItem(TOKEN_KEY) || "";
}

function headers(extra) {
  const h = Object.assign({ accept: "application/json" }, extra || {});
  const t = token();
  if (t) h.authorization = "Bearer " + t;
  return h;
}

async function getJson(path) {
  const r = await fetch(path, { headers: headers(), cache: "no-store" });
  if (!r.ok) throw new Error(path + ": HTTP " + r.status + " " + (await errorText(r)));
  return r.json();
}

async function errorText(r) {
  const text = await r.text();
  try {
    const v = JSON.parse(text);
    if (v && typeof v.error === "string") return v.error;
  } catch (_) { /* not JSON: the text itself */ }
  return text.slice(0, 300);
}

// ---- time -----------------------------------------------------------------------------

function ago(iso) {
  if (!iso) return "–";
  const ms = Date.now() - Date.parse(iso);
  if (!isFinite(ms)) return iso;
  return duration(ms) + " ago";
}

function until(iso) {
  const ms = Date.parse(iso) - Date.now();
  if (!isFinite(ms)) return iso;
  return ms <= 0 ? "now" : "in " + duration(ms);
}

function duration(ms) {
  const s = Math.max(0, Math.round(ms / 1000));
  if (s < 60) return s + " s";
  if (s < 3600) return Math.floor(s / 60) + " min " + (s % 60) + " s";
  return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
}

function clock(iso) {
  const d = new Date(iso);
  return isNaN(d) ? iso : d.toLocaleTimeString();
}

// ---- polling --------------------------------------------------------------------------

// One read of everything; the page keeps the last state when it fails.
async function refresh() {
  try {
    const [registry, breakers, overrides, envoys, virtuals, auth, limits] = await Promise.all([
      getJson("/v1/registry"),
      getJson("/v1/breakers"),
      getJson("/v1/overrides"),
      getJson("/v1/envoys"),
      getJson("/v1/virtual"),
      getJson("/v1/auth"),
      getJson("/v1/limits"),
    ]);
    view.limits = limits;
    view.virtuals = virtuals.virtual_servers || [];
    view.auth = auth;
    view.registry = registry;
    view.breakers = breakers.breakers || [];
    view.overrides = overrides.overrides || [];
    view.envoys = envoys.envoys || [];
    view.lastOk = new Date();
    view.failure = null;
  } catch (e) {
    // Keep showing the last state; say loudly that it is old.
    view.failure = String(e.message || e);
  }
  render();
}

async function loop() {
  await refresh();
  setTimeout(loop, POLL_MS);
}

// ---- rendering ------------------------------------------------------------------------

function matches(...fields) {
  const f = view.filter;
  return !f || fields.some((x) => String(x || "").toLowerCase().includes(f));
}

function render() {
  renderAlerts();
  renderSummary();
  renderTools();
  renderInstances();
  renderVirtual();
  renderAuth();
  renderLimits();
  renderEnvoys();
}

function renderAlerts() {
  const alerts = $("alerts");
  alerts.replaceChildren();
  const since = view.lastOk ? " Last update " + view.lastOk.toLocaleTimeString() + "." : "";
  if (view.failure) {
    alerts.append(el("p", { class: "alert", role: "alert", id: "alert-admin" },
      "toolgate-xds UNREACHABLE: " + view.failure + ". Showing the last known state." + since));
  }
  if (view.registry && view.registry.etcd_up === false) {
    alerts.append(el("p", { class: "alert", role: "alert", id: "alert-etcd" },
      "etcd UNREACHABLE: routing continues on the last known endpoints (revision " +
      view.registry.revision + "); changes and overrides cannot be made until etcd is back."));
  }
  $("source").textContent = view.registry
    ? "etcd revision " + view.registry.revision + " · " + view.registry.instances + " instances" +
      (view.lastOk ? " · updated " + view.lastOk.toLocaleTimeString() : "")
    : "connecting…";
}

function instanceRows() {
  const rows = [];
  const services = (view.registry && view.registry.services) || {};
  for (const [service, instances] of Object.entries(services)) {
    for (const i of instances) rows.push(Object.assign({ service }, i));
  }
  return rows;
}

function renderSummary() {
  const counts = { UP: 0, SUSPECT: 0, UNHEALTHY: 0, DOWN: 0, UNKNOWN: 0 };
  for (const r of instanceRows()) counts[r.state] = (counts[r.state] || 0) + 1;
  const open = view.breakers.filter((b) => b.state === "open").length;
  const forced = view.overrides.length;
  $("summary").replaceChildren(
    ...Object.entries(counts).map(([s, n]) =>
      el("span", { class: "count" }, stateBadge(s), " ", n)),
    el("span", { class: "count" }, "breakers open: " + open),
    el("span", { class: "count" }, "overrides: " + forced),
  );
}

function stateBadge(state) {
  return el("span", { class: "badge state-" + state },
    (STATE_SYMBOL[state] || "") + " " + state);
}

function compare(a, b, key) {
  const x = a[key], y = b[key];
  if (typeof x === "number" && typeof y === "number") return x - y;
  return String(x ?? "").localeCompare(String(y ?? ""));
}

function sorted(rows, table, keys) {
  const { key, dir } = view.sort[table];
  return rows.slice().sort((a, b) => {
    const primary = compare(a, b, keys[key] || key) * dir;
    if (primary) return primary;
    return compare(a, b, "service") || compare(a, b, "instance") || compare(a, b, "tool");
  });
}

function renderInstances() {
  const rows = instanceRows()
    .filter((r) => matches(r.service, r.instance_id, ...(r.tools || [])))
    .map((r) => Object.assign(r, {
      instance: r.instance_id,
      stateRank: STATE_ORDER[r.state] ?? 9,
      sinceMs: Date.parse(r.since) || 0,
    }));
  const body = $("instances").tBodies[0];
  const out = sorted(rows, "instances", { state: "stateRank", since: "sinceMs" }).map((r) => {
    const failed = r.calls ? Object.entries(r.calls)
      .filter(([k]) => k !== "ok").reduce((n, [, v]) => n + v, 0) : 0;
    const total = failed + ((r.calls && r.calls.ok) || 0);
    const probe = (r.probes || [])[r.probes.length - 1];
    return el("tr", { "data-key": r.service + "/" + r.instance_id, "data-service": r.service,
      "data-instance": r.instance_id, "data-state": r.state },
      el("td", {}, r.service),
      el("td", {}, r.instance_id),
      el("td", { class: "wide" }, r.endpoint),
      el("td", {}, stateBadge(r.state)),
      el("td", { title: r.since }, ago(r.since)),
      el("td", {}, r.cause || "–"),
      el("td", { class: "wide" }, total ? total + (total === 1 ? " call, " : " calls, ") +
        Math.round(r.call_failure_rate * 100) + "% failed" : "–"),
      el("td", { class: "wide", title: probe ? probe.at : "" }, probe
        ? (r.probe || "http") + " " + (probe.ok ? "ok " : "failed ") + probe.detail +
          " (" + ago(probe.at) + ")"
        : (r.probe || "http") + " –"),
    );
  });
  patchRows(body, (out.length ? out : [emptyRow(8, view.registry
    ? "No instance registered" + (view.filter ? " matches the filter." : ".")
    : "Waiting for toolgate-xds…")]));
  markSort("instances");
}

function emptyRow(span, text) {
  return el("tr", { class: "empty", "data-key": "(empty)" }, el("td", { colspan: span }, text));
}

// Puts `rows` (each with a data-key) into `tbody`, keeping the existing row element of a key
// and replacing only the cells whose content changed: a button under the pointer is not
// swapped for a copy between press and release, and focus stays where it was.
function patchRows(tbody, rows) {
  const old = new Map();
  for (const tr of tbody.rows) old.set(tr.dataset.key, tr);
  const out = rows.map((tr) => {
    const prev = old.get(tr.dataset.key);
    if (!prev || prev.cells.length !== tr.cells.length) return tr;
    const [before, after] = [[...prev.cells], [...tr.cells]];
    after.forEach((cell, i) => {
      if (before[i].innerHTML !== cell.innerHTML || before[i].className !== cell.className) {
        before[i].replaceWith(cell);
      }
    });
    for (const a of tr.attributes) {
      if (prev.getAttribute(a.name) !== a.value) prev.setAttribute(a.name, a.value);
    }
    return prev;
  });
  tbody.replaceChildren(...out);
}

function toolRows() {
  const byKey = new Map();
  const row = (service, tool) => {
    const key = service + "\u0000" + tool;
    if (!byKey.has(key)) byKey.set(key, { service, tool, breaker: null, override: null });
    return byKey.get(key);
  };
  for (const r of instanceRows()) for (const t of r.tools || []) row(r.service, t);
  for (const b of view.breakers) row(b.service, b.tool).breaker = b;
  for (const o of view.overrides) row(o.service, o.tool).override = o;
  return [...byKey.values()];
}

// What the fleet's breaker of a tool is: closed (no key), open until its expiry, or half-open
// once the expiry passed (each gateway then lets probe calls through).
function breakerState(b) {
  if (!b) return "closed";
  return b.state === "open" ? "open" : "half-open";
}

function renderTools() {
  const rows = toolRows()
    .filter((r) => matches(r.service, r.tool))
    .map((r) => Object.assign(r, {
      breakerRank: { open: 0, "half-open": 1, closed: 2 }[breakerState(r.breaker)] -
        (r.override ? 3 : 0),
    }));
  const body = $("tools").tBodies[0];
  const out = sorted(rows, "tools", { breaker: "breakerRank" }).map((r) => {
    const state = breakerState(r.breaker);
    const breaker = [el("span", { class: "badge breaker-" + state },
      { open: "✖ OPEN", "half-open": "◐ HALF-OPEN", closed: "● CLOSED" }[state])];
    if (r.breaker && state === "open") {
      breaker.push(" until " + clock(r.breaker.until) + " (" + until(r.breaker.until) +
        "), opened by " + (r.breaker.opened_by || "?"));
    } else if (r.breaker) {
      breaker.push(" probing since " + clock(r.breaker.until) + ", opened by " +
        (r.breaker.opened_by || "?"));
    }
    const o = r.override;
    const override = o
      ? [el("span", { class: "badge override-" + o.mode },
          o.mode === "force_open" ? "⊘ FORCED OPEN" : "✔ FORCED CLOSED"),
        " “" + o.reason + "”" + (o.author ? " by " + o.author : "") + ", " + ago(o.since)]
      : ["–"];
    const name = r.service + "/" + r.tool;
    const actions = [
      el("button", { type: "button", class: "danger", "data-action": "force_open",
        "aria-label": "Force open " + name, onclick: () => ask("force_open", r) }, "Force open"),
      el("button", { type: "button", "data-action": "force_closed",
        "aria-label": "Force close " + name, onclick: () => ask("force_closed", r) }, "Force close"),
    ];
    if (o) {
      actions.push(el("button", { type: "button", class: "restore", "data-action": "lift",
        "aria-label": "Lift the override on " + name, onclick: () => ask("lift", r) }, "Lift"));
    }
    return el("tr", { "data-key": r.service + "/" + r.tool, "data-service": r.service,
      "data-tool": r.tool, "data-breaker": state,
      "data-override": o ? o.mode : "" },
      el("td", {}, r.service),
      el("td", {}, r.tool),
      el("td", {}, breaker),
      el("td", {}, override),
      el("td", { class: "actions" }, actions),
    );
  });
  patchRows(body, (out.length ? out : [emptyRow(5, "No tool" +
    (view.filter ? " matches the filter." : " registered yet."))]));
  markSort("tools");
}

// One row per virtual server: where it is served, what it selects, and every name it offers
// with what that name calls; the tools it could not name, with why.
function renderVirtual() {
  const body = $("virtual").tBodies[0];
  const out = (view.virtuals || [])
    .filter((v) => matches(v.name, ...Object.keys(v.tools || {}), ...Object.values(v.tools || {})))
    .map((v) => {
      const d = v.definition || {};
      const selection = [
        (d.naming || "prefixed") + (v.stored ? "" : " (built-in)"),
        "services: " + ((d.services || []).join(", ") || "all"),
      ];
      if ((d.include || []).length) selection.push("include: " + d.include.join(", "));
      if ((d.exclude || []).length) selection.push("exclude: " + d.exclude.join(", "));
      if (d.unavailable === "hide") selection.push("hides unavailable tools");
      const tools = Object.entries(v.tools || {}).map(([name, target]) =>
        el("div", {}, name + " → " + target));
      const unnamed = (v.unnamed || []).map((u) =>
        el("div", { class: "error" }, u.service + "/" + u.tool + ": " + u.reason));
      return el("tr", { "data-key": v.name },
        el("td", {}, v.name),
        el("td", {}, (v.paths || []).join(" ")),
        el("td", {}, selection.map((s) => el("div", {}, s))),
        el("td", { class: "wide" }, tools.length ? tools : "–"),
        el("td", {}, unnamed.length ? unnamed : "–"),
      );
    });
  patchRows(body, out.length ? out : [emptyRow(5, "No virtual server matches.")]);
}

// One compact line per rule: the tools, resources and prompts it covers, then who it grants
// them to (subjects AND roles AND all scopes); claims copied into headers last.
function ruleLines(rules) {
  if (!rules) return ["– (no rule set: every caller the token check lets in)"];
  const lines = (rules.rules || []).map((r) => {
    const who = [];
    if ((r.subjects || []).length) who.push("subjects " + r.subjects.join(", "));
    if ((r.roles || []).length) who.push("roles " + r.roles.join(" | "));
    if ((r.scopes || []).length) who.push("scopes " + r.scopes.join(" + "));
    const what = [];
    if ((r.tools || []).length) what.push(r.tools.join(", "));
    if ((r.resources || []).length) what.push("resources " + r.resources.join(", "));
    if ((r.prompts || []).length) what.push("prompts " + r.prompts.join(", "));
    return what.join(" · ") + " ← " + who.join(" · ");
  });
  if (!lines.length) lines.push("no rule: every tool is refused");
  for (const [claim, header] of Object.entries(rules.claim_headers || {})) {
    lines.push("claim " + claim + " → header " + header);
  }
  return lines;
}

// Per service and virtual server: whether it requires a token, and its rules.
// The limits in force, then who they refused most in the last ten minutes.
function renderLimits() {
  const limits = view.limits;
  const rows = [];
  for (const l of (limits && limits.limits) || []) {
    const tool = l.tool || "*";
    for (const r of l.rules || []) {
      if (!matches(l.service, tool, r.label)) continue;
      rows.push(el("tr", { "data-key": "rule/" + l.service + "/" + tool + "/" + r.label },
        el("td", {}, l.service + "/" + tool),
        el("td", {}, r.label),
        el("td", {}, r.per),
        el("td", {}, r.calls + " per " + r.per_seconds + " s, burst " + (r.burst || r.calls)),
      ));
    }
  }
  patchRows($("limits").tBodies[0], rows.length ? rows
    : [emptyRow(4, limits ? "No limit is set." : "Waiting for toolgate-xds…")]);
  const top = [];
  for (const t of (limits && limits.top_limited) || []) {
    if (!matches(t.caller, t.service, t.tool, t.rule)) continue;
    top.push(el("tr", { "data-key": "top/" + t.caller + "/" + t.service + "/" + t.tool + "/" + t.rule },
      el("td", {}, t.caller),
      el("td", {}, t.service + "/" + t.tool),
      el("td", {}, t.rule),
      el("td", {}, String(t.refused) + ", last " + t.last_ago_secs + " s ago"),
    ));
  }
  patchRows($("limited").tBodies[0], top.length ? top
    : [emptyRow(4, limits ? "Nobody was refused in the last ten minutes." : "Waiting for toolgate-xds…")]);
}

function renderAuth() {
  const auth = view.auth;
  const state = !auth ? "–"
    : auth.configured
      ? "Tokens checked for " + auth.config.resource + "; issuers: " +
        (auth.config.issuers || []).map((i) => i.issuer).join(", ") + "."
      : "No auth configuration: no service requires a token." +
        (auth.rules_unused ? " Rule sets are stored but not applied until one is." : "");
  if ($("auth-state").textContent !== state) $("auth-state").textContent = state;
  const rows = [];
  for (const [kind, key, exists] of [["service", "services", "registered"],
    ["virtual server", "virtual_servers", "defined"]]) {
    for (const [name, e] of Object.entries((auth && auth[key]) || {})) {
      if (!matches(name)) continue;
      const label = [name, el("span", { class: "muted" },
        " (" + kind + (e[exists] ? "" : ", not " + exists) + ")")];
      rows.push(el("tr", { "data-key": kind + "/" + name, "data-token": String(!!e.requires_token) },
        el("td", {}, label),
        el("td", {}, el("span", { class: "badge " + (e.requires_token ? "token-required" : "token-open") },
          e.requires_token ? "🔒 REQUIRED" : "OPEN")),
        el("td", { class: "wide" }, ruleLines(e.rules).map((l) => el("div", {}, l))),
      ));
    }
  }
  patchRows($("auth").tBodies[0], rows.length ? rows
    : [emptyRow(3, auth ? "No service matches." : "Waiting for toolgate-xds…")]);
}

function renderEnvoys() {
  const body = $("envoys").tBodies[0];
  const out = view.envoys.map((e) => {
    const types = Object.entries(e.types || {});
    const last = types.map(([, t]) => t.sent_at).filter(Boolean).sort().pop();
    const config = types.map(([name, t]) => {
      if (t.nacked_version && t.nacked_version === t.sent_version) {
        return el("div", { class: "error" }, name + ": REJECTED " + t.nacked_version + ": " + t.nack_error);
      }
      const acked = t.acked_version && t.acked_version === t.sent_version;
      return el("div", {}, name + ": " + (acked ? "applied " : "sent, not yet acknowledged ") +
        (t.sent_version || "–").slice(0, 8));
    });
    // The filter's own word: it accepts every ECDS response, so a configuration it refused
    // shows only here.
    const filter = e.filter_config;
    if (filter && filter.state === "rejected") {
      config.push(el("div", { class: "error", title: filter.since, "data-filter": "rejected" },
        "filter: REFUSED its configuration (" + ago(filter.since) + "): " + (filter.error || "") +
        "; it judges with the last one it accepted"));
    } else if (filter) {
      config.push(el("div", { title: filter.since, "data-filter": "ok" },
        "filter: configuration accepted again (" + ago(filter.since) + ")"));
    }
    return el("tr", { "data-key": String(e.stream), "data-node": e.node },
      el("td", {}, e.node || "(not identified yet)"),
      el("td", { class: "wide" }, e.peer || "–"),
      el("td", { title: e.connected_at }, ago(e.connected_at)),
      el("td", { title: last || "" }, last ? ago(last) : "–"),
      el("td", {}, config.length ? config : "–"),
    );
  });
  patchRows(body, out.length ? out : [emptyRow(5, "No Envoy connected.")]);
}

function markSort(table) {
  const { key, dir } = view.sort[table];
  for (const b of document.querySelectorAll("#" + table + " th button")) {
    if (b.dataset.sort === key) b.setAttribute("aria-sort", dir > 0 ? "ascending" : "descending");
    else b.removeAttribute("aria-sort");
  }
}

// ---- actions --------------------------------------------------------------------------

let pending = null;

function ask(action, row) {
  pending = { action, service: row.service, tool: row.tool };
  const title = { force_open: "Force open", force_closed: "Force close", lift: "Lift the override on" }[action];
  $("confirm-title").textContent = title + " " + row.service + "/" + row.tool;
  $("confirm-what").textContent = {
    force_open: "Every gateway answers calls of this tool at once with the reason below, without calling it.",
    force_closed: "Every gateway lets calls through whatever its breaker says.",
    lift: "The breakers decide again.",
  }[action];
  $("confirm-ok").className = action === "force_open" ? "danger" : "restore";
  $("reason").value = "";
  $("reason").required = action !== "lift";
  $("reason").parentElement.querySelector("label[for=reason]").hidden = action === "lift";
  $("reason").hidden = action === "lift";
  $("confirm-error").hidden = true;
  $("confirm").showModal();
  (action === "lift" ? $("confirm-ok") : $("reason")).focus();
}

async function confirmAction(event) {
  event.preventDefault();
  if (!pending) return;
  const { action, service, tool } = pending;
  const path = "/v1/overrides/" + encodeURIComponent(service) + "/" + encodeURIComponent(tool);
  const reason = $("reason").value.trim();
  if (action !== "lift" && !reason) {
    showError("A reason is required: agents are told it.");
    return;
  }
  $("confirm-ok").disabled = true;
  try {
    const init = action === "lift"
      ? { method: "DELETE", headers: headers() }
      : {
        method: "PUT",
        headers: headers({ "content-type": "application/json" }),
        body: JSON.stringify({ mode: action, reason, author: $("author").value.trim() }),
      };
    const r = await fetch(path, init);
    if (!r.ok) {
      const why = await errorText(r);
      const hint = r.status === 401 ? " Enter the admin token at the top of the page."
        : r.status === 403 ? " The token was refused." : "";
      showError("HTTP " + r.status + ": " + why + hint);
      return;
    }
    $("confirm").close();
    pending = null;
    refresh();
  } catch (e) {
    showError("toolgate-xds did not answer: " + (e.message || e));
  } finally {
    $("confirm-ok").disabled = false;
  }
}

function showError(text) {
  const p = $("confirm-error");
  p.textContent = text;
  p.hidden = false;
}

// ---- token ----------------------------------------------------------------------------

function renderToken() {
  const set = !!token();
  $("token-state").textContent = set ? "token set for this tab" : "no token: read only";
  $("token-forget").hidden = !set;
  $("token").value = "";
}

function setup() {
  $("token-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const t = $("token").value.trim();
    if (t) sessionStorage.setItem(TOKEN_KEY, t);
    renderToken();
  });
  $("token-forget").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    renderToken();
  });
  // `change` too: clearing a field programmatically (or by some assistive tools) sends no `input`.
  for (const kind of ["input", "change"]) {
    $("filter").addEventListener(kind, (e) => {
      view.filter = e.target.value.trim().toLowerCase();
      render();
    });
  }
  for (const table of ["instances", "tools"]) {
    for (const b of document.querySelectorAll("#" + table + " th button")) {
      b.addEventListener("click", () => {
        const s = view.sort[table];
        s.dir = s.key === b.dataset.sort ? -s.dir : 1;
        s.key = b.dataset.sort;
        render();
      });
    }
  }
  $("confirm-form").addEventListener("submit", confirmAction);
  $("confirm-cancel").addEventListener("click", () => {
    pending = null;
    $("confirm").close();
  });
  renderToken();
  loop();
}

document.addEventListener("DOMContentLoaded", setup);
