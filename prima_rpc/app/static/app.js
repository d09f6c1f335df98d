"use strict";
// The page's one script: a chat streamed from /v1/chat/completions (server-sent events), the ring polled
// from /api/ring, the plan from /api/plan. The ring's token, when it has one, is kept in sessionStorage.

const $ = (id) => document.getElementById(id);
const TOKEN_KEY = "prima-token";
const HISTORY_KEY = "prima-chat";
const POLL_MS = 2000;
const MAX_TOKENS = 256; // and the model's sampling defaults: as `prima-ctl chat` answers
const PLAIN_NOTE = "This model has no chat template: it is a base model, so it does not answer questions. It " +
  "continues the text you write (plain completion): start a sentence, a list or a story and it carries on.";
const WORDS_PER_TOKEN = 0.75; // English text: about 4 words in 3 tokens
const TECH_KEY = "prima-technical";

let history = JSON.parse(sessionStorage.getItem(HISTORY_KEY) || "[]"); // the messages list sent each turn
let answering = null; // the AbortController of the answer streaming now
let answerTpot = null; // ms between tokens of the last answer, as this page received them
let headTpot = null; // ms of the head's last decode step, as /api/ring reports it

// ------------------------------------------------------------------ the token

function headers() {
  const token = sessionStorage.getItem(TOKEN_KEY);
  return token ? {"Content-Type": "application/json", Authorization: `Bearer ${token}`}
               : {"Content-Type": "application/json"};
}

class NeedsToken extends Error {}

async function call(path, options = {}) {
  const res = await fetch(path, {...options, headers: headers()});
  if (res.status === 401) {
    askToken(sessionStorage.getItem(TOKEN_KEY) ? "That token was refused." : "");
    throw new NeedsToken("the ring's token is needed");
  }
  return res;
}

async function errorOf(res) {
  try {
    return (await res.json()).error.message;
  } catch {
    return `${res.status} ${res.statusText}`;
  }
}

function askToken(why) {
  $("token-form").hidden = false;
  $("token-error").textContent = why;
  $("token").focus();
}

$("token-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, $("token").value.trim());
  $("token").value = "";
  $("token-form").hidden = true;
  refresh();
});

// ------------------------------------------------------------------ the chat

function bubble(role, text) {
  $("empty").hidden = true;
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  const who = document.createElement("span");
  who.className = "who";
  who.textContent = role === "user" ? "you" : "model";
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  div.append(who, body);
  $("messages").append(div);
  div.scrollIntoView({block: "end"});
  return div;
}

function note(div, text, kind = "muted") {
  const p = document.createElement("p");
  p.className = `note ${kind}`;
  p.textContent = text;
  div.append(p);
}

function busy(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  $("new-chat").disabled = on;
}

function save() {
  sessionStorage.setItem(HISTORY_KEY, JSON.stringify(history));
}

async function ask(prompt) {
  history.push({role: "user", content: prompt});
  bubble("user", prompt);
  const reply = bubble("assistant", "");
  const text = reply.querySelector(".text");
  reply.classList.add("streaming");
  answering = new AbortController();
  busy(true);
  let content = "";
  const started = performance.now();
  let received = 0; // events with text: about one a token
  let tokens = null; // the exact count, from the last event's usage
  let cut = false; // finish_reason "length"
  let first = 0;
  let last = 0;
  try {
    const res = await call("/v1/chat/completions", {
      method: "POST", signal: answering.signal,
      body: JSON.stringify({messages: history, stream: true, stream_options: {include_usage: true},
                            max_tokens: MAX_TOKENS}),
    });
    if (!res.ok) throw new Error(await errorOf(res));
    const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) { // one event: "data: {...}"
        const data = buffer.slice(0, end).replace(/^data: /, "");
        buffer = buffer.slice(end + 2);
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        const delta = chunk.choices[0]?.delta?.content;
        if (delta) {
          content += delta;
          received += 1;
          if (received === 1) first = performance.now();
          last = performance.now();
          text.textContent = content;
          reply.scrollIntoView({block: "end"});
        }
        cut = cut || chunk.choices[0]?.finish_reason === "length";
        if (chunk.usage) tokens = chunk.usage.completion_tokens;
      }
    }
    const elapsed = (performance.now() - started) / 1000;
    const rate = received > 1 ? `, ${wordsASecond((last - first) / (received - 1))}` : "";
    note(reply, `${tokens ?? received} tokens in ${elapsed.toFixed(1)} s${rate}` +
      `${cut ? `, cut at the ${MAX_TOKENS}-token limit (finish reason: length)` : ""}`);
    if (received > 1) {
      answerTpot = (last - first) / (received - 1);
      measured(headTpot);
    }
  } catch (error) {
    if (error.name === "AbortError") note(reply, "stopped");
    else note(reply, error instanceof NeedsToken ? "Enter the ring's token above, then ask again." : error.message,
              "error");
  } finally {
    reply.classList.remove("streaming");
    answering = null;
    busy(false);
    if (content) {
      history.push({role: "assistant", content});
    } else { // nothing came back: the question goes back into the box, not into the history
      history.pop();
      if (!$("prompt").value) $("prompt").value = prompt;
    }
    save();
    $("prompt").focus();
  }
}

$("ask").addEventListener("submit", (event) => {
  event.preventDefault();
  const prompt = $("prompt").value.trim();
  if (!prompt || answering) return;
  $("prompt").value = "";
  ask(prompt);
});

$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("ask").requestSubmit();
  }
});

$("stop").addEventListener("click", () => answering && answering.abort());

$("new-chat").addEventListener("click", () => {
  history = [];
  save();
  $("messages").replaceChildren($("empty"));
  $("empty").hidden = false;
  $("prompt").focus();
});

// ------------------------------------------------------------------ the ring

const mib = (bytes) => `${(bytes / 2 ** 20).toFixed(0)} MiB`;
const seconds = (s) => `${s.toFixed(2)} s`;

function el(tag, className, text) {
  const e = document.createElement(tag);
  if (className) e.className = className;
  if (text !== undefined) e.textContent = text;
  return e;
}

function layerMap(windows, nLayers) {
  // One strip per node: where its windows sit among the model's layers.
  const map = el("div", "layers");
  map.title = windows.map(([a, b]) => `layers [${a},${b})`).join(", ") || "no layers";
  for (const [a, b] of windows) {
    const part = el("span", "window");
    part.style.left = `${(100 * a) / nLayers}%`;
    part.style.width = `${(100 * (b - a)) / nLayers}%`;
    map.append(part);
  }
  return map;
}

function wordsASecond(msPerToken) {
  const words = (1000 / msPerToken) * WORDS_PER_TOKEN;
  return `about ${words >= 10 ? words.toFixed(0) : words.toFixed(1)} words a second`;
}

function duty(node) {
  // What a device does, in the household's words (the role and the layers are the technical view's).
  if (node.state === "lost") return "not answering: is it switched on?";
  if (node.state && node.state !== "up") return "getting ready";
  if (node.role === "head") return "answers questions";
  if (node.windows.length) return "helps with part of the model";
  return "not needed now";
}

function nodeItem(node, nLayers) {
  const li = el("li", `node ${node.role}${node.error || node.state === "lost" ? " failed" : ""}`);
  const head = el("div", "node-head");
  head.append(el("strong", "", node.name || node.address), el("span", `role tech ${node.role}`, node.role));
  if (node.state && node.state !== "up") head.append(el("span", "role state tech", node.state));
  li.append(head, el("p", "does", duty(node)), el("div", "address muted tech", node.address));
  const ranges = node.windows.map(([a, b]) => `[${a},${b})`).join(" ");
  li.append(el("div", "windows tech", ranges ? `layers ${ranges}` : "no layers"));
  if (nLayers) li.append(layerMap(node.windows, nLayers));
  const stats = el("dl", "stats tech");
  const rows = [["weights", mib(node.resident_bytes)], ["RSS", mib(node.rss_bytes)],
    ["compute", seconds(node.compute_s)], ["stall", seconds(node.stall_s)], ["link", seconds(node.link_s)],
    ["frames", String(node.frames)]];
  if (node.role === "head") rows.push(["last token", `${node.last_token_ms.toFixed(1)} ms`]);
  for (const [term, value] of rows) {
    const pair = el("div");
    pair.append(el("dt", "", term), el("dd", "", value));
    stats.append(pair);
  }
  li.append(stats);
  if (node.error) li.append(el("p", "error", node.error));
  return li;
}

async function pollRing() {
  let ring;
  try {
    const res = await call("/api/ring");
    if (!res.ok) throw new Error(await errorOf(res));
    ring = await res.json();
  } catch (error) {
    const why = error instanceof NeedsToken ? "token needed" : "server unreachable";
    $("status").textContent = why;
    $("ring-error").textContent = `No news from the ring: ${why}.`;
    $("ring-error").hidden = false;
    return;
  }
  $("plain-note").hidden = !ring.plain_chat;
  $("plain-note").textContent = ring.plain_chat ? PLAIN_NOTE : "";
  $("prompt").placeholder = ring.plain_chat ? "Start a text for the model to continue…" : "Ask something…";
  const nLayers = Math.max(0, ...ring.nodes.flatMap((n) => n.windows.map(([, b]) => b)));
  $("nodes").replaceChildren(...ring.nodes.map((n) => nodeItem(n, nLayers)));
  $("ring-error").hidden = !ring.error;
  $("ring-error").textContent = ring.error || "";
  $("ring-time").textContent = `live · ${new Date(ring.time * 1000).toLocaleTimeString()}`;
  $("status").textContent = `${ring.nodes.length} device${ring.nodes.length === 1 ? "" : "s"}` +
    (document.body.classList.contains("technical") ? ` · head ${ring.head}` : "");
  const head = ring.nodes[0];
  const ms = head && head.role === "head" && head.last_token_ms > 0 ? head.last_token_ms : null;
  const helping = ring.nodes.filter((n) => n.windows.length && n.state !== "lost").length;
  $("speed").textContent = (ms === null ? "No answer yet: ask something. " : `Answers come at ${wordsASecond(ms)}. `) +
    `${helping} of ${ring.nodes.length} device${ring.nodes.length === 1 ? "" : "s"} work on each answer.` +
    (ring.busy ? ` ${ring.busy[0].toUpperCase()}${ring.busy.slice(1)}.` : "");
  measured(ms);
}

// ------------------------------------------------------------------ the plan

function measured(ms) {
  headTpot = ms;
  const parts = [];
  if (ms !== null) parts.push(`${ms.toFixed(1)} ms (the head's last token)`);
  if (answerTpot !== null) parts.push(`${answerTpot.toFixed(1)} ms (this page's last answer)`);
  $("measured").textContent = parts.join(" · ") || "no token yet";
}

function showPlan(answer) {
  const plan = answer.plan;
  $("timeline").hidden = !plan;
  measured(answer.measured_tpot_ms);
  $("predicted").textContent = plan ? `${plan.predicted_tpot_ms.toFixed(1)} ms (k = ${plan.k})` : "none yet";
  if (plan) {
    $("timeline").src = `data:image/png;base64,${answer.timeline_png}`;
    $("plan-note").textContent = "The cost model's picture of one token through the windows the ring holds now, " +
      "from the nodes' profiles.";
  } else {
    $("plan-note").textContent = answer.reason ||
      "No prediction yet. Predict TPOT profiles every node (cached per node; measured the first time, which " +
      "takes a while) and prices the windows the ring holds now with the cost model.";
  }
}

async function loadPlan(method) {
  $("predict").disabled = true;
  if (method === "POST") $("plan-note").textContent = "Profiling the nodes and pricing their windows…";
  try {
    const res = await call("/api/plan", {method});
    if (!res.ok) throw new Error(await errorOf(res));
    showPlan(await res.json());
  } catch (error) {
    if (!(error instanceof NeedsToken)) $("plan-note").textContent = error.message;
  } finally {
    $("predict").disabled = false;
  }
}

$("predict").addEventListener("click", () => loadPlan("POST"));

// ------------------------------------------------------------------ start

async function loadModel() {
  try {
    const res = await call("/v1/models");
    if (res.ok) $("model").textContent = (await res.json()).data[0].id;
  } catch {
    // the token form is shown; the name comes with the next refresh
  }
}

function technical(on) {
  document.body.classList.toggle("technical", on);
  $("tech-toggle").setAttribute("aria-pressed", String(on));
  $("tech-toggle").textContent = on ? "Plain view" : "Technical view";
  sessionStorage.setItem(TECH_KEY, on ? "1" : "");
}

$("tech-toggle").addEventListener("click", () => technical(!document.body.classList.contains("technical")));

function refresh() {
  loadModel();
  pollRing();
  loadPlan("GET");
}

for (const message of history) bubble(message.role, message.content);
technical(Boolean(sessionStorage.getItem(TECH_KEY)));
refresh();
setInterval(() => document.hidden || pollRing(), POLL_MS);
