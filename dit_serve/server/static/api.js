// The page's only way to the service: fetch() with the API key, and a job's event stream read with
// fetch() too. EventSource cannot send an Authorization header, and a key in a URL ends up in logs and
// history, so the stream (text/event-stream, docs/service.md "Events") is parsed here.

const KEY = "dit-serve.api-key"; // sessionStorage: entered once per tab, gone when the tab closes

export const apiKey = {
  get: () => sessionStorage.getItem(KEY),
  set: (value) => sessionStorage.setItem(KEY, value),
  clear: () => sessionStorage.removeItem(KEY),
};

export class ApiError extends Error {
  constructor(status, message, param = null) {
    super(message);
    this.status = status;
    this.param = param;
  }
}

let askForKey = async () => { throw new ApiError(401, "this service needs an API key"); };
let asking = null; // one prompt shared by every request that got a 401 meanwhile

// `ask(message)` shows the key form and resolves once a key was stored (apiKey.set).
export function onKeyNeeded(ask) { askForKey = ask; }

// A /v1 call: the parsed JSON, or the Response itself with `raw`. A 401 asks for a key (again, saying
// why, when the stored one was refused) and repeats the call; other errors throw ApiError with the
// service's message and the field it is about.
export async function api(path, { method = "GET", body, headers = {}, signal, raw = false } = {}) {
  for (;;) {
    const sent = apiKey.get();
    const h = { ...headers };
    if (sent) h.Authorization = `Bearer ${sent}`;
    if (body !== undefined) h["Content-Type"] = "application/json";
    const r = await fetch(path, { method, headers: h, signal,
                                  body: body === undefined ? undefined : JSON.stringify(body) });
    if (r.ok) return raw ? r : r.json();
    const err = await errorOf(r);
    if (r.status !== 401) throw err;
    if (apiKey.get() === sent) { // not replaced since this call was sent: ask
      if (sent) apiKey.clear();
      asking ??= askForKey(sent ? `That key was refused: ${err.message}` : "")
        .finally(() => { asking = null; });
      await asking;
    }
  }
}

async function errorOf(r) {
  try {
    const e = (await r.json()).error;
    return new ApiError(r.status, e.message, e.param);
  } catch {
    return new ApiError(r.status, `${r.status} ${r.statusText}`);
  }
}

export const sleep = (ms, signal) => new Promise((resolve) => {
  const t = setTimeout(resolve, ms);
  signal?.addEventListener("abort", () => { clearTimeout(t); resolve(); }, { once: true });
});

// Follows GET /v1/jobs/{id}/events, calling onEvent(name, data) for each event, until the `end` event
// (returns true) or the signal aborts (returns false). A dropped stream is resumed with Last-Event-ID
// after the delay the stream's `retry:` asked for; an ApiError (a 429: too many open streams; a 404)
// or `retries` drops in a row without an event in between throw, and the caller polls instead.
export async function followEvents(jobId, onEvent, signal, retries = 3) {
  let lastId = null;
  let retryMs = 1000;
  let drops = 0;
  while (!signal.aborted) {
    try {
      const headers = lastId === null ? {} : { "Last-Event-ID": lastId };
      const r = await api(`/v1/jobs/${encodeURIComponent(jobId)}/events`, { headers, signal, raw: true });
      for await (const ev of parseEvents(r.body)) {
        if (ev.retry !== undefined) retryMs = ev.retry;
        if (ev.id !== undefined) lastId = ev.id;
        if (ev.event === undefined) continue;
        drops = 0;
        onEvent(ev.event, JSON.parse(ev.data));
        if (ev.event === "end") return true;
      }
    } catch (e) {
      if (signal.aborted) return false;
      if (e instanceof ApiError) throw e;
    }
    if (++drops > retries) throw new Error("the job's event stream keeps dropping");
    await sleep(retryMs, signal);
  }
  return false;
}

// The events of a text/event-stream body as {event, data, id, retry} (fields absent when not sent),
// per the HTML standard's parsing rules: lines end in \n, \r or \r\n; a blank line dispatches; lines
// starting with ':' are comments; 'data' lines are joined with \n.
export async function* parseEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let ev = {};
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      const cut = buffer.endsWith("\r") ? buffer.length - 1 : buffer.length; // a \r\n split across chunks
      const lines = buffer.slice(0, cut).split(/\r\n|\r|\n/);
      buffer = lines.pop() + buffer.slice(cut); // an unfinished line waits for the next chunk
      for (const line of lines) {
        if (line === "") {
          if (ev.data !== undefined || ev.retry !== undefined) yield ev;
          ev = {};
          continue;
        }
        if (line.startsWith(":")) continue;
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        const text = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (field === "data") ev.data = ev.data === undefined ? text : `${ev.data}\n${text}`;
        else if (field === "event") ev.event = text;
        else if (field === "id") ev.id = text;
        else if (field === "retry" && /^\d+$/.test(text)) ev.retry = Number(text);
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}
