// Sluice dashboard: follows /dashboard/feed (server-sent events, a snapshot a second) and draws it.
// No library and no build step; every value goes in through textContent, never as HTML.
// The snapshot's fields are listed in docs/dashboard.md.
"use strict";

(function () {
  const KEEP_S = 300; // the charts keep the last five minutes
  const MIN_SPAN_S = 60; // and show at least the last minute, so that a fresh page is not a sliver
  const COLORS = ["#1a73e8", "#c5221f", "#f29900", "#9334e6", "#188038", "#e52592", "#12b5cb", "#5f6368"];
  const points = [];
  const codeColors = {};

  const $ = (id) => document.getElementById(id);

  function el(tag, text, cls) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (cls) node.className = cls;
    return node;
  }

  function row(cells) {
    const tr = document.createElement("tr");
    for (const cell of cells) {
      if (cell instanceof Node) {
        const td = document.createElement("td");
        td.appendChild(cell);
        tr.appendChild(td);
      } else {
        tr.appendChild(el("td", cell));
      }
    }
    return tr;
  }

  function replace(tbody, rows, empty, span) {
    tbody.replaceChildren();
    if (!rows.length) {
      const td = el("td", empty, "muted");
      td.colSpan = span;
      const tr = document.createElement("tr");
      tr.appendChild(td);
      tbody.appendChild(tr);
      return;
    }
    for (const r of rows) tbody.appendChild(r);
  }

  function num(x, digits) {
    if (x === null || x === undefined || !isFinite(x)) return "–";
    const d = digits === undefined ? (Math.abs(x) >= 100 ? 0 : Math.abs(x) >= 10 ? 1 : 2) : digits;
    return Number(x).toFixed(d);
  }

  function int(x) {
    if (x === null || x === undefined || !isFinite(x)) return "–";
    return Math.round(x).toLocaleString("en-US");
  }

  function secs(x) {
    if (x === null || x === undefined || !isFinite(x)) return "–";
    if (x < 1) return Math.round(x * 1000) + " ms";
    if (x < 120) return num(x, 1) + " s";
    return num(x / 60, 1) + " min";
  }

  function colorFor(code) {
    if (!(code in codeColors)) codeColors[code] = COLORS[(Object.keys(codeColors).length + 1) % COLORS.length];
    return codeColors[code];
  }

  // --- charts: plain canvas lines over the last KEEP_S seconds -------------------------------

  function drawChart(id, series) {
    const canvas = $("chart-" + id);
    const legend = $("legend-" + id);
    const ratio = window.devicePixelRatio || 1;
    const w = canvas.clientWidth, h = canvas.clientHeight;
    if (canvas.width !== Math.round(w * ratio) || canvas.height !== Math.round(h * ratio)) {
      canvas.width = Math.round(w * ratio);
      canvas.height = Math.round(h * ratio);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, w, h);
    const now = points.length ? points[points.length - 1].t : 0;
    const span = Math.min(KEEP_S, Math.max(MIN_SPAN_S, points.length ? now - points[0].t : 0));
    const left = 40, right = 6, top = 6, bottom = 16;
    let max = 0;
    for (const s of series) for (const p of s.values) if (p[1] !== null && p[1] > max) max = p[1];
    max = max > 0 ? max * 1.15 : 1;
    const x = (t) => left + (w - left - right) * (1 - (now - t) / span);
    const y = (v) => top + (h - top - bottom) * (1 - v / max);
    ctx.strokeStyle = "#dde3ea";
    ctx.fillStyle = "#6b7785";
    ctx.font = "10px system-ui, sans-serif";
    ctx.lineWidth = 1;
    for (let i = 0; i <= 2; i++) {
      const v = (max / 1.15) * (i / 2);
      ctx.beginPath();
      ctx.moveTo(left, y(v));
      ctx.lineTo(w - right, y(v));
      ctx.stroke();
      ctx.fillText(num(v, max >= 10 ? 0 : 1), 2, y(v) + 3);
    }
    ctx.fillText(span >= 120 ? "-" + Math.round(span / 60) + " min" : "-" + Math.round(span) + " s", left, h - 3);
    ctx.fillText("now", w - right - 20, h - 3);
    legend.replaceChildren();
    for (const s of series) {
      ctx.strokeStyle = s.color;
      ctx.lineWidth = 1.6;
      ctx.beginPath();
      let drawing = false;
      for (const [t, v] of s.values) {
        if (v === null || now - t > span) {
          drawing = false;
          continue;
        }
        if (drawing) ctx.lineTo(x(t), y(v));
        else ctx.moveTo(x(t), y(v));
        drawing = true;
      }
      ctx.stroke();
      const item = el("span", s.label);
      const swatch = el("i");
      swatch.style.background = s.color;
      item.prepend(swatch);
      legend.appendChild(item);
    }
  }

  function charts() {
    const pick = (f) => points.map((p) => [p.t, f(p)]);
    drawChart("queue", [
      { label: "queued", color: COLORS[0], values: pick((p) => p.queued) },
      { label: "running", color: COLORS[4], values: pick((p) => p.running) },
    ]);
    const codes = new Set();
    for (const p of points) for (const c of Object.keys(p.refused_by_code || {})) codes.add(c);
    const admissions = [{ label: "admitted", color: COLORS[0], values: pick((p) => p.admitted) }];
    for (const code of [...codes].sort()) {
      admissions.push({
        label: "refused: " + code,
        color: colorFor(code),
        values: pick((p) => (p.refused_by_code || {})[code] || 0),
      });
    }
    drawChart("admissions", admissions);
    drawChart("goodput", [{ label: "answers / s", color: COLORS[4], values: pick((p) => p.goodput) }]);
    drawChart("latency", [
      { label: "first token p50", color: COLORS[0], values: pick((p) => p.ttft_p50) },
      { label: "first token p99", color: COLORS[3], values: pick((p) => p.ttft_p99) },
      { label: "queue wait p50", color: COLORS[4], values: pick((p) => p.wait_p50) },
      { label: "queue wait p99", color: COLORS[2], values: pick((p) => p.wait_p99) },
    ]);
  }

  // --- the rest of the page --------------------------------------------------------------------

  function sum(list, f) {
    return list.reduce((a, x) => a + (f(x) || 0), 0);
  }

  function tiles(s) {
    const models = s.models;
    $("tile-queued").textContent = int(sum(models, (m) => m.queued_jobs));
    $("tile-queued-sub").textContent = int(sum(models, (m) => m.queued_tokens)) + " tokens";
    $("tile-running").textContent = int(sum(models, (m) => m.running_jobs));
    $("tile-running-sub").textContent = "of " + int(sum(models, (m) => m.slots)) + " slots";
    $("tile-admitted").textContent = num(s.rates.admitted);
    $("tile-admitted-sub").textContent = "last " + s.rate_window_s + " s";
    $("tile-refused").textContent = num(s.rates.refused);
    const codes = Object.entries(s.rates.refused_by_code).filter(([, r]) => r > 0);
    $("tile-refused-sub").textContent = codes.map(([c, r]) => c + " " + num(r)).join(", ");
    $("tile-goodput").textContent = num(s.rates.goodput);
    $("tile-goodput-sub").textContent = num(s.rates.tokens, 0) + " tokens / s";
    const ttft = s.latency.ttft;
    $("tile-ttft").textContent = secs(ttft.p50);
    $("tile-ttft-sub").textContent = "p99 " + secs(ttft.p99) + ", " + int(ttft.count) + " answers in " + Math.round(s.window_s / 60) + " min";
    const waits = models.map((m) => m.predicted_wait_s).filter((x) => x !== null);
    $("tile-wait").textContent = waits.length ? secs(Math.max(...waits)) : "–";
    $("tile-wait-sub").textContent = "queued tokens ÷ drain rate";
    const sc = s.scaling;
    $("tile-busy").textContent = sc.engines_busy === null ? "–" : num(sc.engines_busy);
    $("tile-busy-sub").textContent =
      "of " + sc.engines + " engine" + (sc.engines === 1 ? "" : "s") +
      (sc.desired_engines === null || sc.desired_engines === undefined ? "" : "; " + int(sc.desired_engines) + " wanted");
  }

  function meter(fill) {
    const box = el("div", null, "meter");
    const bar = el("div");
    const share = fill === null ? 0 : Math.min(fill, 1);
    bar.style.width = (share * 100).toFixed(1) + "%";
    if (share >= 0.9) box.classList.add("bad");
    else if (share >= 0.7) box.classList.add("warn");
    box.appendChild(bar);
    return box;
  }

  function fact(label, value) {
    const span = el("span", label + " ");
    span.appendChild(el("b", value));
    return span;
  }

  function modelCard(m) {
    const card = el("div", null, "card");
    card.dataset.model = m.name;
    card.appendChild(el("h3", m.name));
    const facts = el("div", null, "facts");
    const bound = m.max_queued_jobs === null ? "unbounded" : int(m.max_queued_jobs);
    facts.append(
      fact("queued", int(m.queued_jobs) + " / " + bound),
      fact("running", int(m.running_jobs) + " / " + int(m.slots) + " slots"),
      fact("predicted wait", secs(m.predicted_wait_s)),
      fact("drain", num(m.drain_rate, 0) + " tok/s" + (m.measured ? "" : " (prior)")),
      fact("engines busy", (m.engines_busy === null ? "–" : num(m.engines_busy)) + " of " + m.engines),
      fact("engines wanted", m.desired_engines === null ? "–" : int(m.desired_engines)),
      fact("deadlines at risk", m.deadlines_at_risk.length ? m.deadlines_at_risk.join(", ") : "none"),
    );
    card.appendChild(facts);
    const m2 = meter(m.fill);
    m2.title = "queue fill: " + (m.fill === null ? "unbounded" : num(m.fill * 100, 0) + " %");
    card.appendChild(m2);
    const classes = el("table");
    classes.appendChild(row(["Class", "Jobs", "Tokens", "Predicted wait", "Bound"]));
    classes.firstChild.classList.add("head");
    for (const c of m.classes) {
      classes.appendChild(row([c.name, int(c.jobs), int(c.tokens), secs(c.predicted_wait_s), c.max_jobs === null ? "–" : int(c.max_jobs)]));
    }
    const tenants = el("table");
    tenants.appendChild(row(["Top tenants (" + m.tenant_count + " waiting)", "Jobs", "Tokens"]));
    for (const t of m.tenants) tenants.appendChild(row([t.tenant, int(t.jobs), int(t.tokens)]));
    if (!m.tenants.length) tenants.appendChild(row(["nobody is waiting", "", ""]));
    const tables = el("div", null, "tables");
    tables.append(classes, tenants);
    card.appendChild(tables);
    const poolText = (p) => p.name + " (" + int(p.engines) + (p.engines === 1 ? " engine, " : " engines, ") + int(p.inflight) + " / " + int(p.limit) + " in flight" + (p.learned ? ", limits learned" : "") + (p.out ? ", " + int(p.out) + " out" : "") + ")";
    const pools = el("p", "Pools: " + (m.pools.length ? m.pools.map(poolText).join("; ") : "–"), "muted small pools");
    card.appendChild(pools);
    return card;
  }

  function models(s) {
    const box = $("models");
    box.replaceChildren();
    if (!s.models.length) box.appendChild(el("p", "No model has a queue yet.", "muted"));
    for (const m of s.models) box.appendChild(modelCard(m));
  }

  function engines(s) {
    const rows = s.engines.map((e) => {
      const share = e.limit ? e.inflight / e.limit : 0;
      const cell = el("div");
      cell.append(el("span", int(e.inflight) + " / " + int(e.limit)), meter(share));
      const state = el("span", e.state, "badge " + e.state);
      const tr = row([
        e.name,
        e.worker,
        (e.models || []).join(", "),
        e.pool || "–",
        cell,
        e.limit_source,
        int(e.failures),
        e.cooldown_s > 0 ? secs(e.cooldown_s) : "–",
        state,
      ]);
      tr.dataset.engine = e.name;
      tr.dataset.state = e.state;
      return tr;
    });
    replace($("engines"), rows, "No worker has reported yet.", 9);
  }

  function refusals(s) {
    const codes = new Set([...Object.keys(s.window.refused_by_code), ...Object.keys(s.rates.refused_by_code)]);
    const ra = s.retry_after.by_code || {};
    const rows = [...codes].sort().map((code) => {
      const tr = row([code, num(s.rates.refused_by_code[code] || 0), int(s.window.refused_by_code[code] || 0), int(ra[code] || 0)]);
      tr.dataset.code = code;
      return tr;
    });
    replace($("refusals"), rows, "None.", 4);
    $("refusals-window").textContent = "(last " + Math.round(s.window_s / 60) + " min)";
    const r = s.retry_after;
    $("retry-after").textContent = r.count
      ? int(r.count) + " given; p50 " + secs(r.p50) + ", p90 " + secs(r.p90) + ", p99 " + secs(r.p99)
      : "No refusals in the window.";
    const bars = $("retry-after-bars");
    bars.replaceChildren();
    const most = Math.max(1, ...r.buckets.map((b) => b.count));
    for (const b of r.buckets) {
      const bar = el("div");
      bar.style.height = ((b.count / most) * 100).toFixed(1) + "%";
      bar.title = (b.le === null ? "> 120 s" : "≤ " + b.le + " s") + ": " + int(b.count);
      bar.appendChild(el("span", b.le === null ? "∞" : b.le));
      bars.appendChild(bar);
    }
  }

  function fleet(s) {
    const gateways = s.processes.filter((p) => p.role === "gateway").length;
    const workers = s.processes.filter((p) => p.role === "worker").length;
    $("fleet").textContent = gateways + " gateway" + (gateways === 1 ? "" : "s") + ", " + workers + " worker" + (workers === 1 ? "" : "s");
    const rows = s.processes.map((p) => row([p.id, p.role, p.host, p.pid, secs(p.up_s), secs(p.age_s) + " ago"]));
    replace($("processes"), rows, "No process reports.", 6);
    const sc = s.scaling;
    $("scaling").textContent =
      sc.engines_busy === null
        ? "No capacity registered."
        : num(sc.engines_busy) + " engines busy of " + sc.engines + " (demand " + num(sc.demand_ratio * 100, 0) + " % of the slots)" +
          (sc.desired_engines === null ? "" : "; the scaling signal wants " + int(sc.desired_engines) + " (sluice_desired_engines)");
  }

  function render(s) {
    tiles(s);
    models(s);
    engines(s);
    refusals(s);
    fleet(s);
    charts();
    $("updated").textContent = "updated " + new Date(s.at * 1000).toLocaleTimeString();
  }

  function live(on, text) {
    const badge = $("live");
    badge.textContent = text;
    badge.className = "badge " + (on ? "on" : "off");
  }

  function push(point) {
    if (!point || point.t === undefined) return;
    if (points.length && points[points.length - 1].t >= point.t) return;
    points.push(point);
    while (points.length && point.t - points[0].t > KEEP_S) points.shift();
  }

  function connect() {
    const feed = new EventSource("/dashboard/feed");
    feed.addEventListener("history", (e) => {
      points.length = 0;
      for (const p of JSON.parse(e.data).points) push(p);
    });
    feed.addEventListener("snapshot", (e) => {
      const s = JSON.parse(e.data);
      push(s.point);
      render(s);
      document.body.dataset.seq = e.lastEventId;
      live(true, "live");
    });
    // EventSource reconnects by itself; a session that expired needs /dashboard?key= again.
    feed.addEventListener("error", () => live(false, "reconnecting"));
  }

  window.addEventListener("resize", charts);
  connect();
})();
