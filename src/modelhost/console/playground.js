// Playground: chat (streaming, stop, reasoning and tool calls shown as such, TTFT and tok/s),
// structured output, typed decisions, transcription and embeddings. Every answer from a model
// is put on the page as text.

import { apiKey, post, request, stream } from "./api.js";
import { $, $$, el, ms, num, replace, say } from "./dom.js";
import { models, onModels } from "./models.js";

let messages = [];
let attached = []; // data URLs of the images the next message sends
const IMAGE_TYPES = ["image/png", "image/jpeg", "image/webp", "image/gif"];
let running = null; // the AbortController of the chat request in flight
let lastSent = null; // {path, body} for "Copy as curl / Python"
let recorder = null;
let recorded = null;

const chatCapable = (row) => !row.embeddings && !row.transcription && row.capabilities?.chat_completions !== false && !row.refusal;

export function init() {
  for (const tab of $$(".tabs [role=tab]")) {
    tab.addEventListener("click", () => selectTab(tab));
    tab.addEventListener("keydown", (event) => {
      const tabs = $$(".tabs [role=tab]");
      const step = { ArrowRight: 1, ArrowLeft: -1 }[event.key];
      if (!step) return;
      const next = tabs[(tabs.indexOf(tab) + step + tabs.length) % tabs.length];
      next.focus();
      selectTab(next);
    });
  }
  onModels(fillSelects);
  $("#chat-form").addEventListener("submit", (event) => { event.preventDefault(); sendChat(); });
  $("#chat-input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      if (!running) sendChat();
    }
  });
  $("#chat-image").addEventListener("change", (event) => {
    attachFiles([...event.target.files]);
    event.target.value = "";
  });
  $("#chat-input").addEventListener("paste", (event) => {
    const files = [...(event.clipboardData?.files || [])].filter((file) => file.type.startsWith("image/"));
    if (files.length) { event.preventDefault(); attachFiles(files); }
  });
  $("#chat-stop").addEventListener("click", () => running?.abort());
  $("#chat-clear").addEventListener("click", () => { messages = []; attached = []; showAttached(); replace($("#chat-log")); });
  for (const button of $$("[data-copy]")) button.addEventListener("click", () => copy(button.dataset.copy));
  $("#structured-form").addEventListener("submit", runStructured);
  $("#decisions-form").addEventListener("submit", runDecisions);
  $("#transcribe-form").addEventListener("submit", runTranscribe);
  $("#record").addEventListener("click", toggleRecording);
  $("#embed-form").addEventListener("submit", runEmbed);
}

function selectTab(tab) {
  for (const other of $$(".tabs [role=tab]")) {
    const on = other === tab;
    other.setAttribute("aria-selected", String(on));
    other.tabIndex = on ? 0 : -1;
  }
  for (const panel of $$(".tab-panel")) panel.hidden = panel.dataset.panel !== tab.dataset.tab;
}

function fillSelects(rows) {
  for (const select of $$(".model-select")) {
    const need = select.dataset.need;
    const fit = rows.filter(need === "embed" ? (row) => row.embeddings : chatCapable);
    const chosen = select.value || rows.find((row) => row.current && fit.includes(row))?.id;
    replace(select, fit.map((row) => el("option", { value: row.id }, row.id)));
    if (chosen && fit.some((row) => row.id === chosen)) select.value = chosen;
  }
}

function settings() {
  const form = new FormData($("#chat-settings"));
  const number = (name) => (form.get(name) === "" ? undefined : Number(form.get(name)));
  return {
    model: form.get("model") || undefined,
    system: String(form.get("system") || "").trim(),
    temperature: number("temperature"),
    top_p: number("top_p"),
    max_tokens: number("max_tokens"),
    tools: String(form.get("tools") || "").trim(),
  };
}

// Images go as OpenAI image_url parts with data URLs: the server never fetches a URL for us.
async function attachFiles(files) {
  for (const file of files) {
    if (!IMAGE_TYPES.includes(file.type)) {
      say(`${file.name || "The pasted file"} is not a PNG, JPEG, WebP or GIF image`, "error");
      continue;
    }
    try { attached.push(await dataUrl(file)); } catch (error) { say(`Could not read ${file.name}: ${error.message}`, "error"); }
  }
  showAttached();
}

function dataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

function showAttached() {
  replace($("#chat-attachments"), attached.map((url, index) => el("button", {
    type: "button", class: "thumb", title: "Remove this image", "aria-label": `Remove image ${index + 1}`,
    onclick: () => { attached.splice(index, 1); showAttached(); },
  }, el("img", { src: url, alt: `image ${index + 1} to send` }))));
}

async function sendChat() {
  const input = $("#chat-input");
  const text = input.value.trim();
  if (!text || running) return;
  const options = settings();
  let toolList;
  if (options.tools) {
    try { toolList = JSON.parse(options.tools); } catch (error) {
      say(`The tools are not JSON: ${error.message}`, "error");
      return;
    }
  }
  input.value = "";
  const images = attached;
  attached = [];
  showAttached();
  const parts = images.map((url) => ({ type: "image_url", image_url: { url } }));
  messages.push({ role: "user", content: parts.length ? [{ type: "text", text }, ...parts] : text });
  const shown = images.map((url, index) => el("img", { class: "thumb-img", src: url, alt: `sent image ${index + 1}` }));
  $("#chat-log").append(el("li", { class: "msg user" }, el("div", { class: "who" }, "You"), el("div", { class: "text" }, text), ...shown));
  const body = {
    model: options.model,
    messages: options.system ? [{ role: "system", content: options.system }, ...messages] : [...messages],
    temperature: options.temperature,
    top_p: options.top_p,
    max_tokens: options.max_tokens,
    tools: toolList,
    stream: true,
    stream_options: { include_usage: true },
  };
  lastSent = { path: "/v1/chat/completions", body };
  const reasoning = el("details", { class: "reasoning", hidden: true }, el("summary", {}, "Reasoning"));
  const reasoningText = el("div", { class: "text" });
  reasoning.append(reasoningText);
  const content = el("div", { class: "text" });
  const tools = el("pre", { class: "tool-calls", hidden: true });
  const figures = el("div", { class: "figures-line muted" }, "waiting…");
  const item = el("li", { class: "msg assistant", "aria-busy": "true" },
    el("div", { class: "who" }, options.model || "assistant"), reasoning, content, tools, figures);
  $("#chat-log").append(item);
  item.scrollIntoView({ block: "end" });
  running = new AbortController();
  $("#chat-stop").disabled = false;
  $("#chat-send").disabled = true;
  const started = performance.now();
  let first = null;
  let pieces = 0;
  let usage = null;
  let answer = "";
  let finish = null;
  const calls = [];
  try {
    await stream("/v1/chat/completions", { method: "POST", json: body, signal: running.signal }, ({ data }) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || "the stream failed");
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices?.[0];
      if (!choice) return;
      const delta = choice.delta || {};
      if (delta.content || delta.reasoning || delta.tool_calls) {
        first ??= performance.now();
        pieces += 1;
      }
      if (delta.reasoning) { reasoning.hidden = false; reasoningText.textContent += delta.reasoning; }
      if (delta.content) { answer += delta.content; content.textContent = answer; }
      for (const call of delta.tool_calls || []) {
        const slot = (calls[call.index ?? calls.length] ||= { name: "", arguments: "" });
        if (call.function?.name) slot.name += call.function.name;
        if (call.function?.arguments) slot.arguments += call.function.arguments;
        tools.hidden = false;
        tools.textContent = calls.map((c) => `tool call: ${c.name}(${c.arguments})`).join("\n");
      }
      if (choice.finish_reason) finish = choice.finish_reason;
      figures.textContent = `TTFT ${ms(first - started)} · ${pieces} tokens…`;
    });
    messages.push({ role: "assistant", content: answer });
  } catch (error) {
    if (running.signal.aborted) finish = "stopped";
    else {
      finish = "error";
      item.append(el("div", { class: "error" }, error.message));
    }
  } finally {
    const end = performance.now();
    const tokens = usage?.completion_tokens ?? pieces;
    const rate = first && tokens > 1 ? (tokens - 1) / ((end - first) / 1000) : null;
    figures.textContent = `TTFT ${ms(first === null ? null : first - started)} · ${num(rate)} tok/s · ${tokens} tokens · ${finish || "done"}`;
    item.removeAttribute("aria-busy");
    item.dataset.finish = finish || "done";
    running = null;
    $("#chat-stop").disabled = true;
    $("#chat-send").disabled = false;
    $("#chat-input").focus();
  }
}

function copy(kind) {
  if (!lastSent) return say("Send something first.");
  const url = new URL(lastSent.path, location.href).href;
  const json = JSON.stringify(lastSent.body, null, 2);
  const auth = apiKey.get() ? ' -H "Authorization: Bearer $MODELHOST_API_KEY"' : "";
  const python = lastSent.path === "/v1/chat/completions"
    ? `import os\nfrom openai import OpenAI\n\nclient = OpenAI(base_url="${new URL("/v1", location.href).href}", api_key=os.environ.get("MODELHOST_API_KEY", "none"))\nstream = client.chat.completions.create(**${json.replace(/\btrue\b/g, "True").replace(/\bfalse\b/g, "False").replace(/\bnull\b/g, "None")})\nfor chunk in stream:\n    if chunk.choices and chunk.choices[0].delta.content:\n        print(chunk.choices[0].delta.content, end="", flush=True)\n`
    : `import os\nimport httpx\n\nprint(httpx.post("${url}", json=${json.replace(/\btrue\b/g, "True").replace(/\bfalse\b/g, "False").replace(/\bnull\b/g, "None")}, headers={"Authorization": "Bearer " + os.environ.get("MODELHOST_API_KEY", "")}).json())\n`;
  const text = kind === "curl"
    ? `curl -N ${url} -H "Content-Type: application/json"${auth} -d '${JSON.stringify(lastSent.body).replace(/'/g, "'\\''")}'`
    : python;
  navigator.clipboard?.writeText(text).then(() => say(`Copied as ${kind}.`), () => say(text));
}

async function runStructured(event) {
  event.preventDefault();
  const form = new FormData(event.target);
  const out = $("#structured-out");
  let schema;
  try { schema = JSON.parse(form.get("schema")); } catch (error) {
    out.textContent = `The schema is not JSON: ${error.message}`;
    return;
  }
  const body = {
    model: form.get("model") || undefined,
    messages: [{ role: "user", content: form.get("prompt") }],
    response_format: { type: "json_schema", json_schema: { name: "answer", schema, strict: true } },
    max_tokens: 256,
  };
  lastSent = { path: "/v1/chat/completions", body };
  out.textContent = "running…";
  try {
    const answer = await post("/v1/chat/completions", body);
    const text = answer.choices[0].message.content;
    let shown = text;
    try { shown = JSON.stringify(JSON.parse(text), null, 2); } catch { /* shown as it came */ }
    out.textContent = `${shown}\n\n(${answer.choices[0].finish_reason}; ${answer.usage?.completion_tokens ?? "?"} tokens, constrained by the schema)`;
  } catch (error) {
    out.textContent = `Refused: ${error.message}`;
  }
}

async function runDecisions(event) {
  event.preventDefault();
  const form = new FormData(event.target);
  const out = $("#decisions-out");
  let questions;
  try { questions = JSON.parse(form.get("questions")); } catch (error) {
    out.textContent = `The questions are not JSON: ${error.message}`;
    return;
  }
  const body = { model: form.get("model") || undefined, input: form.get("input"), questions };
  lastSent = { path: "/v1/decisions", body };
  out.textContent = "deciding…";
  try {
    const answer = await post("/v1/decisions", body);
    const lines = answer.answers.map((a, i) => {
      const name = a.name || `question ${i + 1}`;
      if (a.type === "predicate") return `${name}: ${a.probability >= 0.5 ? "yes" : "no"} (p(true) ${a.probability.toFixed(3)})`;
      const picked = a.choice ?? a.label ?? a.score ?? "";
      const spread = (a.probabilities || []).map((p) => `${p.label ?? p.value} ${p.probability.toFixed(3)}`).join(", ");
      return `${name}: ${picked}${spread ? ` (${spread})` : ""}`;
    });
    out.textContent = `${lines.join("\n")}\n\n${JSON.stringify(answer, null, 2)}`;
  } catch (error) {
    out.textContent = `Refused: ${error.message}`;
  }
}

async function toggleRecording() {
  const state = $("#record-state");
  if (recorder) { recorder.stop(); return; }
  try {
    const media = await navigator.mediaDevices.getUserMedia({ audio: true });
    const chunks = [];
    recorder = new MediaRecorder(media);
    recorder.addEventListener("dataavailable", (e) => chunks.push(e.data));
    recorder.addEventListener("stop", () => {
      media.getTracks().forEach((t) => t.stop());
      recorded = new Blob(chunks, { type: recorder.mimeType || "audio/webm" });
      recorder = null;
      $("#record").textContent = "Record";
      state.textContent = `recorded ${(recorded.size / 1000).toFixed(0)} kB: Transcribe sends it`;
    });
    recorder.start();
    $("#record").textContent = "Stop recording";
    state.textContent = "recording…";
  } catch (error) {
    state.textContent = `no microphone: ${error.message}`;
  }
}

async function runTranscribe(event) {
  event.preventDefault();
  const out = $("#transcribe-out");
  const file = event.target.file.files[0];
  const form = new FormData();
  if (file) form.append("file", file, file.name);
  else if (recorded) form.append("file", recorded, "recording.webm");
  else { out.textContent = "Choose a file or record one first."; return; }
  const transcriber = models().find((row) => row.transcription);
  if (transcriber) form.append("model", transcriber.id);
  out.textContent = "transcribing…";
  try {
    const answer = await request("/v1/audio/transcriptions", { method: "POST", form });
    const text = typeof answer === "string" ? answer : answer.text;
    out.textContent = text.trim() || "(no speech found)";
  } catch (error) {
    out.textContent = `Refused: ${error.message}`;
  }
}

async function runEmbed(event) {
  event.preventDefault();
  const form = new FormData(event.target);
  const out = $("#embed-out");
  const body = { model: form.get("model") || undefined, input: [form.get("a"), form.get("b")] };
  lastSent = { path: "/v1/embeddings", body };
  out.textContent = "embedding…";
  try {
    const answer = await post("/v1/embeddings", body);
    const [a, b] = answer.data.map((d) => d.embedding);
    const dot = a.reduce((sum, v, i) => sum + v * b[i], 0);
    const norm = (v) => Math.sqrt(v.reduce((sum, x) => sum + x * x, 0));
    out.textContent = `Cosine similarity ${(dot / (norm(a) * norm(b))).toFixed(4)} (${a.length} dimensions, ${answer.model})`;
  } catch (error) {
    out.textContent = `Refused: ${error.message}`;
  }
}
