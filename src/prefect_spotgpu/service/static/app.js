// The market dashboard: plain JavaScript, no libraries, nothing fetched from another host.
// Public views come from the public API; a signed-in tenant's views use its key in the
// Authorization header. A server-sent event stream (/api/v1/stream) drives every refresh.
"use strict";

const API = "/api/v1";
const state = {
  key: sessionStorage.getItem("spotgpu-key") || "",
  pools: [],
  selected: null, // "model|region|capacity"
  range: 24,
  seenBids: new Set(),
  refreshing: false,
  again: false,
};

const $ = (id) => document.getElementById(id);
const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
const money = (x) => (x === null || x === undefined ? "–" : Number(x).toFixed(2));
const poolKey = (p) => `${p.gpu_model}|${p.region}|${p.capacity || "spot"}`;
const statusCell = (s) => `<span class="status s-${esc(s)}">${esc(s)}</span>`;
const kindCell = (k) => `<span class="kind-${esc(k)}">${k === "on_demand" ? "on-demand" : "spot"}</span>`;

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

// ------------------------------------------------------------------ pools

function renderPools() {
  const body = $("pools").querySelector("tbody");
  $("pools-empty").hidden = state.pools.length > 0;
  if (!state.selected && state.pools.length) {
    const spot = state.pools.find((p) => (p.capacity || "spot") === "spot") || state.pools[0];
    state.selected = poolKey(spot);
  }
  body.innerHTML = state.pools
    .map((p) => {
      const price = p.clearing_price ?? p.reserve_price;
      const discount = price && p.on_demand_price ? `${Math.round((1 - price / p.on_demand_price) * 100)} %` : "–";
      const key = poolKey(p);
      return `<tr class="pool${key === state.selected ? " selected" : ""}" data-key="${esc(key)}">
        <td>${esc(p.gpu_model)}</td><td>${esc(p.region)}</td><td>${kindCell(p.capacity || "spot")}</td>
        <td class="num">${p.gpus_free} / ${p.gpus_total}</td><td class="num">${money(price)}</td>
        <td class="num opt">${money(p.on_demand_price)}</td><td class="num">${discount}</td>
        <td class="num opt">${p.waiting_bids}</td></tr>`;
    })
    .join("");
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

function drawChart(series, forecast, pool) {
  const svg = $("chart");
  // drawn at the element's own size, so text is never stretched (a phone's width included)
  const box = svg.getBoundingClientRect();
  const W = Math.max(280, Math.round(box.width) || 800), H = Math.max(160, Math.round(box.height) || 260);
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const now = Date.now();
  const span = state.range * 3600e3;
  const t0 = now - span, t1 = now + span / 4;
  const prices = series.map((p) => p.close);
  for (const f of forecast) prices.push(f.low, f.high);
  if (pool && pool.on_demand_price) prices.push(pool.on_demand_price);
  let lo = prices.length ? Math.min(...prices) : 0, hi = prices.length ? Math.max(...prices) : 1;
  if (hi - lo < 1e-9) { lo -= 0.5; hi += 0.5; }
  const pad = (hi - lo) * 0.08;
  lo = Math.max(0, lo - pad); hi += pad;
  const x = (t) => PAD.l + ((t - t0) / (t1 - t0)) * (W - PAD.l - PAD.r);
  const y = (p) => H - PAD.b - ((p - lo) / (hi - lo)) * (H - PAD.t - PAD.b);
  const parts = [];
  for (const [a, b] of cheapSpans(t0, t1)) {
    parts.push(`<rect class="night" x="${x(a).toFixed(1)}" y="${PAD.t}" width="${(x(b) - x(a)).toFixed(1)}" height="${H - PAD.t - PAD.b}" fill="rgba(30,41,80,.07)"/>`);
  }
  for (let i = 0; i <= 4; i++) {
    const p = lo + ((hi - lo) * i) / 4;
    parts.push(`<line x1="${PAD.l}" x2="${W - PAD.r}" y1="${y(p).toFixed(1)}" y2="${y(p).toFixed(1)}" stroke="#e3e6ec"/>`);
    parts.push(`<text x="${PAD.l - 6}" y="${(y(p) + 4).toFixed(1)}" text-anchor="end">${p.toFixed(2)}</text>`);
  }
  const ticks = Math.max(2, Math.min(state.range > 48 ? 7 : 6, Math.floor(W / 110)));
  for (let i = 0; i <= ticks; i++) {
    const t = t0 + ((t1 - t0) * i) / ticks;
    const d = new Date(t);
    const label = state.range > 48 ? d.toLocaleDateString([], { weekday: "short", day: "numeric" }) : d.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
    const anchor = i === 0 ? "start" : i === ticks ? "end" : "middle";
    parts.push(`<text x="${x(t).toFixed(1)}" y="${H - 6}" text-anchor="${anchor}">${esc(label)}</text>`);
  }
  parts.push(`<line x1="${x(now).toFixed(1)}" x2="${x(now).toFixed(1)}" y1="${PAD.t}" y2="${H - PAD.b}" stroke="#94a3b8" stroke-dasharray="3 3"/>`);
  if (pool && pool.on_demand_price) {
    const yo = y(pool.on_demand_price).toFixed(1);
    parts.push(`<line class="on-demand" x1="${PAD.l}" x2="${W - PAD.r}" y1="${yo}" y2="${yo}" stroke="#9333ea" stroke-dasharray="6 4"/>`);
  }
  if (forecast.length) {
    const upper = forecast.map((f) => `${x(Date.parse(f.at)).toFixed(1)},${y(f.high).toFixed(1)}`);
    const lower = forecast.map((f) => `${x(Date.parse(f.at)).toFixed(1)},${y(f.low).toFixed(1)}`).reverse();
    parts.push(`<polygon class="forecast-band" points="${[...upper, ...lower].join(" ")}" fill="rgba(37,99,235,.14)" stroke="none"/>`);
    const mid = forecast.map((f) => `${x(Date.parse(f.at)).toFixed(1)},${y(f.expected).toFixed(1)}`);
    parts.push(`<polyline class="forecast" points="${mid.join(" ")}" fill="none" stroke="#2563eb" stroke-dasharray="4 3"/>`);
  }
  if (series.length) {
    const points = series.map((p) => `${x(p.t).toFixed(1)},${y(p.close).toFixed(1)}`).join(" ");
    parts.push(`<polyline id="price-line" data-points="${series.length}" points="${points}" fill="none" stroke="#2563eb" stroke-width="2"/>`);
  }
  svg.innerHTML = parts.join("");
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
    forecast = f.points;
    note.textContent = f.error ? `Forecast error on held-back history: ${(f.error.mae ?? 0).toFixed(3)} per GPU-hour (MAE).` : "Forecast from the history so far.";
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
  if (!pool) { box.innerHTML = '<p class="muted">No pool selected.</p>'; return; }
  $("depth-pool").textContent = `${pool.gpu_model} ${pool.region}`;
  const book = await getJSON(`/market/depth/${encodeURIComponent(pool.gpu_model)}/${encodeURIComponent(pool.region)}?capacity=${pool.capacity || "spot"}`);
  if (!book.levels.length) { box.innerHTML = '<p class="muted">No open bids.</p>'; return; }
  const most = Math.max(...book.levels.map((l) => l.held + l.waiting));
  box.innerHTML = book.levels
    .map((l) => `<div class="depth-row"><span>${money(l.price)}</span>
      <div class="depth-bar"><div class="held" style="width:${(100 * l.held) / most}%"></div><div class="waiting" style="width:${(100 * l.waiting) / most}%"></div></div>
      <span class="num small">${l.held + l.waiting} GPUs</span></div>`)
    .join("");
}

async function refreshPool() {
  const pool = selectedPool();
  await Promise.all([refreshChart(pool), refreshDepth(pool)]);
}

// ------------------------------------------------------------------ nodes

async function refreshNodes() {
  const nodes = await getJSON("/market/nodes");
  $("nodes").innerHTML = nodes.length
    ? nodes
        .map((n) => {
          const gpus = [];
          for (let i = 0; i < n.gpu_count; i++) {
            const t = n.gpus.find((g) => g.index === i) || {};
            const util = t.utilization;
            const title = `GPU ${i}` + (util != null ? `: ${util} % busy` : "") + (t.memory_used_mb != null ? `, ${t.memory_used_mb} MB` : "") + (t.power_w != null ? `, ${t.power_w} W` : "") + (t.temperature_c != null ? `, ${t.temperature_c} °C` : "");
            gpus.push(`<div class="gpu${i < n.gpus_busy ? " busy" : ""}" title="${esc(title)}">${util != null ? `<div class="fill" style="height:${util}%"></div>` : ""}${i}</div>`);
          }
          return `<div class="node" data-node="${n.id}"><div class="title"><span>Node ${n.id}</span>${statusCell(n.state)}</div>
            <div class="small muted">${esc(n.gpu_model)} · ${esc(n.region)} · ${kindCell(n.capacity)} · reserve ${money(n.reserve_price)}</div>
            <div class="small">${n.gpus_busy} / ${n.gpu_count} GPUs in use</div><div class="gpus">${gpus.join("")}</div></div>`;
        })
        .join("")
    : '<p class="muted">No nodes yet.</p>';
}

// ------------------------------------------------------------------ the signed-in tenant

async function refreshTenant() {
  const card = $("tenant-card");
  if (!state.key) { card.hidden = true; return; }
  const [me, bids, allocations, ledger] = await Promise.all([
    getJSON("/me", true), getJSON("/bids?limit=1000", true), getJSON("/allocations?limit=1000", true), getJSON("/ledger", true),
  ]);
  card.hidden = false;
  $("who").textContent = `Signed in as ${me.name}`;
  $("balance").textContent = money(me.balance);
  $("spent").textContent = money(ledger.spent);
  $("credits").textContent = money(ledger.credits);
  $("preemptions").textContent = allocations.filter((a) => a.status === "preempted").length;
  $("bids").querySelector("tbody").innerHTML = bids
    .slice()
    .reverse()
    .map((b) => {
      const fresh = !state.seenBids.has(b.id) && state.seenBids.size ? " fresh" : "";
      return `<tr class="bid${fresh}" data-bid="${b.id}"><td>${b.id}</td><td>${b.gpu_count} × ${esc(b.gpu_model)}</td><td>${esc(b.region)}</td>
      <td>${kindCell(b.capacity || "spot")}</td><td class="num">${money(b.max_price)}</td><td>${statusCell(b.status)}</td>
      <td>${esc(new Date(b.created_at).toLocaleString())}</td></tr>`;
    })
    .join("");
  bids.forEach((b) => state.seenBids.add(b.id));
  $("allocations").querySelector("tbody").innerHTML = allocations
    .slice()
    .reverse()
    .map((a) => {
      const ran = ((a.ended_at ?? Date.now() / 1000) - a.started_at) / 60;
      return `<tr data-allocation="${a.id}"><td>${a.id}</td><td>${a.bid_id}</td><td>${a.node_id}</td><td>${statusCell(a.status)}</td>
      <td>${esc(a.notice_reason || a.end_reason || "")}</td><td class="num">${money(a.price)}</td><td class="num">${a.charged_amount.toFixed(4)}</td>
      <td class="num">${a.status === "reserved" ? "–" : `${Math.max(0, ran).toFixed(1)} min`}</td></tr>`;
    })
    .join("");
  $("ledger").innerHTML = ledger.entries.length
    ? ledger.entries.map((e) => `<li>${money(e.amount)} — ${esc(e.reason || e.kind || "")} <span class="muted small">${esc(new Date(e.created_at).toLocaleString())}</span></li>`).join("")
    : '<li class="muted">None.</li>';
}

$("signin").addEventListener("submit", (event) => {
  event.preventDefault();
  const key = $("key").value.trim();
  if (!key) return;
  state.key = key;
  state.seenBids.clear();
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
    await Promise.all([refreshPool(), refreshNodes(), refreshTenant(), refreshHealth()]);
  } catch (error) {
    report(error);
  } finally {
    state.refreshing = false;
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
