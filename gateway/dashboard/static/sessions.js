// aigw dashboard, the Session card: one session's turns (GET /dashboard/api/sessions/{project}/{session})
// with each turn's prompt and cached tokens, hit ratio, and where its prompt diverged from the
// turn before (the cache-miss explainer). Reads with the admin key app.js keeps in sessionStorage.
(function () {
  "use strict";
  const KEY = "aigw.adminKey";
  const $ = (id) => document.getElementById(id);
  const esc = (v) => String(v ?? "").replace(/[&<>"']/g,
    (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
  const pct = (v) => (v === null || v === undefined) ? "—" : (100 * v).toFixed(1) + "%";
  const num = (v) => (v === null || v === undefined) ? "—" : Number(v).toLocaleString();

  function divergence(d) {
    if (!d) return '<span class="muted">none (the prompt grew)</span>';
    return esc(d.where) + ' <span class="muted">at token ' + (d.exact ? "" : "~") + esc(d.token_index) + "</span>";
  }

  async function show(event) {
    event.preventDefault();
    const project = $("session-project").value.trim(), session = $("session-name").value.trim();
    const body = $("session-turns").querySelector("tbody");
    const message = $("session-msg");
    if (!project || !session) { message.textContent = "project and session, please"; return; }
    message.textContent = "";
    const path = "/dashboard/api/sessions/" + encodeURIComponent(project) + "/" + encodeURIComponent(session);
    const response = await fetch(path, { headers: { authorization: "Bearer " + sessionStorage.getItem(KEY) }, cache: "no-store" });
    if (!response.ok) { message.textContent = "HTTP " + response.status; return; }
    const turns = (await response.json()).turns;
    if (!turns.length) message.textContent = "no turns of this session in this gateway process";
    body.innerHTML = turns.map((t) => "<tr><td>" + esc(t.turn) + "</td><td>" + esc(new Date(t.at * 1000).toLocaleTimeString())
      + "</td><td><code>" + esc(t.request_id) + "</code></td><td>" + num(t.prompt_tokens) + "</td><td>" + num(t.cached_tokens)
      + "</td><td>" + pct(t.hit_ratio) + "</td><td>" + divergence(t.divergence) + "</td></tr>").join("");
  }

  function start() {
    const form = $("session-form");
    if (form) form.addEventListener("submit", (event) => show(event).catch((e) => { $("session-msg").textContent = String(e); }));
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start); else start();
})();
