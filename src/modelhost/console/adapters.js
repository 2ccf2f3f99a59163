// LoRA adapters in the Models view: each base's adapters under its row (from /v1/models'
// `parent`, with /api/adapters' loaded bytes and running requests where the server has that
// route), a form that loads one at run time (POST /api/adapters) and an Unload button per
// adapter (DELETE /api/adapters/{name}). A refusal is shown as the server words it.

import { get, post, request } from "./api.js";
import { $, bytes, el, replace, say } from "./dom.js";

let held = {}; // adapter name -> /api/adapters row: {name, model, path, loaded, bytes?, running?}
const pending = new Set(); // adapters with an unload in flight
const refusals = new Map(); // adapter name -> the server's last refusal of its unload
let changed = async () => {};

// `onChange()` runs after a load or an unload: the models view lists again.
export function init(onChange) {
  changed = onChange;
  $("#adapter-form").addEventListener("submit", (event) => { event.preventDefault(); load(); });
}

// The adapters' state, fetched again when `listing` (/v1/models) has any (the route is absent
// on a one-model server: there, no state).
export async function refresh(listing) {
  if (!listing.some((row) => row.adapter)) {
    held = {};
    return;
  }
  try {
    held = Object.fromEntries((await get("/api/adapters")).data.map((row) => [row.name, row]));
  } catch {
    held = {};
  }
}

// The bases the form offers: the generative models, the current one first.
export function offerBases(listing) {
  const select = $("#adapter-model");
  const chosen = select.value;
  const bases = listing.filter((row) => !row.adapter && !row.embeddings && !row.rerank);
  bases.sort((a, b) => Number(Boolean(b.current)) - Number(Boolean(a.current)));
  replace(select, bases.map((row) => el("option", { value: row.id }, row.id)));
  if (bases.some((row) => row.id === chosen)) select.value = chosen;
}

// The row under a base's row that lists its adapters; null when it has none.
export function adapterRow(base, listing, columns) {
  const mine = listing.filter((row) => row.adapter && row.parent === base);
  if (!mine.length) return null;
  return el("tr", { class: "adapters", dataset: { base } },
    el("td", { colspan: String(columns) },
      el("ul", { class: "adapter-list", "aria-label": `LoRA adapters of ${base}` },
        mine.map((row) => adapterItem(row)))));
}

function adapterItem(row) {
  const state = held[row.id];
  const words = [];
  if (state?.loaded) {
    words.push(`loaded ${bytes(state.bytes)}`);
    if (state.running !== undefined) words.push(`${state.running} running`);
  } else if (state) {
    words.push("not loaded");
  }
  const note = refusals.get(row.id);
  return el("li", { dataset: { adapter: row.id, loaded: state?.loaded ? "yes" : "no" } },
    el("span", { class: "badge" }, "LoRA"), " ",
    el("strong", {}, row.id), " ",
    el("code", { class: "muted small", title: "the adapter's files" }, row.root || "–"), " ",
    el("span", { class: "state muted small" }, words.join(" · ")), " ",
    el("button", {
      type: "button", class: "secondary", disabled: pending.has(row.id),
      "aria-label": `Unload adapter ${row.id}`, onclick: () => unload(row.id),
    }, pending.has(row.id) ? "working…" : "Unload"),
    note ? el("div", { class: "error small" }, note) : null);
}

async function unload(name) {
  pending.add(name);
  refusals.delete(name);
  await changed();
  try {
    await request(`/api/adapters/${encodeURIComponent(name)}`, { method: "DELETE" });
    say(`${name}: adapter unloaded`);
  } catch (error) {
    refusals.set(name, error.message);
    say(`${name}: ${error.message}`, "error");
  } finally {
    pending.delete(name);
    await changed();
  }
}

async function load() {
  const form = $("#adapter-form"), status = $("#adapter-status"), button = $("#adapter-button");
  const name = form.elements.name.value.trim(), path = form.elements.path.value.trim();
  const model = form.elements.model.value;
  if (!name || !path) return;
  button.disabled = true;
  status.className = "muted small";
  status.textContent = `${name}: loading…`;
  try {
    const answer = await post("/api/adapters", { name, path, ...(model ? { model } : {}) });
    status.textContent = `${name}: loaded for ${answer.model} (${bytes(answer.bytes)})`;
    say(`${name}: adapter loaded`);
    form.elements.name.value = form.elements.path.value = "";
  } catch (error) {
    status.className = "error small";
    status.textContent = `${name}: ${error.message}`;
    say(`Adapter ${name}: ${error.message}`, "error");
  } finally {
    button.disabled = false;
    await changed();
  }
}
