// The bagserve console: a static page on the service's own API (no build step, no
// external resource). Everything shown comes from /v1; text goes in through
// textContent, never innerHTML, so no model or file name can inject markup.
"use strict";

const state = { models: [], selected: null };
const $ = (id) => document.getElementById(id);

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : String(c));
  return node;
}

function headers() {
  const key = $("api-key").value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function api(path, options = {}) {
  const response = await fetch(path, {
    ...options,
    headers: { ...headers(), ...(options.headers || {}) },
  });
  const type = response.headers.get("content-type") || "";
  const body = type.includes("json") ? await response.json() : await response.text();
  if (!response.ok) {
    const detail = typeof body === "string" ? body : body.detail || body.error;
    const errors = typeof body === "object" && body.errors ? body.errors : [];
    throw new Error([`${response.status}: ${detail}`, ...errors].join("\n"));
  }
  return { body, response };
}

const fmt = (x) =>
  typeof x === "number" ? (Math.abs(x) >= 1e4 || Math.abs(x) < 1e-3 && x !== 0
    ? x.toExponential(3) : Number(x.toPrecision(4)).toString()) : String(x);

// ------------------------------------------------------------------ models
async function loadModels() {
  $("models-status").textContent = "loading…";
  try {
    const { body } = await api("/v1/models");
    state.models = body.models;
    const list = $("models");
    list.replaceChildren();
    for (const model of body.models) {
      const latest = model.versions[model.versions.length - 1];
      const item = el("li", { "data-model": model.name }, model.name,
        el("span", { class: "kind" }, `v${latest.version} · ${latest.kind}`));
      item.addEventListener("click", () => selectModel(model.name));
      list.append(item);
    }
    $("models-status").textContent = `${body.models.length} model(s)`;
    const failures = Object.entries(body.failures || {});
    $("failures").hidden = failures.length === 0;
    $("failures").textContent = failures.map(([k, v]) => `not served: ${k} (${v})`).join("\n");
    if (!state.selected && body.models.length) selectModel(body.models[0].name);
  } catch (error) {
    $("models-status").textContent = error.message;
    $("models-status").className = "error";
  }
}

function latestOf(name) {
  const model = state.models.find((m) => m.name === name);
  return model.versions[model.versions.length - 1];
}

async function selectModel(name) {
  state.selected = name;
  for (const li of $("models").children) {
    li.classList.toggle("selected", li.dataset.model === name);
  }
  const info = latestOf(name);
  $("model-panel").hidden = false;
  $("model-title").textContent = `${name} / ${info.version}`;
  const facts = $("model-facts");
  facts.replaceChildren();
  const add = (k, v) => v !== undefined && v !== null && facts.append(el("dt", {}, k), el("dd", {}, v));
  add("estimator", info.estimator);
  add("answers", info.kind);
  add("panel", info.panel ? info.panel.markers.join(", ") : "by column position");
  add("created", info.created);
  add("artifact sha256", info.sha256);
  add("training data sha256", info.training_data_sha256);
  $("interval-label").hidden = info.kind === "cell";
  $("results").replaceChildren();
  $("predict-status").textContent = "";
  try {
    const { body } = await api(`/v1/models/${encodeURIComponent(name)}/card`);
    renderMarkdown($("card"), body);
  } catch (error) {
    $("card").textContent = error.message;
  }
}

// A small Markdown subset (the model cards': headings, lists, tables, code spans).
function renderMarkdown(target, text) {
  target.replaceChildren();
  const inline = (line) => {
    const span = el("span");
    line.split(/(`[^`]*`)/).forEach((part) => {
      span.append(part.startsWith("`") && part.endsWith("`") && part.length > 1
        ? el("code", {}, part.slice(1, -1)) : part);
    });
    return span;
  };
  let list = null;
  let table = null;
  for (const line of text.split("\n")) {
    if (!line.startsWith("- ")) list = null;
    if (!line.startsWith("|")) table = null;
    const heading = line.match(/^(#{1,3}) (.*)/);
    if (heading) {
      target.append(el(`h${heading[1].length + 2}`, {}, inline(heading[2])));
    } else if (line.startsWith("- ")) {
      if (!list) target.append((list = el("ul")));
      list.append(el("li", {}, inline(line.slice(2))));
    } else if (line.startsWith("|")) {
      const cells = line.split("|").slice(1, -1).map((c) => c.trim());
      if (cells.every((c) => /^-+$/.test(c))) continue;
      if (!table) {
        target.append((table = el("table")));
        table.append(el("tr", {}, ...cells.map((c) => el("th", {}, c))));
      } else {
        table.append(el("tr", {}, ...cells.map((c) => el("td", {}, c))));
      }
    } else if (line.trim()) {
      target.append(el("p", {}, inline(line)));
    }
  }
}

// ------------------------------------------------------------------ predictions
async function predictFiles(files) {
  const name = state.selected;
  const info = latestOf(name);
  const form = new FormData();
  for (const file of files) form.append("files", file, file.name);
  const params = new URLSearchParams();
  params.set("plot", "3000");
  if (info.kind !== "cell") {
    params.set("interval", $("interval").value);
    params.set("explain", "true");
  }
  $("predict-status").textContent = "predicting…";
  $("predict-status").className = "muted";
  $("results").replaceChildren();
  try {
    let answer;
    try {
      answer = await api(`/v1/models/${encodeURIComponent(name)}/predict?${params}`,
        { method: "POST", body: form });
    } catch (error) {
      // A model without intervals, or without explanations: ask again without them.
      if (/interval/.test(error.message)) params.delete("interval");
      else if (params.has("explain")) { params.delete("explain"); params.delete("plot"); }
      else throw error;
      answer = await api(`/v1/models/${encodeURIComponent(name)}/predict?${params}`,
        { method: "POST", body: form });
    }
    renderAnswer(answer.body, info);
    $("predict-status").textContent =
      `request ${answer.body.request_id} · request sha256 ${answer.body.request_sha256.slice(0, 16)}…`;
    loadAudit();
  } catch (error) {
    $("predict-status").textContent = error.message;
    $("predict-status").className = "error";
  }
}

function domainBadge(flagged, score, fallback) {
  return el("span", { class: `badge ${flagged ? "out" : "ok"}` },
    flagged ? `outside the applicability domain (score ${fmt(score)})`
      + (fallback ? ", answered on the standardised sample" : "")
      : `within the applicability domain (score ${fmt(score)})`);
}

function renderAnswer(answer, info) {
  const results = $("results");
  for (const warning of answer.warnings || []) {
    results.append(el("p", { class: "warning" }, warning));
  }
  // Routine facts (channels ignored, compensation applied): shown, but not as warnings.
  for (const note of answer.notes || []) {
    results.append(el("p", { class: "note muted" }, note));
  }
  for (const bag of answer.predictions) {
    const box = el("div", { class: "bag" }, el("h4", {}, bag.id,
      " ", el("span", { class: `status ${bag.status}` }, bag.status)));
    if (bag.input_sha256) {
      box.append(el("p", { class: "muted" }, `file sha256 ${bag.input_sha256.slice(0, 16)}…`));
    }
    if (bag.withheld) {
      if (bag.domain) box.append(domainBadge(bag.domain.out_of_range, bag.domain.score));
      box.append(el("p", { class: "withheld" }, `no value: ${bag.withheld}`));
    } else if (bag.population) {
      box.append(domainBadge(bag.report.out_of_range,
        bag.domain ? bag.domain.score : bag.report.distance_to_nearest, bag.report.fallback));
      box.append(el("p", { class: "muted" }, `${bag.n_points} cells`));
      const table = el("table", {}, el("tr", {},
        ...["population", "cells", "%", "mean probability"].map((h) => el("th", {}, h))));
      for (const row of bag.population) {
        table.append(el("tr", {}, el("td", {}, row.class), el("td", {}, row.count),
          el("td", {}, row.percent.toFixed(2)),
          el("td", {}, row.mean_probability === undefined ? "–" : row.mean_probability.toFixed(3))));
      }
      box.append(table);
      if (bag.plot) box.append(scatter(bag.plot, bag.population.map((r) => r.class)));
    } else {
      const value = Array.isArray(bag.prediction) ? bag.prediction.map(fmt).join(", ")
        : fmt(bag.prediction);
      box.append(el("div", { class: "value" }, value));
      if (bag.interval) {
        box.append(el("p", {}, `${Math.round(100 * $("interval").value)} % interval: `
          + `[${fmt(bag.interval[0])}, ${fmt(bag.interval[1])}]`));
      }
      if (bag.set) box.append(el("p", {}, `prediction set: {${bag.set.join(", ")}}`));
      if (bag.probabilities) {
        box.append(el("p", {}, "probabilities: " + Object.entries(bag.probabilities)
          .map(([k, v]) => `${k} ${v.toFixed(3)}`).join(" · ")));
      }
      if (bag.domain) {
        box.append(domainBadge(bag.domain.out_of_range, bag.domain.score));
        box.append(el("p", { class: "muted" }, `nearest training samples: ${bag.domain.nearest.join(", ")}`));
      }
      if (bag.explanation) box.append(explanation(bag.explanation));
      if (bag.plot && bag.plot.contributions) box.append(scatter(bag.plot, []));
    }
    results.append(box);
  }
}

// Why this prediction: the explanation's numbers, for the last output (a classifier's
// last class).
function explanation(e) {
  const k = e.outputs.length - 1;
  const wrap = el("div", { class: "explanation" }, el("h5", {}, "Why this prediction"));
  wrap.append(el("p", {}, `${e.method === "exact" ? "exact contributions" : "first-order influence"}`
    + ` of ${e.n_cells} cells to ${e.outputs[k]}: baseline ${fmt(e.baseline[k])},`
    + ` cells ${e.total[k] >= 0 ? "+" : ""}${fmt(e.total[k])}`));
  const table = el("table", {}, el("tr", {},
    ...["marker", "effect (high cells push up if +)"].map((h) => el("th", {}, h))));
  for (const m of e.by_marker.slice(0, 5)) {
    table.append(el("tr", {}, el("td", {}, m.marker), el("td", {}, fmt(m.effect[k]))));
  }
  wrap.append(table);
  return wrap;
}

// A diverging colour for a contribution: blue lowers the answer, red raises it.
function diverging(v, scale) {
  const t = Math.max(-1, Math.min(1, v / (scale || 1)));
  const a = Math.round(255 * (1 - Math.abs(t)));
  return t >= 0 ? `rgb(255,${a},${a})` : `rgb(${a},${a},255)`;
}

const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
  "#7f7f7f", "#bcbd22", "#17becf"];

function scatter(plot, classes) {
  const wrap = el("div", { class: "plot" });
  const canvas = el("canvas", { width: 420, height: 420,
    "aria-label": plot.contributions ? "cells coloured by contribution" : "cells coloured by label" });
  const xs = el("select");
  const ys = el("select");
  plot.markers.forEach((m, j) => {
    xs.append(el("option", { value: j }, m));
    ys.append(el("option", { value: j }, m));
  });
  ys.value = plot.markers.length > 1 ? 1 : 0;
  const colour = new Map(classes.map((c, k) => [String(c), PALETTE[k % PALETTE.length]]));
  const draw = () => {
    const ctx = canvas.getContext("2d");
    const i = Number(xs.value);
    const j = Number(ys.value);
    const x = plot.points.map((p) => p[i]);
    const y = plot.points.map((p) => p[j]);
    const [x0, x1] = [Math.min(...x), Math.max(...x)];
    const [y0, y1] = [Math.min(...y), Math.max(...y)];
    const pad = 12;
    const sx = (v) => pad + ((v - x0) / (x1 - x0 || 1)) * (canvas.width - 2 * pad);
    const sy = (v) => canvas.height - pad - ((v - y0) / (y1 - y0 || 1)) * (canvas.height - 2 * pad);
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    ctx.globalAlpha = 0.6;
    if (plot.contributions) {
      // Largest contributions drawn last, on top; the scale is their 99th percentile.
      const order = plot.contributions.map((c, k) => k)
        .sort((a, b) => Math.abs(plot.contributions[a]) - Math.abs(plot.contributions[b]));
      const sorted = plot.contributions.map(Math.abs).sort((a, b) => a - b);
      const scale = sorted[Math.floor(0.99 * (sorted.length - 1))];
      ctx.fillStyle = "#ddd";
      ctx.globalAlpha = 0.9;
      for (const k of order) {
        ctx.fillStyle = diverging(plot.contributions[k], scale);
        ctx.fillRect(sx(x[k]) - 1.5, sy(y[k]) - 1.5, 3, 3);
      }
      return;
    }
    plot.labels.forEach((label, k) => {
      ctx.fillStyle = colour.get(String(label)) || "#000";
      ctx.fillRect(sx(x[k]) - 1.5, sy(y[k]) - 1.5, 3, 3);
    });
  };
  xs.addEventListener("change", draw);
  ys.addEventListener("change", draw);
  const keys = plot.contributions
    ? [["rgb(255,0,0)", `raises ${plot.output}`], ["rgb(0,0,255)", `lowers ${plot.output}`]]
    : classes.map((c) => [colour.get(String(c)), c]);
  const legend = el("div", { class: "legend" },
    el("p", {}, el("label", {}, "x ", xs), " ", el("label", {}, "y ", ys)),
    ...keys.map(([c, text]) => el("div", {}, el("span", { style: `background:${c}` }), text)),
    el("p", { class: "muted" }, `${plot.points.length} cells shown, as the model sees them`));
  wrap.append(canvas, legend);
  requestAnimationFrame(draw);
  return wrap;
}

// ------------------------------------------------------------------ audit trail
// Each answer's status under the model's policy and its domain flag, bag by bag, as the
// record keeps them: a preliminary or withheld answer is what a reviewer looks for.
function auditAnswers(output) {
  const statuses = (output && output.status) || [];
  const flags = (output && output.out_of_range) || [];
  const shown = statuses.slice(0, 5).map((s, i) => el("div", { class: "answer" },
    el("span", { class: `status ${s}` }, s),
    flags[i] ? el("span", { class: "flag" }, " out of domain") : ""));
  if (statuses.length > 5) shown.push(el("div", { class: "muted" }, `and ${statuses.length - 5} more`));
  return shown;
}

async function loadAudit() {
  const body = $("audit").tBodies[0];
  try {
    const { body: answer } = await api("/v1/audit?limit=20");
    body.replaceChildren(...answer.entries.map((e) => el("tr", {},
      el("td", {}, e.time), el("td", {}, e.model ? `${e.model.name}/${e.model.version}` : ""),
      el("td", {}, e.status), el("td", {}, (e.bag_sizes || []).length),
      el("td", { class: "answers" }, ...auditAnswers(e.output)),
      el("td", {}, (e.request_sha256 || e.input_sha256 || "").slice(0, 16)), el("td", {}, e.request_id))));
  } catch (error) {
    body.replaceChildren(el("tr", {}, el("td", { colspan: 7 }, error.message)));
  }
}

// ------------------------------------------------------------------ start
$("api-key").value = sessionStorage.getItem("bagserve-key") || "";
$("api-key").addEventListener("change", () => {
  sessionStorage.setItem("bagserve-key", $("api-key").value.trim());
  loadModels();
  loadAudit();
});
$("predict-form").addEventListener("submit", (event) => {
  event.preventDefault();
  predictFiles([...$("sample").files]);
});
$("audit-refresh").addEventListener("click", loadAudit);
window.bagserve = { predictFiles, selectModel, loadModels };
loadModels();
loadAudit();
