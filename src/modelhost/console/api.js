// Talking to the server: the public API, with the tab's API key when the server wants one.
// The key lives in sessionStorage: this tab only, gone when it closes.

const KEY = "modelhost.apiKey";
const listeners = new Set();

export class ApiError extends Error {
  constructor(status, message, body) {
    super(message);
    this.status = status;
    this.body = body;
  }
}

export const apiKey = {
  get: () => sessionStorage.getItem(KEY) || "",
  set: (key) => sessionStorage.setItem(KEY, key),
  clear: () => sessionStorage.removeItem(KEY),
};

// `fn(error)` runs when the server answers 401: the page asks for the key.
export function onUnauthorized(fn) { listeners.add(fn); }

export function headers(extra = {}) {
  const key = apiKey.get();
  return key ? { authorization: `Bearer ${key}`, ...extra } : { ...extra };
}

// What the server's error body says, whichever protocol's shape it has.
export function messageOf(body, status) {
  if (body && typeof body === "object") {
    const error = body.error;
    if (typeof error === "string") return error;
    if (error && typeof error.message === "string") return error.message;
    if (typeof body.message === "string") return body.message;
  }
  return `HTTP ${status}`;
}

export async function request(path, { method = "GET", json, form, signal, raw = false } = {}) {
  const init = { method, signal, headers: headers(), credentials: "same-origin" };
  if (json !== undefined) {
    init.body = JSON.stringify(json);
    init.headers["content-type"] = "application/json";
  } else if (form !== undefined) {
    init.body = form;
  }
  const response = await fetch(path, init);
  if (response.status === 401) {
    const error = new ApiError(401, "the server needs an API key", null);
    for (const fn of listeners) fn(error);
    throw error;
  }
  if (raw) {
    if (!response.ok) {
      const body = await response.json().catch(() => null);
      throw new ApiError(response.status, messageOf(body, response.status), body);
    }
    return response;
  }
  const text = await response.text();
  let body = text;
  try { body = JSON.parse(text); } catch { /* a text answer (/metrics) */ }
  if (!response.ok) throw new ApiError(response.status, messageOf(body, response.status), body);
  return body;
}

export const get = (path, options) => request(path, options);
export const post = (path, json, options = {}) => request(path, { ...options, method: "POST", json });

// Server-Sent Events over fetch (EventSource cannot send the API key): `onEvent({event, data})`
// for each event until the stream ends or `signal` aborts.
export async function stream(path, { method = "GET", json, signal } = {}, onEvent) {
  const response = await request(path, { method, json, signal, raw: true });
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value.replace(/\r\n?/g, "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let event = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) onEvent({ event, data: data.join("\n") });
    }
  }
}

// The Prometheus text exposition as {name: [{labels, value}]}.
export function parseMetrics(text) {
  const out = {};
  for (const line of String(text).split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const match = line.match(/^([a-zA-Z_:][\w:]*)(\{(.*)\})?\s+(\S+)/);
    if (!match) continue;
    const labels = {};
    for (const pair of (match[3] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) {
      labels[pair[1]] = pair[2];
    }
    (out[match[1]] ||= []).push({ labels, value: Number(match[4]) });
  }
  return out;
}

export function metricSum(metrics, name, filter = () => true) {
  return (metrics[name] || []).filter((s) => filter(s.labels)).reduce((a, s) => a + s.value, 0);
}
