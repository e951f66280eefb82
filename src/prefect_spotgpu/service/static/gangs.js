// Gangs on the dashboard. A gang bid (node_count above 1) is node_count member bids with the
// same terms: rank 0 is the lowest id, every member's gang_id is rank 0's id, and each member
// row lists the gang's `members` in rank order. The API pages them as rows like any other bid;
// this file folds them, so a gang shows as ONE entry (rank 0's bid, "gang of N", its GPUs as
// node_count × gpu_count) with its members beneath it (each member's bid id, rank, status and
// newest allocation: node, id, status). The allocations list folds the same way: one entry per
// gang (its newest placement: rank 0's status, price and time run, every member's node, the
// cost of all), every member's allocation beneath it.
//
// Paging stays by bid rows (100 a page, "Show older" for the next 100): a gang of N takes N
// rows, and a gang cut by the last page's end is completed with one more read of exactly the
// rows it lacks, so every gang shows once, whole. The allocations list pages by allocations;
// a gang's older ones join its entry as their pages come.
//
// Loaded before app.js, and called only by it: h(), num(), fixed(), statusCell(), getJSON(),
// getPages(), state... are app.js's, looked up when called. Text only, as in app.js.
"use strict";

// `pages` pages of the tenant's bids (newest first), and a gang that the last page cuts
// completed: the rows between its rank 0 and the page's end, read at once (a gang's member
// rows are written together, so that is its missing members, give or take a bid written
// beside them). Whether older bids follow.
async function getBidPages(pages) {
  const got = await getPages("/bids?limit=100", pages);
  const last = got.rows[got.rows.length - 1];
  const first = last && Array.isArray(last.members) ? num(last.members[0], 1) : null;
  if (!got.more || first === null || first >= last.id) return got;
  const gap = Math.min(999, last.id - first);
  const older = await getJSON(`/bids?limit=${gap + 1}&before=${num(last.id, 1)}`, true);
  const rest = older.filter((b) => num(b.id) >= first);
  return { first: got.first, rows: got.rows.concat(rest), more: rest.length < older.length };
}

// Learn which bids are gang members: from the bid rows read, and for an allocation of a
// member whose bid is not among them (a rank, no known gang), by reading that bid once.
async function learnGangs(bids, allocations) {
  const learn = (b) => {
    const gang = num(b.gang_id, 1);
    state.gangOf.set(b.id, gang);
    if (gang === null) return;
    state.gangSize.set(gang, num(b.node_count, 1));
    for (const id of Array.isArray(b.members) ? b.members : []) state.gangOf.set(num(id), gang);
  };
  bids.forEach(learn);
  const unknown = new Set(
    allocations.filter((a) => num(a.rank) !== null && !state.gangOf.has(a.bid_id)).map((a) => num(a.bid_id, 1)));
  await Promise.all([...unknown].filter((id) => id !== null).map((id) =>
    getJSON(`/bids/${id}`, true).then(learn, () => state.gangOf.set(id, null))));
}

// bid rows (newest first) -> entries in that order: {bid} for a one-node bid; for a gang
// {gang, bid: rank 0's row (or its newest member's, when rank 0 was not read), members:
// [{id, rank, row}]} at the place of its newest member
function foldBids(rows) {
  const entries = [], gangs = new Map();
  for (const b of rows) {
    const gang = num(b.gang_id, 1);
    if (gang === null) { entries.push({ bid: b }); continue; }
    let entry = gangs.get(gang);
    if (!entry) {
      entry = { gang, rows: new Map(), ids: [] };
      gangs.set(gang, entry);
      entries.push(entry);
    }
    if (!entry.rows.has(b.id)) entry.rows.set(b.id, b);
    const ids = (Array.isArray(b.members) ? b.members : []).map((id) => num(id, 1)).filter((id) => id !== null);
    if (ids.length > entry.ids.length) entry.ids = ids;
  }
  for (const entry of gangs.values()) {
    entry.bid = entry.rows.get(entry.gang) || entry.rows.values().next().value;
    entry.members = entry.ids.map((id, rank) => ({ id, rank, row: entry.rows.get(id) || null }));
  }
  return entries;
}

// allocation rows (newest first) -> entries in that order: {alloc} for a one-node bid's;
// {gang, allocs} for a gang's, every member's allocation (newest first), at its newest's place
function foldAllocations(rows) {
  const entries = [], gangs = new Map();
  for (const a of rows) {
    const gang = num(a.rank) === null ? null : state.gangOf.get(a.bid_id) ?? null;
    if (gang === null) { entries.push({ alloc: a }); continue; }
    let entry = gangs.get(gang);
    if (!entry) {
      entry = { gang, allocs: [] };
      gangs.set(gang, entry);
      entries.push(entry);
    }
    entry.allocs.push(a);
  }
  return entries;
}

// bid id -> its newest allocation among `rows` (newest first)
function newestAllocations(rows) {
  const newest = new Map();
  for (const a of rows) if (!newest.has(a.bid_id)) newest.set(a.bid_id, a);
  return newest;
}

// a <details> that stays as the viewer left it across refreshes (open unless folded away)
function folding(key, summary, items) {
  return h("details", { "data-fold": key, open: !state.closed.has(key) },
    h("summary", { class: "small muted" }, summary), h("ol", { class: "members" }, items));
}
document.addEventListener("toggle", (event) => {
  const key = event.target.dataset && event.target.dataset.fold;
  if (!key) return;
  if (event.target.open) state.closed.delete(key);
  else state.closed.add(key);
}, true); // toggle does not bubble: caught on its way down

// the row beneath a gang's bid: each member's bid id, rank, status and newest allocation
function membersRow(entry, newest) {
  const items = entry.members.map((m) => {
    const a = newest.get(m.id);
    return h("li", { class: "member", "data-member": m.id, "data-rank": m.rank },
      h("span", { class: "rank" }, `rank ${m.rank}`), " · ", h("span", { class: "member-bid" }, `bid ${m.id}`), " ",
      statusCell((m.row || entry.bid).status),
      a ? h("span", { class: "placement", "data-allocation": a.id }, ` · node ${a.node_id} · allocation ${a.id} `, statusCell(a.status))
        : h("span", { class: "placement muted" }, " · no allocation"));
  });
  const running = entry.members.filter((m) => newest.get(m.id)?.status === "running").length;
  const summary = `${items.length} members, ranks 0–${items.length - 1}` + (running ? ` · ${running} running` : "");
  return h("tr", { class: "members", "data-members-of": entry.gang },
    h("td", { colspan: 8 }, folding(`bids:${entry.gang}`, summary, items)));
}

// a gang's entry in the allocations list and the row of its members' allocations beneath it
function gangAllocationRows(entry) {
  const latest = new Map(); // rank -> its newest allocation
  for (const a of entry.allocs) if (!latest.has(num(a.rank))) latest.set(num(a.rank), a);
  const ranks = [...latest.keys()].sort((x, y) => x - y);
  const lead = latest.get(ranks[0]);
  const size = state.gangSize.get(entry.gang) ?? ranks.length;
  const cost = entry.allocs.reduce((sum, a) => sum + (num(a.charged_amount, 0) ?? 0), 0);
  const row = h("tr", { class: "allocation gang", "data-gang": entry.gang },
    h("td", {}, h("span", { class: "gang-of" }, `gang of ${size}`), h("div", { class: "small muted" }, `${entry.allocs.length} allocations`)),
    h("td", {}, String(entry.gang)), h("td", {}, ranks.map((r) => String(latest.get(r).node_id)).join(", ")),
    h("td", {}, statusCell(lead.status)), h("td", {}, reasonFor(lead)),
    h("td", { class: "num" }, money(lead.price)), h("td", { class: "num" }, fixed(cost, 4)),
    h("td", { class: "num" }, ranFor(lead)));
  const items = entry.allocs.map((a) =>
    h("li", { class: "member", "data-allocation": a.id, "data-rank": num(a.rank) },
      h("span", { class: "rank" }, `rank ${num(a.rank)}`), ` · allocation ${a.id} · bid ${a.bid_id} · node ${a.node_id} `,
      statusCell(a.status), reasonFor(a) ? ` ${reasonFor(a)}` : "", ` · ${fixed(a.charged_amount, 4)} · ${ranFor(a)}`));
  return [row, h("tr", { class: "members", "data-members-of": entry.gang },
    h("td", { colspan: 8 }, folding(`allocations:${entry.gang}`, `${items.length} member allocations`, items)))];
}
