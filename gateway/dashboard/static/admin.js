// aigw ops dashboard, the writes: projects, keys (created and rotated secrets are shown once),
// limits and budgets, usage by key/tag. Every call goes to the admin API (/admin/v1) with the
// admin key app.js keeps in sessionStorage, as an Authorization header: no cookie is set, so no
// other site can make the browser send a credential; the API also refuses cross-site writes.
(function () {
  "use strict";
  const KEY = "aigw.adminKey";
  const $ = (id) => document.getElementById(id);
  const esc = (v) => String(v ?? "").replace(/[&<>"']/g,
    (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
  const enc = encodeURIComponent;
  let project = null;
  let limitScope = null; // {kind: "project"|"key", id}

  async function call(method, path, body) {
    const init = { method, cache: "no-store", headers: { authorization: "Bearer " + sessionStorage.getItem(KEY) } };
    if (body !== undefined) { init.headers["content-type"] = "application/json"; init.body = JSON.stringify(body); }
    const response = await fetch("/admin/v1" + path, init);
    const text = await response.text();
    let data = null;
    try { data = text ? JSON.parse(text) : null; } catch (e) { data = text; }
    if (!response.ok) {
      const message = (data && data.error && data.error.message) || ("HTTP " + response.status);
      throw new Error(message);
    }
    return data;
  }

  function say(message, isError) {
    $("admin-msg").textContent = message || "";
    $("admin-msg").className = isError ? "error" : "muted";
  }

  async function guarded(action) {
    try { say(""); await action(); } catch (error) { say(error.message, true); }
  }

  async function loadProjects() {
    const projects = (await call("GET", "/projects")).data;
    const select = $("admin-project");
    select.innerHTML = projects.map((p) => `<option value="${esc(p.name)}">${esc(p.name)}</option>`).join("");
    if (project && projects.some((p) => p.name === project)) select.value = project;
    project = select.value || null;
    if (project) await loadProject();
  }

  async function loadProject() {
    const keys = (await call("GET", `/projects/${enc(project)}/keys`)).data;
    $("admin-keys").tBodies[0].innerHTML = keys.map((k) => {
      const state = k.revoked_at ? '<span class="badge bad">revoked</span>' : '<span class="badge ok">active</span>';
      const actions = k.revoked_at ? "" : `<button data-act="limits">Limits</button>
        <button data-act="rotate">Rotate</button> <button data-act="revoke" class="danger">Revoke</button>`;
      return `<tr data-key="${esc(k.key_id)}"><td><code>${esc(k.key_id)}</code></td><td>${esc(k.name)}</td>
        <td>${esc(k.scopes.join(" "))}</td><td>${new Date(k.created_at * 1000).toLocaleString()}</td>
        <td>${state}</td><td>${actions}</td></tr>`;
    }).join("") || '<tr><td colspan="6" class="muted">no keys</td></tr>';
    $("admin-keys").querySelectorAll("button[data-act]").forEach((button) => button.addEventListener("click", () => {
      const keyId = button.closest("tr").dataset.key;
      const act = button.dataset.act;
      if (act === "limits") guarded(() => selectLimits({ kind: "key", id: keyId }));
      if (act === "rotate") guarded(async () => showSecret((await call("POST", `/keys/${enc(keyId)}/rotate`, { grace_seconds: 0 })).key));
      if (act === "revoke" && window.confirm(`Revoke ${keyId}? Every gateway refuses it within a second.`)) {
        guarded(async () => { await call("POST", `/keys/${enc(keyId)}/revoke`); await loadProject(); });
      }
    }));
    await selectLimits({ kind: "project", id: project });
    await loadUsage();
  }

  function showSecret(secret) {
    $("admin-secret").hidden = false;
    $("admin-secret-value").textContent = secret;
    say("Copy the key now: it is shown once.");
    return loadProject();
  }

  const number = (id) => { const v = $(id).value.trim(); return v === "" ? undefined : Number(v); };

  function fillLimits(stored) {
    const s = stored || {};
    const budgets = s.budgets || [];
    const byWindow = (w) => budgets.find((b) => b.window === w);
    $("lim-rpm").value = s.requests_per_minute ?? "";
    $("lim-tpm").value = s.tokens_per_minute ?? "";
    $("lim-conc").value = s.max_concurrent_requests ?? "";
    $("lim-day").value = s.daily_budget_usd ?? (byWindow("day") ? byWindow("day").usd : "");
    $("lim-month").value = byWindow("month") ? byWindow("month").usd : "";
    const alerted = budgets.find((b) => (b.alert_at || []).length);
    $("lim-alert").value = alerted ? alerted.alert_at.join(",") : "";
    $("lim-hook").value = s.webhook_url ?? "";
    $("lim-secret").value = "";
    $("lim-secret").placeholder = s.webhook_secret_set ? "set: re-enter it to keep the webhook" : "webhook secret";
  }

  async function selectLimits(scope) {
    limitScope = scope;
    const path = scope.kind === "project" ? `/projects/${enc(scope.id)}/limits` : `/keys/${enc(scope.id)}/limits`;
    const view = await call("GET", path);
    $("admin-limits-scope").textContent = scope.kind === "project" ? `project ${scope.id}` : `key ${scope.id}`;
    $("admin-limits-source").textContent = view.source === "api" ? "set through the API" : "from the config file";
    $("admin-limits-effective").textContent = JSON.stringify(view.effective, null, 1);
    fillLimits(view.stored);
  }

  async function saveLimits(event) {
    event.preventDefault();
    const alertAt = $("lim-alert").value.split(",").map((v) => v.trim()).filter(Boolean).map(Number);
    const body = { requests_per_minute: number("lim-rpm"), tokens_per_minute: number("lim-tpm"),
                   max_concurrent_requests: number("lim-conc"), budgets: [] };
    for (const [id, window] of [["lim-day", "day"], ["lim-month", "month"]]) {
      const usd = number(id);
      if (usd !== undefined) body.budgets.push({ usd, window, alert_at: alertAt });
    }
    if ($("lim-hook").value.trim()) {
      body.webhook_url = $("lim-hook").value.trim();
      body.webhook_secret = $("lim-secret").value;
    }
    const path = limitScope.kind === "project" ? `/projects/${enc(limitScope.id)}/limits` : `/keys/${enc(limitScope.id)}/limits`;
    const view = await call("PUT", path, body);
    $("admin-limits-effective").textContent = JSON.stringify(view.effective, null, 1);
    $("admin-limits-source").textContent = "set through the API";
    say(`Limits of ${$("admin-limits-scope").textContent} saved: every gateway applies them within a second.`);
  }

  async function clearLimits() {
    const path = limitScope.kind === "project" ? `/projects/${enc(limitScope.id)}/limits` : `/keys/${enc(limitScope.id)}/limits`;
    await call("DELETE", path);
    await selectLimits(limitScope);
    say("Stored limits removed: the config file's apply.");
  }

  async function loadUsage() {
    const by = $("admin-usage-by").value;
    const rows = (await call("GET", `/projects/${enc(project)}/usage?group_by=${enc(by)}`)).data;
    const field = { key: "key_id", tag: "tag", session: "session_id", model: "model", day: "day" }[by];
    $("admin-usage").tBodies[0].innerHTML = rows.map((r) => `<tr data-group="${esc(r[field] ?? "")}">
      <td>${esc(r[field] ?? "—")}</td><td>${r.requests}</td><td>${r.prompt_tokens}</td>
      <td>${r.completion_tokens}</td><td>$${Number(r.cost_usd).toFixed(6)}</td></tr>`).join("")
      || '<tr><td colspan="5" class="muted">no usage yet</td></tr>';
    $("admin-usage-csv").onclick = () => guarded(() => download(by));
  }

  async function download(by) {
    const response = await fetch(`/admin/v1/projects/${enc(project)}/usage?group_by=${enc(by)}&format=csv`,
      { headers: { authorization: "Bearer " + sessionStorage.getItem(KEY) }, cache: "no-store" });
    if (!response.ok) throw new Error("HTTP " + response.status);
    const link = document.createElement("a");
    link.href = URL.createObjectURL(await response.blob());
    link.download = `usage-${project}-by-${by}.csv`;
    link.click();
  }

  function wire() {
    $("admin-project").addEventListener("change", () => guarded(async () => { project = $("admin-project").value; await loadProject(); }));
    $("admin-new-project").addEventListener("submit", (event) => { event.preventDefault(); guarded(async () => {
      const name = $("admin-project-name").value.trim();
      await call("POST", "/projects", { name });
      project = name; $("admin-project-name").value = "";
      await loadProjects();
    }); });
    $("admin-new-key").addEventListener("submit", (event) => { event.preventDefault(); guarded(async () => {
      const scopes = [...document.querySelectorAll("#admin-new-key input[name=scope]:checked")].map((c) => c.value);
      const created = await call("POST", `/projects/${enc(project)}/keys`, { name: $("admin-key-name").value.trim(), scopes });
      $("admin-key-name").value = "";
      await showSecret(created.key);
    }); });
    $("admin-secret-hide").addEventListener("click", () => { $("admin-secret").hidden = true; $("admin-secret-value").textContent = ""; });
    $("admin-limits-form").addEventListener("submit", (event) => guarded(() => saveLimits(event)));
    $("admin-limits-clear").addEventListener("click", () => guarded(clearLimits));
    $("admin-limits-project").addEventListener("click", () => guarded(() => selectLimits({ kind: "project", id: project })));
    $("admin-usage-by").addEventListener("change", () => guarded(loadUsage));
    let loaded = false;
    new MutationObserver(() => {
      if (!$("main").hidden && !loaded) { loaded = true; guarded(loadProjects); }
      if ($("main").hidden) { loaded = false; $("admin-secret").hidden = true; $("admin-secret-value").textContent = ""; }
    }).observe($("main"), { attributes: true, attributeFilter: ["hidden"] });
  }

  wire();
})();
