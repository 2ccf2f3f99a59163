// The console's entry: the API key prompt, the views (one per hash), and the live stream that
// feeds the Models and Live views.

import { apiKey, get, onUnauthorized, stream } from "./api.js";
import { $, $$, say } from "./dom.js";
import * as jobs from "./jobs.js";
import * as live from "./live.js";
import * as models from "./models.js";
import * as playground from "./playground.js";

const VIEWS = { models, live, playground, jobs };
let started = false;
let initialised = false;
let liveAbort = null;

function showView() {
  const name = location.hash.slice(1) in VIEWS ? location.hash.slice(1) : "models";
  for (const section of $$(".view")) section.hidden = section.id !== `view-${name}`;
  for (const link of $$("nav a")) {
    if (link.dataset.view === name) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  VIEWS[name].shown?.();
}

function askForKey(message) {
  if (liveAbort) liveAbort.abort();
  liveAbort = null;
  started = false;
  for (const section of $$(".view")) section.hidden = true;
  $("#key-prompt").hidden = false;
  $("#key-error").textContent = message || "";
  $("#key-input").focus();
}

// One stream for the whole page: each snapshot goes to every view that shows it.
async function followLive() {
  liveAbort = new AbortController();
  const signal = liveAbort.signal;
  while (!signal.aborted) {
    try {
      await stream("/api/live", { signal }, ({ event, data }) => {
        if (event !== "snapshot") return;
        const snapshot = JSON.parse(data);
        models.onSnapshot(snapshot);
        live.onSnapshot(snapshot);
      });
    } catch (error) {
      if (signal.aborted || error.status === 401) return;
    }
    await new Promise((resolve) => setTimeout(resolve, 1500)); // as an EventSource would
  }
}

async function start() {
  let index;
  try {
    index = await get("/v1");
  } catch (error) {
    if (error.status === 401) return; // the prompt is up
    say(`The server did not answer: ${error.message}`, "error");
    return;
  }
  $("#key-prompt").hidden = true;
  $("#server-info").textContent = `${index.name} ${index.version} · current ${index.model ?? "–"}`;
  if (!initialised) {
    initialised = true;
    for (const view of Object.values(VIEWS)) view.init?.();
  }
  if (!started) {
    started = true;
    followLive();
  }
  showView();
}

onUnauthorized(() => askForKey(apiKey.get() ? "That key was refused." : ""));

$("#key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  apiKey.set($("#key-input").value.trim());
  $("#key-input").value = "";
  start();
});

addEventListener("hashchange", () => { if (started) showView(); });
start();
