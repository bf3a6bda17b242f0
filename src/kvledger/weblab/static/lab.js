// The prefix ownership lab: a view over kvledger's JSON endpoints. Every number shown here comes from the
// server (the real ledger and scheduler); this script only lays the answers out and keeps the learner's
// progress in localStorage.
"use strict";

(() => {
  const KEY = "kvledger.lab.v1";
  const NUMERIC = ["layers", "kv_heads", "head_dim", "tp", "block_size", "requests", "prompt", "shared_prefix",
    "max_new", "groups", "branches"];
  const PREDICTIONS = ["blocks_per_request", "one_group_needed", "one_group_admitted", "isolated_needed",
    "isolated_admitted"];
  const $ = (sel, root = document) => root.querySelector(sel);
  const $$ = (sel, root = document) => Array.from(root.querySelectorAll(sel));
  const fmt = (n) => (typeof n === "number" ? n.toLocaleString("en-US") : String(n));

  let meta = null;
  let state = load();

  // ---- small DOM helpers -------------------------------------------------------------------------------
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") node.className = v;
      else if (k === "text") node.textContent = v;
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else if (k === "hue") node.style.setProperty("--g", String(v));
      else node.setAttribute(k, v === true ? "" : v);
    }
    for (const c of children.flat()) {
      if (c === null || c === undefined || c === false) continue;
      node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return node;
  }

  function setChildren(node, ...children) {
    node.replaceChildren(...children.flat().filter((c) => c !== null && c !== undefined && c !== false));
  }

  function load() {
    try {
      return JSON.parse(localStorage.getItem(KEY)) || {};
    } catch (e) {
      return {};
    }
  }

  function save() {
    try {
      localStorage.setItem(KEY, JSON.stringify(state));
      $("#saved-note").textContent = "Progress saved in this browser.";
    } catch (e) {
      $("#saved-note").textContent = "This browser does not let the page keep progress.";
    }
  }

  class LabError extends Error {}

  function showError(target, message) {
    if (!target) return;
    target.textContent = message;
    target.hidden = false;
  }

  async function api(path, body, errorTarget) {
    if (errorTarget) errorTarget.hidden = true;
    let res;
    try {
      res = await fetch(path, body === undefined ? {} : {
        method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body),
      });
    } catch (e) {
      showError(errorTarget, "The lab server did not answer: is `kvledger lab` still running?");
      throw new LabError("no answer");
    }
    let data = null;
    try {
      data = await res.json();
    } catch (e) {
      data = null;
    }
    if (!res.ok) {
      const message = (data && typeof data.error === "string") ? data.error : `the server answered ${res.status}`;
      showError(errorTarget, message);
      throw new LabError(message);
    }
    return data;
  }

  // ---- controls ----------------------------------------------------------------------------------------
  function fillSelect(select, values, labels) {
    select.replaceChildren(...values.map((v, i) => el("option", {value: v, text: labels ? labels[i] : v})));
  }

  function numberOrRaw(text) {
    if (text.trim() === "") return null;
    const n = Number(text);
    return Number.isFinite(n) ? n : text;
  }

  function readControls() {
    const mode = $("#c-mode").value;
    const c = {};
    if (mode === "model") c.model = $("#c-model").value;
    for (const name of NUMERIC) {
      if (mode === "model" && ["layers", "kv_heads", "head_dim"].includes(name)) continue;
      const v = numberOrRaw($(`#c-${name}`).value);
      if (v !== null) c[name] = v;
    }
    const dtype = $("#c-kv_dtype").value;
    if (dtype) c.kv_dtype = dtype;
    c.pool = $("#c-pool").value;
    c.policy = $("#c-policy").value;
    c.prefix_cache = $("#c-prefix_cache").checked;
    return c;
  }

  function writeControls(c) {
    $("#c-mode").value = c.model ? "model" : "explicit";
    if (c.model) $("#c-model").value = c.model;
    for (const name of NUMERIC) {
      if (c[name] !== undefined && c[name] !== null) $(`#c-${name}`).value = c[name];
    }
    $("#c-kv_dtype").value = c.kv_dtype || "";
    $("#c-pool").value = c.pool || "";
    $("#c-policy").value = c.policy || "full";
    $("#c-prefix_cache").checked = c.prefix_cache !== false;
    syncMode();
  }

  function syncMode() {
    const model = $("#c-mode").value === "model";
    $$(".model-only").forEach((n) => { n.hidden = !model; });
    $$(".explicit-only").forEach((n) => { n.hidden = model; });
    $$(".n-requests").forEach((n) => { n.textContent = $("#c-requests").value || "N"; });
  }

  function readPrediction() {
    const p = {};
    for (const k of PREDICTIONS) {
      const v = numberOrRaw($(`#p-${k}`).value);
      if (v !== null) p[k] = v;
    }
    return p;
  }

  // ---- step 2: the reveal --------------------------------------------------------------------------------
  function renderScore(score) {
    const rows = score.items.map((i) => el("tr", {},
      el("th", {scope: "row", text: i.label}),
      el("td", {class: "num", text: i.predicted === null ? "—" : fmt(i.predicted)}),
      el("td", {class: "num", text: fmt(i.actual)}),
      el("td", {class: i.correct === null ? "unset" : (i.correct ? "ok" : "bad"),
        text: i.correct === null ? "not predicted" : (i.correct ? "right" : "not quite")})));
    setChildren($("#score"),
      el("p", {class: "summary", "data-testid": "score-total"},
        `Your prediction: ${score.correct} of ${score.total} right.`),
      el("table", {"aria-label": "Your prediction against the ledger"},
        el("thead", {}, el("tr", {}, el("th", {text: "quantity"}), el("th", {class: "num", text: "you"}),
          el("th", {class: "num", text: "ledger"}), el("th", {text: "verdict"}))),
        el("tbody", {}, rows)));
  }

  function renderArithmetic(steps) {
    $("#arithmetic").replaceChildren(...steps.map((s) => el("li", {},
      el("strong", {text: `${s.name}: `}), el("span", {class: "formula", text: s.formula}), " = ",
      el("span", {text: s.result}))));
  }

  function hue(tint) {
    return tint === null || tint === undefined ? 210 : (210 + tint * 47) % 360;
  }

  function cellTitle(c) {
    return `block ${c.block}: ${stateText(c.state)}, ${c.owner}` + (c.slack_note ? `; ${c.slack_note}` : "");
  }

  function stateText(s) {
    const entry = (meta && meta.states) ? meta.states[s] : null;
    return entry || s;
  }

  function renderMap(map, panelTitle) {
    const wrap = el("div", {class: "mapwrap"});
    const legend = el("ul", {class: "legend", "aria-label": "Legend"},
      map.legend.map((l) => el("li", {},
        el("span", {class: `cell s-${l.state}`, "aria-hidden": "true", text: l.label}),
        el("span", {"data-testid": `count-${l.state}`}, `${l.text}: ${fmt(l.count)}`))),
      el("li", {}, el("span", {class: "slack-mark", "aria-hidden": "true"}),
        el("span", {text: "tail slack: a page charged whole whose last slots stay empty"})));
    wrap.append(legend);
    if (!map.drawn) {
      wrap.append(el("p", {class: "note",
        text: `The pool has ${fmt(map.pool_blocks)} pages: too many to draw one cell each; the counts above are exact.`}));
      return wrap;
    }
    const counts = map.legend.map((l) => `${fmt(l.count)} ${l.state}`).join(", ");
    const grid = el("div", {class: map.cells.length > 1024 ? "blockmap wide" : "blockmap", role: "img",
      "aria-label": `Block map of ${panelTitle}: ${map.pool_blocks} pages, ${counts}. A text list follows.`});
    for (const c of map.cells) {
      grid.append(el("div", {class: `cell s-${c.state}${c.slack ? " slack" : ""}`, hue: hue(c.tint),
        title: cellTitle(c), "data-state": c.state, text: c.label}));
    }
    wrap.append(grid, el("p", {class: "note", text: map.promise_note}));
    // The same map as text: runs of consecutive blocks with the same state and owner.
    const runs = [];
    for (const c of map.cells) {
      const last = runs[runs.length - 1];
      if (last && last.state === c.state && last.owner === c.owner && !c.slack && !last.slack) last.end = c.block;
      else runs.push({start: c.block, end: c.block, state: c.state, owner: c.owner, slack: c.slack_note});
    }
    const list = el("ul", {}, runs.map((r) => el("li", {},
      (r.start === r.end ? `block ${r.start}` : `blocks ${r.start}–${r.end}`) + `: ${stateText(r.state)} — ${r.owner}`
      + (r.slack ? ` (${r.slack})` : ""))));
    wrap.append(el("details", {}, el("summary", {text: "The block map as text"}), list));
    return wrap;
  }

  function renderPanel(p) {
    const n = p.decisions.length;
    const u = p.usage;
    const decisions = el("table", {"aria-label": `Decisions: ${p.title}`},
      el("thead", {}, el("tr", {}, ["request", "trust group", "decision", "the ledger's reason"]
        .map((h) => el("th", {text: h})))),
      el("tbody", {}, p.decisions.map((d) => el("tr", {"data-outcome": d.outcome},
        el("td", {text: d.request}), el("td", {text: d.group}),
        el("td", {class: `outcome-${d.outcome}`, text: d.outcome.replace("_", " ")}),
        el("td", {text: d.reason})))));
    const g = p.growth;
    return el("article", {class: "panel", "data-groups": p.groups, "aria-label": p.title},
      el("h4", {text: p.title}),
      el("p", {class: "summary", "data-testid": "panel-summary"},
        `${p.admitted} of ${n} admitted using ${fmt(p.admitted_blocks)} pages (${fmt(u.active)} live + `
        + `${fmt(u.promised)} promised); ${fmt(p.free_blocks_after)} left to promise.`),
      el("p", {"data-testid": "panel-pages"}, p.groups >= n
        ? `${fmt(p.blocks_per_request)} pages per request; no two requests share a trust group, so each stores `
          + `its own prefix and all ${n} together need ${fmt(p.blocks_needed_all)}. Pool: ${fmt(p.pool_blocks)} pages.`
        : `${fmt(p.blocks_per_request)} pages per request = ${fmt(p.shared_prefix_blocks)} shared-prefix + `
          + `${fmt(p.private_blocks_per_request)} private; all ${n} together need ${fmt(p.blocks_needed_all)} `
          + `(${fmt(p.blocks_needed_unshared)} with no sharing). Pool: ${fmt(p.pool_blocks)} pages.`),
      g ? el("p", {class: "note"}, `Run to completion through the scheduler (${g.policy}): ${g.started_at_once} `
        + `started at once, peak ${g.peak_running_requests} running, ${g.preemptions} preemption(s), `
        + `${fmt(g.steps)} steps.`) : null,
      renderMap(p.map, p.title),
      el("details", {open: true}, el("summary", {text: "Each request's decision and the ledger's reason"}),
        decisions));
  }

  function summarize(lab) {
    return lab.panels.map((p) => ({title: p.title, groups: p.groups, blocks_per_request: p.blocks_per_request,
      admitted: p.admitted, admitted_blocks: p.admitted_blocks, free_blocks_after: p.free_blocks_after,
      requests: p.decisions.length}));
  }

  function renderCompare(first, now) {
    const keys = [["blocks_per_request", "pages per request"], ["admitted", "admitted"],
      ["admitted_blocks", "pages used"], ["free_blocks_after", "left to promise"]];
    const rows = [];
    for (const p of now) {
      const before = first.find((f) => f.groups === p.groups && f.requests === p.requests)
        || first.find((f) => f.title === p.title);
      for (const [k, label] of keys) {
        const was = before ? before[k] : null;
        const changed = was !== null && was !== p[k];
        rows.push(el("tr", {class: changed ? "changed" : null},
          el("th", {scope: "row", text: `${p.title}: ${label}`}),
          el("td", {class: "num", text: was === null ? "—" : fmt(was)}),
          el("td", {class: "num", text: fmt(p[k])}),
          el("td", {text: changed ? "changed" : "same"})));
      }
    }
    $("#compare").replaceChildren(el("table", {"aria-label": "First reveal against the latest run"},
      el("thead", {}, el("tr", {}, el("th", {text: "quantity"}), el("th", {class: "num", text: "first reveal"}),
        el("th", {class: "num", text: "latest run"}), el("th", {text: "change"}))),
      el("tbody", {}, rows)));
  }

  function renderLab(lab) {
    renderArithmetic(lab.arithmetic);
    $("#panels").replaceChildren(...lab.panels.map(renderPanel));
  }

  function showRevealed() {
    for (const id of ["#revealed", "#change", "#decide"]) $(id).hidden = false;
    $("#run").disabled = false;
    $("#run-hint").textContent = "";
    $("#reveal-hint").textContent = "Revealed. Change a control and run the ledger again to see what moves.";
  }

  async function reveal() {
    const controls = readControls();
    const prediction = readPrediction();
    const err = $("#predict-error");
    // One after the other: both answers check the same controls and write the same message line, so
    // in parallel whichever bad answer arrived last would decide the wording the learner sees.
    const lab = await api("/api/lab", controls, err);
    const score = await api("/api/score", {controls, prediction}, err);
    renderScore(score);
    renderLab(lab);
    state.revealed = {controls, prediction, first: summarize(lab)};
    state.latest = null;
    save();
    showRevealed();
    renderCompare(state.revealed.first, state.revealed.first);
    $("#revealed-h").focus();
  }

  async function run() {
    if (!state.revealed) {
      $("#run-hint").textContent = "Predict first, then reveal: the ledger runs after your prediction.";
      return;
    }
    const controls = readControls();
    const lab = await api("/api/lab", controls, $("#controls-error"));
    renderLab(lab);
    state.latest = summarize(lab);
    save();
    renderCompare(state.revealed.first, state.latest);
    await loadQuiz();
  }

  // ---- step 4: the written decision ---------------------------------------------------------------------
  async function checkDecision() {
    const text = $("#decision-text").value;
    const res = await api("/api/decision", {controls: state.revealed.controls, text}, $("#decision-error"));
    state.decision = {text, checked: true};
    save();
    setChildren($("#decision-result"),
      el("p", {class: "summary", "data-testid": "decision-score"},
        `Your decision mentions ${res.found} of ${res.total} key points.`),
      el("ul", {}, res.items.map((i) => el("li", {class: i.found ? "ok" : "bad"},
        `${i.found ? "✓ mentioned" : "✗ missing"}: ${i.label}`))),
      el("h4", {text: "A model answer"}),
      el("p", {id: "model-answer", text: res.model_answer}));
  }

  // ---- check yourself ------------------------------------------------------------------------------------
  function quizKey(q, controls) {
    return q.source === "seed" ? "seed" : JSON.stringify(controls);
  }

  async function loadQuiz() {
    const controls = readControls();
    let data;
    try {
      data = await api("/api/quiz", controls, $("#quiz-error"));
    } catch (e) {
      return;
    }
    state.quiz = state.quiz || {};
    const list = $("#quiz-list");
    list.replaceChildren();
    data.questions.forEach((q, i) => list.append(renderQuestion(q, i + 1, controls)));
    for (const q of data.questions) {
      const saved = state.quiz[q.id];
      if (saved && saved.key === quizKey(q, controls) && saved.revealed) await revealAnswer(q, controls, false);
    }
  }

  function answerOf(q) {
    const box = $(`#quiz-${q.id}`);
    if (q.kind === "choice") {
      const checked = $(`input[name="q-${q.id}"]:checked`, box);
      return checked ? checked.value : "";
    }
    return $(`#a-${q.id}`, box).value;
  }

  function renderQuestion(q, number, controls) {
    const saved = (state.quiz[q.id] && state.quiz[q.id].key === quizKey(q, controls)) ? state.quiz[q.id] : null;
    const box = el("fieldset", {class: "quiz-q", id: `quiz-${q.id}`, "data-kind": q.kind});
    box.append(el("legend", {}, `${number}. ${q.text}`,
      el("span", {class: "tag", text: q.source === "seed" ? "(from the lesson)" : "(from your controls)"})));
    let input;
    if (q.kind === "choice") {
      input = el("div", {class: "choices", role: "radiogroup"}, q.options.map((o) => el("label", {},
        el("input", {type: "radio", name: `q-${q.id}`, value: o, checked: saved && saved.answer === o}), ` ${o}`)));
    } else if (q.kind === "number") {
      input = el("div", {}, el("label", {for: `a-${q.id}`, text: "Your answer "}),
        el("input", {id: `a-${q.id}`, type: "text", inputmode: "numeric", value: saved ? saved.answer : ""}));
    } else {
      input = el("div", {}, el("label", {for: `a-${q.id}`, text: "Your answer (numbers included)"}),
        el("textarea", {id: `a-${q.id}`, rows: "3"}, saved ? saved.answer : ""));
    }
    const button = el("button", {type: "button", class: "reveal-answer", disabled: !(saved && saved.answer),
      text: "Reveal the answer"});
    const out = el("div", {class: "answer-box", "aria-live": "polite"});
    box.append(input, el("p", {class: "actions"}, button), out);
    const onInput = () => {
      const answer = answerOf(q);
      button.disabled = !answer.trim();
      state.quiz[q.id] = {key: quizKey(q, controls), answer, revealed: false};
      out.replaceChildren();
      save();
    };
    box.addEventListener("input", onInput);
    box.addEventListener("change", onInput);
    button.addEventListener("click", () => revealAnswer(q, controls, true));
    return box;
  }

  async function revealAnswer(q, controls, store) {
    const box = $(`#quiz-${q.id}`);
    const answer = answerOf(q);
    if (!answer.trim()) return;
    const res = await api("/api/quiz/check", {controls, id: q.id, answer}, $("#quiz-error"));
    if (store) {
      state.quiz[q.id] = {key: quizKey(q, controls), answer, revealed: true};
      save();
    }
    const verdict = res.correct ? "Right." : "Not quite.";
    setChildren($(".answer-box", box),
      el("p", {class: res.correct ? "ok" : "bad", "data-testid": "verdict"},
        verdict + (res.expected !== null && res.expected !== undefined ? ` The answer is ${fmt(res.expected)}.` : "")),
      res.items.length ? el("ul", {}, res.items.map((i) => el("li", {class: i.found ? "ok" : "bad"},
        `${i.found ? "✓" : "✗"} ${i.label}`))) : null,
      el("p", {text: res.explanation}));
  }

  // ---- forks and copy-on-write ---------------------------------------------------------------------------
  function formValues(form) {
    const out = {};
    for (const input of $$("input", form)) {
      const name = input.name || input.id.replace(/^[a-z]-/, "");
      const v = numberOrRaw(input.value);
      if (v !== null) out[name] = v;
    }
    return out;
  }

  function stepper(container, steps, render) {
    let i = 0;
    const status = el("span", {"aria-live": "polite"});
    const prev = el("button", {type: "button", class: "quiet", text: "◀ Previous step"});
    const next = el("button", {type: "button", class: "quiet", text: "Next step ▶"});
    const body = el("div", {});
    const show = () => {
      status.textContent = `Step ${i + 1} of ${steps.length}: ${steps[i].title}`;
      prev.disabled = i === 0;
      next.disabled = i === steps.length - 1;
      body.replaceChildren(render(steps[i], i > 0 ? steps[i - 1] : null));
    };
    prev.addEventListener("click", () => { if (i > 0) { i -= 1; show(); } });
    next.addEventListener("click", () => { if (i < steps.length - 1) { i += 1; show(); } });
    const nav = el("div", {class: "nav", tabindex: "0", "aria-label": "Steps: use the arrow keys or the buttons"},
      prev, next, status);
    nav.addEventListener("keydown", (e) => {
      if (e.key === "ArrowRight") next.click();
      if (e.key === "ArrowLeft") prev.click();
    });
    container.replaceChildren(nav, body);
    show();
  }

  function usageLine(u, extra) {
    return `Pool: ${fmt(u.free)} free, ${fmt(u.active)} active, ${fmt(u.retained)} retained (evictable), `
      + `${fmt(u.promised)} promised${extra || ""}; ${fmt(u.available)} available to promise.`;
  }

  function renderForkStep(step, previous) {
    const before = {};
    if (previous) for (const s of previous.sequences) before[s.id] = s.blocks.map((b) => b.block);
    const seqs = el("div", {class: "seqs"}, step.sequences.map((s) => el("div", {class: "seq"},
      el("span", {class: "name", text: s.id}),
      s.blocks.map((b, idx) => {
        const moved = before[s.id] && before[s.id][idx] !== undefined && before[s.id][idx] !== b.block;
        const fresh = before[s.id] && before[s.id][idx] === undefined;
        const bits = [`#${b.block}`];
        if (b.ref > 1) bits.push(`shared ×${b.ref}`);
        if (b.used < step.block_size) bits.push(`${b.used}/${step.block_size} used`);
        if (moved) bits.push("copy");
        if (fresh) bits.push("new");
        return el("span", {class: `chip${b.ref > 1 ? " shared" : ""}${moved ? " copied" : ""}`,
          title: `block ${b.block}, ${b.ref} holder(s), ${b.used} slots used`, text: bits.join(" · ")});
      }),
      el("span", {class: "note", text: `${s.tokens} tokens, ${s.promised} promised`}))));
    return el("div", {},
      el("ul", {}, step.events.map((e) => el("li", {text: e}))),
      seqs,
      el("p", {class: "note", text: usageLine(step.usage, step.copy_promises
        ? ` (${step.copy_promises} of them for tail copies)` : "")}));
  }

  async function runForks(e) {
    if (e) e.preventDefault();
    const values = formValues($("#forks-form"));
    const res = await api("/api/views/forks", values, $("#forks-error"));
    const out = $("#forks-out");
    if (!res.steps.length) {
      out.replaceChildren(el("p", {class: "bad", text: `${res.decision.outcome}: ${res.decision.reason}`}));
      return;
    }
    const bs = values.block_size;
    res.steps.forEach((s) => { s.block_size = bs; });
    stepper(out, res.steps, renderForkStep);
  }

  // ---- eviction vs preemption ----------------------------------------------------------------------------
  function renderEvictStep(step) {
    const cells = el("div", {class: "paged-row", role: "img", "aria-label": step.map_text},
      step.cells.map((c) => el("div", {class: `cell s-${c.state}`, hue: hue(c.tint), title: c.title,
        text: c.label})));
    return el("div", {},
      el("p", {class: "summary", text: step.what}),
      el("ul", {}, step.events.map((e) => el("li", {text: e}))),
      cells,
      step.cost ? el("p", {class: "note", text: step.cost}) : null,
      el("p", {class: "note", text: usageLine(step.usage)}));
  }

  async function runEvict() {
    const res = await api("/api/views/eviction", {}, $("#evict-error"));
    $("#evict-intro").replaceChildren(...res.intro.map((t) => el("p", {text: t})));
    stepper($("#evict-out"), res.steps, renderEvictStep);
  }

  // ---- tail slack vs holes -------------------------------------------------------------------------------
  function listOf(text) {
    return text.split(/[\s,;]+/).filter((t) => t).map((t) => numberOrRaw(t));
  }

  async function runFrag(e) {
    if (e) e.preventDefault();
    const body = {capacity_tokens: numberOrRaw($("#g-capacity_tokens").value),
      block_size: numberOrRaw($("#g-block_size").value), lengths: listOf($("#g-lengths").value),
      finish: listOf($("#g-finish").value), new_length: numberOrRaw($("#g-new_length").value)};
    for (const k of Object.keys(body)) if (body[k] === null) delete body[k];
    const res = await api("/api/views/fragmentation", body, $("#frag-error"));
    const c = res.contiguous;
    const hues = {};
    res.names.forEach((n, i) => { hues[n] = hue(i); });
    const bar = el("div", {class: "bar", role: "img", "aria-label": c.segments.map((s) =>
      `${s.owner ? s.owner : "hole"} ${s.size} slots at ${s.start}`).join("; ")},
    c.segments.map((s) => {
      const seg = el("div", {class: `seg ${s.owner ? "used" : "hole"}`, hue: s.owner ? hues[s.owner] : null,
        title: `${s.owner ? `request ${s.owner}` : "hole"}: slots ${s.start}–${s.start + s.size - 1}`,
        text: `${s.owner || "hole"} ${s.size}`});
      seg.style.width = `${(100 * s.size) / c.capacity}%`;
      return seg;
    }));
    const p = res.paged;
    const cells = el("div", {class: "paged-row", role: "img", "aria-label": p.cells.map((x) =>
      `block ${x.block}: ${x.owner || "free"}${x.slack ? `, ${x.slack} slots of tail slack` : ""}`).join("; ")},
    p.cells.map((x) => el("div", {class: `cell ${x.owner ? "s-private" : "s-free"}${x.slack ? " slack" : ""}`,
      hue: x.owner ? hues[x.owner] : null, title: `block ${x.block}: ${x.owner || "free"}`
        + (x.slack ? `, tail slack ${x.slack} of ${p.block_size} slots` : ""),
      text: x.owner || "·"})));
    const slack = Object.entries(p.tail_slack).map(([k, v]) => `${k}: ${v}`).join(", ");
    setChildren($("#frag-out"),
      el("h3", {text: "Contiguous (first fit, exact lengths)"}),
      bar,
      el("p", {"data-testid": "frag-contiguous"}, `After ${res.finished.join(", ") || "nothing"} finished: `
        + `${fmt(c.free_total)} slots free, largest hole ${fmt(c.largest_hole)}. ${res.new.name} `
        + `(${res.new.length} tokens): `, el("strong", {class: c.outcome === "admitted" ? "ok" : "bad",
        text: c.outcome.replace("_", " ")}), ` — ${c.reason}.`),
      c.notes.length ? el("ul", {}, c.notes.map((n) => el("li", {text: n}))) : null,
      el("h3", {text: `Paged (${p.blocks} pages of ${p.block_size} slots, the real ledger)`}),
      cells,
      el("p", {"data-testid": "frag-paged"}, `${res.new.name}: `, el("strong", {
        class: p.outcome === "admitted" ? "ok" : "bad", text: p.outcome.replace("_", " ")}), ` — ${p.reason}. `
        + `Tail slack per request (slots charged but empty): ${slack}; ${p.tail_slack_total} in all.`
        + (p.unused_capacity ? ` ${p.unused_capacity} slots of capacity do not fill a whole page.` : "")),
      p.notes.length ? el("ul", {}, p.notes.map((n) => el("li", {text: n}))) : null);
  }

  // ---- hybrid pool -----------------------------------------------------------------------------------------
  const HYBRID_FIELDS = ["full_layers", "sliding_layers", "window", "block_size", "prompt", "max_new", "requests",
    "pool_blocks"];
  const HYBRID_SERIES = [["full", "global blocks", "#2b8cbe"], ["sliding", "window blocks", "#74c476"],
    ["retained", "retained (cache)", "#bdbdbd"], ["uniform", "uniform pool, same tokens", "#e6550d"]];

  // The SVG namespace, read from the parser (the page names no URL of any kind).
  const SVG_NS = (() => {
    const t = document.createElement("template");
    t.innerHTML = "<svg></svg>";
    return t.content.firstChild.namespaceURI;
  })();

  function svgEl(tag, attrs) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
    return node;
  }

  function hybridChart(steps) {
    const w = 640, h = 220, pad = 30;
    const top = Math.max(1, ...steps.map((s) => Math.max(s.full + s.sliding, s.uniform, s.retained)));
    const x = (i) => pad + ((w - 2 * pad) * i) / Math.max(1, steps.length - 1);
    const y = (v) => h - pad - ((h - 2 * pad) * v) / top;
    const svg = svgEl("svg", {viewBox: `0 0 ${w} ${h}`, width: "100%", role: "img",
      "aria-label": `blocks held over ${steps.length} steps: global, window, retained and a uniform pool's`});
    svg.append(svgEl("line", {x1: pad, y1: h - pad, x2: w - pad, y2: h - pad, stroke: "#999"}));
    svg.append(svgEl("line", {x1: pad, y1: pad, x2: pad, y2: h - pad, stroke: "#999"}));
    const label = svgEl("text", {x: pad + 4, y: pad - 8, "font-size": 11});
    label.textContent = `${fmt(top)} blocks`;
    svg.append(label);
    for (const [key, , color] of HYBRID_SERIES) {
      const pts = steps.map((s, i) => `${x(i).toFixed(1)},${y(s[key]).toFixed(1)}`).join(" ");
      svg.append(svgEl("polyline", {points: pts, fill: "none", stroke: color, "stroke-width": 2,
        "stroke-dasharray": key === "uniform" ? "5 3" : "none"}));
    }
    return svg;
  }

  async function runHybrid(e) {
    if (e) e.preventDefault();
    const body = {};
    for (const k of HYBRID_FIELDS) {
      const v = numberOrRaw($(`#h-${k}`).value);
      if (v !== null) body[k] = v;
    }
    const res = await api("/api/views/hybrid", body, $("#hybrid-error"));
    const kinds = {};
    res.groups.forEach((g) => { kinds[g.kind] = (kinds[g.kind] || 0) + 1; });
    const peak = res.peak;
    setChildren($("#hybrid-out"),
      el("p", {text: `${res.groups.length} KV cache groups of ${res.group_size} layer(s): `
        + Object.entries(kinds).map(([k, n]) => `${n} ${k}`).join(", ")
        + (res.padding_layers ? ` (${res.padding_layers} padding layer(s))` : "") + `; ${fmt(res.pool_blocks)} blocks.`}),
      res.steps.length ? hybridChart(res.steps) : null,
      el("ul", {class: "legend"}, HYBRID_SERIES.map(([key, name]) => el("li", {},
        el("span", {class: `swatch h-${key}`}), ` ${name}`))),
      el("p", {"data-testid": "hybrid-summary"}, peak
        ? `Peak: ${fmt(peak.full)} global + ${fmt(peak.sliding)} window blocks held at step ${peak.step} `
          + `(${peak.running} running); a uniform pool would hold up to ${fmt(res.peak_uniform)} blocks for the same `
          + `tokens. ${res.finished.length} request(s) finished in ${res.steps.length} steps.`
        : `Nothing ran: ${res.never}`));
  }

  // ---- start ---------------------------------------------------------------------------------------------
  function bind(selector, event, handler) {
    $(selector).addEventListener(event, (e) => {
      Promise.resolve(handler(e)).catch((err) => {
        if (!(err instanceof LabError)) console.error(err);
      });
    });
  }

  async function restore() {
    if (!state.revealed) return;
    try {
      const [score, lab] = await Promise.all([
        api("/api/score", {controls: state.revealed.controls, prediction: state.revealed.prediction},
          $("#predict-error")),
        api("/api/lab", readControls(), $("#controls-error"))]);
      renderScore(score);
      renderLab(lab);
      showRevealed();
      renderCompare(state.revealed.first, summarize(lab));
    } catch (e) {
      return;
    }
    if (state.decision && state.decision.text) $("#decision-text").value = state.decision.text;
    if (state.decision && state.decision.checked) await checkDecision().catch(() => {});
  }

  async function start() {
    meta = await api("/api/meta", undefined, $("#controls-error"));
    fillSelect($("#c-model"), meta.models);
    fillSelect($("#c-kv_dtype"), ["", ...meta.kv_dtypes], ["model's own (bf16 if explicit)", ...meta.kv_dtypes]);
    fillSelect($("#c-policy"), meta.policies);
    writeControls(state.controls || meta.seed);
    for (const k of PREDICTIONS) {
      if (state.prediction && state.prediction[k] !== undefined) $(`#p-${k}`).value = state.prediction[k];
    }
    if (!state.revealed) {
      $("#run").disabled = true;
      $("#run-hint").textContent = "Predict below and reveal first; then change a control and run again.";
    }
    $("#controls").addEventListener("input", () => { syncMode(); state.controls = readControls(); save(); });
    $("#controls").addEventListener("change", () => { syncMode(); state.controls = readControls(); save(); });
    $(".predictions").addEventListener("input", () => { state.prediction = readPrediction(); save(); });
    $("#decision-text").addEventListener("input", () => {
      state.decision = {text: $("#decision-text").value, checked: false};
      save();
    });
    bind("#controls", "submit", (e) => { e.preventDefault(); return run(); });
    bind("#reveal", "click", reveal);
    bind("#check-decision", "click", checkDecision);
    bind("#seed-controls", "click", () => { writeControls(meta.seed); state.controls = readControls(); save(); });
    bind("#reset-progress", "click", () => {
      localStorage.removeItem(KEY);
      window.location.reload();
    });
    bind("#forks-form", "submit", runForks);
    bind("#frag-form", "submit", runFrag);
    bind("#evict-run", "click", runEvict);
    bind("#hybrid-form", "submit", runHybrid);
    $("#revealed-h").setAttribute("tabindex", "-1");
    await restore();
    await loadQuiz();
    await Promise.all([runForks(), runFrag(), runEvict(), runHybrid()].map((p) => p.catch(() => {})));
    document.body.dataset.ready = "true";
  }

  document.addEventListener("DOMContentLoaded", () => {
    start().catch((e) => {
      if (!(e instanceof LabError)) console.error(e);
    });
  });
})();
