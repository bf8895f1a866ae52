// h3serve web console: plain JavaScript, no build step, no dependencies.
// Talks to the gateway's HTTP door (/v1/assets, /v1/videos, /healthz, and /v1/models for the served adapters
// where the door lists them) with relative URLs, so it also works behind a reverse proxy that serves the door under
// a path prefix.
"use strict";

(() => {
  const $ = (selector, root = document) => root.querySelector(selector);
  const $$ = (selector, root = document) => Array.from(root.querySelectorAll(selector));

  const TOKEN_KEY = "h3serve.console.token";
  const MODEL = "minimax-h3";
  const PAGE_SIZE = 20;
  const MAX_STREAMS = 4;          // a browser opens at most 6 HTTP/1.1 connections per host: leave room for calls
  const POLL_MS = 5000;           // list refresh; also covers unfinished jobs past MAX_STREAMS
  const HEALTH_MS = 15000;
  const STALL_MS = 45000;         // the door sends a keep-alive every 15 s: a stream silent for longer is dead
  const FINISHED = new Set(["completed", "failed", "cancelled"]);
  const TERMINAL_EVENTS = new Set(["done", "failed", "cancelled"]);
  const KIND_BADGES = {image: "IMG", video: "VID", audio: "AUD"};
  const STATUS_WORDS = {queued: "queued", in_progress: "in progress", completed: "completed", failed: "failed",
                        cancelled: "cancelled"};
  const PARTITIONS = {t2va: "transformer", fl2va: "transformer", ref2va: "transformer_ref"};  // what each runs on

  const state = {
    view: "jobs",                 // "jobs" or "bin"
    jobs: new Map(),              // id -> {video, el, event, progress, media}
    lastId: null,
    hasMore: false,
    loading: false,
    generation: 0,                // bumped on every list reload: stale loads and streams stop
    streams: new Map(),           // id -> AbortController
    // The form's uploads, its adapters ({name, weight} in the order ticked) and whether the user typed its seed.
    form: {first: null, last: null, refs: [], adapters: [], seedTyped: false},
    // What the door lists (GET v1/models): {adapters: [{name, weight, scale, partitions, steps, fused}], max} or
    // null while unknown (no such route, or no answer yet): the picker then shows only adapters a restored job names.
    served: null,
    submitting: false,
    retryKey: null,               // {body, key}: an Idempotency-Key kept after a submission that got no answer
  };

  // ---------------------------------------------------------------- small helpers

  class ApiError extends Error {
    constructor(message, status, body) {
      super(message);
      this.status = status;
      this.body = body;
    }
  }

  const sleep = (ms, signal) => new Promise((resolve) => {
    const timer = setTimeout(resolve, ms);
    if (signal) signal.addEventListener("abort", () => { clearTimeout(timer); resolve(); }, {once: true});
  });

  // Seeds are 63-bit integers: past 2^53 JSON.parse would round them, so they are kept as strings.
  const parseJson = (text) => JSON.parse(text.replace(/("seed"\s*:\s*)(-?\d+)/g, '$1"$2"'));
  const stringifyBody = (body) => JSON.stringify(body).replace(/"seed":"(\d+)"/g, '"seed":$1');

  function field(obj, name) {   // snake_case or camelCase (protobuf JSON) field
    if (!obj) return undefined;
    if (obj[name] !== undefined) return obj[name];
    return obj[name.replace(/_([a-z])/g, (_, c) => c.toUpperCase())];
  }

  function newKey() {
    if (window.crypto && crypto.randomUUID) return crypto.randomUUID();
    const bytes = new Uint8Array(16);
    crypto.getRandomValues(bytes);
    return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
  }

  function formatBytes(n) {
    if (!Number.isFinite(n)) return "";
    if (n < 1024) return `${n} B`;
    if (n < 1024 * 1024) return `${(n / 1024).toFixed(1)} kB`;
    return `${(n / 1024 / 1024).toFixed(1)} MB`;
  }

  function formatSeconds(s) {
    const n = Number(s);
    if (!Number.isFinite(n)) return String(s);
    return `${Math.round(n * 100) / 100}`;
  }

  function formatTime(unix) {
    if (!unix) return "";
    const date = new Date(unix * 1000);
    const today = new Date().toDateString() === date.toDateString();
    return today ? date.toLocaleTimeString() : date.toLocaleString();
  }

  function formatDuration(s) {
    if (!Number.isFinite(s) || s < 0) return "";
    if (s < 60) return `${Math.round(s)} s`;
    const m = Math.floor(s / 60);
    return m < 60 ? `${m} min ${Math.round(s % 60)} s` : `${Math.floor(m / 60)} h ${m % 60} min`;
  }

  function fileNameFrom(disposition) {
    if (!disposition) return null;
    const star = /filename\*\s*=\s*(?:UTF-8|utf-8)''([^;]+)/.exec(disposition);
    if (star) {
      try { return decodeURIComponent(star[1].trim().replace(/^"|"$/g, "")); } catch (e) { /* fall through */ }
    }
    const plain = /filename\s*=\s*("([^"]*)"|[^;]+)/.exec(disposition);
    return plain ? (plain[2] !== undefined ? plain[2] : plain[1].trim()) : null;
  }

  // ---------------------------------------------------------------- token and API calls

  function storedToken() {
    try { return localStorage.getItem(TOKEN_KEY) || ""; } catch (e) { return ""; }
  }

  function storeToken(value) {
    try {
      if (value) localStorage.setItem(TOKEN_KEY, value);
      else localStorage.removeItem(TOKEN_KEY);
    } catch (e) { /* storage disabled: the field still works for this page */ }
  }

  function authHeaders(extra = {}) {
    const headers = {...extra};
    const token = $("#token").value.trim();
    if (token) headers.Authorization = `Bearer ${token}`;
    return headers;
  }

  async function errorFrom(response) {
    let message = `${response.status} ${response.statusText || "error"}`.trim();
    let body = null;
    try { body = JSON.parse(await response.text()); } catch (e) { /* not JSON */ }
    const error = body && body.error;
    if (error && typeof error === "object" && error.message) message = error.message;
    else if (typeof error === "string" && error) message = error;
    else if (body && typeof body.detail === "string") message = body.detail;
    else if (body && Array.isArray(body.detail)) {
      message = body.detail.map((d) => (d && d.msg ? `${(d.loc || []).join(".")}: ${d.msg}` : JSON.stringify(d)))
        .join("; ");
    }
    if (response.status === 401) showAuthBanner(message);
    return new ApiError(message, response.status, body);
  }

  async function request(path, {method = "GET", json, form, headers = {}, signal, raw = false} = {}) {
    const init = {method, headers: authHeaders(headers), signal, cache: "no-store"};
    if (json !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.body = typeof json === "string" ? json : stringifyBody(json);
    } else if (form) {
      init.body = form;
    }
    let response;
    try {
      response = await fetch(path, init);
    } catch (e) {
      if (e.name === "AbortError") throw e;
      throw new ApiError(`Cannot reach the gateway (${e.message}).`, 0, null);
    }
    if (!response.ok) throw await errorFrom(response);
    if (response.status !== 401) hideAuthBanner();
    if (raw) return response;
    const text = await response.text();
    return text ? parseJson(text) : null;
  }

  const videoPath = (id, tail = "") => `v1/videos/${encodeURIComponent(id)}${tail}`;

  function showAuthBanner(message) {
    const banner = $("#auth-banner");
    banner.textContent = `The gateway refused the call (401): ${message}. ` +
      ($("#token").value.trim() ? "Check the bearer token." : "It needs a bearer token: enter it at the top right.");
    banner.hidden = false;
    $("#token").classList.add("attention");
  }

  function hideAuthBanner() {
    $("#auth-banner").hidden = true;
    $("#token").classList.remove("attention");
  }

  // ---------------------------------------------------------------- toast

  let toastTimer = null;

  function toast(text, {action, onAction, error = false, ms = 6000} = {}) {
    const box = $("#toast");
    $(".toast-text", box).textContent = text;
    const button = $(".toast-action", box);
    button.hidden = !action;
    button.textContent = action || "";
    button.onclick = action ? () => { box.hidden = true; onAction(); } : null;
    box.classList.toggle("toast-error", error);
    box.hidden = false;
    clearTimeout(toastTimer);
    toastTimer = setTimeout(() => { box.hidden = true; }, ms);
  }

  // ---------------------------------------------------------------- health

  async function checkHealth() {
    const badge = $("#health");
    try {
      const response = await fetch("healthz", {headers: authHeaders(), cache: "no-store"});
      let serving = false;
      try { serving = !!(await response.json()).serving; } catch (e) { /* not JSON */ }
      badge.dataset.state = serving ? "serving" : "degraded";
      badge.textContent = serving ? "serving" : "not serving";
      badge.title = serving ? "Every stage has a healthy replica" : "A stage has no healthy replica: jobs wait";
    } catch (e) {
      badge.dataset.state = "down";
      badge.textContent = "unreachable";
      badge.title = "The gateway did not answer";
    }
  }

  // ---------------------------------------------------------------- job cards

  function stageText(kind, data) {
    const body = (data && data[kind]) || {};
    switch (kind) {
      case "accepted": return "accepted";
      case "waiting": {
        const stage = field(body, "stage");
        const reason = field(body, "reason");
        return `waiting for ${stage || "a stage"}${reason ? ` (${reason})` : ""}`;
      }
      case "retrying": {
        const attempt = field(body, "attempt");
        const max = field(body, "max_attempts");
        const reason = field(body, "reason");
        return `retrying${attempt ? `, attempt ${attempt}${max ? `/${max}` : ""}` : ""}${reason ? ` (${reason})` : ""}`;
      }
      case "conditioning": return `conditioning ${field(body, "done") || 0}/${field(body, "total") || "?"}`;
      case "encoding": return field(body, "cache_hit") ? "encoding (cached)" : "encoding";
      case "denoising": {
        const eta = Number(field(body, "eta_seconds"));
        return `denoising ${field(body, "step") || 0}/${field(body, "total") || "?"}` +
          (Number(field(body, "compiled_graphs")) > 0 ? " · compiling a new shape" : "") +
          (eta > 0.5 ? ` · ~${formatDuration(eta)} left` : "");
      }
      case "decoding": return `decoding ${field(body, "chunk") || 0}/${field(body, "total") || "?"}`;
      case "muxing": return `muxing ${field(body, "done") || 0}/${field(body, "total") || "?"}`;
      case "done": return "";
      case "failed": return field(body, "message") || field(body, "code_name") || "";
      case "cancelled": return field(body, "reason") || "";
      default: return kind;
    }
  }

  function metaText(video) {
    const h = video.h3serve || {};
    const parts = [];
    const size = h.width && h.height ? `${h.width}×${h.height}` : (video.size || "").replace("x", "×");
    if (size) parts.push(size);
    if (video.seconds) parts.push(`${formatSeconds(video.seconds)} s`);
    if (h.steps) parts.push(`${h.steps} steps`);
    if (h.seed !== undefined && h.seed !== null && h.seed !== "") parts.push(`seed ${h.seed}`);
    if (h.workflow === "fl2va") {
      const frames = [h.first_frame && "first", h.last_frame && "last"].filter(Boolean);
      if (frames.length) parts.push(`${frames.join(" + ")} keyframe${frames.length > 1 ? "s" : ""}`);
    }
    if (h.workflow === "ref2va" && Array.isArray(h.references) && h.references.length) {
      parts.push(h.references.map((r) => r.label || r.kind).join(" "));
    }
    if (Array.isArray(h.adapters) && h.adapters.length) {
      parts.push(h.adapters.map((a) => `${a.name} ×${a.weight || 1}`).join(" + "));
    }
    return parts.join(" · ");
  }

  function createCard(video) {
    const el = $("#job-template").content.firstElementChild.cloneNode(true);
    el.id = `job-${video.id}`;
    el.dataset.jobId = video.id;
    $(".job-time", el).title = video.id;
    return el;
  }

  function entryFor(video, {prepend = false} = {}) {
    let entry = state.jobs.get(video.id);
    if (!entry) {
      entry = {video, el: createCard(video), event: null, progress: null, media: null};
      state.jobs.set(video.id, entry);
      const list = $("#job-list");
      if (prepend) list.prepend(entry.el);
      else list.append(entry.el);
    }
    return entry;
  }

  function updateVideo(video, options) {
    const entry = entryFor(video, options);
    const streaming = state.streams.has(video.id);
    if (FINISHED.has(entry.video.status) && !FINISHED.has(video.status)) {
      // An answer sent before the stream's terminal event: the job does not go back to running.
      video = {...video, status: entry.video.status, progress: entry.video.progress, error: entry.video.error};
    }
    // While the job runs, its stream's events are newer than a polled object: keep the event's progress.
    if (!(streaming && !FINISHED.has(video.status) && entry.progress !== null)) entry.progress = video.progress;
    // A polled job (no stream) has no current stage: an old event's would be stale.
    if (!streaming && !FINISHED.has(video.status)) entry.event = null;
    entry.video = video;
    render(entry);
    return entry;
  }

  function render(entry) {
    const {video, el} = entry;
    const h = video.h3serve || {};
    const status = video.status || "queued";
    el.dataset.status = status;
    el.dataset.workflow = h.workflow || "";
    $(".wf", el).textContent = h.workflow || "video";
    $(".job-prompt", el).textContent = video.prompt || "";
    $(".job-prompt", el).title = video.prompt || "";
    $(".job-meta", el).textContent = metaText(video);

    const time = $(".job-time", el);
    time.textContent = video.deleted_at ? `deleted ${formatTime(video.deleted_at)}` : formatTime(video.created_at);
    if (video.created_at) time.dateTime = new Date(video.created_at * 1000).toISOString();
    time.title = `${video.id}${video.created_at ? ` · ${new Date(video.created_at * 1000).toLocaleString()}` : ""}`;

    let detail = "";
    if (status === "queued") {
      detail = entry.event && entry.event.kind === "waiting" ? stageText("waiting", entry.event.data) : "";
    } else if (status === "in_progress") {
      detail = entry.event && !TERMINAL_EVENTS.has(entry.event.kind) && entry.event.kind !== "accepted"
        ? stageText(entry.event.kind, entry.event.data) : "";
    } else if (status === "completed") {
      const took = video.completed_at && video.created_at ? formatDuration(video.completed_at - video.created_at) : "";
      detail = took ? `in ${took}` : "";
    } else if (status === "failed") {
      const error = video.error || {};
      detail = error.message || (entry.event && stageText("failed", entry.event.data)) || "";
    } else if (status === "cancelled" && entry.event && entry.event.kind === "cancelled") {
      detail = stageText("cancelled", entry.event.data);
    }
    $(".status-word", el).textContent = STATUS_WORDS[status] || status;
    $(".status-detail", el).textContent = detail;

    let progress = status === "completed" ? 100 : Number(entry.progress ?? video.progress ?? 0);
    if (!Number.isFinite(progress)) progress = 0;
    progress = Math.max(0, Math.min(100, Math.round(progress)));
    const bar = $(".bar", el);
    bar.setAttribute("aria-valuenow", String(progress));
    bar.dataset.state = status;
    $(".bar-fill", bar).style.width = `${progress}%`;
    $(".bar-text", bar).textContent = `${progress}%`;

    const errorBox = $(".job-error", el);
    if (status === "failed") {
      const error = video.error || {};
      const code = error.code || (entry.event && field(entry.event.data.failed, "code_name"));
      errorBox.textContent = `${code ? `${code}: ` : ""}${detail || "the job failed"}`;
      errorBox.hidden = false;
    } else if (entry.note) {
      errorBox.textContent = entry.note;
      errorBox.hidden = false;
    } else {
      errorBox.hidden = true;
    }

    const inBin = state.view === "bin" || !!video.deleted_at;
    const show = {
      play: !inBin && status === "completed",
      download: !inBin && status === "completed",
      cancel: !inBin && !FINISHED.has(status),
      rerun: !inBin,
      edit: !inBin,
      restore: inBin,
      delete: !inBin,
    };
    for (const button of $$("[data-action]", el)) button.hidden = !show[button.dataset.action];
    const play = $('[data-action="play"]', el);
    if (entry.media && entry.media.url && !$(".job-media", el).hidden) play.hidden = true;
  }

  function removeCard(id) {
    const entry = state.jobs.get(id);
    stopStream(id);
    if (!entry) return;
    if (entry.media && entry.media.url) URL.revokeObjectURL(entry.media.url);
    entry.el.remove();
    state.jobs.delete(id);
    updateEmpty();
  }

  function updateEmpty() {
    const empty = $("#empty");
    empty.hidden = state.jobs.size > 0 || state.loading;
    empty.textContent = state.view === "bin" ? "The bin is empty." : "No jobs yet: describe a video on the left.";
    $("#load-more").hidden = !state.hasMore;
  }

  // ---------------------------------------------------------------- list, views, polling

  function listPath(after, limit = PAGE_SIZE) {
    const params = new URLSearchParams({limit: String(limit), order: "desc", deleted: String(state.view === "bin")});
    if (after) params.set("after", after);
    return `v1/videos?${params}`;
  }

  // The first page (a refresh keeps the cards still on it, players included; `clear`: a new view, none kept),
  // or with `more` the next page.
  async function loadList({more = false, clear = false} = {}) {
    const generation = more ? state.generation : ++state.generation;
    if (clear) {
      for (const id of Array.from(state.jobs.keys())) removeCard(id);
    }
    if (!more) {
      state.lastId = null;
      state.hasMore = false;
    }
    state.loading = true;
    $("#list-error").hidden = true;
    $("#job-list").setAttribute("aria-busy", "true");
    try {
      const page = await request(listPath(more ? state.lastId : null));
      if (generation !== state.generation) return;
      const data = page.data || [];
      if (!more) {
        const listed = new Set(data.map((video) => video.id));
        for (const id of Array.from(state.jobs.keys())) if (!listed.has(id)) removeCard(id);
      }
      const list = $("#job-list");
      let cursor = more ? null : list.firstElementChild;   // cards in the page's order, moving only those out of it
      for (const video of data) {
        const el = updateVideo(video).el;
        if (el === cursor) cursor = cursor.nextElementSibling;
        else list.insertBefore(el, cursor);
      }
      state.lastId = page.last_id || state.lastId;
      state.hasMore = !!page.has_more;
      followUnfinished();
    } catch (e) {
      if (generation !== state.generation) return;
      $("#list-error").textContent = e.message;
      $("#list-error").hidden = false;
    } finally {
      if (generation === state.generation) {
        state.loading = false;
        $("#job-list").removeAttribute("aria-busy");
        updateEmpty();
      }
    }
  }

  async function poll() {
    if (document.hidden || state.loading) return;
    const generation = state.generation;
    try {
      const page = await request(listPath(null));
      if (generation !== state.generation) return;
      $("#list-error").hidden = true;
      const known = new Set(state.jobs.keys());
      // Jobs new to this page (submitted or restored elsewhere) go where their creation time puts them.
      const fresh = (page.data || []).filter((v) => !known.has(v.id));
      for (const video of fresh.reverse()) placeByTime(updateVideo(video, {prepend: true}));
      for (const video of page.data || []) if (known.has(video.id)) updateVideo(video);
      // Unfinished jobs beyond the first page and without a stream: ask one by one.
      const seen = new Set((page.data || []).map((v) => v.id));
      for (const [id, entry] of state.jobs) {
        if (!seen.has(id) && !FINISHED.has(entry.video.status) && !state.streams.has(id)) refreshJob(id);
      }
      if (!state.jobs.size && !page.data.length) state.hasMore = false;
      followUnfinished();
      updateEmpty();
    } catch (e) {
      if (generation === state.generation && e.status !== undefined) {
        $("#list-error").textContent = e.message;
        $("#list-error").hidden = false;
      }
    }
  }

  // The job's object, also shown on its card; null: the job is gone (404); undefined: no answer this time.
  async function refreshJob(id) {
    try {
      const video = await request(videoPath(id));
      if (!state.jobs.has(id)) return video;
      const inBin = !!video.deleted_at;
      if (inBin !== (state.view === "bin")) removeCard(id);  // moved to or out of the bin elsewhere
      else updateVideo(video);
      return video;
    } catch (e) {
      if (e.status === 404) {
        removeCard(id);
        return null;
      }
      return undefined;
    }
  }

  function setView(view) {
    if (state.view === view) { loadList(); return; }
    state.view = view;
    $("#tab-jobs").setAttribute("aria-selected", String(view === "jobs"));
    $("#tab-bin").setAttribute("aria-selected", String(view === "bin"));
    $("#job-list").dataset.view = view;
    loadList({clear: true});
  }

  // ---------------------------------------------------------------- Server-Sent Events (fetch + ReadableStream)

  // The messages of an event stream, as {id, event, data}; `onChunk` hears of every chunk (comments included).
  async function* sseMessages(body, onChunk) {
    const reader = body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    let data = [];
    let event = "";
    let id = "";
    try {
      for (;;) {
        const {value, done} = await reader.read();
        if (done) return;
        onChunk();
        buffer += value;
        for (;;) {
          const match = /\r\n|\r|\n/.exec(buffer);
          if (!match || (match[0] === "\r" && match.index === buffer.length - 1)) break;  // maybe a split \r\n
          const line = buffer.slice(0, match.index);
          buffer = buffer.slice(match.index + match[0].length);
          if (line === "") {
            if (data.length) yield {id, event: event || "message", data: data.join("\n")};
            data = [];
            event = "";
          } else if (line[0] !== ":") {
            const colon = line.indexOf(":");
            const name = colon < 0 ? line : line.slice(0, colon);
            let value = colon < 0 ? "" : line.slice(colon + 1);
            if (value[0] === " ") value = value.slice(1);
            if (name === "data") data.push(value);
            else if (name === "event") event = value;
            else if (name === "id" && !value.includes("\0")) id = value;
          }
        }
      }
    } finally {
      reader.cancel().catch(() => {});
    }
  }

  // Streams for the unfinished jobs highest in the list, up to MAX_STREAMS; the others are polled.
  function followUnfinished() {
    for (const el of $("#job-list").children) {
      if (state.streams.size >= MAX_STREAMS) break;
      const entry = state.jobs.get(el.dataset.jobId);
      if (entry && !FINISHED.has(entry.video.status) && !entry.video.deleted_at && !state.streams.has(entry.video.id)) {
        follow(entry.video.id);
      }
    }
  }

  function stopStream(id) {
    const controller = state.streams.get(id);
    if (controller) {
      state.streams.delete(id);
      controller.abort();
    }
  }

  // `first`: a job just submitted takes the stream of the lowest followed job when all are in use.
  function follow(id, {first = false} = {}) {
    if (state.streams.has(id)) return;
    if (state.streams.size >= MAX_STREAMS && first) {
      const followed = $$("#job-list > [data-job-id]").map((el) => el.dataset.jobId)
        .filter((job) => state.streams.has(job));
      if (followed.length) stopStream(followed[followed.length - 1]);
    }
    if (state.streams.size >= MAX_STREAMS) return;
    const controller = new AbortController();
    state.streams.set(id, controller);
    streamEvents(id, controller.signal)
      .catch(() => {})
      .finally(() => {
        if (state.streams.get(id) === controller) state.streams.delete(id);
        followUnfinished();
      });
  }

  async function streamEvents(id, signal) {
    let lastEventId = "";
    let delay = 500;
    while (!signal.aborted) {
      let terminal = false;
      // One connection; a watchdog drops it when nothing (not even the server's keep-alive) came for STALL_MS.
      const connection = new AbortController();
      const stop = () => connection.abort();
      signal.addEventListener("abort", stop, {once: true});
      let watchdog = null;
      const arm = () => {
        clearTimeout(watchdog);
        watchdog = setTimeout(stop, STALL_MS);
      };
      arm();
      try {
        const headers = {Accept: "text/event-stream"};
        if (lastEventId) headers["Last-Event-ID"] = lastEventId;
        const response = await fetch(videoPath(id, "/events"),
                                     {headers: authHeaders(headers), signal: connection.signal, cache: "no-store"});
        if (!response.ok) {
          const error = await errorFrom(response);
          if (response.status >= 400 && response.status < 500 && response.status !== 408 && response.status !== 429) {
            if (response.status === 404) removeCard(id);
            return;
          }
          throw error;
        }
        for await (const message of sseMessages(response.body, arm)) {
          if (signal.aborted) return;
          if (message.id) lastEventId = message.id;
          delay = 500;
          let data;
          try { data = parseJson(message.data); } catch (e) { continue; }
          const kind = message.event !== "message" ? message.event : data.kind;
          applyEvent(id, kind, data);
          if (TERMINAL_EVENTS.has(kind)) { terminal = true; break; }
        }
      } catch (e) {
        if (signal.aborted) return;
      } finally {
        clearTimeout(watchdog);
        signal.removeEventListener("abort", stop);
      }
      if (signal.aborted) return;
      // After the terminal event: the whole object (completed_at, error, file name). Without it the stream broke
      // (the gateway restarted, the network dropped): look at the job, then resume after the last event seen.
      const video = await refreshJob(id);
      if (terminal || video === null || !state.jobs.has(id)) return;
      if (video && (FINISHED.has(video.status) || video.deleted_at)) return;
      await sleep(delay, signal);
      delay = Math.min(delay * 2, 10000);
    }
  }

  function applyEvent(id, kind, data) {
    const entry = state.jobs.get(id);
    if (!entry) return;
    // A replayed event of a job already known to be finished (a poll answered first) changes nothing.
    if (FINISHED.has(entry.video.status) && !TERMINAL_EVENTS.has(kind)) return;
    entry.event = {kind, data};
    if (typeof data.progress === "number") entry.progress = data.progress;
    const video = {...entry.video};
    if (kind === "done") {
      video.status = "completed";
      entry.progress = 100;
    } else if (kind === "failed") {
      video.status = "failed";
      const body = data.failed || {};
      video.error = {code: field(body, "code_name") || "failed", message: field(body, "message") || ""};
    } else if (kind === "cancelled") {
      video.status = "cancelled";
    } else if (kind === "accepted" || kind === "waiting") {
      // no work measured: the status stays what the job object says
    } else {
      video.status = "in_progress";
    }
    if (typeof data.progress === "number") video.progress = data.progress;
    entry.video = video;
    render(entry);
  }

  // ---------------------------------------------------------------- job actions

  async function loadMedia(entry) {
    if (entry.media) return entry.media.promise;
    const media = {url: null, fileName: null, promise: null};
    media.promise = (async () => {
      const response = await request(videoPath(entry.video.id, "/content"), {raw: true});
      const blob = await response.blob();
      media.fileName = fileNameFrom(response.headers.get("Content-Disposition")) ||
        (entry.video.h3serve && entry.video.h3serve.file_name) || `h3-${entry.video.id}.mp4`;
      media.url = URL.createObjectURL(blob.type ? blob : new Blob([blob], {type: "video/mp4"}));
      return media;
    })();
    entry.media = media;
    try {
      return await media.promise;
    } catch (e) {
      entry.media = null;
      throw e;
    }
  }

  async function busy(button, label, work) {
    const text = button.textContent;
    button.disabled = true;
    if (label) button.textContent = label;
    try {
      return await work();
    } finally {
      button.disabled = false;
      button.textContent = text;
    }
  }

  const actions = {
    async play(entry, button) {
      const media = await busy(button, "Loading…", () => loadMedia(entry));
      const box = $(".job-media", entry.el);
      const player = $("video", box);
      const h = entry.video.h3serve || {};
      if (h.width && h.height) player.style.aspectRatio = `${h.width} / ${h.height}`;
      if (player.src !== media.url) player.src = media.url;
      box.hidden = false;
      button.hidden = true;
      player.play().catch(() => { /* autoplay refused: the controls are there */ });
    },
    async download(entry, button) {
      const media = await busy(button, "Loading…", () => loadMedia(entry));
      const link = document.createElement("a");
      link.href = media.url;
      link.download = media.fileName;
      link.dataset.testid = "download-link";
      document.body.append(link);
      link.click();
      link.remove();
    },
    async cancel(entry, button) {
      const video = await busy(button, "Cancelling…", () => request(videoPath(entry.video.id, "/cancel"),
                                                                     {method: "POST"}));
      updateVideo(video);
    },
    async delete(entry, button) {
      const id = entry.video.id;
      await busy(button, "Deleting…", () => request(videoPath(id), {method: "DELETE"}));
      removeCard(id);
      toast("Moved to the bin.", {action: "Undo", onAction: () => restore(id)});
    },
    async restore(entry, button) {
      await busy(button, "Restoring…", () => restore(entry.video.id));
    },
    async rerun(entry, button) {
      fillForm(entry.video);
      await busy(button, "Submitting…", () => submit());
    },
    edit(entry) {
      fillForm(entry.video);
      $("#job-form").scrollIntoView({behavior: "smooth", block: "start"});
      $("#prompt").focus();
    },
  };

  async function restore(id) {
    try {
      const video = await request(videoPath(id, "/restore"), {method: "POST"});
      if (state.view === "bin") removeCard(id);
      else {
        updateVideo(video);
        // keep newest first: put it back where it belongs
        placeByTime(state.jobs.get(id));
        followUnfinished();
      }
      toast("Restored.");
      return video;
    } catch (e) {
      toast(`Restore failed: ${e.message}`, {error: true});
      throw e;
    }
  }

  function placeByTime(entry) {
    if (!entry) return;
    const list = $("#job-list");
    const created = entry.video.created_at || 0;
    for (const other of list.children) {
      if (other === entry.el) continue;
      const otherEntry = state.jobs.get(other.dataset.jobId);
      if (otherEntry && (otherEntry.video.created_at || 0) < created) {
        list.insertBefore(entry.el, other);
        return;
      }
    }
    list.append(entry.el);
  }

  // ---------------------------------------------------------------- the form: uploads

  function workflow() {
    const checked = $('input[name="workflow"]:checked');
    return checked ? checked.value : "t2va";
  }

  function setWorkflow(value) {
    const radio = $(`#wf-${value}`);
    if (radio) radio.checked = true;
    showWorkflowFields();
  }

  function showWorkflowFields() {
    const wf = workflow();
    $("#fl2va-fields").hidden = wf !== "fl2va";
    $("#ref2va-fields").hidden = wf !== "ref2va";
    $("#job-form").dataset.workflow = wf;
    updateAdapters();
  }

  function uploadAsset(file, onProgress) {
    return new Promise((resolve, reject) => {
      const xhr = new XMLHttpRequest();
      xhr.open("POST", "v1/assets");
      for (const [name, value] of Object.entries(authHeaders())) xhr.setRequestHeader(name, value);
      xhr.upload.onprogress = (e) => { if (e.lengthComputable) onProgress(e.loaded / e.total); };
      xhr.onerror = () => reject(new ApiError("Cannot reach the gateway.", 0, null));
      xhr.onload = () => {
        let body = null;
        try { body = parseJson(xhr.responseText); } catch (e) { /* not JSON */ }
        if (xhr.status >= 200 && xhr.status < 300 && body) { resolve(body); return; }
        const error = body && body.error;
        let message = error && error.message ? error.message : (typeof error === "string" ? error : "");
        if (!message && body && body.detail) {
          message = typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
        }
        if (!message) message = `${xhr.status} ${xhr.statusText || "error"}`;
        if (xhr.status === 401) showAuthBanner(message);
        reject(new ApiError(message, xhr.status, body));
      };
      const form = new FormData();
      form.append("file", file, file.name);
      xhr.send(form);
    });
  }

  function newItem(file) {
    const item = {file, name: file.name, status: "uploading", progress: 0, asset: null, error: null,
                  preview: file.type.startsWith("image/") ? URL.createObjectURL(file) : null,
                  guess: file.type.split("/")[0]};
    item.promise = uploadAsset(file, (fraction) => { item.progress = fraction; renderUploads(); })
      .then((asset) => {
        item.asset = asset;
        item.status = "ready";
      })
      .catch((e) => {
        item.status = "error";
        item.error = e.message;
        if (inForm(item)) showFormError(`Upload of ${file.name} failed: ${e.message}`);  // not one replaced since
      })
      .finally(renderUploads);
    return item;
  }

  function knownItem(assetId, kind, label) {   // an asset already on the gateway (re-run / edit)
    return {file: null, name: `asset ${assetId.slice(0, 12)}…`, status: "ready", progress: 1, error: null,
            asset: {id: assetId, kind: kind || "image", has_audio: /<Audio /.test(label || "")},
            preview: null, guess: kind, promise: Promise.resolve()};
  }

  function inForm(item) {
    return state.form.first === item || state.form.last === item || state.form.refs.includes(item);
  }

  function releaseItem(item) {
    if (item && item.preview) URL.revokeObjectURL(item.preview);
  }

  function setSlot(slot, file) {
    releaseItem(state.form[slot]);
    state.form[slot] = file ? newItem(file) : null;
    clearFormError();
    renderUploads();
  }

  function addReferences(files) {
    for (const file of files) state.form.refs.push(newItem(file));
    clearFormError();
    renderUploads();
  }

  // The gateway numbers the keyframes a request gives, first before last. A slot whose upload failed still counts:
  // the form cannot be submitted until that image is replaced (in place) or removed, and until then the other
  // keyframe keeps the number the prompt was written with (a failed first frame does not make the last one
  // <Picture 1>). Removing a keyframe does renumber, as the request then would.
  function keyframeLabels() {
    const labels = {};
    let n = 0;
    for (const slot of ["first", "last"]) {
      if (state.form[slot]) labels[slot] = `<Picture ${++n}>`;
    }
    return labels;
  }

  function referenceLabels() {
    const counts = {image: 0, video: 0, audio: 0};
    return state.form.refs.map((item) => {
      if (item.status !== "ready") return "";
      const kind = item.asset.kind;
      const labels = [];
      if (item.asset.has_audio || kind === "audio") labels.push(`<Audio ${++counts.audio}>`);
      if (kind === "image") labels.push(`<Picture ${++counts.image}>`);
      if (kind === "video") labels.push(`<Video ${++counts.video}>`);
      return labels.join(" ");
    });
  }

  function describeAsset(asset) {
    const parts = [asset.kind];
    if (asset.format) parts.push(asset.format);
    if (asset.width && asset.height) parts.push(`${asset.width}×${asset.height}`);
    if (asset.duration_s) parts.push(`${formatSeconds(asset.duration_s)} s`);
    if (asset.kind === "video" && asset.has_audio) parts.push("with sound");
    if (asset.bytes) parts.push(formatBytes(asset.bytes));
    return parts.join(" · ");
  }

  function chip(item, label, {onRemove, onUp, onDown}) {
    const el = document.createElement("li");
    el.className = "chip";
    el.dataset.testid = "asset";
    el.dataset.state = item.status;
    if (item.asset) el.dataset.assetId = item.asset.id;
    const thumb = document.createElement(item.preview ? "img" : "span");
    thumb.className = "thumb";
    if (item.preview) { thumb.src = item.preview; thumb.alt = ""; }
    else thumb.textContent = KIND_BADGES[(item.asset && item.asset.kind) || item.guess] || "…";
    el.append(thumb);
    const text = document.createElement("div");
    text.className = "chip-text";
    const name = document.createElement("span");
    name.className = "chip-name";
    name.textContent = item.name;
    name.title = item.asset ? item.asset.id : item.name;
    const info = document.createElement("span");
    info.className = "chip-info";
    info.dataset.testid = "asset-info";
    if (item.status === "uploading") info.textContent = `uploading ${Math.round(item.progress * 100)}%`;
    else if (item.status === "error") { info.textContent = item.error; info.classList.add("chip-error"); }
    else info.textContent = describeAsset(item.asset);
    text.append(name, info);
    const tags = document.createElement("span");
    tags.className = "chip-labels";
    for (const one of (label || "").match(/<[^>]+>/g) || []) {   // a video with sound has two: <Audio j> <Video k>
      const tag = document.createElement("button");
      tag.type = "button";
      tag.className = "label";
      tag.dataset.testid = "asset-label";
      tag.textContent = one;
      tag.title = `Insert ${one} into the prompt`;
      tag.addEventListener("click", () => insertIntoPrompt(one));
      tags.append(tag);
    }
    if (tags.childElementCount) text.append(tags);
    el.append(text);
    const controls = document.createElement("span");
    controls.className = "chip-controls";
    const add = (symbol, title, handler, testid) => {
      const button = document.createElement("button");
      button.type = "button";
      button.textContent = symbol;
      button.title = title;
      button.setAttribute("aria-label", title);
      button.dataset.testid = testid;
      button.disabled = !handler;
      button.addEventListener("click", handler || (() => {}));
      controls.append(button);
    };
    if (onUp !== undefined) add("↑", "Move up", onUp, "asset-up");
    if (onDown !== undefined) add("↓", "Move down", onDown, "asset-down");
    add("×", "Remove", onRemove, "asset-remove");
    el.append(controls);
    return el;
  }

  function renderUploads() {
    const labels = keyframeLabels();
    for (const slot of ["first", "last"]) {
      const box = $(`#${slot}-frame-asset`);
      box.replaceChildren();
      const item = state.form[slot];
      // one keyframe per slot: remove it to choose another, or choose another in place of one that failed
      $(`label[for="${slot}-frame-file"]`).hidden = !!item && item.status !== "error";
      if (item) {
        box.append(chip(item, labels[slot], {onRemove: () => setSlot(slot, null)}));
      }
    }
    const list = $("#ref-list");
    list.replaceChildren();
    const refLabels = referenceLabels();
    const refs = state.form.refs;
    refs.forEach((item, index) => {
      const move = (to) => () => {
        const [moved] = refs.splice(index, 1);
        refs.splice(to, 0, moved);
        renderUploads();
      };
      list.append(chip(item, refLabels[index], {
        onUp: index > 0 ? move(index - 1) : null,
        onDown: index < refs.length - 1 ? move(index + 1) : null,
        onRemove: () => { releaseItem(refs.splice(index, 1)[0]); renderUploads(); },
      }));
    });
  }

  function insertIntoPrompt(text) {
    const prompt = $("#prompt");
    const start = prompt.selectionStart ?? prompt.value.length;
    const end = prompt.selectionEnd ?? prompt.value.length;
    const before = prompt.value.slice(0, start);
    const insert = (before && !/\s$/.test(before) ? " " : "") + text + " ";
    prompt.value = before + insert + prompt.value.slice(end);
    prompt.focus();
    prompt.selectionStart = prompt.selectionEnd = start + insert.length;
  }

  // ---------------------------------------------------------------- the form: adapters

  // The served adapters as the door lists them: OpenAI's model list (GET v1/models), h3serve's fields in the model's
  // `h3serve` object, as the DiT's Info gives them ({name, partitions, rank, alpha, recommended_steps, fused} each,
  // and max_request_adapters), an adapter's default `weight` where given (else 1) and its `scale` (else alpha / rank).
  // null: the answer lists no adapters at all (not even an empty list).
  function servedFrom(listing) {
    const models = listing && Array.isArray(listing.data) ? listing.data : [];
    const model = models.find((m) => m && m.id === MODEL) || models[0];
    const h = model && model.h3serve;
    if (!h || !Array.isArray(h.adapters)) return null;
    const adapters = h.adapters.filter((a) => a && typeof a.name === "string" && a.name).map((a) => {
      const rank = Number(a.rank);
      const alpha = Number(a.alpha);
      let scale = a.scale === undefined || a.scale === null ? NaN : Number(a.scale);
      if (!Number.isFinite(scale) && rank > 0) scale = alpha > 0 ? alpha / rank : 1;  // alpha 0: none recorded
      const weight = Number(a.weight);
      return {
        name: a.name,
        weight: Number.isFinite(weight) && weight !== 0 ? weight : 1,   // 0 means 1.0
        scale,
        partitions: Array.isArray(a.partitions) && a.partitions.length ? a.partitions : null,
        steps: Number(a.recommended_steps) || 0,
        fused: !!a.fused,
        listed: true,
      };
    });
    return {adapters, max: Number(h.max_request_adapters) || 0};
  }

  async function loadAdapters() {
    try {
      state.served = servedFrom(await request("v1/models"));
    } catch (e) {
      if (e.status === 404) state.served = null;   // a door that does not list its models: nothing known
      // any other failure keeps what was known (the list and the health badge say what is wrong)
    }
    renderAdapters();
  }

  // The picker's rows: the served adapters, then any a restored job names that the door does not list.
  function adapterRows() {
    const rows = state.served ? state.served.adapters.slice() : [];
    for (const chosen of state.form.adapters) {
      if (!rows.some((row) => row.name === chosen.name)) {
        rows.push({name: chosen.name, weight: 1, scale: NaN, partitions: null, steps: 0, fused: false, listed: false});
      }
    }
    return rows;
  }

  const runsOn = (adapter, wf) => !adapter.partitions || adapter.partitions.includes(PARTITIONS[wf]);

  // The ticked adapters this workflow can run, in the order ticked; a fused one runs on every job unnamed.
  function chosenAdapters(wf) {
    const rows = new Map(adapterRows().map((row) => [row.name, row]));
    return state.form.adapters.filter((chosen) => {
      const row = rows.get(chosen.name);
      return row && !row.fused && runsOn(row, wf);
    });
  }

  function renderAdapters() {
    const rows = adapterRows();
    $("#adapters").hidden = !state.served && !rows.length;   // unknown and nothing restored: no picker
    $("#adapters-none").hidden = rows.length > 0;
    $("#adapters-hint").hidden = !rows.length;
    $("#adapter-list").replaceChildren(...rows.map(adapterRow));
    updateAdapters();
  }

  function adapterRow(adapter) {
    const el = document.createElement("li");
    el.className = "adapter";
    el.dataset.testid = "adapter";
    el.dataset.name = adapter.name;
    const picked = state.form.adapters.find((chosen) => chosen.name === adapter.name);
    const label = document.createElement("label");
    const box = document.createElement("input");
    box.type = "checkbox";
    box.dataset.testid = "adapter-on";
    box.checked = !!picked || adapter.fused;
    const order = document.createElement("span");
    order.className = "adapter-order";
    order.dataset.testid = "adapter-order";
    const name = document.createElement("span");
    name.className = "adapter-name";
    name.textContent = adapter.name;
    label.append(box, name, order);
    const weight = document.createElement("input");
    weight.type = "text";
    weight.inputMode = "decimal";
    weight.spellcheck = false;
    weight.dataset.testid = "adapter-weight";
    weight.setAttribute("aria-label", `${adapter.name} weight`);
    weight.title = "Weight: multiplies the adapter's own scale, -10 to 10";
    weight.value = String(picked ? picked.weight : adapter.weight);
    const info = document.createElement("small");
    info.className = "adapter-info";
    info.dataset.testid = "adapter-info";
    el.append(label, weight, info);
    box.addEventListener("change", () => {
      const chosen = state.form.adapters;
      const at = chosen.findIndex((c) => c.name === adapter.name);
      if (box.checked && at < 0) chosen.push({name: adapter.name, weight: weight.value});
      if (!box.checked && at >= 0) chosen.splice(at, 1);
      clearFormError();
      updateAdapters();
    });
    weight.addEventListener("input", () => {
      const chosen = state.form.adapters.find((c) => c.name === adapter.name);
      if (chosen) chosen.weight = weight.value;
    });
    return el;
  }

  // What the workflow and the per-job limit allow, without rebuilding the rows (a weight being typed keeps focus).
  function updateAdapters() {
    const wf = workflow();
    const rows = new Map(adapterRows().map((row) => [row.name, row]));
    const chosen = chosenAdapters(wf).map((c) => c.name);
    const max = state.served ? state.served.max : 0;
    for (const el of $$("#adapter-list > li")) {
      const adapter = rows.get(el.dataset.name);
      if (!adapter) continue;
      const box = $('[data-testid="adapter-on"]', el);
      const usable = runsOn(adapter, wf);
      const full = max > 0 && chosen.length >= max && !box.checked;
      box.disabled = adapter.fused || !usable || full;
      $('[data-testid="adapter-weight"]', el).disabled = adapter.fused || !usable;
      el.dataset.usable = String(usable);
      const at = chosen.indexOf(adapter.name);
      $(".adapter-order", el).textContent = at >= 0 && chosen.length > 1 ? `${at + 1}` : "";
      const parts = [];
      if (Number.isFinite(adapter.scale)) parts.push(`scale ${formatSeconds(adapter.scale)}`);
      if (adapter.steps) parts.push(`recommends ${adapter.steps} steps`);
      if (adapter.fused) parts.push("fused: runs on every job");
      if (!adapter.listed) parts.push("from the restored job; not listed by this gateway");
      if (!usable) parts.push(`not for ${wf} (targets ${adapter.partitions.join(" and ")})`);
      if (full) parts.push(`at most ${max} per job`);
      $(".adapter-info", el).textContent = parts.join(" · ");
    }
  }

  // ---------------------------------------------------------------- the form: fill and submit

  function showFormError(message) {
    const box = $("#form-error");
    box.textContent = message;
    box.hidden = false;
  }

  function clearFormError() {
    $("#form-error").hidden = true;
    $("#form-error").textContent = "";
  }

  function fillForm(video) {
    const h = video.h3serve || {};
    setWorkflow(h.workflow || "t2va");
    $("#prompt").value = video.prompt || "";
    $("#size").value = h.width && h.height ? `${h.width}x${h.height}` : (video.size || "");
    $("#seconds").value = video.seconds ?? "";
    $("#steps").value = h.steps ?? "";
    $("#seed").value = h.seed ?? "";   // that job's seed, on purpose: for its next submission only (see submit)
    state.form.seedTyped = false;
    releaseItem(state.form.first);
    releaseItem(state.form.last);
    state.form.refs.forEach(releaseItem);
    state.form.first = h.first_frame ? knownItem(h.first_frame, "image", "<Picture") : null;
    state.form.last = h.last_frame ? knownItem(h.last_frame, "image", "<Picture") : null;
    state.form.refs = (h.references || []).map((r) => knownItem(r.asset_id, r.kind, r.label));
    state.form.adapters = (h.adapters || []).filter((a) => a && a.name)
      .map((a) => ({name: a.name, weight: String(a.weight || 1)}));   // the job's order and exact weights
    clearFormError();
    renderUploads();
    renderAdapters();
  }

  function resetForm() {
    $("#job-form").reset();
    releaseItem(state.form.first);
    releaseItem(state.form.last);
    state.form.refs.forEach(releaseItem);
    state.form = {first: null, last: null, refs: [], adapters: [], seedTyped: false};
    showWorkflowFields();
    clearFormError();
    renderUploads();
    renderAdapters();
  }

  async function buildBody() {
    const wf = workflow();
    const items = wf === "fl2va" ? [state.form.first, state.form.last].filter(Boolean)
      : wf === "ref2va" ? state.form.refs : [];
    if (items.some((item) => item.status === "uploading")) {
      $("#submit").textContent = "Uploading…";
      await Promise.allSettled(items.map((item) => item.promise));
    }
    const failed = items.find((item) => item.status === "error");
    if (failed) {
      throw new ApiError(`Upload of ${failed.name} failed: ${failed.error}. Remove it or choose another file.`);
    }

    const prompt = $("#prompt").value.trim();
    if (!prompt) throw new ApiError("Enter a prompt.");
    const body = {model: "minimax-h3", workflow: wf, prompt};
    const size = $("#size").value.trim().replace(/\s*[x×X*]\s*/, "x");
    if (size) body.size = size;
    const seconds = $("#seconds").value.trim();
    if (seconds) body.seconds = seconds;
    const steps = $("#steps").value.trim();
    if (steps) {
      if (!/^\d+$/.test(steps)) throw new ApiError("Steps must be a whole number.");
      body.steps = Number(steps);
    }
    const seed = $("#seed").value.trim();
    if (seed) {
      if (!/^\d+$/.test(seed)) throw new ApiError("The seed must be a whole number (or empty for a random one).");
      body.seed = seed;   // stringifyBody writes it as a JSON integer, digit for digit
    }
    if (wf === "fl2va") {
      if (state.form.first) body.first_frame = state.form.first.asset.id;
      if (state.form.last) body.last_frame = state.form.last.asset.id;
    } else if (wf === "ref2va") {
      body.references = state.form.refs.map((item) => ({asset_id: item.asset.id, kind: item.asset.kind}));
    }
    const adapters = chosenAdapters(wf).map(({name, weight}) => {
      const text = String(weight).trim();
      const value = text === "" ? 1 : Number(text);
      if (!Number.isFinite(value)) throw new ApiError(`The weight of adapter ${name} must be a number (1 by default).`);
      if (value === 0) throw new ApiError(`A weight of 0 means 1 to the gateway: untick adapter ${name} instead.`);
      return {name, weight: value};
    });
    if (adapters.length) body.adapters = adapters;
    return stringifyBody(body);
  }

  async function submit(event) {
    if (event) event.preventDefault();
    if (state.submitting) return null;
    state.submitting = true;
    const button = $("#submit");
    button.disabled = true;
    button.textContent = "Submitting…";
    clearFormError();
    try {
      const body = await buildBody();
      button.textContent = "Submitting…";
      // The same body resubmitted after a call that got no answer reuses its key: the gateway returns that job.
      const key = state.retryKey && state.retryKey.body === body ? state.retryKey.key : newKey();
      state.retryKey = {body, key};
      let video;
      try {
        video = await request("v1/videos", {method: "POST", json: body, headers: {"Idempotency-Key": key}});
      } catch (e) {
        if (e.status) state.retryKey = null;   // the gateway answered: a new attempt is a new job
        throw e;
      }
      state.retryKey = null;
      // A seed the user did not type (a restored job's, used by this submission) does not carry over: the next job
      // draws its own unless the user types one, which stays until changed.
      if (!state.form.seedTyped) $("#seed").value = "";
      if (state.view !== "jobs") setView("jobs");
      else {
        const entry = updateVideo(video, {prepend: true});   // the newest job: on top
        entry.el.classList.add("fresh");
        setTimeout(() => entry.el.classList.remove("fresh"), 2500);
        updateEmpty();
        follow(video.id, {first: true});
      }
      return video;
    } catch (e) {
      showFormError(e.message);
      return null;
    } finally {
      state.submitting = false;
      button.disabled = false;
      button.textContent = "Generate";
    }
  }

  // ---------------------------------------------------------------- wiring

  function wireDrop(zone, onFiles) {
    zone.addEventListener("dragover", (e) => { e.preventDefault(); zone.classList.add("over"); });
    zone.addEventListener("dragleave", () => zone.classList.remove("over"));
    zone.addEventListener("drop", (e) => {
      e.preventDefault();
      zone.classList.remove("over");
      if (e.dataTransfer && e.dataTransfer.files.length) onFiles(Array.from(e.dataTransfer.files));
    });
  }

  function init() {
    const token = $("#token");
    token.value = storedToken();
    token.addEventListener("input", () => storeToken(token.value.trim()));
    token.addEventListener("change", () => {
      storeToken(token.value.trim());
      hideAuthBanner();
      checkHealth();
      loadList();
      loadAdapters();
    });
    const seed = $("#seed");
    seed.addEventListener("input", () => { state.form.seedTyped = seed.value.trim() !== ""; });

    for (const radio of $$('input[name="workflow"]')) radio.addEventListener("change", () => {
      showWorkflowFields();
      clearFormError();
    });
    showWorkflowFields();

    for (const slot of ["first", "last"]) {
      const input = $(`#${slot}-frame-file`);
      input.addEventListener("change", () => {
        if (input.files.length) setSlot(slot, input.files[0]);
        input.value = "";
      });
      wireDrop($(`label[for="${slot}-frame-file"]`), (files) => setSlot(slot, files[0]));
    }
    const refInput = $("#ref-file");
    refInput.addEventListener("change", () => { addReferences(Array.from(refInput.files)); refInput.value = ""; });
    wireDrop($('label[for="ref-file"]'), addReferences);

    $("#job-form").addEventListener("submit", submit);
    $("#prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) submit(e);
    });
    $("#reset-form").addEventListener("click", resetForm);

    $("#tab-jobs").addEventListener("click", () => setView("jobs"));
    $("#tab-bin").addEventListener("click", () => setView("bin"));
    $("#refresh").addEventListener("click", () => { checkHealth(); loadList(); loadAdapters(); });
    $("#load-more").addEventListener("click", () => loadList({more: true}));

    $("#job-list").addEventListener("click", async (e) => {
      const button = e.target.closest("[data-action]");
      if (!button || button.disabled) return;
      const card = button.closest("[data-job-id]");
      const entry = card && state.jobs.get(card.dataset.jobId);
      if (!entry) return;
      entry.note = null;
      try {
        await actions[button.dataset.action](entry, button);
      } catch (error) {
        if (error.name === "AbortError") return;
        entry.note = `${button.textContent.trim() || button.dataset.action}: ${error.message}`;
        if (state.jobs.get(entry.video.id) === entry) render(entry);
        toast(error.message, {error: true});
      }
    });

    document.addEventListener("visibilitychange", () => { if (!document.hidden) poll(); });
    setInterval(poll, POLL_MS);
    setInterval(checkHealth, HEALTH_MS);
    checkHealth();
    loadList();
    loadAdapters();
    renderUploads();
    updateEmpty();
  }

  init();
})();
