// Models: every local model, its state and bytes against the budget, its rows and recent
// tokens per second; load, unload, pin and unpin through /api/models/{id}/{action}; a pull
// from the Hugging Face hub through Ollama's /api/pull, its NDJSON progress on a bar; each
// base's LoRA adapters under its row (adapters.js).

import * as adapters from "./adapters.js";
import { get, metricSum, parseMetrics, post, request } from "./api.js";
import { sparkline } from "./chart.js";
import { $, $$, bytes, el, num, replace, say } from "./dom.js";

const SAMPLE_S = 5;
const KEPT_SAMPLES = 60; // five minutes of tokens per second per model
let listing = [];
let residency = null;
let rows = {}; // model id -> {running, waiting}, from /metrics
let kvStore = null; // /stats.kv_store: the prefix KV store on disk
let packedBytes = 0; // /stats.disk_caches.packed_bytes: every packed weights copy on disk
let diskCaches = {}; // model id -> /stats.disk_caches row: its packed weights and KV blocks on disk
let latest = { requests: [] };
let residentKey = "";
const history = new Map(); // model id -> [tok/s, ...]
const pending = new Set(); // models with an action in flight
const refusals = new Map(); // model id -> the server's last refusal
const listeners = new Set();

export function models() { return listing; }
export function onModels(fn) { listeners.add(fn); if (listing.length) fn(listing); }

export function init() {
  $("#pull-form").addEventListener("submit", (event) => { event.preventDefault(); pull(); });
  adapters.init(refresh);
  setInterval(sample, SAMPLE_S * 1000);
  setInterval(() => { if (!$("#view-models").hidden) refreshRows(); }, SAMPLE_S * 1000);
  refresh();
}

export function shown() { refresh(); refreshRows(); }

export async function refresh() {
  try {
    listing = (await get("/v1/models")).data;
    await adapters.refresh(listing);
  } catch (error) {
    if (error.status !== 401) say(`Models: ${error.message}`, "error");
    return;
  }
  adapters.offerBases(listing);
  for (const fn of listeners) fn(listing);
  render();
}

async function refreshRows() {
  await adapters.refresh(listing); // the requests running with each adapter
  try {
    const metrics = parseMetrics(await get("/metrics"));
    rows = {};
    for (const name of ["modelhost_running_rows", "modelhost_waiting_rows"]) {
      for (const sample of metrics[name] || []) {
        const row = (rows[sample.labels.model] ||= { running: 0, waiting: 0 });
        row[name.includes("running") ? "running" : "waiting"] += sample.value;
      }
    }
    render();
  } catch { /* the next tick tries again */ }
  try {
    const stats = await get("/stats");
    kvStore = stats.kv_store || null;
    packedBytes = stats.disk_caches?.packed_bytes || 0;
    diskCaches = Object.fromEntries((stats.disk_caches?.models || []).map((m) => [m.id, m]));
    render();
  } catch { /* the next tick tries again */ }
}

export function onSnapshot(snapshot) {
  latest = snapshot;
  if (!snapshot.models) return;
  residency = snapshot.models;
  const key = residency.resident.map((m) => `${m.id}:${m.state}:${m.pinned}`).join(",") + residency.current;
  if (key !== residentKey) {
    residentKey = key;
    refresh(); // a model came, went or changed state: its /v1/models row changed too
  } else {
    render();
  }
}

function sample() {
  const rates = {};
  for (const request of latest.requests || []) {
    if (request.in_flight && request.model && request.tok_s) {
      rates[request.model] = (rates[request.model] || 0) + request.tok_s;
    }
  }
  const ids = new Set([...history.keys(), ...Object.keys(rates)]);
  for (const id of ids) {
    const values = history.get(id) || [];
    values.push(rates[id] || 0);
    history.set(id, values.slice(-KEPT_SAMPLES));
  }
}

function residentOf(id) {
  return residency?.resident.find((m) => m.id === id) || null;
}

async function act(id, action) {
  pending.add(id);
  refusals.delete(id);
  render();
  const path = `/api/models/${id.split("/").map(encodeURIComponent).join("/")}/${action}`;
  try {
    await post(path, {});
    say(`${id}: ${action} done`);
  } catch (error) {
    refusals.set(id, error.message);
    say(`${id}: ${error.message}`, "error");
  } finally {
    pending.delete(id);
    await refresh();
  }
}

function stateText(row, resident) {
  if (row.refusal) return "cannot serve";
  if (resident?.state === "loading" || row.state === "loading") {
    const progress = resident?.progress ?? row.progress;
    return progress === undefined ? "loading" : `loading ${Math.round(progress * 100)}%`;
  }
  const words = [row.resident ? (resident?.state || row.state || "resident") : "idle"];
  if (resident?.pinned) words.push("pinned");
  if (row.current) words.push("current");
  return words.join(" · ");
}

// What a model serves besides chat: /v1/models marks rerankers and embedding models.
function kindBadge(row) {
  const kind = row.rerank ? "rerank" : row.embeddings ? "embedding" : null;
  return kind ? el("span", { class: "badge", dataset: { kind } }, kind) : null;
}

function render() {
  renderBudget();
  const body = $("#models-table tbody");
  const columns = $$("#models-table thead th").length;
  replace(body, listing.filter((row) => !row.adapter).flatMap((row) => {
    const resident = residentOf(row.id);
    const busy = pending.has(row.id);
    const counts = rows[row.id] || { running: 0, waiting: 0 };
    const rates = history.get(row.id) || [];
    const actions = el("td", { class: "actions" });
    const button = (label, action, kind) => el("button", {
      type: "button", class: kind, disabled: busy || Boolean(row.refusal),
      "aria-label": `${label} ${row.id}`, onclick: () => act(row.id, action),
    }, label);
    if (row.resident) actions.append(button("Unload", "unload", "secondary"));
    else actions.append(button("Load", "load"));
    actions.append(resident?.pinned ? button("Unpin", "unpin", "secondary") : button("Pin", "pin", "secondary"));
    const note = refusals.get(row.id) || row.refusal;
    return [el("tr", { dataset: { model: row.id, state: row.resident ? "resident" : "idle" } },
      el("th", { scope: "row" }, row.id, " ", kindBadge(row), note ? el("div", { class: "error small" }, note) : null),
      el("td", {}, row.format || "–"),
      el("td", {}, resident ? bytes(resident.bytes) : bytes(row.estimate_bytes ?? row.size_bytes)),
      el("td", { class: "disk" }, diskText(diskCaches[row.id])),
      el("td", { class: "state" }, busy && resident?.state !== "loading" ? "working…" : stateText(row, resident)),
      el("td", {}, `${counts.running} active · ${counts.waiting} queued`),
      el("td", { class: "rate" }, num(rates[rates.length - 1] || 0), " ",
        sparkline(rates, { label: `${row.id} tokens per second, last minutes` })),
      actions), adapters.adapterRow(row.id, listing, columns)];
  }));
}

// What a model's caches take on disk (`modelhost cache clear` removes them).
function diskText(caches) {
  if (!caches) return "–";
  const parts = [];
  if (caches.packed_bytes) parts.push(`packed ${bytes(caches.packed_bytes)}`);
  if (caches.kv_bytes) parts.push(`KV ${bytes(caches.kv_bytes)}`);
  return parts.join(" · ") || "–";
}

function renderBudget() {
  const box = $("#budget");
  if (!residency) return replace(box, el("span", { class: "muted" }, "Residency: waiting for the live stream…"));
  const budget = residency.budget_bytes || 1;
  const bar = el("div", { class: "bar", role: "img",
    "aria-label": `${bytes(residency.resident_bytes)} of ${bytes(budget)} budget in use` });
  residency.resident.forEach((model, index) => {
    const part = el("span", { class: `part s${index % 6}`, title: `${model.id}: ${bytes(model.bytes)}` });
    part.style.width = `${Math.min(100, (model.bytes / budget) * 100)}%`;
    bar.append(part);
  });
  replace(box,
    el("div", { class: "row spread" },
      el("strong", {}, "Budget"),
      el("span", { id: "budget-text" }, `${bytes(residency.resident_bytes)} of ${bytes(budget)} resident`)),
    bar,
    el("div", { class: "legend-row" }, residency.resident.map((model, index) =>
      el("span", { class: `key s${index % 6}` }, `${model.id} ${bytes(model.bytes)}`))),
    kvStore ? el("div", { id: "kv-store-text", class: "muted small" },
      `KV store on disk: ${bytes(kvStore.bytes)} of ${bytes(kvStore.budget_bytes)} ` +
      `(${kvStore.files} blocks, prompts kept across switches and restarts); ` +
      `packed weights on disk: ${bytes(packedBytes)} (loads after the first map them)`) : null);
}

// A pull: one NDJSON line per step ({status}, a file's {digest, total, completed}, or {error}).
async function pull() {
  const input = $("#pull-model"), button = $("#pull-button");
  const bar = $("#pull-progress"), status = $("#pull-status");
  const name = input.value.trim();
  if (!name) return;
  button.disabled = input.disabled = true;
  bar.hidden = false;
  bar.value = 0;
  status.className = "muted small";
  status.textContent = `${name}: starting…`;
  const show = (line) => {
    if (line.error) throw new Error(line.error);
    if (line.total) {
      bar.value = line.completed / line.total;
      status.textContent = `${name}: ${line.status} ${bytes(line.completed)} of ${bytes(line.total)}`;
    } else {
      status.textContent = `${name}: ${line.status}`;
    }
  };
  try {
    const response = await request("/api/pull", { method: "POST", json: { model: name }, raw: true });
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      const lines = buffer.split("\n");
      buffer = lines.pop();
      for (const line of lines) if (line.trim()) show(JSON.parse(line));
    }
    if (buffer.trim()) show(JSON.parse(buffer));
    bar.value = 1;
    say(`${name}: pulled`);
    input.value = "";
  } catch (error) {
    status.className = "error small";
    status.textContent = `${name}: ${error.message}`;
    bar.hidden = true;
    say(`Pull ${name}: ${error.message}`, "error");
  } finally {
    button.disabled = input.disabled = false;
    await refresh();
  }
}
