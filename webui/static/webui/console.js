// The console's few scripts: copy buttons, confirmations, the chunked adapter upload with
// progress, and live updates over websockets (adapter status, the engine fleet).
// Every page works without them; they only make it nicer. No inline script anywhere
// (the Content-Security-Policy allows only this file).
"use strict";

(function () {
  const csrfToken = () => document.querySelector('meta[name="csrf-token"]').content;

  // --- copy buttons --------------------------------------------------------------------
  document.addEventListener("click", async (event) => {
    const button = event.target.closest("[data-copy]");
    if (!button) return;
    const input = document.querySelector(button.dataset.copy);
    const status = button.parentElement.querySelector(".copy-status");
    input.select();
    try {
      await navigator.clipboard.writeText(input.value);
    } catch (err) {
      document.execCommand("copy"); // older browsers, or no clipboard permission
    }
    if (status) status.textContent = "Copied.";
  });

  // --- confirmations -------------------------------------------------------------------
  document.addEventListener("submit", (event) => {
    const form = event.target.closest("form[data-confirm]");
    if (form && !window.confirm(form.dataset.confirm)) event.preventDefault();
  }, true);

  // --- websockets that reconnect -------------------------------------------------------
  function live(path, onMessage, onState) {
    let delay = 500;
    let socket = null;
    const open = () => {
      const scheme = location.protocol === "https:" ? "wss:" : "ws:";
      socket = new WebSocket(`${scheme}//${location.host}${path}`);
      socket.addEventListener("open", () => { delay = 500; onState(true); });
      socket.addEventListener("message", (e) => onMessage(JSON.parse(e.data)));
      socket.addEventListener("close", (e) => {
        onState(false);
        if (e.code === 4403) return; // not allowed: retrying would not help
        setTimeout(open, delay);
        delay = Math.min(delay * 2, 10000);
      });
    };
    open();
    window.addEventListener("beforeunload", () => socket && socket.close());
  }

  const showLive = (on) => document.querySelectorAll("[data-live]").forEach((el) => {
    el.hidden = !on;
  });

  // --- adapters: live status -----------------------------------------------------------
  // A version made elsewhere (a teammate) is shown by reloading the page, but never in the
  // middle of this page's own upload: that waits until the upload ends.
  let uploading = false;
  let listChanged = false;

  function setAdapterStatus(event) {
    const row = document.querySelector(`[data-adapter-id="${event.id}"]`);
    if (!row) {
      if (event.status === "deleted") return;
      if (uploading) listChanged = true; else location.reload();
      return;
    }
    if (event.status === "deleted") { row.remove(); return; }
    const badge = row.querySelector("[data-status]");
    badge.textContent = event.status;
    badge.className = `status status-${event.status}`;
    const failure = row.querySelector("[data-failure]");
    failure.textContent = event.failure_reason ? ` ${event.failure_reason}` : "";
    if (event.status === "ready" && adapterApi) refreshFacts(row, event.id);
  }

  // Rank and size are known once validated: read them from the API.
  async function refreshFacts(row, id) {
    const res = await fetch(`${adapterApi}/${id}`, { credentials: "same-origin" });
    if (!res.ok) return;
    const adapter = await res.json();
    row.querySelector("[data-rank]").textContent = adapter.rank ?? "—";
    const kib = adapter.size_bytes / 1024;
    row.querySelector("[data-size]").textContent = adapter.size_bytes
      ? (kib < 1024 ? `${kib.toFixed(1)} KB` : `${(kib / 1024).toFixed(1)} MB`) : "—";
  }

  const adapterList = document.getElementById("adapter-list");
  const adapterApi = adapterList
    ? `/api/v1${adapterList.dataset.ws.replace(/^\/ws/, "")}` : null;
  if (adapterList) {
    const api = adapterApi;
    live(adapterList.dataset.ws, (msg) => {
      if (msg.type === "adapter.status") setAdapterStatus(msg);
    }, async (on) => {
      showLive(on);
      if (!on) return;
      // Changes made while the socket was closed: read the list once.
      const res = await fetch(api, { credentials: "same-origin" });
      if (!res.ok) return;
      for (const a of (await res.json()).data) {
        const row = document.querySelector(`[data-adapter-id="${a.id}"] [data-status]`);
        if (row && row.textContent !== a.status) setAdapterStatus(a);
      }
    });
  }

  // --- adapters: chunked, resumable upload with progress --------------------------------
  function send(method, url, body, headers, onProgress) {
    return new Promise((resolve, reject) => {
      const xhr = new XMLHttpRequest();
      xhr.open(method, url);
      xhr.setRequestHeader("X-CSRFToken", csrfToken());
      for (const [k, v] of Object.entries(headers || {})) xhr.setRequestHeader(k, v);
      if (onProgress) xhr.upload.addEventListener("progress", (e) => onProgress(e.loaded));
      xhr.addEventListener("load", () => {
        let data = null;
        try { data = JSON.parse(xhr.responseText); } catch (err) { data = null; }
        resolve({ status: xhr.status, data });
      });
      xhr.addEventListener("error", () => reject(new Error("the network failed")));
      xhr.send(body);
    });
  }

  const errorOf = (res) => (res.data && res.data.error && res.data.error.message)
    || `the server answered ${res.status}`;

  const uploadForm = document.getElementById("adapter-upload");
  if (uploadForm) {
    const box = uploadForm.querySelector(".upload-progress");
    const bar = box.querySelector("progress");
    const text = box.querySelector(".upload-text");
    const api = uploadForm.dataset.api;
    const say = (message, percent) => {
      box.hidden = false;
      text.textContent = message;
      if (percent !== undefined) bar.value = percent;
    };

    uploadForm.addEventListener("submit", async (event) => {
      event.preventDefault();
      const name = uploadForm.querySelector('[name="name"]').value.trim();
      const file = uploadForm.querySelector('[name="archive"]').files[0];
      const baseModel = uploadForm.querySelector('[name="base_model"]').value;
      const button = uploadForm.querySelector('button[type="submit"]');
      if (!name || !file) { say("Give a name and choose an archive."); return; }
      button.disabled = true;
      uploading = true;
      try {
        const started = await send("POST", `${api}/adapter-uploads`,
          JSON.stringify({ name, size: file.size, filename: file.name,
                           base_model: baseModel }),
          { "Content-Type": "application/json" });
        if (started.status !== 201) throw new Error(errorOf(started));
        const upload = started.data;
        const chunk = upload.chunk_bytes || Number(uploadForm.dataset.chunk);
        let offset = upload.received;
        let retries = 0;
        while (offset < file.size) {
          const end = Math.min(offset + chunk, file.size);
          const res = await send("PUT", `${api}/adapter-uploads/${upload.id}`,
            file.slice(offset, end),
            { "Content-Type": "application/octet-stream",
              "Content-Range": `bytes ${offset}-${end - 1}/${file.size}` },
            (loaded) => say(`Uploading ${file.name}…`,
              Math.floor((100 * (offset + loaded)) / file.size)))
            .catch(() => ({ status: 0, data: null }));
          if (res.status === 200) { offset = res.data.received; retries = 0; continue; }
          if (retries++ >= 3 || (res.status >= 400 && res.status < 500 && res.status !== 409)) {
            throw new Error(errorOf(res));
          }
          // Resume from what the server has (a lost reply, a conflict, a hiccup).
          const state = await send("GET", `${api}/adapter-uploads/${upload.id}`, null);
          if (state.status !== 200) throw new Error(errorOf(state));
          offset = state.data.received;
        }
        say("Uploaded; validating…", 100);
        const done = await send("POST", `${api}/adapter-uploads/${upload.id}/complete`, null);
        if (done.status !== 202) throw new Error(errorOf(done));
        say(`${done.data.name} version ${done.data.version} is uploaded and being validated.`);
        location.reload();
      } catch (err) {
        uploading = false;
        say(`The upload failed: ${err.message}${listChanged
          ? " (Other versions were added meanwhile: reload the page to see them.)" : ""}`);
        button.disabled = false;
      }
    });
  }

  // --- the engine fleet ------------------------------------------------------------------
  const fleet = document.getElementById("fleet");
  if (fleet) {
    const body = fleet.querySelector("tbody");
    const pct = (v, d) => (v === null || v === undefined ? "—" : `${(v * 100).toFixed(d)}%`);
    const num = (v) => (v === null || v === undefined ? "—" : Number(v).toLocaleString("en-US"));
    const cell = (text, cls) => {
      const td = document.createElement("td");
      if (cls) td.className = cls;
      td.textContent = text;
      return td;
    };
    const render = (engines) => {
      body.replaceChildren();
      if (!engines.length) {
        const tr = document.createElement("tr");
        tr.dataset.empty = "";
        const td = cell("No engine is alive. Start one with atrium engine.", "muted");
        td.colSpan = 10;
        tr.append(td);
        body.append(tr);
        return;
      }
      for (const e of engines) {
        const tr = document.createElement("tr");
        tr.dataset.engine = e.engine_id;
        const th = document.createElement("th");
        th.scope = "row";
        const code = document.createElement("code");
        code.textContent = e.engine_id;
        th.append(code);
        const kv = cell("");
        const meter = document.createElement("meter");
        meter.min = 0; meter.max = 1; meter.value = e.kv_usage;
        meter.setAttribute("aria-label", "KV cache use");
        kv.append(meter, ` ${pct(e.kv_usage, 1)}`);
        if (e.kv_blocks_total) {
          const blocks = document.createElement("span");
          blocks.className = "muted small";
          blocks.textContent = ` (${e.kv_blocks_used}/${e.kv_blocks_total} blocks)`;
          kv.append(blocks);
        }
        kv.dataset.field = "kv";
        const fields = [
          ["running", cell(e.running, "num")],
          ["waiting", cell(e.queued ? `${e.waiting} +${e.queued} in its stream` : e.waiting,
            "num")],
          ["kv", kv], ["prefix", cell(pct(e.prefix_cache_hit_rate, 1), "num")],
          ["tps", cell(e.generation_tokens_per_s ?? "—", "num")],
          ["generated", cell(num(e.tokens_generated), "num")],
          ["adapters", cell(e.adapters_in_slots.length
            ? e.adapters_in_slots.map((a) => a.slice(0, 12)).join(" ") : "none")],
          ["age", cell(`${e.age_s} s ago`, "num")],
        ];
        tr.append(th, cell(e.model));
        for (const [name, td] of fields) { td.dataset.field = name; tr.append(td); }
        body.append(tr);
      }
    };
    const status = document.getElementById("fleet-status");
    live(fleet.dataset.ws, (msg) => {
      if (msg.type === "fleet") {
        render(msg.engines);
        status.textContent = `${msg.engines.length} engine(s) alive, updated ` +
          `${new Date(msg.at * 1000).toLocaleTimeString()}.`;
      } else if (msg.type === "error") {
        status.textContent = `Cannot read the fleet: ${msg.message}.`;
      }
    }, showLive);
  }
})();
