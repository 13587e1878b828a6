// loom report: draws the runs embedded in the page (#loom-data, written by
// src/loom/report/report.cc) with uPlot. Everything the page needs is in the
// page; it makes no request.
//
// window.loomReport tells a test what rendered: per panel its kind, series
// and points (or rows and slices), the errors caught, the time taken, and
// for a live page the step it shows and the seconds until it reloads.
"use strict";
(function () {
  const t0 = performance.now();
  const check = { panels: {}, errors: [], render_ms: 0, done: false };
  window.loomReport = check;
  window.addEventListener("error", (e) => check.errors.push(String(e.message)));

  const data = JSON.parse(document.getElementById("loom-data").textContent);
  // A live page the run stopped rewriting (killed without a last page):
  // older than twenty reload periods, and at least five minutes.
  const age = Date.now() / 1000 - (data.generated_epoch || 0);
  const stale = !!data.live && age > Math.max(300, 20 * data.refresh_s);
  check.live = !!data.live && !stale;
  check.stale = stale;
  check.stopped = data.stopped || "";
  check.last_step = data.runs.length ? data.runs[0].last_step : 0;
  check.reload_s = check.live ? data.refresh_s : 0;
  const app = document.getElementById("app");
  const colors = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
                  "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"];
  const dashes = [[], [6, 3], [2, 2], [8, 2, 2, 2]];
  let xMode = "step";
  let charts = [];

  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") e.className = v;
      else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, v);
    }
    for (const c of children) if (c != null) e.append(c);
    return e;
  }
  function num(v) {
    if (v == null || !isFinite(v)) return String(v);
    const a = Math.abs(v);
    if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(3);
    return String(+v.toPrecision(5));
  }
  function bytes(v) {
    if (v == null) return "";
    const u = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(v) >= 1024 && i < u.length - 1) v /= 1024, i++;
    return (+v.toPrecision(4)) + " " + u[i];
  }
  function width() {
    return Math.max(320, Math.min(620, Math.floor((window.innerWidth - 90) / 2)));
  }
  function panel(id, parent) {
    const p = el("div", { class: "panel", id: id });
    parent.append(p);
    return p;
  }
  // Draws into `parent`, recording a failure on the page and for the test.
  function guarded(id, parent, draw) {
    try {
      draw();
    } catch (err) {
      check.errors.push(id + ": " + err.message);
      console.error(id, err);
      parent.append(el("div", { class: "error" }, "could not draw " + id + ": " + err.message));
    }
  }

  // A line chart of several series with their own x values. Each line:
  // {label, run, x, y, color, dash, markers}; x is in steps and becomes
  // tokens through the run's tokens per step.
  function lineChart(parent, id, title, lines, opts) {
    opts = opts || {};
    const p = panel(id, parent);
    lines = lines.filter((l) => l.x.length > 0);
    if (lines.length === 0) {
      p.remove();
      return;
    }
    // A value that is not finite (null in the data: a NaN loss, an
    // overflowed norm) is a red marker at the top of the chart.
    let top = -Infinity;
    for (const l of lines) for (const v of l.y) if (v != null && v > top) top = v;
    const marks = [];
    for (const l of lines) {
      if (l.markers) continue;
      const xs = l.x.filter((_, k) => l.y[k] == null);
      if (xs.length)
        marks.push({ label: l.label + " not finite", run: l.run, x: xs,
                     y: xs.map(() => (isFinite(top) ? top : 0)), color: "#d62728", markers: true });
    }
    lines = lines.concat(marks);
    const scale = (l) => (xMode === "tokens" ? data.runs[l.run].tokens_per_step : 1);
    const tables = lines.map((l) => [l.x.map((x) => x * scale(l)), l.y]);
    const joined = uPlot.join(tables);
    const series = [{ label: xMode === "tokens" ? "tokens" : "step" }];
    for (const l of lines) {
      const s = {
        label: l.label,
        stroke: l.color,
        width: 1.5,
        dash: l.dash || [],
        spanGaps: true,
        value: (u, v) => (v == null ? "-" : opts.bytes ? bytes(v) : num(v)),
      };
      if (l.markers) {
        s.paths = () => null;
        s.points = { show: true, size: 8, stroke: l.color, fill: l.color };
      } else {
        s.points = { show: l.x.length < 60 };
      }
      series.push(s);
    }
    const u = new uPlot(
      {
        title: title,
        width: opts.width || width(),
        height: opts.height || 240,
        scales: { x: { time: false }, y: opts.log ? { distr: 3 } : {} },
        series: series,
        axes: [
          { label: xMode === "tokens" ? "tokens" : "step" },
          {
            label: opts.ylabel || "",
            size: 70,
            values: (u, splits) => splits.map((v) => (v == null ? "" : opts.bytes ? bytes(v) : num(v))),
          },
        ],
        cursor: { drag: { x: true, y: false }, sync: { key: "loom-" + xMode } },
      },
      joined,
      p
    );
    charts.push(u);
    let points = 0;
    for (let i = 1; i < u.data.length; i++)
      for (const v of u.data[i]) if (v != null) points++;
    check.panels[id] = { kind: "chart", series: lines.length, points: points,
                         labels: lines.map((l) => l.label) };
    if (opts.caption) p.append(el("div", { class: "caption" }, opts.caption));
    return u;
  }

  function runLabel(r, i) {
    return data.runs.length > 1 ? r.name : "";
  }
  function seriesOf(name, label, opts) {
    const out = [];
    data.runs.forEach((r, i) => {
      const s = r.series[name];
      if (!s) return;
      const pre = runLabel(r, i);
      out.push(Object.assign({ label: pre ? pre + (label ? " " + label : "") : label || name,
                               run: i, x: s.x, y: s.y, color: colors[i % colors.length] }, opts || {}));
    });
    return out;
  }
  function downsampleCaption(name) {
    const notes = [];
    data.runs.forEach((r) => {
      const s = r.series[name];
      if (s && s.x.length < s.points)
        notes.push(r.name + ": " + s.points + " steps shown as the least and greatest value of " +
                   data.buckets + " buckets");
    });
    return notes.length ? notes.join("; ") : null;
  }

  function header() {
    app.append(el("h1", {}, "loom report"));
    app.append(el("p", { class: "sub" }, "made " + data.generated + " from " +
                  data.runs.map((r) => r.dir).join(", ")));
    if (data.live && stale) {
      app.append(el("p", { class: "stopped", id: "live" },
                    "stale: this page was written " + data.generated + " (" +
                    Math.round(age / 60) + " min ago) at step " + data.runs[0].last_step +
                    " and the run has not rewritten it since; it no longer reloads"));
    } else if (data.live) {
      const r = data.runs[0];
      app.append(el("p", { class: "live", id: "live" },
                    "live: the run is at step " + r.last_step + " of " + r.total_steps +
                    "; this page reloads every " + data.refresh_s + " s"));
    }
    if (data.stopped) app.append(el("p", { class: "stopped", id: "stopped" }, data.stopped));
    const runs = el("ul", { class: "notes", id: "runs" });
    data.runs.forEach((r, i) => {
      runs.append(el("li", {}, el("b", { style: "color:" + colors[i % colors.length] }, r.name),
                     " (" + r.dir + "): " + r.model + "; steps " + r.last_step + " of " +
                     r.total_steps + " (" + r.records + " records)"));
    });
    app.append(runs);
    if (data.notes.length) {
      const notes = el("ul", { class: "notes", id: "notes" });
      for (const n of data.notes)
        notes.append(el("li", { class: /incomplete|not a step|not JSON|after step|older than|not a profile/.test(n) ?
                                        "damage" : "" }, n));
      app.append(notes);
    }
    const ctl = el("div", { class: "controls" }, "x axis: ");
    for (const mode of ["step", "tokens"]) {
      const input = el("input", { type: "radio", name: "xmode", value: mode, id: "x-" + mode });
      if (mode === xMode) input.checked = true;
      input.addEventListener("change", () => {
        xMode = mode;
        render();
      });
      ctl.append(el("label", { for: "x-" + mode }, input, " " + mode));
    }
    ctl.append(el("span", { class: "sub" },
                  "  drag across a chart to zoom, double-click to reset, click a legend entry to hide it"));
    app.append(ctl);
  }

  function layoutPanel(parent) {
    const labels = [];
    for (const r of data.runs)
      for (const [k] of r.layout) if (!labels.includes(k)) labels.push(k);
    const table = el("table", { class: "layout", id: "layout" });
    const head = el("tr", {}, el("th", {}, ""));
    for (const r of data.runs) head.append(el("th", {}, r.name));
    table.append(head);
    for (const k of labels) {
      const tr = el("tr", {}, el("th", {}, k));
      for (const r of data.runs) {
        const row = r.layout.find((x) => x[0] === k);
        tr.append(el("td", {}, row ? row[1] : "-"));
      }
      table.append(tr);
    }
    parent.append(table);
    check.panels.layout = { kind: "table", rows: labels.length, columns: data.runs.length };
  }

  function trainingPanels(parent) {
    const loss = seriesOf("loss", "train");
    data.runs.forEach((r, i) => {
      if (r.val.x.length)
        loss.push({ label: (runLabel(r, i) ? r.name + " " : "") + "validation", run: i,
                    x: r.val.x, y: r.val.y, color: colors[i % colors.length], dash: [6, 3] });
    });
    lineChart(parent, "loss", "loss", loss, { caption: downsampleCaption("loss") });
    lineChart(parent, "lr", "learning rate", seriesOf("lr"));
    lineChart(parent, "grad_norm", "gradient norm (before clipping)", seriesOf("grad_norm"));
    const scale = seriesOf("loss_scale", "loss scale");
    let skipped = 0, shown = 0;
    data.runs.forEach((r, i) => {
      if (r.skips.x.length) {
        skipped += r.skips.total;
        shown += r.skips.x.length;
        scale.push({ label: (runLabel(r, i) ? r.name + " " : "") + "skipped step", run: i,
                     x: r.skips.x, y: r.skips.y, color: "#d62728", markers: true });
      }
    });
    lineChart(parent, "loss_scale", "loss scale", scale, {
      log: true,
      caption: !skipped ? "no step skipped"
             : (shown < skipped ? "the first " + shown + " of " : "") + skipped + " skipped step" +
               (skipped > 1 ? "s" : "") + " marked (a gradient held inf or NaN)",
    });
  }

  function throughputPanels(parent) {
    lineChart(parent, "tokens_per_s", "tokens/s", seriesOf("tokens_per_s"));
    lineChart(parent, "mfu", "MFU (model FLOP/s over the GEMM path's peak)", seriesOf("mfu"));
  }

  function memoryPanels(parent) {
    const lines = [];
    const cats = ["params", "grads", "optimizer", "activations", "comm", "workspace"];
    data.runs.forEach((r, i) => {
      cats.forEach((c, k) => {
        const s = r.series["mem." + c];
        if (!s) return;
        lines.push({ label: (runLabel(r, i) ? r.name + " " : "") + c, run: i, x: s.x, y: s.y,
                     color: colors[k % colors.length], dash: dashes[i % dashes.length] });
      });
    });
    lineChart(parent, "memory", "peak memory per category (the largest rank)", lines,
              { bytes: true });
  }

  function stepTimePanels(parent) {
    const parts = [["time.step", "step"], ["time.forward", "forward"],
                   ["time.backward", "backward (recompute included)"],
                   ["time.recompute", "recompute"], ["time.optimizer", "optimizer"],
                   ["time.comm_exposed", "communication exposed"],
                   ["time.comm_hidden", "communication hidden"],
                   ["time.bubble", "pipeline bubble"], ["time.all_to_all", "MoE all-to-all"]];
    data.runs.forEach((r, i) => {
      const lines = [];
      parts.forEach(([key, label], k) => {
        const s = r.series[key];
        if (!s || !s.y.some((v) => v != null && v !== 0)) return;
        lines.push({ label: label, run: i, x: s.x, y: s.y, color: colors[k % colors.length],
                     dash: key === "time.step" ? [6, 3] : [] });
      });
      lineChart(parent, "step_time-r" + i, "step time (s)" + (data.runs.length > 1 ? ": " + r.name : ""),
                lines, { caption: "communication hidden: the part of the gradient communication " +
                                  "that overlapped compute" });
    });
  }

  function heatmap(parent, id, title, m) {
    const p = panel(id, parent);
    p.classList.add("heat");
    p.append(el("div", {}, el("b", {}, title)));
    const cols = m.load.length, rows = m.experts;
    const cell = Math.max(1, Math.floor((width() - 40) / cols));
    const rowH = Math.max(6, Math.min(24, Math.floor(200 / rows)));
    const canvas = el("canvas", { width: String(cell * cols), height: String(rowH * rows) });
    const ctx = canvas.getContext("2d");
    // Load over the mean: blue below 1, white at 1, red above (2 and more: full red).
    const color = (ratio) => {
      const t = Math.max(-1, Math.min(1, ratio - 1));
      const c = (a, b, f) => Math.round(a + (b - a) * f);
      return t < 0 ? "rgb(" + c(255, 33, -t) + "," + c(255, 102, -t) + "," + c(255, 172, -t) + ")"
                   : "rgb(" + c(255, 178, t) + "," + c(255, 24, t) + "," + c(255, 43, t) + ")";
    };
    for (let c = 0; c < cols; c++)
      for (let e = 0; e < rows; e++) {
        ctx.fillStyle = color(m.load[c][e] * rows);
        ctx.fillRect(c * cell, e * rowH, cell, rowH);
      }
    const readout = el("div", { class: "readout" }, "hover a cell");
    canvas.addEventListener("mousemove", (ev) => {
      const c = Math.floor(ev.offsetX / cell), e = Math.floor(ev.offsetY / rowH);
      if (c < 0 || c >= cols || e < 0 || e >= rows) return;
      const share = m.load[c][e];
      readout.textContent = "steps " + m.first[c] + "-" + m.last[c] + ", expert " + e + ": " +
        (100 * share).toFixed(2) + "% of assignments, " + (share * rows).toFixed(2) + "x the mean";
    });
    p.append(canvas, readout,
             el("div", { class: "caption" }, "rows: experts 0-" + (rows - 1) + "; columns: steps " +
                m.first[0] + " to " + m.last[cols - 1] + "; blue below the mean load, red above " +
                "(full red at twice the mean)"));
    check.panels[id] = { kind: "heatmap", columns: cols, experts: rows };
  }

  function moePanels(parent) {
    const imb = [], drop = [];
    data.runs.forEach((r, i) => {
      const layers = Object.keys(r.series).filter((k) => /^moe\.\d+\.imbalance$/.test(k))
        .map((k) => +k.split(".")[1]).sort((a, b) => a - b);
      layers.forEach((l, k) => {
        const pre = (runLabel(r, i) ? r.name + " " : "") + "block " + l;
        const a = r.series["moe." + l + ".imbalance"], d = r.series["moe." + l + ".dropped"];
        imb.push({ label: pre, run: i, x: a.x, y: a.y, color: colors[k % colors.length],
                   dash: dashes[i % dashes.length] });
        if (d) drop.push({ label: pre, run: i, x: d.x, y: d.y, color: colors[k % colors.length],
                           dash: dashes[i % dashes.length] });
      });
    });
    if (!imb.length) return false;
    lineChart(parent, "moe_imbalance", "MoE load imbalance (busiest expert over the mean)", imb);
    lineChart(parent, "moe_dropped", "MoE share of assignments dropped at capacity", drop);
    data.runs.forEach((r, i) => {
      for (const m of r.moe_load)
        guarded("moe_load-r" + i + "-b" + m.layer, parent, () =>
          heatmap(parent, "moe_load-r" + i + "-b" + m.layer,
                  "expert load, block " + m.layer + (data.runs.length > 1 ? ", " + r.name : ""), m));
    });
    return true;
  }

  function timeline(parent, id, r) {
    const p = panel(id, parent);
    p.classList.add("timeline");
    const t = r.trace;
    const select = el("select", { id: id + "-step" });
    for (const s of t.steps) select.append(el("option", { value: String(s) }, "step " + s));
    // The last traced step: the first ones warm up.
    select.value = String(t.steps[t.steps.length - 1]);
    p.append(el("div", {}, el("b", {}, "schedule timeline" + (data.runs.length > 1 ? ": " + r.name : "")),
                select));
    const holder = el("div", {});
    const readout = el("div", { class: "readout" }, "hover a slice");
    p.append(holder, readout);
    const legend = el("div", { class: "legend-row" });
    p.append(legend);
    const catColor = {};
    const catOf = (c) => {
      if (!(c in catColor)) catColor[c] = colors[Object.keys(catColor).length % colors.length];
      return catColor[c];
    };
    const NS = "http://www.w3.org/2000/svg";
    const draw = () => {
      const step = +select.value;
      holder.textContent = "";
      const W = 2 * width(), rowH = 22, left = 190;
      const rows = t.ranks.map((k) => k.events.filter((e) => e[0] === step));
      let lo = Infinity, hi = -Infinity;
      for (const evs of rows) for (const e of evs) lo = Math.min(lo, e[1]), hi = Math.max(hi, e[1] + e[2]);
      if (!isFinite(lo)) lo = 0, hi = 1;
      const span = Math.max(hi - lo, 1e-6);
      const svg = document.createElementNS(NS, "svg");
      svg.setAttribute("width", String(W));
      svg.setAttribute("height", String(rowH * rows.length + 24));
      let slices = 0;
      rows.forEach((evs, k) => {
        const label = document.createElementNS(NS, "text");
        label.setAttribute("x", "0");
        label.setAttribute("y", String(k * rowH + 15));
        label.setAttribute("font-size", "11");
        label.textContent = t.ranks[k].name.replace(/ \(.*\)$/, "");
        svg.append(label);
        for (const e of evs) {
          const rect = document.createElementNS(NS, "rect");
          rect.setAttribute("x", String(left + (e[1] - lo) / span * (W - left - 10)));
          rect.setAttribute("y", String(k * rowH + 2));
          rect.setAttribute("width", String(Math.max(0.5, e[2] / span * (W - left - 10))));
          rect.setAttribute("height", String(rowH - 4));
          rect.setAttribute("fill", catOf(e[4]));
          const tip = e[3] + ": " + e[2].toFixed(3) + " ms at " + (e[1] - lo).toFixed(3) + " ms";
          rect.addEventListener("mouseenter", () => (readout.textContent = t.ranks[k].name + ": " + tip));
          const title = document.createElementNS(NS, "title");
          title.textContent = tip;
          rect.append(title);
          svg.append(rect);
          slices++;
        }
      });
      const axis = document.createElementNS(NS, "text");
      axis.setAttribute("x", String(left));
      axis.setAttribute("y", String(rowH * rows.length + 18));
      axis.setAttribute("font-size", "11");
      axis.textContent = "0 ms ... " + span.toFixed(2) + " ms (step " + step + ", one row per rank: " +
                         (t.ranks[0].row || "compute") + ")";
      svg.append(axis);
      holder.append(svg);
      legend.textContent = "";
      for (const [c, col] of Object.entries(catColor))
        legend.append(el("span", { class: "swatch", style: "background:" + col }), c);
      check.panels[id] = { kind: "timeline", rows: rows.length, slices: slices, step: step };
    };
    select.addEventListener("change", () => guarded(id, p, draw));
    draw();
  }

  // log.profile: the per-layer table, the ranks and the imbalance report.
  function profilePanels(parent, id, r) {
    const p = r.profile;
    const box = el("div", { class: "panel wide", id: id });
    box.append(el("h3", {}, r.name + ": per layer (each stage's first rank; per step, mean of " +
                  p.steps + " profiled steps)"));
    const fmt = (v, d) => (typeof v === "number" ? v.toFixed(d) : String(v));
    const table = (cls, heads, rows, digits) => {
      const t = el("table", { class: "layout " + cls });
      t.append(el("tr", {}, ...heads.map((h) => el("th", {}, h))));
      for (const row of rows)
        t.append(el("tr", {}, ...row.map((v, k) => el("td", {}, k < digits.length ? fmt(v, digits[k]) : String(v)))));
      return t;
    };
    const layers = p.layers.map((l) => [l[0], l[1], l[2], l[3], l[4], l[5], l[6], 100 * l[7], l[8]]);
    box.append(table("profile", ["stage", "piece", "params", "GFLOP", "fwd ms", "bwd ms", "recompute ms",
                                 "step %", "GFLOP/s"], layers, [0, 0, 0, 3, 2, 2, 2, 1, 1]));
    box.append(el("h3", {}, "per rank"));
    box.append(table("profile", ["rank", "host", "stage", "step ms", "compute ms", "waiting ms", "sent MB",
                                 "peak MB"], p.ranks, [0, 0, 0, 1, 1, 1, 3, 1]));
    box.append(el("h3", {}, "load imbalance (the largest rank over the mean)"));
    const list = el("ul", { class: "notes imbalance" });
    for (const f of p.imbalance)
      list.append(el("li", {}, el("b", {}, f.kind + " " + (100 * f.imbalance).toFixed(1) + "%"), ": " + f.detail,
                     f.suggestion ? el("div", { class: "suggestion" }, "\u2192 " + f.suggestion) : null));
    box.append(list);
    parent.append(box);
    check.panels[id] = { kind: "table", rows: p.layers.length, ranks: p.ranks.length,
                         findings: p.imbalance.length };
  }

  function section(title, id) {
    app.append(el("h2", { id: id }, title));
    const g = el("div", { class: "grid" });
    app.append(g);
    return g;
  }

  function render() {
    for (const u of charts) u.destroy();
    charts = [];
    app.textContent = "";
    check.panels = {};
    header();
    const lay = section("Layout", "s-layout");
    guarded("layout", lay, () => layoutPanel(lay));
    const tr = section("Training", "s-training");
    guarded("training", tr, () => trainingPanels(tr));
    const th = section("Throughput", "s-throughput");
    guarded("throughput", th, () => throughputPanels(th));
    const mem = section("Memory", "s-memory");
    guarded("memory", mem, () => memoryPanels(mem));
    const st = section("Step time", "s-step-time");
    guarded("step_time", st, () => stepTimePanels(st));
    if (data.runs.some((r) => Object.keys(r.series).some((k) => k.startsWith("moe.")))) {
      const moe = section("Mixture of experts", "s-moe");
      guarded("moe", moe, () => moePanels(moe));
    }
    if (data.runs.some((r) => r.profile)) {
      const pr = section("Profile (log.profile)", "s-profile");
      data.runs.forEach((r, i) => {
        if (r.profile) guarded("profile-r" + i, pr, () => profilePanels(pr, "profile-r" + i, r));
      });
    }
    if (data.runs.some((r) => r.trace)) {
      const tl = section("Timeline (trace.json)", "s-timeline");
      data.runs.forEach((r, i) => {
        if (r.trace) guarded("timeline-r" + i, tl, () => timeline(tl, "timeline-r" + i, r));
      });
    }
  }

  render();
  check.render_ms = performance.now() - t0;
  check.done = true;
  if (data.live && !stale) setTimeout(() => location.reload(), 1000 * data.refresh_s);
})();
