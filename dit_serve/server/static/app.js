// The dit-serve page: a submit form and the job list (#/), and a job's page (#/jobs/<id>) whose grid
// fills in as its images finish. Framework-free; every call goes through api.js (key, errors, events).

import { api, apiKey, followEvents, onKeyNeeded, sleep } from "./api.js";

const $ = (id) => document.getElementById(id);
const SAMPLERS = ["ddpm", "ddim", "euler", "euler_a", "dpmpp_2m", "flow_euler"]; // for a service without /v1/models' samplers
const MAX_CELLS = 2000;       // a bigger job shows its first items; "Download all" has every image
const ITEM_REFRESH_MAX = 256; // jobs up to this size re-read their items (each one's step) once a second
const models = new Map();     // id -> card, from GET /v1/models
let adapters = [];             // GET /v1/loras: the adapters this key may name
let view = null;              // the shown view: { leave() }

function el(tag, props = {}, ...children) {
  const node = Object.assign(document.createElement(tag), props);
  node.append(...children);
  return node;
}

function showError(node, e) {
  node.textContent = e ? e.message ?? String(e) : ""; // an ApiError's message is the service's own
}

function fraction(job) {
  if (job.state === "done") return 1;
  return job.steps_total ? job.steps_done / job.steps_total : 0;
}

function setState(node, state) {
  node.textContent = state;
  node.className = `state s-${state}`;
}

const isActive = (job) => job.state === "queued" || job.state === "running";
const images = (n) => `${n} image${n === 1 ? "" : "s"}`;

// -- the API key -----------------------------------------------------------------------------------
function askKey(message) {
  $("key-view").hidden = false;
  $("key-error").textContent = message;
  $("key-input").focus();
  return new Promise((resolve) => {
    $("key-form").onsubmit = (e) => {
      e.preventDefault();
      const key = $("key-input").value.trim();
      if (!key) return;
      apiKey.set(key);
      $("key-input").value = "";
      $("key-view").hidden = true;
      $("forget-key").hidden = false;
      resolve();
    };
  });
}

// -- the submit form -------------------------------------------------------------------------------
const chosenLabels = [];

function card() { return models.get($("f-model").value); }

function applyModel() {
  const m = card();
  const text = m.conditioning === "text";
  $("labels-field").hidden = text;
  $("prompts-field").hidden = !text;
  $("f-count-label").textContent = text ? "Images per prompt" : "Images per label";
  const d = m.defaults || {};
  $("f-sampler").replaceChildren(el("option", { value: "", textContent: `default (${d.sampler ?? "model's"})` }),
    ...(m.samplers?.length ? m.samplers : SAMPLERS).map((s) => el("option", { value: s, textContent: s })));
  $("f-steps").placeholder = d.steps ?? "";
  $("f-guidance").placeholder = d.guidance ?? "";
  $("f-guidance").disabled = m.guidance === "none";
  $("f-size").replaceChildren(...m.sizes.map((s) => el("option", { value: s, textContent: s.replace("x", " × ") })));
  $("class-names").replaceChildren(...m.class_names.map((n) => el("option", { value: n })));
  chosenLabels.length = 0;
  renderLabels();
  $("edit-field").hidden = !m.takes_image;
  const several = (m.max_images ?? 1) > 1;
  $("image-note").textContent = m.edit === "reference"
    ? `(${m.needs_image ? "required" : "optional"}: the image the prompt's instruction edits` +
      (several ? `; up to ${m.max_images}, the prompt names them picture 1, 2, ...)` : ")")
    : m.takes_mask ? "(optional: vary it, or paint over it where to repaint)" : "(optional: vary it)";
  if ($("f-image").multiple !== several) {
    $("f-image").multiple = several;
    clearImage();
  }
  showMaskEditor();
}

// -- an edit's input image, and the mask painted over it on a canvas of the image's own size -----------
// the chosen file (a data URL, a blob URL), any strokes, and the further reference images' data URLs
const edit = { dataUrl: null, blob: null, painted: false, more: [] };

function showMaskEditor() {
  const m = card();
  $("mask-editor").hidden = !(m?.takes_image && edit.dataUrl);
  $("f-mask").hidden = !m?.takes_mask;
  $("mask-note").hidden = !m?.takes_mask;
  $("clear-mask").hidden = !m?.takes_mask;
}

// the file is shown from a blob: URL (the page's Content-Security-Policy allows those) and sent as a data URL
function chooseImage() {
  const [file, ...more] = $("f-image").files;
  clearImage(false);
  if (!file) return;
  more.forEach((f, i) => {  // images 2, 3, ... in the order picked: sent after the first
    const r = new FileReader();
    r.onload = () => { edit.more[i] = r.result; };
    r.readAsDataURL(f);
  });
  const reader = new FileReader();
  reader.onload = () => {
    const img = $("f-image-preview");
    edit.blob = URL.createObjectURL(file);
    img.onload = () => {  // the mask has the image's size, upright as the browser shows it (EXIF applied)
      const canvas = $("f-mask");
      canvas.width = img.naturalWidth;
      canvas.height = img.naturalHeight;
      const paint = $("mask-editor").querySelector(".paint");
      paint.style.setProperty("--ratio", `${img.naturalWidth} / ${img.naturalHeight}`);
      paint.classList.toggle("pixelated", img.naturalWidth < 256);
      edit.dataUrl = reader.result;
      showMaskEditor();
    };
    img.onerror = () => { edit.dataUrl = reader.result; showMaskEditor(); }; // the service says what is wrong
    img.src = edit.blob;
  };
  reader.readAsDataURL(file);
}

function clearImage(resetInput = true) {
  edit.dataUrl = null;
  edit.more = [];
  edit.painted = false;
  if (edit.blob) URL.revokeObjectURL(edit.blob);
  edit.blob = null;
  if (resetInput) $("f-image").value = "";
  $("f-image-preview").removeAttribute("src");
  clearMask();
  showMaskEditor();
}

function clearMask() {
  const canvas = $("f-mask");
  canvas.getContext("2d").clearRect(0, 0, canvas.width, canvas.height);
  edit.painted = false;
}

// strokes in the canvas's own pixels (the image's), whatever size it is shown at
function paintable(canvas) {
  const ctx = canvas.getContext("2d");
  let last = null;
  const at = (e) => {
    const box = canvas.getBoundingClientRect();
    return [(e.clientX - box.left) * canvas.width / box.width, (e.clientY - box.top) * canvas.height / box.height];
  };
  const stroke = (to) => {
    const radius = Math.max(0.5, Number($("f-brush").value) / 100 * Math.max(canvas.width, canvas.height) / 2);
    ctx.fillStyle = ctx.strokeStyle = "rgba(255, 64, 64, 0.55)";
    ctx.lineWidth = radius * 2;
    ctx.lineCap = "round";
    ctx.beginPath();
    if (last) { ctx.moveTo(...last); ctx.lineTo(...to); ctx.stroke(); }
    else { ctx.arc(...to, radius, 0, 2 * Math.PI); ctx.fill(); }
    last = to;
    edit.painted = true;
  };
  canvas.onpointerdown = (e) => { canvas.setPointerCapture(e.pointerId); last = null; stroke(at(e)); };
  canvas.onpointermove = (e) => { if (e.buttons & 1) stroke(at(e)); };
  canvas.onpointerup = canvas.onpointercancel = () => { last = null; };
}

// the painted strokes as the service reads a mask: a PNG of the image's size, white = repaint, black = keep
function maskDataUrl() {
  const canvas = $("f-mask");
  const painted = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height);
  const out = document.createElement("canvas");
  out.width = canvas.width;
  out.height = canvas.height;
  const ctx = out.getContext("2d");
  const mask = ctx.createImageData(canvas.width, canvas.height);
  for (let i = 0; i < painted.data.length; i += 4) {
    const v = painted.data[i + 3] > 0 ? 255 : 0;
    mask.data[i] = mask.data[i + 1] = mask.data[i + 2] = v;
    mask.data[i + 3] = 255;
  }
  ctx.putImageData(mask, 0, 0);
  return out.toDataURL("image/png");
}

function addLabels() {
  const input = $("f-label");
  for (const part of input.value.split(",")) {
    if (part.trim()) chosenLabels.push(part.trim());
  }
  input.value = "";
  renderLabels();
}

function renderLabels() {
  $("chosen-labels").replaceChildren(...chosenLabels.map((label, i) => el("li", { className: "chip" }, label,
    el("button", { type: "button", textContent: "×", title: `remove ${label}`, ariaLabel: `remove ${label}`,
                   onclick: () => { chosenLabels.splice(i, 1); renderLabels(); } }))));
}

const number = (id) => ($(id).value === "" ? undefined : Number($(id).value));

// The request as typed; the service validates it (one place) and its message is shown as it is.
function jobRequest() {
  const m = card();
  const [width, height] = ($("f-size").value || "x").split("x").map((v) => (v ? Number(v) : undefined));
  const body = { model: m.id, sampler: $("f-sampler").value || undefined, steps: number("f-steps"),
                 guidance: $("f-guidance").disabled ? undefined : number("f-guidance"), width, height,
                 seed: number("f-seed"), priority: number("f-priority"),
                 preview_every: number("f-preview") || undefined };
  if (m.takes_image && edit.dataUrl) {
    body.image = edit.more.length ? [edit.dataUrl, ...edit.more] : edit.dataUrl;
    if (m.takes_mask && edit.painted) body.mask = maskDataUrl();
    body.strength = number("f-strength");
  }
  const loras = $("f-loras").value.split(",").map((t) => t.trim()).filter(Boolean).map((t) => {
    const at = t.lastIndexOf(":");
    return at > 0 ? { name: t.slice(0, at), scale: Number(t.slice(at + 1)) } : { name: t };
  });
  if (loras.length) body.loras = loras;
  if (m.conditioning === "text") {
    body.prompts = $("f-prompts").value.split("\n").map((p) => p.trim()).filter(Boolean);
    body.num_per_prompt = number("f-count");
    body.negative_prompt = $("f-negative").value || undefined;
  } else {
    addLabels(); // what was typed but not added yet counts too
    body.labels = chosenLabels.map((l) => (/^\d+$/.test(l) ? Number(l) : l));
    body.num_per_label = number("f-count");
  }
  return body;
}

// The adapters the chosen model may apply: its own and those for any model of its family.
function listAdapters() {
  const m = card();
  const usable = adapters.filter((a) => (a.model ? a.model === m.id : !a.family || a.family === m.family));
  $("lora-names").replaceChildren(...usable.map((a) => el("option", { value: a.name })));
  $("lora-list").textContent = usable.length ? `Adapters: ${usable.map((a) => `${a.name} (rank ${a.rank})`).join(", ")}`
                                             : "No adapters for this model.";
}

async function submitJob(e) {
  e.preventDefault();
  const button = $("submit");
  showError($("form-error"), null);
  for (const node of $("job-form").querySelectorAll("[aria-invalid]")) node.removeAttribute("aria-invalid");
  button.disabled = true;
  try {
    const job = await api("/v1/jobs", { method: "POST", body: jobRequest() });
    location.hash = `#/jobs/${job.id}`;
  } catch (err) {
    showError($("form-error"), err);
    const top = (err.param ?? "").split(".")[0]; // "loras.0": the loras field
    const field = { num_per_label: "count", num_per_prompt: "count", width: "size", height: "size",
                    image_b64: "image", mask_b64: "mask" }[top] ?? top;
    $("job-form").querySelector(`[name="${CSS.escape(field ?? "")}"]`)?.setAttribute("aria-invalid", "true");
  } finally {
    button.disabled = false;
  }
}

// -- the job list (#/) -----------------------------------------------------------------------------
function homeView() {
  const ctrl = new AbortController();
  let limit = 20;
  const rows = new Map(); // job id -> its <li>, updated in place between refreshes (and visits)
  for (const li of $("jobs").children) rows.set(li.dataset.id, li);
  $("home-view").hidden = false;
  $("more-jobs").onclick = () => { limit += 20; wake(); };
  let wake = () => {};

  async function loop() {
    while (!ctrl.signal.aborted) {
      let active = false;
      try {
        const list = await api(`/v1/jobs?limit=${limit}`, { signal: ctrl.signal });
        active = list.data.some(isActive);
        renderJobs(list, rows);
        showError($("jobs-error"), null);
        renderWorkers(await api("/v1/workers", { signal: ctrl.signal }).catch(() => null));
      } catch (e) {
        if (ctrl.signal.aborted) return;
        showError($("jobs-error"), e);
      }
      // live progress by polling the list: one request for every job shown, fast while any runs
      const pause = active && !document.hidden ? 1000 : 5000;
      await new Promise((resolve) => { wake = resolve; sleep(pause, ctrl.signal).then(resolve); });
    }
  }
  loop();
  return { leave() { ctrl.abort(); $("home-view").hidden = true; } };
}

function renderJobs(list, rows) {
  const ul = $("jobs");
  const seen = new Set();
  list.data.forEach((job, i) => {
    seen.add(job.id);
    let li = rows.get(job.id);
    if (!li) {
      li = el("li", { className: "job" },
        el("a", { href: `#/jobs/${job.id}` }, el("code", { textContent: job.id.slice(0, 12) })),
        el("span", { className: "what" }), el("span", { className: "state" }), el("progress", { max: 1 }));
      li.dataset.id = job.id;
      rows.set(job.id, li);
    }
    const when = new Date(job.created_at * 1000).toLocaleTimeString();
    li.querySelector(".what").textContent = `${job.model} · ${images(job.num_items)} · ${when}`;
    setState(li.querySelector(".state"), job.state);
    li.querySelector("progress").value = fraction(job);
    if (ul.children[i] !== li) ul.insertBefore(li, ul.children[i] ?? null);
  });
  for (const [id, li] of rows) {
    if (!seen.has(id)) { li.remove(); rows.delete(id); }
  }
  $("jobs-empty").hidden = list.total > 0;
  $("more-jobs").hidden = list.next_offset == null;
}

// The workers and the models each holds (GET /v1/workers): what autoscaling started, switched or stopped.
function renderWorkers(list) {
  if (!list) return; // a service without the route
  $("workers").replaceChildren(...list.data.map((w) => {
    const held = [w.models.join(", ") || "no model", w.loading.length ? `loading ${w.loading.join(", ")}` : "",
                  w.state === "ready" ? `${w.held} item${w.held === 1 ? "" : "s"}` : ""].filter(Boolean).join(" · ");
    const state = el("span");
    setState(state, w.state);
    return el("li", { className: "job worker" }, el("code", { textContent: w.name }), state,
              el("span", { className: "what", textContent: held }));
  }));
  $("workers-empty").hidden = list.data.length > 0;
}

// -- a job's page (#/jobs/<id>) --------------------------------------------------------------------
function jobView(jobId) {
  const ctrl = new AbortController();
  const blobs = [];     // object URLs of the shown images, revoked on leaving
  const cells = [];     // one <li> per item shown
  const queue = [];     // cells whose image is wanted: done and on screen
  let fetching = 0;
  let job = null;
  let itemsReadAt = 0;
  $("job-view").hidden = false;
  $("j-id").textContent = jobId;
  $("grid").replaceChildren();
  showError($("j-error"), null);

  const seen = new IntersectionObserver((entries) => {
    for (const entry of entries) {
      entry.target.visible = entry.isIntersecting;
      if (entry.isIntersecting) wantImage(entry.target);
    }
  }, { rootMargin: "400px" });

  function wantImage(cell) {
    if (cell.url && cell.visible && !cell.loading) {
      cell.loading = true;
      queue.push(cell);
      pump();
    }
  }

  // at most 4 image fetches at once: the rest of the browser's 6 connections stay for the event stream
  async function pump() {
    while (fetching < 4 && queue.length && !ctrl.signal.aborted) {
      const cell = queue.shift();
      fetching += 1;
      try {
        const r = await api(cell.url, { signal: ctrl.signal, raw: true });
        setCellImage(cell, URL.createObjectURL(await r.blob()));
      } catch (e) {
        if (!ctrl.signal.aborted) { cell.loading = false; cell.title = e.message; }
      } finally {
        fetching -= 1;
      }
    }
  }

  // the cell's picture: the final image, or a preview while denoising
  function setCellImage(cell, url) {
    blobs.push(url);
    const img = cell.querySelector("img");
    img.onload = () => img.classList.toggle("pixelated", img.naturalWidth < img.clientWidth);
    img.src = url;
    cell.classList.add("has-image");
    cell.classList.remove("preview");
  }

  function itemText(item) {
    if (item.prompt != null) return item.prompt;
    const names = models.get(job.model)?.class_names ?? [];
    return names[item.label] ?? `class ${item.label}`;
  }

  // an edit's input (its further reference images, image2, image3, ..., and its mask) first, the results beside them
  function inputCells() {
    const p = job.params ?? {};
    const extra = (p.image ? p.extra_images ?? [] : []).map((_, i) => `image${i + 2}`);
    const caption = (name) => name === "mask" ? "mask"
      : name === "image" ? `input${extra.length ? " 1" : ""}${p.strength ? `, strength ${p.strength}` : ""}`
      : `input ${name.slice("image".length)}`;
    return ["image", ...extra, "mask"].filter((name) => name.startsWith("image") ? p.image : p.mask).map((name) => {
      const cell = el("li", { className: "cell input" },
        el("div", { className: "frame" }, el("img", { alt: `the job's input ${name}` })),
        el("div", { className: "cap" }, el("span", { className: "what", textContent: caption(name) })));
      cell.dataset.input = name;
      api(`/v1/jobs/${encodeURIComponent(jobId)}/inputs/${name}`, { signal: ctrl.signal, raw: true })
        .then(async (r) => setCellImage(cell, URL.createObjectURL(await r.blob())))
        .catch((e) => { if (!ctrl.signal.aborted) cell.title = e.message; });
      return cell;
    });
  }

  function buildGrid() {
    const items = job.items.slice(0, MAX_CELLS);
    $("grid").replaceChildren(...inputCells(), ...items.map((item) => {
      const cell = el("li", { className: "cell" },
        el("div", { className: "frame" }, el("img", { alt: `${itemText(item)}, seed ${item.seed}` })),
        el("div", { className: "cap" }, el("span", { className: "what", textContent: itemText(item) }),
           el("span", { className: "state" })),
        el("progress", { max: 1, value: 0 }),
        el("p", { className: "why error", hidden: true }));
      cell.dataset.index = item.index;
      cells[item.index] = cell;
      seen.observe(cell);
      return cell;
    }));
    if (job.num_items > MAX_CELLS) {
      $("grid").append(el("li", { className: "more muted",
        textContent: `Showing the first ${MAX_CELLS} of ${job.num_items} images; "Download all" has every one.` }));
    }
  }

  // step and total are known from a read of the job; an item event has neither: the bar stays where it was
  // (a cancelled item keeps the progress it made)
  function setItem(index, state, url = null, error = null, step = null, total = null) {
    const cell = cells[index];
    if (!cell) return;
    setState(cell.querySelector(".state"), state);
    cell.dataset.state = state;
    const bar = cell.querySelector("progress");
    if (state === "done") bar.value = 1;
    else if (total) bar.value = step / total;
    const why = state === "failed" ? error ?? "failed" : "";
    cell.querySelector(".why").textContent = why; // visible text: a tooltip is not seen on a phone
    cell.querySelector(".why").hidden = !why;
    if (state === "done" && url && !cell.url) { cell.url = url; wantImage(cell); }
  }

  function renderHeader(j) {
    setState($("j-state"), j.state);
    $("j-progress").value = fraction(j);
    const p = j.params;
    const counts = Object.entries(j.counts).map(([s, n]) => `${n} ${s}`).join(", ");
    const size = p && p.width ? ` · ${p.width}×${p.height}` : "";
    const kind = p?.mask ? ` · inpainting` : p?.image ? ` · image-to-image` : "";
    const how = p ? ` · ${p.sampler}, ${p.steps} steps, guidance ${p.guidance}${size}${kind}` : "";
    $("j-summary").textContent = `${j.model} · ${images(j.num_items)}${how} · ${counts}`;
    $("j-failures").replaceChildren(...(j.failures ?? []).map((f) => el("li", {},
      `${f.items} item${f.items === 1 ? "" : "s"} failed (first: #${f.first}): `, el("span", { textContent: f.error }))));
    $("j-cancel").disabled = !isActive(j);
    $("j-download").disabled = !j.counts.done; // nothing to download yet (or ever, for a failed job)
  }

  function render(full) {
    job = full;
    renderHeader(full);
    for (const item of full.items) {
      setItem(item.index, item.state, item.state === "done" ? `/v1/jobs/${jobId}/images/${item.index}` : null,
              item.error, item.step, item.total_steps);
    }
  }

  async function refresh() {
    itemsReadAt = Date.now();
    render(await api(`/v1/jobs/${encodeURIComponent(jobId)}`, { signal: ctrl.signal }));
  }

  // a running item's latest preview, until its final image is known (cell.url); one fetch per cell at once
  async function showPreview(ev) {
    const cell = cells[ev.index];
    if (!cell || cell.url || cell.previewing || ev.step <= (cell.previewStep ?? 0)) return;
    cell.previewing = true;
    try {
      const r = await api(ev.url, { signal: ctrl.signal, raw: true });
      const blob = await r.blob();
      if (cell.url) return;  // the final image won the race
      cell.previewStep = ev.step;
      setCellImage(cell, URL.createObjectURL(blob));
      cell.classList.add("preview");
    } catch (e) {
      // a preview is best effort: a 404 means the item ended meanwhile, and its image follows
    } finally {
      cell.previewing = false;
    }
  }

  // what each event of the stream does
  const handlers = {
    progress(ev) {
      renderHeader({ ...job, ...ev });
      if (job.num_items <= ITEM_REFRESH_MAX && Date.now() - itemsReadAt > 1000) refresh().catch(() => {});
    },
    item(ev) { setItem(ev.index, ev.state, ev.url, ev.error); },
    preview(ev) { showPreview(ev); },
    end(ev) {
      if (ev.state === "deleted") { location.hash = "#/"; return; }
      renderHeader({ ...job, ...ev });
    },
  };

  async function follow() {
    try {
      await refresh();
      buildGrid();
      render(job);
      if (!isActive(job)) return;
      try {
        if (await followEvents(jobId, (name, data) => handlers[name]?.(data), ctrl.signal)) await refresh();
      } catch (e) { // no stream (too many open, an older service): poll instead
        if (ctrl.signal.aborted) return;
        while (isActive(job) && !ctrl.signal.aborted) {
          await sleep(1000, ctrl.signal);
          await refresh();
        }
      }
    } catch (e) {
      if (!ctrl.signal.aborted) showError($("j-error"), e);
    }
  }

  $("j-cancel").onclick = () => act(async () => {
    render(await api(`/v1/jobs/${encodeURIComponent(jobId)}`, { method: "DELETE" }));
  });
  $("j-download").onclick = () => act(async () => {
    const r = await api(`/v1/jobs/${encodeURIComponent(jobId)}/archive`, { raw: true });
    const url = URL.createObjectURL(await r.blob());
    el("a", { href: url, download: `${jobId}.zip` }).click();
    setTimeout(() => URL.revokeObjectURL(url), 60_000);
  });
  const del = $("j-delete");
  del.textContent = "Delete";
  del.dataset.armed = "";
  del.onclick = () => act(async () => {
    if (del.dataset.armed !== "1") { // a second click within 5 s deletes: no modal dialog
      del.dataset.armed = "1";
      del.textContent = "Delete job and images?";
      setTimeout(() => { del.dataset.armed = ""; del.textContent = "Delete"; }, 5000);
      return;
    }
    await api(`/v1/jobs/${encodeURIComponent(jobId)}?purge=true`, { method: "DELETE" });
    location.hash = "#/";
  });

  async function act(fn) {
    showError($("j-error"), null);
    try { await fn(); } catch (e) { showError($("j-error"), e); }
  }

  follow();
  return {
    leave() {
      ctrl.abort();
      seen.disconnect();
      blobs.forEach((u) => URL.revokeObjectURL(u));
      $("job-view").hidden = true;
    },
  };
}

// -- start -----------------------------------------------------------------------------------------
function route() {
  view?.leave();
  const m = location.hash.match(/^#\/jobs\/([0-9A-Za-z_-]{1,64})$/);
  view = m ? jobView(m[1]) : homeView();
}

async function start() {
  onKeyNeeded(askKey);
  $("forget-key").hidden = !apiKey.get();
  $("forget-key").onclick = () => { apiKey.clear(); location.reload(); };
  $("f-model").onchange = applyModel;
  $("add-label").onclick = addLabels;
  $("f-label").onkeydown = (e) => { if (e.key === "Enter") { e.preventDefault(); addLabels(); } };
  $("job-form").onsubmit = submitJob;
  $("f-image").onchange = chooseImage;
  $("clear-image").onclick = () => clearImage();
  $("clear-mask").onclick = clearMask;
  paintable($("f-mask"));
  const list = await api("/v1/models");
  for (const m of list.data) models.set(m.id, m);
  $("f-model").replaceChildren(...list.data.map((m) =>
    el("option", { value: m.id, textContent: m.speed && m.speed !== "default" ? `${m.id} (${m.speed})` : m.id })));
  adapters = (await api("/v1/loras").catch(() => ({ data: [] }))).data;
  $("f-model").addEventListener("change", listAdapters);
  listAdapters();
  applyModel();
  window.addEventListener("hashchange", route);
  route();
}

start().catch((e) => { document.body.append(el("p", { className: "error card", textContent: e.message })); });
