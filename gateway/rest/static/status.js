// The status page: polls GET /status once a second with the operator key from the URL's
// fragment (/#key=...: a fragment never reaches a server or its logs); streams a test prompt
// through POST /v1/chat/completions with fetch and a small server-sent-events reader.
"use strict";

const $ = (id) => document.getElementById(id);
const operatorKey = new URLSearchParams(location.hash.slice(1)).get("key") || "";
const cell = (v, cls) => `<td${cls ? ` class="${cls}"` : ""}>${escape(v ?? "–")}</td>`;
const escape = (v) => String(v).replace(/[&<>"]/g, (c) => `&#${c.charCodeAt(0)};`);

function render(s) {
  const gw = s.gateway;
  const tokens = gw ? gw.tokens : s.shim.tokens;
  $("summary").innerHTML =
    `gateway <b>${escape(s.gateway_target)}</b> · prompt tokens <b id="prompt-tokens">` +
    `${tokens.prompt}</b> · cached <b id="cached-tokens">${tokens.cached}</b> · ` +
    `cached-token ratio <b id="cached-ratio">${(100 * tokens.cached_ratio).toFixed(1)}%</b>` +
    ` · completion tokens <b>${tokens.completion}</b> · shim up ${s.shim.uptime_s} s`;
  const rows = [];
  for (const pool of gw ? gw.pools : []) {
    if (pool.workers.length === 0) rows.push(`<tr>${cell(pool.model, "l")}` +
      `<td class="l muted" colspan="10">no worker (waiting: ${pool.waiting})</td></tr>`);
    for (const w of pool.workers) {
      const fmt = w.served ? `${w.served.prefill} | ${w.served.decode}` : null;
      rows.push(`<tr class="worker">${cell(pool.model, "l")}${cell(w.id, "l")}` +
        `${cell(w.state, "l")}${cell(w.inflight)}${cell(w.requests_served)}` +
        `${cell(w.pages_used)}${cell(w.pages_free)}${cell(w.pages_cached)}` +
        `${cell(w.integrity_checks)}${cell(w.integrity_mismatches,
          w.integrity_mismatches ? "bad" : "")}${cell(fmt, "l")}</tr>`);
    }
  }
  if (!gw) rows.push(`<tr><td class="l muted" colspan="11">the shim is not in the gateway's ` +
    `process: pools are not visible here</td></tr>`);
  $("workers").tBodies[0].innerHTML = rows.join("");
  const gwReasons = gw ? gw.requests_by_reason : {};
  const shimReasons = s.shim.requests_by_reason;
  const names = [...new Set([...Object.keys(gwReasons), ...Object.keys(shimReasons)])].sort();
  $("reasons").tBodies[0].innerHTML = names.map((r) => `<tr>` +
    cell(r, r === "KV_INTEGRITY_VIOLATION" ? "l bad" : "l") + cell(gwReasons[r] ?? 0) +
    cell(shimReasons[r] ?? 0) + `</tr>`).join("");
  if (!$("model").value && gw && gw.pools.length) $("model").value = gw.pools[0].model;
  $("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
  document.body.dataset.polls = String(Number(document.body.dataset.polls || 0) + 1);
}

async function poll() {
  try {
    const r = await fetch("/status", { cache: "no-store",
      headers: { authorization: `Bearer ${operatorKey}` } });
    if (r.status === 401) {
      $("updated").textContent = "needs the operator key: open this page as /#key=<operator key>";
    } else {
      render(await r.json());
    }
  } catch (e) {
    $("updated").textContent = `status unavailable: ${e}`;
  }
  setTimeout(poll, 1000);
}

async function* sseEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += value;
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, end);
      buf = buf.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trim()).join("\n");
      if (data) yield data;
    }
  }
}

async function send(ev) {
  ev.preventDefault();
  const out = $("output"), state = $("stream-state");
  out.textContent = ""; out.dataset.chunks = "0"; $("usage").textContent = "";
  state.textContent = "sending...";
  const body = { model: $("model").value, stream: true,
    stream_options: { include_usage: true }, max_tokens: Number($("max-tokens").value),
    messages: [{ role: "user", content: $("prompt").value }] };
  try {
    const r = await fetch("/v1/chat/completions", { method: "POST", body: JSON.stringify(body),
      headers: { "content-type": "application/json",
                 authorization: `Bearer ${$("api-key").value}` } });
    if (!r.ok) {
      const err = (await r.json()).error;
      state.textContent = `error ${r.status} ${err.reason}: ${err.message}`;
      return;
    }
    state.textContent = "streaming...";
    for await (const data of sseEvents(r.body)) {
      if (data === "[DONE]") { state.textContent = "done"; break; }
      const msg = JSON.parse(data);
      if (msg.error) { state.textContent = `error ${msg.error.reason}: ${msg.error.message}`; }
      const delta = msg.choices && msg.choices[0] && msg.choices[0].delta;
      if (delta && delta.content) {
        out.textContent += delta.content;
        out.dataset.chunks = String(Number(out.dataset.chunks) + 1);
      }
      if (msg.usage) $("usage").textContent = `prompt ${msg.usage.prompt_tokens} · cached ` +
        `${msg.usage.prompt_tokens_details.cached_tokens} · completion ` +
        `${msg.usage.completion_tokens} · ${msg.system_fingerprint || ""}`;
    }
  } catch (e) {
    state.textContent = `failed: ${e}`;
  }
}

$("prompt-form").addEventListener("submit", send);
poll();
