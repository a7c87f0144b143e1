// aigw ops dashboard: polls /dashboard/api/* every POLL_MS with the admin key kept in sessionStorage.
(function () {
  "use strict";
  const POLL_MS = 3000;
  const KEY = "aigw.adminKey";
  const $ = (id) => document.getElementById(id);
  let selectedTrace = null;
  let pinnedTrace = false;
  let charts = {};
  let timer = null;

  const esc = (v) => String(v ?? "").replace(/[&<>"']/g,
    (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
  const num = (v, d = 0) => (v === null || v === undefined) ? "—" : Number(v).toLocaleString(undefined, { maximumFractionDigits: d });
  const pct = (v) => (v === null || v === undefined) ? "—" : (100 * v).toFixed(1) + "%";
  const usd = (v) => (v === null || v === undefined) ? "—" : "$" + Number(v).toFixed(6);
  const ms = (s) => (s === null || s === undefined) ? "—" : (s * 1000).toFixed(s < 0.01 ? 2 : 0) + " ms";

  async function api(path) {
    const response = await fetch(path, { headers: { authorization: "Bearer " + sessionStorage.getItem(KEY) }, cache: "no-store" });
    if (response.status === 401 || response.status === 403) {
      const body = await response.json().catch(() => ({}));
      throw Object.assign(new Error((body.error && body.error.message) || "not allowed"), { auth: true });
    }
    if (!response.ok) throw new Error(path + ": HTTP " + response.status);
    return response.json();
  }

  function showLogin(message) {
    clearTimeout(timer);
    $("main").hidden = true; $("logout").hidden = true; $("login").hidden = false;
    $("status").textContent = "signed out";
    $("login-error").hidden = !message; $("login-error").textContent = message || "";
  }

  function showMain() {
    $("login").hidden = true; $("main").hidden = false; $("logout").hidden = false;
  }

  function renderReplicas(rows) {
    $("replicas").tBodies[0].innerHTML = rows.map((r) => {
      const health = r.healthy ? (r.can_serve ? '<span class="badge ok">healthy</span>' : '<span class="badge warn">ejected</span>')
        : '<span class="badge bad">down</span>';
      const kv = r.kv_usage === null ? "—" : `<span class="bar"><i style="width:${(100 * r.kv_usage).toFixed(1)}%"></i></span>${pct(r.kv_usage)}`;
      return `<tr data-replica="${esc(r.name)}"><td><code>${esc(r.name)}</code></td><td>${esc(r.model)}</td><td>${health}</td>
        <td>${esc(r.breaker)}</td><td>${num(r.outstanding)}</td><td>${num(r.running)}</td><td>${num(r.waiting)}</td>
        <td>${kv}</td><td>${pct(r.cache_hit_ratio)}</td></tr>`;
    }).join("") || '<tr><td colspan="9" class="muted">no endpoints configured</td></tr>';
  }

  function renderLatency(latency) {
    $("latency-window").textContent = `(last ${latency.window_s / 60} min, ${latency.num_requests} requests)`;
    const tile = (title, q) => `<div class="tile"><b>${title}</b><span>p50 ${ms(q.p50)}</span><span>p90 ${ms(q.p90)}</span><span>p99 ${ms(q.p99)}</span></div>`;
    $("latency").innerHTML = tile("End to end", latency.latency_s) + tile("Time to first token (streams)", latency.ttft_s)
      + tile("Gateway overhead", latency.overhead_s);
  }

  function renderSlo(rows) {
    const against = (p90, target, within) => {
      const badge = within === null ? "" : within ? ' <span class="badge ok">within</span>' : ' <span class="badge bad">over</span>';
      return `${ms(p90)} / ${target ? num(target) + " ms" : "—"}${badge}`;
    };
    $("slo").tBodies[0].innerHTML = (rows || []).map((r) => `<tr><td>${esc(r.model)}</td><td>${esc(r.service_tier)}</td>
        <td>${against(r.ttft_p90_s, r.ttft_target_ms, r.ttft_within)}</td><td>${against(r.tpot_p90_s, r.tpot_target_ms, r.tpot_within)}</td>
        <td>${num(r.completed)}</td><td>${num(r.goodput)} (${pct(r.goodput_ratio)})</td><td>${num(r.goodput_per_s, 2)}</td>
        <td>${num(r.refused)}</td><td>${num(r.refused_per_s, 2)}</td></tr>`).join("")
      || '<tr><td colspan="9" class="muted">no replica reports per-class latencies yet</td></tr>';
  }

  function renderUsage(usage, daily) {
    document.querySelectorAll(".bucket").forEach((el) => { el.textContent = usage.bucket_s + " s"; });
    const projects = Object.entries(usage.projects);
    const today = new Date().toISOString().slice(0, 10);
    $("usage").tBodies[0].innerHTML = projects.map(([name, p]) => {
      const t = p.totals;
      const day = (daily[name] || []).find((row) => row.day === today);
      const dayText = day ? `${num(day.requests)} req · ${num(day.total_tokens)} tok · ${usd(day.cost_usd)}` : "—";
      return `<tr data-project="${esc(name)}"><td><b>${esc(name)}</b></td><td>${num(t.requests)}</td><td>${num(t.input_tokens)}</td>
        <td>${num(t.cached_tokens)}</td><td>${num(t.output_tokens)}</td>
        <td>${t.input_tokens ? pct(t.cached_tokens / t.input_tokens) : "—"}</td><td>${usd(t.cost_usd)}</td>
        <td>${usd(t.savings_usd)}</td><td>${dayText}</td></tr>`;
    }).join("") || '<tr><td colspan="9" class="muted">no traffic yet</td></tr>';
    drawChart("tokens", usage.t, projects, [["input_tokens", "input"], ["cached_tokens", "cached"], ["output_tokens", "output"]]);
    drawChart("cost", usage.t, projects, [["cost_usd", "cost"], ["savings_usd", "saved"]]);
  }

  const PALETTE = ["#5b8def", "#3ecf8e", "#f5b84a", "#b57bee", "#f0616d", "#4fd1e0", "#e07bb5", "#9bd35a"];

  function drawChart(name, t, projects, fields) {
    const el = $("chart-" + name);
    const series = [{}];
    const data = [t];
    let color = 0;
    for (const [project, p] of projects) {
      for (const [field, label] of fields) {
        series.push({ label: `${project} ${label}`, stroke: PALETTE[color++ % PALETTE.length], width: 2,
                      value: (u, v) => v === null ? "—" : (name === "cost" ? "$" + v.toFixed(6) : num(v)) });
        data.push(p.series[field]);
      }
    }
    const signature = series.map((s) => s.label).join("|");
    const width = Math.max(300, el.clientWidth || 500);
    const chart = charts[name];
    if (chart && chart.signature === signature) {
      chart.plot.setData(data);
      if (Math.abs(chart.plot.width - width) > 4) chart.plot.setSize({ width, height: 200 });
      return;
    }
    if (chart) chart.plot.destroy();
    el.innerHTML = "";
    const axis = { stroke: "#8b95ad", grid: { stroke: "#283049" }, ticks: { stroke: "#283049" } };
    const money = (u, values) => values.map((v) => "$" + (v === 0 ? "0" : v < 0.01 ? v.toExponential(1) : v.toFixed(2)));
    const yAxis = name === "cost" ? { ...axis, size: 70, values: money } : { ...axis, size: 70 };
    const plot = new uPlot({ width, height: 200, series, axes: [axis, yAxis],
                             scales: { x: { time: true } }, cursor: { drag: { x: false, y: false } } }, data, el);
    charts[name] = { plot, signature };
  }

  function renderTraces(traces) {
    if (!pinnedTrace && traces.length && traces[0].trace_id !== selectedTrace) {
      const firstUseful = traces.find((t) => t.model) || traces[0];
      selectedTrace = firstUseful.trace_id;
    }
    $("traces").tBodies[0].innerHTML = traces.map((t) => {
      const when = new Date(t.start_ns / 1e6).toLocaleTimeString();
      const tokens = t.input_tokens === undefined || t.input_tokens === null ? "—"
        : `${num(t.input_tokens)} / ${num(t.cached_tokens)} / ${num(t.output_tokens)}`;
      const bad = t.status === "ERROR" || (t.http_status || 0) >= 400;
      return `<tr data-trace="${esc(t.trace_id)}" class="${t.trace_id === selectedTrace ? "selected" : ""}">
        <td>${esc(when)}</td><td>${esc(t.name)}</td><td>${esc(t.model || "—")}</td><td>${esc(t.project || "—")}</td>
        <td><code>${esc(t.replica || "—")}</code></td><td>${tokens}</td><td>${t.duration_ms.toFixed(1)} ms</td>
        <td><span class="badge ${bad ? "bad" : "ok"}">${esc(t.http_status || t.status)}</span></td></tr>`;
    }).join("") || '<tr><td colspan="8" class="muted">no traces yet</td></tr>';
  }

  function renderTracing(tracing) {
    let text = "— tracing is off";
    if (tracing.enabled && tracing.sample_ratio === 0) {
      text = `— only requests whose caller sent a sampled traceparent; the newest ${num(tracing.num_traces_buffered)} kept`;
    } else if (tracing.enabled) {
      const which = tracing.sample_ratio < 1 ? `${num(tracing.sample_ratio * 100, 2)}% of new requests` : "every new request";
      const limit = tracing.max_new_per_s ? ` up to ${num(tracing.max_new_per_s, 2)} a second` : "";
      text = `— ${which}${limit}; the newest ${num(tracing.num_traces_buffered)} kept`;
    }
    $("tracing").textContent = text;
  }

  function depthOf(span, byId) {
    let depth = 0;
    for (let p = byId[span.parent_span_id]; p && depth < 20; p = byId[p.parent_span_id]) depth++;
    return depth;
  }

  function renderWaterfall(trace) {
    $("trace-id").textContent = trace.trace_id;
    const spans = trace.spans;
    if (!spans.length) { $("waterfall").innerHTML = '<p class="muted">no spans (the trace may have left the buffer)</p>'; return; }
    const byId = Object.fromEntries(spans.map((s) => [s.span_id, s]));
    const ordered = [];
    const children = {};
    for (const s of spans) (children[byId[s.parent_span_id] ? s.parent_span_id : "root"] ||= []).push(s);
    const walk = (key) => (children[key] || []).sort((a, b) => a.start_ns - b.start_ns)
      .forEach((s) => { ordered.push(s); walk(s.span_id); });
    walk("root");
    const t0 = Math.min(...spans.map((s) => s.start_ns));
    const t1 = Math.max(...spans.map((s) => s.end_ns));
    const total = Math.max(1, t1 - t0);
    const rows = ordered.map((s) => {
      const left = (100 * (s.start_ns - t0) / total).toFixed(3);
      const width = Math.max(0.2, 100 * (s.end_ns - s.start_ns) / total).toFixed(3);
      const side = /^(replica|engine)\./.test(s.name) ? "replica" : "gateway";  // whatever OTEL_SERVICE_NAME says
      const cls = s.status === "ERROR" ? "error" : side;
      const indent = 14 * depthOf(s, byId);
      return `<div class="wf-row" data-span="${esc(s.span_id)}" title="${esc(s.service)}">
        <div class="wf-name" style="padding-left:${indent}px">${esc(s.name)} <span class="muted">· ${esc(s.service)}</span></div>
        <div class="wf-track"><div class="wf-bar ${cls}" style="left:${left}%;width:${width}%"></div></div>
        <div class="wf-dur">${((s.end_ns - s.start_ns) / 1e6).toFixed(2)} ms</div></div>`;
    });
    $("waterfall").innerHTML = `<div class="legend"><i style="background:var(--gw)"></i>gateway<i style="background:var(--rep)"></i>replica
      <span style="margin-left:16px">${(total / 1e6).toFixed(1)} ms in all, ${spans.length} spans</span></div>` + rows.join("");
    $("waterfall").querySelectorAll(".wf-row").forEach((row) => row.addEventListener("click", () => {
      const span = byId[row.dataset.span];
      $("span-detail").textContent = JSON.stringify({ name: span.name, service: span.service, kind: span.kind,
        status: span.status, duration_ms: (span.end_ns - span.start_ns) / 1e6, attributes: span.attributes }, null, 2);
    }));
  }

  // the trace's request log entries (admin API; the project must log requests: gateway/request_logs/)
  async function renderTraceLogs(traceId) {
    const box = $("trace-logs");
    let response;
    try {
      response = await fetch("/admin/v1/request-logs?trace_id=" + encodeURIComponent(traceId),
        { headers: { authorization: "Bearer " + sessionStorage.getItem(KEY) }, cache: "no-store" });
    } catch (error) { box.textContent = "request logs unreachable: " + error.message; return; }
    if (response.status === 404) { box.textContent = "request logs are not served here (auth off)"; return; }
    if (!response.ok) { box.textContent = "request logs: HTTP " + response.status; return; }
    const entries = (await response.json()).data;
    if (!entries.length) { box.textContent = "no request log entry for this trace (its project does not log requests, or it was not sampled)"; return; }
    box.innerHTML = entries.map((e) => `<div class="log-entry" data-log="${esc(e.id)}">
      <div><b>${esc(e.project)}</b> · ${esc(e.model)} · ${esc(e.path)} · status ${esc(e.status)} ·
        ${num(e.usage.prompt_tokens)} + ${num(e.usage.completion_tokens)} tokens · ${usd(e.cost_usd)} ·
        ${num(e.latency_ms, 1)} ms${e.truncated ? " · truncated" : ""}</div>
      <pre>${esc(JSON.stringify({ request: e.request, response: e.response, error: e.error }, null, 2))}</pre></div>`).join("");
  }

  async function refresh() {
    try {
      const overview = await api("/dashboard/api/overview");
      showMain();
      renderReplicas(overview.replicas);
      renderLatency(overview.latency);
      renderSlo(overview.slo);
      renderUsage(overview.usage, overview.usage_daily || {});
      renderTraces(overview.traces);
      renderTracing(overview.tracing);
      if (selectedTrace) {
        renderWaterfall(await api("/dashboard/api/traces/" + encodeURIComponent(selectedTrace)));
        await renderTraceLogs(selectedTrace);
      }
      $("status").textContent = "updated " + new Date().toLocaleTimeString();
    } catch (error) {
      if (error.auth) { sessionStorage.removeItem(KEY); showLogin(error.message); return; }
      $("status").textContent = "refresh failed: " + error.message;
    }
    timer = setTimeout(refresh, POLL_MS);
  }

  $("traces").addEventListener("click", (event) => {
    const row = event.target.closest("tr[data-trace]");
    if (!row) return;
    selectedTrace = row.dataset.trace; pinnedTrace = true;
    clearTimeout(timer); refresh();
  });
  $("login-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = $("key").value.trim();
    if (!key) return;
    sessionStorage.setItem(KEY, key);
    $("key").value = "";
    clearTimeout(timer); refresh();
  });
  $("logout").addEventListener("click", () => { sessionStorage.removeItem(KEY); showLogin(""); });

  if (sessionStorage.getItem(KEY)) refresh(); else showLogin("");
})();
