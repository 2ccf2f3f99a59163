// Live: requests in flight and just finished, from the server's /api/live stream, and the
// headline /metrics figures (read every few seconds while the view shows).

import { get, metricSum, parseMetrics } from "./api.js";
import { $, el, ms, num, replace } from "./dom.js";

let timer = 0;

export function init() {}

export function shown() {
  refreshMetrics();
  clearInterval(timer);
  timer = setInterval(() => {
    if ($("#view-live").hidden) clearInterval(timer);
    else refreshMetrics();
  }, 5000);
}

export function onSnapshot(snapshot) {
  replace($("#live-table tbody"), snapshot.requests.map((r) =>
    el("tr", { class: r.in_flight ? "in-flight" : "", dataset: { id: r.id } },
      el("td", { class: "mono small", title: r.id }, r.id.slice(0, 12)),
      el("td", {}, `${r.method} ${r.route}`),
      el("td", {}, r.model || "–"),
      el("td", {}, r.in_flight ? "streaming" : String(r.status ?? "–")),
      el("td", {}, r.prompt_tokens ?? "–"),
      el("td", {}, r.completion_tokens ?? "–"),
      el("td", {}, ms(r.ttft_ms)),
      el("td", {}, num(r.tok_s)),
      el("td", {}, ms(r.total_ms)))));
}

async function refreshMetrics() {
  let metrics;
  try { metrics = parseMetrics(await get("/metrics")); } catch { return; }
  const count = (name) => metricSum(metrics, name);
  const mean = (name) => {
    const total = count(`${name}_count`);
    return total ? (count(`${name}_sum`) / total) * 1000 : null;
  };
  const figures = [
    ["Requests", count("modelhost_http_requests_total").toFixed(0)],
    ["Running rows", count("modelhost_running_rows").toFixed(0)],
    ["Waiting rows", count("modelhost_waiting_rows").toFixed(0)],
    ["Prompt tokens", count("modelhost_prompt_tokens_total").toFixed(0)],
    ["Generated tokens", count("modelhost_generation_tokens_total").toFixed(0)],
    ["Mean TTFT", ms(mean("modelhost_time_to_first_token_seconds"))],
    ["Mean token gap", ms(mean("modelhost_inter_token_latency_seconds"))],
    ["Prefix-cache hits", `${num(100 * (count("modelhost_prefix_cache_hit_tokens_total") / (count("modelhost_prefix_cache_query_tokens_total") || 1)), 0)}%`],
  ];
  replace($("#headline"), figures.map(([label, value]) =>
    el("div", { class: "figure" }, el("span", { class: "value" }, value), el("span", { class: "muted" }, label))));
  replace($("#speculation"), speculationLines(metrics).map((line) => el("li", {}, line)));
}

// One line per model that guessed ahead: the share of its guesses kept, and its draft
// model's share where one guessed (the /metrics counters of engine/speculation.py).
export function speculationLines(metrics) {
  const byModel = (name) => {
    const out = {};
    for (const s of metrics[name] || []) out[s.labels.model] = (out[s.labels.model] || 0) + s.value;
    return out;
  };
  const drafted = byModel("modelhost_spec_draft_tokens_total");
  const accepted = byModel("modelhost_spec_accepted_tokens_total");
  const modelDrafted = byModel("modelhost_spec_draft_model_tokens_total");
  const modelAccepted = byModel("modelhost_spec_draft_model_accepted_tokens_total");
  const share = (kept, all) => `${num((100 * kept) / all, 0)}%`;
  return Object.keys(drafted).filter((model) => drafted[model] > 0).sort().map((model) => {
    let line = `${model}: speculation kept ${share(accepted[model] || 0, drafted[model])} ` +
      `of ${drafted[model].toFixed(0)} guessed tokens`;
    if (modelDrafted[model] > 0) {
      line += ` (draft model: ${share(modelAccepted[model] || 0, modelDrafted[model])} ` +
        `of ${modelDrafted[model].toFixed(0)})`;
    }
    return line;
  });
}
