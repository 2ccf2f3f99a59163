// Jobs: the list, a form for bench-serve and eval-serve, each job's progress from its SSE
// stream, a finished bench's plot (tok/s and TTFT against concurrency), eval's table, cancel.

import { get, post, stream } from "./api.js";
import { linePlot } from "./chart.js";
import { $, $$, el, ms, num, replace, say } from "./dom.js";

const FOLLOWED_FINISHED = 5; // the newest finished jobs show their results without a click
const followed = new Map(); // job id -> AbortController
const cards = new Map(); // job id -> {node, parts}

export function init() {
  const form = $("#job-form");
  form.kind.addEventListener("change", () => {
    for (const set of $$("fieldset[data-kind]", form)) set.hidden = set.dataset.kind !== form.kind.value;
  });
  form.addEventListener("submit", submit);
}

export function shown() { refresh(); }

function configOf(form) {
  const data = new FormData(form);
  const config = {};
  if (data.get("model")) config.model = data.get("model");
  if (data.get("kind") === "bench-serve") {
    config.concurrency = String(data.get("concurrency")).split(/[ ,]+/).filter(Boolean).map(Number);
    for (const name of ["requests", "prompt_tokens", "max_tokens"]) config[name] = Number(data.get(name));
  } else {
    config.chunk_chars = Number(data.get("chunk_chars"));
    config.choices = data.get("choices") === "on";
  }
  return config;
}

async function submit(event) {
  event.preventDefault();
  const form = event.target;
  try {
    const { job } = await post("/api/jobs", { kind: form.kind.value, config: configOf(form) });
    say(`Job ${job.id} started`);
    await refresh();
  } catch (error) {
    say(`The job was refused: ${error.message}`, "error");
  }
}

async function refresh() {
  let jobs;
  try { jobs = (await get("/api/jobs?limit=20")).jobs; } catch (error) {
    if (error.status !== 401) say(`Jobs: ${error.message}`, "error");
    return;
  }
  const list = $("#job-list");
  replace(list, jobs.map((job) => card(job).node));
  if (!jobs.length) list.append(el("li", { class: "muted" }, "No jobs yet: start one with the form."));
  let finished = 0;
  for (const job of jobs) {
    const done = ["done", "failed", "zombie"].includes(job.status);
    if (!done || (finished += 1) <= FOLLOWED_FINISHED) follow(job);
  }
}

function card(job) {
  let entry = cards.get(job.id);
  if (!entry) {
    const parts = {
      status: el("span", { class: "badge" }),
      progress: el("progress", { max: 1, value: 0 }),
      message: el("div", { class: "muted small" }),
      result: el("div", { class: "result" }),
      cancel: el("button", { type: "button", class: "danger", onclick: () => cancel(job.id) }, "Cancel"),
      show: el("button", { type: "button", class: "secondary", onclick: () => follow(job, true) }, "Results"),
    };
    parts.progress.setAttribute("aria-label", `${job.kind} ${job.id} progress`);
    const node = el("li", { class: "card job", dataset: { job: job.id, kind: job.kind } },
      el("div", { class: "row spread" },
        el("strong", {}, job.kind), el("span", { class: "mono small" }, job.id), parts.status),
      el("div", { class: "muted small" }, `${job.config?.model || "current model"} · started ${job.started_at} UTC`),
      parts.progress, parts.message, el("div", { class: "row" }, parts.cancel, parts.show), parts.result);
    entry = { node, parts, points: [] };
    cards.set(job.id, entry);
  }
  update(entry, job);
  return entry;
}

function update(entry, job) {
  const { parts } = entry;
  parts.status.textContent = job.status;
  parts.status.dataset.status = job.status;
  entry.node.dataset.status = job.status;
  parts.progress.value = job.status === "done" ? 1 : job.progress || 0;
  parts.message.textContent = job.error || job.message || "";
  const live = job.status === "queued" || job.status === "running";
  parts.cancel.hidden = !live;
  parts.show.hidden = live || followed.has(job.id) || Boolean(parts.result.firstChild);
}

async function follow(job, force = false) {
  if (followed.has(job.id) && !force) return;
  const abort = new AbortController();
  followed.set(job.id, abort);
  const entry = card(job);
  const state = { ...job };
  entry.points = [];
  try {
    await stream(`/api/jobs/${encodeURIComponent(job.id)}/stream`, { signal: abort.signal }, ({ event, data }) => {
      if (event === "end") return;
      const e = JSON.parse(data);
      if (e.progress !== undefined) state.progress = e.progress;
      if (e.message) state.message = e.message;
      if (e.type === "started" || e.type === "stage") state.status = "running";
      if (e.type === "metric" && e.kind === "bench") {
        entry.points.push(e);
        renderBench(entry, entry.points);
      }
      if (e.type === "done") {
        state.status = "done";
        state.message = e.summary?.split("\n")[0] || "done";
        if (job.kind === "bench-serve" && e.results?.levels) renderBench(entry, e.results.levels);
        if (job.kind === "eval-serve" && e.results) renderEval(entry, e.results);
      }
      if (e.type === "failed") { state.status = "failed"; state.error = e.error; }
      update(entry, state);
    });
  } catch (error) {
    if (!abort.signal.aborted) entry.parts.message.textContent = `stream: ${error.message}`;
  } finally {
    followed.delete(job.id);
    update(entry, state);
  }
}

function renderBench(entry, levels) {
  const rows = [...levels].sort((a, b) => a.concurrency - b.concurrency);
  const plot = linePlot([
    { name: "tok/s (all streams)", points: rows.map((l) => [l.concurrency, l.aggregate_tps]) },
    { name: "TTFT p50 (ms)", axis: "right", points: rows.map((l) => [l.concurrency, l.ttft_ms_p50]) },
  ], { title: "tok/s and TTFT against concurrency", xLabel: "concurrency", leftLabel: "tok/s", rightLabel: "TTFT ms" });
  const table = el("table", { class: "small" },
    el("thead", {}, el("tr", {}, ["c", "ok", "tok/s", "stream tok/s", "TTFT p50", "TTFT p95"].map((h) => el("th", { scope: "col" }, h)))),
    el("tbody", {}, rows.map((l) => el("tr", {},
      el("td", {}, l.concurrency), el("td", {}, `${l.ok}/${l.requests}`), el("td", {}, num(l.aggregate_tps)),
      el("td", {}, num(l.stream_tps)), el("td", {}, ms(l.ttft_ms_p50)), el("td", {}, ms(l.ttft_ms_p95))))));
  replace(entry.parts.result, plot, el("div", { class: "table-wrap" }, table));
}

function renderEval(entry, results) {
  const rows = [["perplexity", num(results.perplexity, 3)], ["tokens scored", results.tokens]];
  if (results.choices) rows.push(["multiple choice", `${results.choices.correct}/${results.choices.total}`]);
  replace(entry.parts.result, el("table", { class: "small" },
    el("tbody", {}, rows.map(([k, v]) => el("tr", {}, el("th", { scope: "row" }, k), el("td", {}, v))))));
}

async function cancel(id) {
  try {
    await post(`/api/jobs/${encodeURIComponent(id)}/cancel`, {});
    say(`Job ${id} cancelled`);
  } catch (error) {
    say(`Cancel: ${error.message}`, "error");
  }
  refresh();
}
