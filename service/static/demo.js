// facerec-triton web demo: plain JavaScript, no dependencies, nothing fetched from elsewhere.
// It calls REST API v1 with the key typed into the page: identify (or detect without a collection),
// enroll a clicked face by its box, list and delete identities.

const $ = (id) => document.getElementById(id);
const STORAGE = { base: "facerec.demo.apiBase", collection: "facerec.demo.collection", key: "facerec.demo.apiKey" };
const COLORS = { match: "#15803d", unknown: "#c2410c", detect: "#1d4ed8" };

const state = {
  image: null, // {blob, name, bitmap}
  result: null, // {mode: "identify" | "detect", width, height, faces}
  selected: -1,
  run: 0, // bumped for every analysis; late answers of older ones are dropped
  identities: [],
  stream: null,
};

class ApiError extends Error {
  constructor(status, code, message, details = {}) {
    super(message);
    this.status = status;
    this.code = code;
    this.details = details;
  }
}

// ---------------------------------------------------------------- settings and API calls

function settings() {
  return {
    base: $("api-base").value.trim().replace(/\/+$/, ""),
    collection: $("collection").value.trim(),
    key: $("api-key").value.trim(),
  };
}

function loadSettings() {
  try {
    $("api-base").value = localStorage.getItem(STORAGE.base) ?? "";
    $("collection").value = localStorage.getItem(STORAGE.collection) ?? "";
    $("api-key").value = localStorage.getItem(STORAGE.key) ?? "";
  } catch {
    /* storage disabled: the fields simply start empty */
  }
}

function saveSettings() {
  const s = settings();
  try {
    localStorage.setItem(STORAGE.base, s.base);
    localStorage.setItem(STORAGE.collection, s.collection);
    localStorage.setItem(STORAGE.key, s.key);
  } catch {
    /* storage disabled or full */
  }
}

function forgetSettings() {
  try {
    Object.values(STORAGE).forEach((k) => localStorage.removeItem(k));
  } catch {
    /* nothing stored */
  }
  ["api-base", "collection", "api-key"].forEach((id) => ($(id).value = ""));
  setStatus("Connection settings forgotten.");
  loadIdentities();
}

const enc = encodeURIComponent;

async function api(method, path, { body, query } = {}) {
  const s = settings();
  let url;
  try {
    url = new URL(s.base + path, window.location.href);
  } catch {
    throw new ApiError(0, "bad_api_base", `the API base ${JSON.stringify(s.base)} is not a URL`);
  }
  Object.entries(query ?? {}).forEach(([k, v]) => url.searchParams.set(k, String(v)));
  const headers = {};
  if (s.key) headers["X-API-Key"] = s.key;
  if (body !== undefined && !(body instanceof FormData)) {
    headers["Content-Type"] = "application/json";
    body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(url, { method, headers, body });
  } catch (err) {
    throw new ApiError(0, "network_error", `no answer from ${url.origin}: ${err.message}`);
  }
  if (response.status === 204) return null;
  const text = await response.text();
  let data = null;
  try {
    data = text ? JSON.parse(text) : null;
  } catch {
    data = null;
  }
  if (!response.ok) {
    if (data && typeof data.code === "string") {
      throw new ApiError(response.status, data.code, data.message ?? "", data.details ?? {});
    }
    throw new ApiError(response.status, "http_error", text.slice(0, 300) || response.statusText);
  }
  return data;
}

// ---------------------------------------------------------------- messages

function setStatus(text) {
  $("status").textContent = text;
}

function showError(err) {
  const box = $("error");
  box.replaceChildren();
  if (!err) {
    box.hidden = true;
    return;
  }
  const code = document.createElement("strong");
  code.dataset.testid = "error-code";
  code.textContent = err instanceof ApiError ? [err.status || "", err.code].join(" ").trim() : "error";
  const message = document.createElement("span");
  message.dataset.testid = "error-message";
  message.textContent = err.message;
  const close = document.createElement("button");
  close.type = "button";
  close.className = "link";
  close.textContent = "Dismiss";
  close.addEventListener("click", () => showError(null));
  box.append(code, " ", message, " ", close);
  const details = err instanceof ApiError ? err.details : null;
  if (details && Object.keys(details).length) {
    const pre = document.createElement("pre");
    pre.textContent = JSON.stringify(details, null, 1).slice(0, 2000);
    box.append(pre);
  }
  box.hidden = false;
}

function setResultState(value) {
  $("result").dataset.state = value;
  $("result").setAttribute("aria-busy", String(value === "busy"));
}

// ---------------------------------------------------------------- photo and analysis

async function loadImage(blob, name) {
  showError(null);
  const run = ++state.run;
  state.image = null;
  state.result = null;
  state.selected = -1;
  closeEnroll();
  $("reanalyze").hidden = true;
  setResultState("busy");
  setStatus(`Reading ${name}…`);
  render();
  let bitmap;
  try {
    bitmap = await createImageBitmap(blob, { imageOrientation: "from-image" });
  } catch {
    if (run !== state.run) return;
    setResultState("error");
    setStatus("");
    showError(new ApiError(0, "invalid_image", `${name} is not an image this browser can read`));
    return;
  }
  if (run !== state.run) return;
  state.image = { blob, name, bitmap };
  $("result").dataset.image = name;
  $("reanalyze").hidden = false;
  render();
  await analyze(run);
}

async function analyze(run, note = "") {
  // note: what the user just did (enrolled, deleted), kept in front of the analysis status
  if (!state.image) return;
  const s = settings();
  const mode = s.collection ? "identify" : "detect";
  const path = mode === "identify" ? `/v1/collections/${enc(s.collection)}/identify` : "/v1/detect";
  const form = new FormData();
  form.append("image", state.image.blob, state.image.name);
  setResultState("busy");
  const prefix = note ? `${note} ` : "";
  setStatus(prefix + (mode === "identify" ? `Identifying faces in collection ${s.collection}…` : "Detecting faces…"));
  const started = performance.now();
  try {
    const data = await api("POST", path, { body: form });
    if (run !== state.run) return;
    state.result = { mode, width: data.width, height: data.height, faces: data.faces };
    $("result").dataset.width = data.width;
    $("result").dataset.height = data.height;
    if (state.selected >= data.faces.length) state.selected = -1;
    const n = data.faces.length;
    const ms = Math.round(performance.now() - started);
    setStatus(`${prefix}${n} face${n === 1 ? "" : "s"} in ${state.image.name} (${ms} ms)` +
      (mode === "detect" ? ": detection only; enter a collection to name faces." : "."));
    setResultState("done");
  } catch (err) {
    if (run !== state.run) return;
    state.result = null;
    setStatus(note);
    showError(err);
    setResultState("error");
  }
  render();
}

function faceLabel(face, mode) {
  if (mode === "detect") return { name: "face", score: face.score.toFixed(2) };
  if (face.decision === "match" && face.identity) {
    return { name: face.identity.name || face.identity.external_id, score: face.identity.score.toFixed(2) };
  }
  return { name: "unknown", score: "" };
}

function faceColor(face, mode) {
  return mode === "detect" ? COLORS.detect : COLORS[face.decision] ?? COLORS.unknown;
}

function render() {
  draw();
  renderFaces();
}

function draw() {
  const canvas = $("canvas");
  const ctx = canvas.getContext("2d");
  if (!state.image) {
    canvas.width = 640;
    canvas.height = 360;
    ctx.fillStyle = "#e5e7eb";
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    canvas.setAttribute("aria-label", "no photo yet");
    return;
  }
  const { bitmap } = state.image;
  canvas.width = bitmap.width;
  canvas.height = bitmap.height;
  ctx.drawImage(bitmap, 0, 0);
  const r = state.result;
  if (!r) {
    canvas.setAttribute("aria-label", `${state.image.name}, analysing`);
    return;
  }
  const sx = bitmap.width / r.width;
  const sy = bitmap.height / r.height;
  const unit = Math.max(2, Math.round(Math.max(bitmap.width, bitmap.height) / 320));
  const font = Math.max(12, unit * 7);
  ctx.font = `600 ${font}px system-ui, sans-serif`;
  ctx.textBaseline = "middle";
  r.faces.forEach((face, i) => {
    const { x1, y1, x2, y2 } = face.box;
    const [x, y, w, h] = [x1 * sx, y1 * sy, (x2 - x1) * sx, (y2 - y1) * sy];
    const color = faceColor(face, r.mode);
    const selected = i === state.selected;
    if (selected) {
      ctx.lineWidth = unit * 4;
      ctx.strokeStyle = "#fde047";
      ctx.strokeRect(x, y, w, h);
    }
    ctx.lineWidth = unit;
    ctx.strokeStyle = color;
    ctx.strokeRect(x, y, w, h);
    const { name, score } = faceLabel(face, r.mode);
    const text = `${i + 1}. ${name}${score ? ` ${score}` : ""}`;
    const tw = ctx.measureText(text).width + font * 0.6;
    const th = font * 1.4;
    const tx = Math.max(0, Math.min(x - unit / 2, canvas.width - tw));
    const ty = y - th - unit / 2 >= 0 ? y - th - unit / 2 : Math.min(y + h + unit / 2, canvas.height - th);
    ctx.fillStyle = color;
    ctx.fillRect(tx, ty, tw, th);
    ctx.fillStyle = "#fff";
    ctx.fillText(text, tx + font * 0.3, ty + th / 2);
  });
  const names = r.faces.map((f) => faceLabel(f, r.mode).name);
  canvas.setAttribute("aria-label", `${state.image.name}: ${r.faces.length} face(s)` +
    (names.length ? `: ${names.join(", ")}` : ""));
}

function renderFaces() {
  const list = $("faces");
  list.replaceChildren();
  const r = state.result;
  const empty = $("faces-empty");
  if (!state.image) {
    empty.textContent = state.run ? "" : "No photo yet.";
  } else if (!r) {
    empty.textContent = $("result").dataset.state === "busy" ? "Analysing…" : "";
  } else {
    empty.textContent = r.faces.length ? "Select a face to enroll it." : "No face found.";
  }
  if (!r) return;
  r.faces.forEach((face, i) => {
    const { name, score } = faceLabel(face, r.mode);
    const item = document.createElement("li");
    item.dataset.testid = "face";
    item.dataset.decision = r.mode === "detect" ? "detected" : face.decision;
    item.dataset.box = [face.box.x1, face.box.y1, face.box.x2, face.box.y2].map((v) => v.toFixed(1)).join(",");
    const button = document.createElement("button");
    button.type = "button";
    button.className = "face";
    button.dataset.testid = "face-button";
    button.setAttribute("aria-pressed", String(i === state.selected));
    const swatch = document.createElement("span");
    swatch.className = "swatch";
    swatch.style.background = faceColor(face, r.mode);
    const nameEl = document.createElement("span");
    nameEl.dataset.testid = "face-name";
    nameEl.className = "name";
    nameEl.textContent = name;
    const scoreEl = document.createElement("span");
    scoreEl.dataset.testid = "face-score";
    scoreEl.className = "score";
    scoreEl.textContent = score;
    button.append(swatch, `${i + 1}. `, nameEl, " ", scoreEl);
    button.addEventListener("click", () => selectFace(i));
    const detail = document.createElement("small");
    detail.dataset.testid = "face-detail";
    detail.textContent = faceDetail(face, r.mode);
    item.append(button, detail);
    list.append(item);
  });
}

function faceDetail(face, mode) {
  const { x1, y1, x2, y2 } = face.box;
  const size = `${Math.round(x2 - x1)}×${Math.round(y2 - y1)} px`;
  if (mode === "detect") return `detection ${face.score.toFixed(2)}, ${size}`;
  if (face.identity) {
    const id = face.identity;
    return `similarity ${id.score.toFixed(3)}, confidence ${Math.round(id.confidence * 100)} %, id ${id.external_id}`;
  }
  const best = face.candidates?.[0];
  return best ? `closest: ${best.name || best.external_id} (${best.score.toFixed(2)}), ${size}` : size;
}

function faceAt(event) {
  const r = state.result;
  if (!r) return -1;
  const rect = $("canvas").getBoundingClientRect();
  const x = ((event.clientX - rect.left) / rect.width) * r.width;
  const y = ((event.clientY - rect.top) / rect.height) * r.height;
  let best = -1;
  let bestArea = Infinity;
  r.faces.forEach((f, i) => {
    const { x1, y1, x2, y2 } = f.box;
    const area = (x2 - x1) * (y2 - y1);
    if (x >= x1 && x <= x2 && y >= y1 && y <= y2 && area < bestArea) {
      best = i;
      bestArea = area;
    }
  });
  return best;
}

// ---------------------------------------------------------------- enrollment

function selectFace(i) {
  state.selected = i;
  render();
  const face = state.result.faces[i];
  if (!settings().collection) {
    showError(new ApiError(0, "no_collection", "Enter a collection (and its API key) to enroll faces."));
    return;
  }
  showError(null);
  const form = $("enroll");
  $("enroll-title").textContent = `Enroll face ${i + 1}`;
  const known = face.identity && state.identities.some((p) => p.external_id === face.identity.external_id);
  form.elements.target.value = known ? "existing" : "new";
  fillIdentitySelect(known ? face.identity.external_id : undefined);
  syncEnrollFields();
  form.hidden = false;
  (known ? $("enroll-select") : $("enroll-name")).focus();
}

function closeEnroll() {
  $("enroll").hidden = true;
  $("enroll-name").value = "";
  $("enroll-id").value = "";
}

function syncEnrollFields() {
  const isNew = $("enroll").elements.target.value === "new";
  $("enroll-new-fields").hidden = !isNew;
  $("enroll-existing-fields").hidden = isNew;
}

function slug(name) {
  const ascii = name.normalize("NFKD").replace(/[\u0300-\u036f]/g, "").toLowerCase();
  return ascii.replace(/[^a-z0-9]+/g, "-").replace(/^-+|-+$/g, "").slice(0, 64) ||
    name.replace(/\//g, "-").trim().slice(0, 64);
}

async function enroll(event) {
  event.preventDefault();
  const face = state.result?.faces[state.selected];
  if (!face || !state.image) return;
  const s = settings();
  const isNew = $("enroll").elements.target.value === "new";
  let externalId;
  let name = "";
  if (isNew) {
    name = $("enroll-name").value.trim();
    externalId = $("enroll-id").value.trim() || slug(name);
    if (!externalId) {
      showError(new ApiError(0, "missing_name", "Give the new identity a name or an external id."));
      $("enroll-name").focus();
      return;
    }
    if (externalId.includes("/")) {
      showError(new ApiError(0, "bad_external_id", "An external id cannot contain '/'."));
      $("enroll-id").focus();
      return;
    }
    if (state.identities.some((p) => p.external_id === externalId)) {
      showError(new ApiError(0, "identity_exists",
        `${externalId} already exists: choose "existing" to add this face to it, or another external id.`));
      $("enroll-id").focus();
      return;
    }
  } else {
    externalId = $("enroll-select").value;
    if (!externalId) {
      showError(new ApiError(0, "missing_identity", "Choose an identity."));
      return;
    }
  }
  const { x1, y1, x2, y2 } = face.box;
  const form = new FormData();
  form.append("images", state.image.blob, state.image.name);
  form.append("box", [x1, y1, x2, y2].map((v) => v.toFixed(1)).join(","));
  const submit = $("enroll").querySelector("button[type=submit]");
  submit.disabled = true;
  showError(null);
  setStatus(`Enrolling face ${state.selected + 1}…`);
  try {
    const data = await api("POST", `/v1/collections/${enc(s.collection)}/identities/${enc(externalId)}/faces`,
      { body: form, query: isNew ? { create: "true", name } : {} });
    const note = `Enrolled face ${state.selected + 1} as ${data.identity.name || data.identity.external_id}.`;
    closeEnroll();
    setStatus(note);
    state.selected = -1;
    await loadIdentities();
    await analyze(++state.run, note);
  } catch (err) {
    setStatus("");
    showError(err);
  } finally {
    submit.disabled = false;
  }
}

// ---------------------------------------------------------------- identities

function fillIdentitySelect(chosen) {
  const select = $("enroll-select");
  const current = chosen ?? select.value;
  select.replaceChildren(...state.identities.map((p) => {
    const option = document.createElement("option");
    option.value = p.external_id;
    option.textContent = p.name ? `${p.name} (${p.external_id})` : p.external_id;
    return option;
  }));
  if (state.identities.some((p) => p.external_id === current)) select.value = current;
  $("enroll-existing").disabled = state.identities.length === 0;
}

async function loadIdentities() {
  const s = settings();
  const list = $("identities");
  const count = $("identities-count");
  if (!s.collection || !s.key) {
    state.identities = [];
    list.replaceChildren();
    count.textContent = s.collection ? "Enter the API key to list identities." : "Enter a collection to list its identities.";
    fillIdentitySelect();
    return;
  }
  try {
    const page = await api("GET", `/v1/collections/${enc(s.collection)}/identities`, { query: { limit: 500 } });
    state.identities = page.items;
    count.textContent = page.total > page.items.length ? `first ${page.items.length} of ${page.total}`
      : `${page.total} in ${s.collection}`;
  } catch (err) {
    state.identities = [];
    count.textContent = "";
    showError(err);
  }
  list.replaceChildren(...state.identities.map(identityItem));
  fillIdentitySelect();
}

function identityItem(p) {
  const item = document.createElement("li");
  item.dataset.testid = "identity";
  item.dataset.externalId = p.external_id;
  const name = document.createElement("span");
  name.className = "name";
  name.dataset.testid = "identity-name";
  name.textContent = p.name || p.external_id;
  const id = document.createElement("code");
  id.textContent = p.external_id;
  const del = document.createElement("button");
  del.type = "button";
  del.className = "danger";
  del.dataset.testid = "identity-delete";
  del.textContent = "Delete";
  del.setAttribute("aria-label", `Delete ${p.name || p.external_id}`);
  del.addEventListener("click", () => deleteIdentity(p, del));
  item.append(name, " ", id, " ", del);
  return item;
}

async function deleteIdentity(p, button) {
  const who = p.name ? `${p.name} (${p.external_id})` : p.external_id;
  if (!window.confirm(`Delete ${who} and all their enrolled faces?`)) return;
  button.disabled = true;
  try {
    await api("DELETE", `/v1/collections/${enc(settings().collection)}/identities/${enc(p.external_id)}`);
  } catch (err) {
    showError(err);
    button.disabled = false;
    return;
  }
  setStatus(`Deleted ${who}.`);
  await loadIdentities();
  if (state.image) await analyze(++state.run, `Deleted ${who}.`);
}

// ---------------------------------------------------------------- camera

async function setupCamera() {
  const media = navigator.mediaDevices;
  if (!media?.getUserMedia || !media.enumerateDevices) return;
  const check = async () => {
    try {
      const devices = await media.enumerateDevices();
      $("camera-open").hidden = !devices.some((d) => d.kind === "videoinput");
    } catch {
      $("camera-open").hidden = true;
    }
  };
  media.addEventListener?.("devicechange", check);
  await check();
}

async function openCamera() {
  try {
    state.stream = await navigator.mediaDevices.getUserMedia({
      video: { width: { ideal: 1280 }, height: { ideal: 720 } }, audio: false,
    });
  } catch (err) {
    showError(new ApiError(0, "camera_error", `the camera is not available: ${err.message}`));
    return;
  }
  $("video").srcObject = state.stream;
  $("camera").hidden = false;
  $("camera-snap").focus();
}

function closeCamera() {
  state.stream?.getTracks().forEach((t) => t.stop());
  state.stream = null;
  $("video").srcObject = null;
  $("camera").hidden = true;
}

async function snapshot() {
  const video = $("video");
  if (!video.videoWidth) return;
  const canvas = document.createElement("canvas");
  canvas.width = video.videoWidth;
  canvas.height = video.videoHeight;
  canvas.getContext("2d").drawImage(video, 0, 0);
  const blob = await new Promise((resolve) => canvas.toBlob(resolve, "image/jpeg", 0.92));
  closeCamera();
  if (blob) {
    const stamp = new Date().toISOString().replace(/[:.]/g, "-");
    await loadImage(blob, `snapshot-${stamp}.jpg`);
  }
}

// ---------------------------------------------------------------- wiring

function takeFile(file) {
  if (!file) return;
  if (!file.type.startsWith("image/")) {
    showError(new ApiError(0, "unsupported_media_type", `${file.name} is not an image`));
    return;
  }
  loadImage(file, file.name);
}

function wire() {
  loadSettings();
  ["api-base", "collection", "api-key"].forEach((id) => {
    $(id).addEventListener("input", saveSettings);
    $(id).addEventListener("change", loadIdentities);
  });
  $("connection").addEventListener("submit", (e) => {
    e.preventDefault();
    loadIdentities();
  });
  $("forget").addEventListener("click", forgetSettings);

  $("file").addEventListener("change", (e) => {
    const file = e.target.files?.[0];
    e.target.value = ""; // choosing the same file again fires change again
    takeFile(file);
  });
  const drop = $("drop");
  document.addEventListener("dragover", (e) => {
    if (!e.dataTransfer?.types.includes("Files")) return;
    e.preventDefault();
    drop.classList.add("over");
  });
  document.addEventListener("dragleave", (e) => {
    if (e.relatedTarget === null) drop.classList.remove("over");
  });
  document.addEventListener("drop", (e) => {
    if (!e.dataTransfer?.files.length) return;
    e.preventDefault();
    drop.classList.remove("over");
    takeFile(e.dataTransfer.files[0]);
  });
  $("reanalyze").addEventListener("click", () => analyze(++state.run));

  $("camera-open").addEventListener("click", openCamera);
  $("camera-close").addEventListener("click", closeCamera);
  $("camera-snap").addEventListener("click", snapshot);

  const canvas = $("canvas");
  canvas.addEventListener("click", (e) => {
    const i = faceAt(e);
    if (i >= 0) selectFace(i);
  });
  canvas.addEventListener("mousemove", (e) => {
    canvas.style.cursor = faceAt(e) >= 0 ? "pointer" : "default";
  });

  const form = $("enroll");
  form.addEventListener("submit", enroll);
  form.addEventListener("change", (e) => {
    if (e.target.name === "target") syncEnrollFields();
  });
  $("enroll-cancel").addEventListener("click", () => {
    closeEnroll();
    state.selected = -1;
    render();
  });
  form.addEventListener("keydown", (e) => {
    if (e.key === "Escape") $("enroll-cancel").click();
  });
  $("identities-refresh").addEventListener("click", loadIdentities);

  render();
  loadIdentities();
  setupCamera();
}

wire();
