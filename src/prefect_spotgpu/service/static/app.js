// The market dashboard: plain JavaScript, no libraries, nothing fetched from another host.
// Public views come from the public API; a signed-in tenant's views use its key in the
// Authorization header. A server-sent event stream (/api/v1/stream) drives every refresh.
//
// The page renders data, never markup. Every value from the API (names, labels, telemetry,
// reasons...) reaches the page as text: built with h()/svg() and text nodes, never through
// innerHTML or a string of markup. Numbers that go into styles or SVG attributes pass through
// num() (Number(), finite, clamped). The service's Content-Security-Policy runs no inline
// script, and no style attribute: sizes are set through the CSSOM (el.style.width).
// gangs.js (loaded first) folds a gang's member bids and allocations under one entry.
"use strict";

const API = "/api/v1";
const state = {
  key: sessionStorage.getItem("spotgpu-key") || "",
  pools: [],
  selected: null, // "model|region|capacity"
  range: 24,
  seenBids: new Set(),
  gangOf: new Map(), // bid id -> its gang's rank 0 id (null: not a gang member); never changes
  gangSize: new Map(), // gang (rank 0's id) -> node_count
  closed: new Set(), // the gangs' member lists the viewer folded away ("bids:12")
  pages: { bids: 1, allocations: 1, ledger: 1 }, // pages of each list shown ("Show older")
  imagesAt: 0, // when the image catalogue was last read (ms)
  refreshing: false,
  again: false,
};

const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";
const UNSAFE_ATTRIBUTE = /^(on|href$|src$|style$|xlink:|formaction$|action$)/i;

function build(node, attrs, children) {
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (UNSAFE_ATTRIBUTE.test(name)) throw new Error(`no ${name} attribute from data`);
    node.setAttribute(name, String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}
// h("td", { class: "num" }, "text", child...): an element; strings become text nodes
const h = (tag, attrs, ...children) => build(document.createElement(tag), attrs, children);
const svg = (tag, attrs, ...children) => build(document.createElementNS(SVG, tag), attrs, children);
// a finite number clamped to [lo, hi], or null: the only way data reaches a style or a geometry
function num(x, lo = -Infinity, hi = Infinity) {
  if (x === null || x === undefined || x === "" || typeof x === "boolean") return null;
  const n = Number(x);
  return Number.isFinite(n) ? Math.min(hi, Math.max(lo, n)) : null;
}
const fixed = (x, digits) => { const n = num(x); return n === null ? "–" : n.toFixed(digits); };
const money = (x) => fixed(x, 2);
const token = (s) => String(s ?? "").replace(/[^A-Za-z0-9_-]/g, ""); // a class-name suffix
const when = (s) => { const t = Date.parse(s); return Number.isFinite(t) ? new Date(t).toLocaleString() : "–"; };
const poolKey = (p) => `${p.gpu_model}|${p.region}|${p.capacity || "spot"}`;
const statusCell = (s) => h("span", { class: `status s-${token(s)}` }, String(s ?? ""));
const kindCell = (k) => h("span", { class: `kind-${token(k)}` }, k === "on_demand" ? "on-demand" : "spot");
const muted = (text, tag = "p") => h(tag, { class: "muted" }, text);

async function getJSON(path, auth = false) {
  const headers = auth && state.key ? { Authorization: `Bearer ${state.key}` } : {};
  const response = await fetch(API + path, { headers });
  if (!response.ok) {
    const error = new Error(`${response.status} ${path}`);
    error.status = response.status;
    throw error;
  }
  return response.json();
}

// The next page of a paged list (newest first): the response's `Link: <url>; rel="next"`,
// asked of this page's own origin whatever host the link names.
function nextPage(response) {
  const match = /<([^>]+)>\s*;\s*rel="next"/.exec(response.headers.get("Link") || "");
  if (!match) return null;
  const url = new URL(match[1], location.href);
  return url.pathname.startsWith(API + "/") ? url.pathname + url.search : null;
}

// `pages` pages of a signed-in list; `rows` picks the list out of a body. Whether more follow.
async function getPages(path, pages, rows = (body) => body) {
  let url = API + path, first = null, all = [];
  for (let i = 0; i < pages && url; i++) {
    const response = await fetch(url, { headers: { Authorization: `Bearer ${state.key}` } });
    if (!response.ok) {
      const error = new Error(`${response.status} ${path}`);
      error.status = response.status;
      throw error;
    }
    const body = await response.json();
    first = first ?? body;
    all = all.concat(rows(body));
    url = nextPage(response);
  }
  return { first, rows: all, more: url !== null };
}

// ------------------------------------------------------------------ pools

function renderPools() {
  const body = $("pools").querySelector("tbody");
  $("pools-empty").hidden = state.pools.length > 0;
  if (!state.selected && state.pools.length) {
    const spot = state.pools.find((p) => (p.capacity || "spot") === "spot") || state.pools[0];
    state.selected = poolKey(spot);
  }
  body.replaceChildren(
    ...state.pools.map((p) => {
      const price = num(p.clearing_price ?? p.reserve_price, 0);
      const onDemand = num(p.on_demand_price, 0);
      const discount = price && onDemand ? `${Math.round((1 - price / onDemand) * 100)} %` : "–";
      const key = poolKey(p);
      return h("tr", { class: key === state.selected ? "pool selected" : "pool", "data-key": key },
        h("td", {}, String(p.gpu_model)), h("td", {}, String(p.region)),
        h("td", {}, kindCell(p.capacity || "spot")),
        h("td", { class: "num" }, `${fixed(p.gpus_free, 0)} / ${fixed(p.gpus_total, 0)}`),
        h("td", { class: "num" }, money(price)), h("td", { class: "num opt" }, money(onDemand)),
        h("td", { class: "num" }, discount), h("td", { class: "num opt" }, fixed(p.waiting_bids, 0)));
    }),
  );
}

$("pools").addEventListener("click", (event) => {
  const row = event.target.closest("tr.pool");
  if (!row) return;
  state.selected = row.dataset.key;
  renderPools();
  refreshPool();
});

function selectedPool() {
  return state.pools.find((p) => poolKey(p) === state.selected) || null;
}

// ------------------------------------------------------------------ price chart

const PAD = { l: 44, r: 10, t: 10, b: 24 };

function isCheap(date) {
  const day = date.getDay(), hour = date.getHours();
  if (day === 0 || day === 6) return true; // the whole weekend
  return hour >= 18 || hour < 9;
}

function cheapSpans(t0, t1) {
  // [start, end] spans of the cheap window between t0 and t1 (ms), hour by hour, local time
  const spans = [];
  const step = 3600e3;
  let t = Math.floor(t0 / step) * step;
  let open = null;
  for (; t <= t1; t += step) {
    const cheap = isCheap(new Date(t));
    if (cheap && open === null) open = Math.max(t, t0);
    if (!cheap && open !== null) { spans.push([open, t]); open = null; }
  }
  if (open !== null) spans.push([open, t1]);
  return spans;
}

function hourly(bars) {
  // minute bars -> one close per hour (for the 7-day view)
  const out = new Map();
  for (const b of bars) {
    const hour = Math.floor(Date.parse(b.minute) / 3600e3) * 3600e3;
    out.set(hour, b.close);
  }
  return [...out.entries()].map(([t, close]) => ({ t, close }));
}

const MAX_PRICE = 1e6; // a price past this is not drawn (the API refuses more than 1000)

function drawChart(rawSeries, rawForecast, pool) {
  const chart = $("chart");
  // drawn at the element's own size, so text is never stretched (a phone's width included)
  const box = chart.getBoundingClientRect();
  const W = Math.max(280, Math.round(box.width) || 800), H = Math.max(160, Math.round(box.height) || 260);
  chart.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const now = Date.now();
  const span = state.range * 3600e3;
  const t0 = now - span, t1 = now + span / 4;
  // only finite numbers reach the geometry
  const series = rawSeries
    .map((p) => ({ t: num(p.t), close: num(p.close, 0, MAX_PRICE) }))
    .filter((p) => p.t !== null && p.close !== null);
  const forecast = rawForecast
    .map((f) => ({ t: num(Date.parse(f.at)), low: num(f.low, 0, MAX_PRICE), high: num(f.high, 0, MAX_PRICE), expected: num(f.expected, 0, MAX_PRICE) }))
    .filter((f) => f.t !== null && f.low !== null && f.high !== null && f.expected !== null);
  const onDemand = pool ? num(pool.on_demand_price, 0, MAX_PRICE) : null;
  const prices = series.map((p) => p.close);
  for (const f of forecast) prices.push(f.low, f.high);
  if (onDemand) prices.push(onDemand);
  let lo = prices.length ? Math.min(...prices) : 0, hi = prices.length ? Math.max(...prices) : 1;
  if (hi - lo < 1e-9) { lo -= 0.5; hi += 0.5; }
  const pad = (hi - lo) * 0.08;
  lo = Math.max(0, lo - pad); hi += pad;
  const x = (t) => (PAD.l + ((t - t0) / (t1 - t0)) * (W - PAD.l - PAD.r)).toFixed(1);
  const y = (p) => (H - PAD.b - ((p - lo) / (hi - lo)) * (H - PAD.t - PAD.b)).toFixed(1);
  const parts = [];
  for (const [a, b] of cheapSpans(t0, t1)) {
    parts.push(svg("rect", { class: "night", x: x(a), y: PAD.t, width: (x(b) - x(a)).toFixed(1), height: H - PAD.t - PAD.b, fill: "rgba(30,41,80,.07)" }));
  }
  for (let i = 0; i <= 4; i++) {
    const p = lo + ((hi - lo) * i) / 4;
    parts.push(svg("line", { x1: PAD.l, x2: W - PAD.r, y1: y(p), y2: y(p), stroke: "#e3e6ec" }));
    parts.push(svg("text", { x: PAD.l - 6, y: (Number(y(p)) + 4).toFixed(1), "text-anchor": "end" }, p.toFixed(2)));
  }
  const ticks = Math.max(2, Math.min(state.range > 48 ? 7 : 6, Math.floor(W / 110)));
  for (let i = 0; i <= ticks; i++) {
    const t = t0 + ((t1 - t0) * i) / ticks;
    const d = new Date(t);
    const label = state.range > 48 ? d.toLocaleDateString([], { weekday: "short", day: "numeric" }) : d.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
    const anchor = i === 0 ? "start" : i === ticks ? "end" : "middle";
    parts.push(svg("text", { x: x(t), y: H - 6, "text-anchor": anchor }, label));
  }
  parts.push(svg("line", { x1: x(now), x2: x(now), y1: PAD.t, y2: H - PAD.b, stroke: "#94a3b8", "stroke-dasharray": "3 3" }));
  if (onDemand) {
    parts.push(svg("line", { class: "on-demand", x1: PAD.l, x2: W - PAD.r, y1: y(onDemand), y2: y(onDemand), stroke: "#9333ea", "stroke-dasharray": "6 4" }));
  }
  if (forecast.length) {
    const upper = forecast.map((f) => `${x(f.t)},${y(f.high)}`);
    const lower = forecast.map((f) => `${x(f.t)},${y(f.low)}`).reverse();
    parts.push(svg("polygon", { class: "forecast-band", points: [...upper, ...lower].join(" "), fill: "rgba(37,99,235,.14)", stroke: "none" }));
    const mid = forecast.map((f) => `${x(f.t)},${y(f.expected)}`);
    parts.push(svg("polyline", { class: "forecast", points: mid.join(" "), fill: "none", stroke: "#2563eb", "stroke-dasharray": "4 3" }));
  }
  if (series.length) {
    const points = series.map((p) => `${x(p.t)},${y(p.close)}`).join(" ");
    parts.push(svg("polyline", { id: "price-line", "data-points": series.length, points, fill: "none", stroke: "#2563eb", "stroke-width": 2 }));
  }
  chart.replaceChildren(...parts);
}

async function refreshChart(pool) {
  const note = $("chart-note");
  if (!pool) { drawChart([], [], null); note.textContent = ""; return; }
  $("chart-title").textContent = `Price: ${pool.gpu_model} ${pool.region}${pool.capacity === "on_demand" ? " (on-demand)" : ""}`;
  if (pool.capacity === "on_demand") {
    const flat = [{ t: Date.now() - state.range * 3600e3, close: pool.on_demand_price }, { t: Date.now(), close: pool.on_demand_price }];
    drawChart(flat, [], pool);
    note.textContent = "On-demand capacity sells at a fixed price.";
    return;
  }
  const path = `/prices/${encodeURIComponent(pool.gpu_model)}/${encodeURIComponent(pool.region)}`;
  const bars = await getJSON(`${path}/history?hours=${state.range}`);
  const series = state.range > 48 ? hourly(bars) : bars.map((b) => ({ t: Date.parse(b.minute), close: b.close }));
  let forecast = [];
  if (bars.length) {
    const f = await getJSON(`${path}/forecast?hours=${Math.round(state.range / 4)}`);
    forecast = Array.isArray(f.points) ? f.points : [];
    note.textContent = f.error ? `Forecast error on held-back history: ${fixed(f.error.mae ?? 0, 3)} per GPU-hour (MAE).` : "Forecast from the history so far.";
  } else {
    note.textContent = "No price history yet: the market records each pool's clearing price every minute.";
  }
  drawChart(series, forecast, pool);
}

document.querySelectorAll(".tab").forEach((tab) =>
  tab.addEventListener("click", () => {
    document.querySelectorAll(".tab").forEach((t) => t.classList.toggle("active", t === tab));
    state.range = Number(tab.dataset.range);
    refreshChart(selectedPool()).catch(report);
  }),
);

// ------------------------------------------------------------------ order book

async function refreshDepth(pool) {
  const box = $("depth");
  if (!pool) { box.replaceChildren(muted("No pool selected.")); return; }
  $("depth-pool").textContent = `${pool.gpu_model} ${pool.region}`;
  const book = await getJSON(`/market/depth/${encodeURIComponent(pool.gpu_model)}/${encodeURIComponent(pool.region)}?capacity=${encodeURIComponent(pool.capacity || "spot")}`);
  const levels = book.levels.map((l) => ({ price: l.price, held: num(l.held, 0) ?? 0, waiting: num(l.waiting, 0) ?? 0 }));
  if (!levels.length) { box.replaceChildren(muted("No open bids.")); return; }
  const most = Math.max(1, ...levels.map((l) => l.held + l.waiting));
  const bar = (kind, gpus) => {
    const part = h("div", { class: kind });
    part.style.width = `${num((100 * gpus) / most, 0, 100)}%`; // the CSSOM: allowed by the CSP
    return part;
  };
  box.replaceChildren(
    ...levels.map((l) =>
      h("div", { class: "depth-row" },
        h("span", {}, money(l.price)),
        h("div", { class: "depth-bar" }, bar("held", l.held), bar("waiting", l.waiting)),
        h("span", { class: "num small" }, `${l.held + l.waiting} GPUs`))),
  );
}

async function refreshPool() {
  const pool = selectedPool();
  await Promise.all([refreshChart(pool), refreshDepth(pool)]);
}

// ------------------------------------------------------------------ nodes

function gpuCell(n, i, telemetry) {
  const t = telemetry.find((g) => num(g.index) === i) || {};
  const util = num(t.utilization, 0, 100), memory = num(t.memory_used_mb, 0);
  const power = num(t.power_w, 0), temperature = num(t.temperature_c);
  const title = `GPU ${i}` + (util !== null ? `: ${util} % busy` : "") + (memory !== null ? `, ${memory} MB` : "") +
    (power !== null ? `, ${power} W` : "") + (temperature !== null ? `, ${temperature} °C` : "");
  const cell = h("div", { class: i < n.gpus_busy ? "gpu busy" : "gpu", title });
  if (util !== null) {
    const fill = h("div", { class: "fill" });
    fill.style.height = `${util}%`; // the CSSOM: allowed by the CSP
    cell.append(fill);
  }
  cell.append(String(i));
  return cell;
}

const MAX_GPUS_SHOWN = 16; // the market's most GPUs on one node

async function refreshNodes() {
  const nodes = await getJSON("/market/nodes");
  if (!nodes.length) { $("nodes").replaceChildren(muted("No nodes yet.")); return; }
  $("nodes").replaceChildren(
    ...nodes.map((n) => {
      const count = num(n.gpu_count, 0, MAX_GPUS_SHOWN) ?? 0;
      const telemetry = Array.isArray(n.gpus) ? n.gpus : [];
      const gpus = [];
      for (let i = 0; i < count; i++) gpus.push(gpuCell(n, i, telemetry));
      return h("div", { class: "node", "data-node": n.id },
        h("div", { class: "title" }, h("span", {}, `Node ${n.id}`), statusCell(n.state)),
        h("div", { class: "small muted" }, `${n.gpu_model} · ${n.region} · `, kindCell(n.capacity), ` · reserve ${money(n.reserve_price)}`),
        h("div", { class: "small" }, `${fixed(n.gpus_busy, 0)} / ${count} GPUs in use`),
        h("div", { class: "gpus" }, gpus));
    }),
  );
}

// ------------------------------------------------------------------ image catalogue

const IMAGES_SECONDS = 10; // the operator changes the catalogue by hand: asked at most this often

async function refreshImages() {
  if (Date.now() - state.imagesAt < IMAGES_SECONDS * 1000) return;
  const body = await getJSON("/images");
  state.imagesAt = Date.now();
  const images = Array.isArray(body) ? body : [];
  $("images-empty").hidden = images.length > 0;
  $("images").querySelector("tbody").replaceChildren(...images.map(imageRow));
}

function imageRow(i) {
  return h("tr", { class: "image", "data-image": String(i.name ?? "") },
    h("td", {}, h("strong", {}, String(i.name ?? ""))),
    h("td", {}, i.runs_flows === false ? "a command" : "flows"),
    h("td", {}, String(i.framework ?? "")),
    h("td", {}, i.cuda_version ? String(i.cuda_version) : "–"),
    h("td", {}, h("code", {}, String(i.reference ?? ""))),
    h("td", { class: "wrap" }, String(i.description ?? "")));
}

// ------------------------------------------------------------------ the signed-in tenant

async function refreshTenant() {
  const card = $("tenant-card");
  if (!state.key) { card.hidden = true; return; }
  const key = state.key; // a reply for a key signed out meanwhile is dropped
  const [me, bids, allocations, ledger] = await Promise.all([
    getJSON("/me", true),
    getBidPages(state.pages.bids),
    getPages("/allocations?limit=100", state.pages.allocations),
    getPages("/ledger?limit=100&charges_before=0", state.pages.ledger, (body) => body.entries),
  ]);
  if (key !== state.key) return;
  await learnGangs(bids.rows, allocations.rows);
  if (key !== state.key) return;
  card.hidden = false;
  $("who").textContent = `Signed in as ${me.name}`;
  $("balance").textContent = money(me.balance);
  $("spent").textContent = money(ledger.first.spent);
  $("credits").textContent = money(ledger.first.credits);
  // a gang's preemption counts once (rank 0's), as the worker counts it
  const preempted = allocations.rows.filter((a) => a.status === "preempted" && !(num(a.rank) > 0));
  $("preemptions").textContent = String(preempted.length);
  const newest = newestAllocations(allocations.rows);
  $("bids").querySelector("tbody").replaceChildren(
    ...foldBids(bids.rows).flatMap((e) => (e.members ? [bidRow(e), membersRow(e, newest)] : [bidRow(e)])));
  bids.rows.forEach((b) => state.seenBids.add(b.id));
  $("allocations").querySelector("tbody").replaceChildren(
    ...foldAllocations(allocations.rows).flatMap((e) => (e.allocs ? gangAllocationRows(e) : [allocationRow(e.alloc)])));
  $("ledger").replaceChildren(
    ...(ledger.rows.length
      ? ledger.rows.map((e) => h("li", {}, `${money(e.amount)} — ${e.reason || e.kind || ""} `, h("span", { class: "muted small" }, when(e.created_at))))
      : [muted("None.", "li")]),
  );
  $("bids-older").hidden = !bids.more;
  $("allocations-older").hidden = !allocations.more;
  $("ledger-older").hidden = !ledger.more;
}

for (const list of ["bids", "allocations", "ledger"]) {
  $(`${list}-older`).addEventListener("click", () => {
    state.pages[list] += 1;
    refreshTenant().catch(report);
  });
}

// an entry of foldBids(): a one-node bid, or a gang (rank 0's bid; its members in the next row)
function bidRow(entry) {
  const b = entry.bid, gang = entry.members ? num(b.node_count, 1) ?? entry.members.length : 0;
  const fresh = !state.seenBids.has(b.id) && state.seenBids.size;
  const labels = Object.entries(b.labels && typeof b.labels === "object" ? b.labels : {});
  const gpus = gang
    ? h("span", { title: `${gang} nodes × ${fixed(b.gpu_count, 0)} GPUs` }, `${gang} × ${fixed(b.gpu_count, 0)} × ${b.gpu_model}`)
    : `${fixed(b.gpu_count, 0)} × ${b.gpu_model}`;
  return h("tr", { class: `bid${gang ? " gang" : ""}${fresh ? " fresh" : ""}`, "data-bid": b.id, "data-gang": gang ? entry.gang : null },
    h("td", {}, String(b.id), gang ? h("div", { class: "small gang-of" }, `gang of ${gang}`) : null,
      b.idempotency_key ? h("div", { class: "small muted key", title: b.idempotency_key }, String(b.idempotency_key)) : null),
    h("td", {}, gpus), h("td", {}, String(b.region)),
    h("td", {}, kindCell(b.capacity || "spot")), h("td", { class: "num" }, money(b.max_price)),
    h("td", {}, statusCell(b.status), b.hold_reason ? h("div", { class: "small muted" }, String(b.hold_reason)) : null),
    h("td", { class: "labels" }, labels.map(([k, v]) => h("span", { class: "chip", title: `${k}=${v}` }, `${k}=${v}`))),
    h("td", {}, when(b.created_at)));
}

// how long an allocation ran (so far), or "–"
function ranFor(a) {
  const started = num(a.started_at), ended = num(a.ended_at ?? Date.now() / 1000);
  const ran = started !== null && ended !== null ? Math.max(0, (ended - started) / 60) : null;
  return a.status === "reserved" || ran === null ? "–" : `${ran.toFixed(1)} min`;
}
const reasonFor = (a) => String(a.notice_reason || a.end_reason || "");

function allocationRow(a) {
  return h("tr", { "data-allocation": a.id },
    h("td", {}, String(a.id)), h("td", {}, String(a.bid_id)), h("td", {}, String(a.node_id)),
    h("td", {}, statusCell(a.status)), h("td", {}, reasonFor(a)),
    h("td", { class: "num" }, money(a.price)), h("td", { class: "num" }, fixed(a.charged_amount, 4)),
    h("td", { class: "num" }, ranFor(a)));
}

$("signin").addEventListener("submit", (event) => {
  event.preventDefault();
  const key = $("key").value.trim();
  if (!key) return;
  state.key = key;
  state.seenBids.clear();
  state.gangOf.clear();
  state.gangSize.clear();
  state.pages = { bids: 1, allocations: 1, ledger: 1 };
  sessionStorage.setItem("spotgpu-key", key);
  $("key").value = "";
  showSignedIn();
  refreshTenant().catch((error) => {
    if (error.status === 401 || error.status === 403) {
      signOut();
      $("who").textContent = "That key was refused";
    } else report(error);
  });
});

function showSignedIn() {
  $("signout").hidden = !state.key;
  $("key").hidden = !!state.key;
  $("signin-button").hidden = !!state.key;
}

function signOut() {
  state.key = "";
  sessionStorage.removeItem("spotgpu-key");
  $("who").textContent = "Signed out";
  $("tenant-card").hidden = true;
  showSignedIn();
}
$("signout").addEventListener("click", signOut);

// ------------------------------------------------------------------ live updates

function report(error) {
  console.warn("dashboard refresh failed:", error.message || error);
}

async function refreshAll() {
  if (state.refreshing) { state.again = true; return; }
  state.refreshing = true;
  try {
    renderPools();
    await Promise.all([refreshPool(), refreshNodes(), refreshImages(), refreshTenant(), refreshHealth()]);
  } catch (error) {
    report(error);
  } finally {
    state.refreshing = false;
    $("live").dataset.refreshes = Number($("live").dataset.refreshes || 0) + 1;  // (tests wait on it)
    if (state.again) { state.again = false; setTimeout(refreshAll, 250); }
  }
}

async function refreshHealth() {
  const h = await getJSON("/health");
  $("health").textContent = `market ${h.version} · ${h.ticks} ticks` + (h.last_tick_seconds != null ? ` · last tick ${(h.last_tick_seconds * 1000).toFixed(1)} ms` : "");
}

function connect() {
  const source = new EventSource(`${API}/stream`);
  source.addEventListener("market", (event) => {
    const body = JSON.parse(event.data);
    state.pools = body.pools.sort((a, b) => poolKey(a).localeCompare(poolKey(b)));
    $("live").textContent = "live";
    $("live").className = "pill on";
    refreshAll();
  });
  source.onerror = () => {
    $("live").textContent = "reconnecting…";
    $("live").className = "pill off";
  };
}

showSignedIn();
connect();
