"""The page at ``/``: plain HTML and JavaScript, served by the same process, no build step.

A prompt, two method pickers (each with its options as JSON), and both answers streaming side by side from
``/v1/chat/completions`` (with ``"fastforward": {"trace": true}``, so every chunk says which tokens it holds and how
each came): a token produced by the target's own forward is plain, a token drafted and accepted at depth d is
coloured by d. Live tau (tokens per
target forward) and tokens/s above each answer; the final statistics below.
"""

PAGE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>fastforward</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
  body { font: 15px/1.45 system-ui, sans-serif; margin: 1.2em auto; max-width: 1200px; padding: 0 1em; color: #222; }
  h1 { font-size: 1.3em; margin: 0 0 .3em; }
  .sub { color: #666; margin-bottom: .8em; }
  textarea { width: 100%; box-sizing: border-box; font: inherit; padding: .5em; }
  .controls { display: flex; gap: 1em; align-items: center; flex-wrap: wrap; margin: .5em 0 1em; }
  .panes { display: grid; grid-template-columns: 1fr 1fr; gap: 1em; }
  .pane { border: 1px solid #ccc; border-radius: 6px; padding: .6em .8em; min-height: 14em; }
  .head { display: flex; justify-content: space-between; align-items: center; gap: .5em; }
  .live { font-variant-numeric: tabular-nums; color: #444; }
  .out { white-space: pre-wrap; margin-top: .5em; font-family: ui-monospace, monospace; font-size: 14px; }
  .final { color: #555; font-size: 13px; margin-top: .6em; border-top: 1px dashed #ccc; padding-top: .4em; }
  .legend span { padding: 0 .35em; border-radius: 3px; margin-right: .3em; font-family: ui-monospace, monospace; }
  .d0 { background: transparent; }
  .d1 { background: #d9f2d0; } .d2 { background: #b5e6c3; } .d3 { background: #9bd9d4; }
  .d4 { background: #a9c8f0; } .d5 { background: #c2b5ef; } .d6 { background: #e0b3e6; } .d7 { background: #f0b8c8; }
  .error { color: #b00020; }
  button { font: inherit; padding: .3em 1.2em; }
</style>
</head>
<body>
<h1>fastforward</h1>
<div class="sub">Lossless parallel decoding: the same answer as one-token-at-a-time decoding, fewer target forwards.
  <span id="model"></span></div>
<textarea id="prompt" rows="3">Explain what a KV cache is in two sentences.</textarea>
<div class="controls">
  <label>left <select id="m0"></select></label>
  <input id="o0" placeholder='options, e.g. {"max_ngram": 4}' style="width:13em">
  <label>right <select id="m1"></select></label>
  <input id="o1" placeholder='options, e.g. {"nodes": 12}' style="width:13em">
  <label>max tokens <input id="max" type="number" value="128" min="1" style="width:5em"></label>
  <label>temperature <input id="temp" type="number" value="0" min="0" max="2" step="0.1" style="width:4em"></label>
  <button id="go">Generate</button>
</div>
<div class="legend">token from the target's forward: <span class="d0">plain</span>
  drafted and accepted at depth <span class="d1">1</span><span class="d2">2</span><span class="d3">3</span><span
  class="d4">4</span><span class="d5">5</span><span class="d6">6</span><span class="d7">7+</span></div>
<div class="panes">
  <div class="pane" id="p0"><div class="head"><b class="name"></b><span class="live"></span></div>
    <div class="out"></div><div class="final"></div></div>
  <div class="pane" id="p1"><div class="head"><b class="name"></b><span class="live"></span></div>
    <div class="out"></div><div class="final"></div></div>
</div>
<script>
let MODEL = null;
const $ = (id) => document.getElementById(id);

async function init() {
  const r = await fetch("/v1/models");
  const card = (await r.json()).data[0];
  MODEL = card.id;
  $("model").textContent = "Model: " + MODEL + ".";
  const methods = Object.keys(card.fastforward.methods);
  for (const [i, sel] of [$("m0"), $("m1")].entries()) {
    for (const m of methods) sel.add(new Option(m, m));
    sel.value = i === 0 ? "ar" : (methods.includes("pld") ? "pld" : methods[0]);
  }
  document.body.dataset.ready = "1";
}

function fmt(x, d) { return (x === null || x === undefined) ? "-" : Number(x).toFixed(d); }

async function run(pane, method, optionsText) {
  const name = pane.querySelector(".name"), live = pane.querySelector(".live");
  const out = pane.querySelector(".out"), fin = pane.querySelector(".final");
  name.textContent = method; out.textContent = ""; fin.textContent = ""; live.textContent = "";
  pane.dataset.done = "";
  const t0 = performance.now();
  let options = {};
  try { options = optionsText.trim() ? JSON.parse(optionsText) : {}; }
  catch (e) { fin.textContent = "error: the options are not JSON"; pane.dataset.done = "1"; return; }
  const body = {model: MODEL, stream: true, max_tokens: Number($("max").value), temperature: Number($("temp").value),
                seed: 0, messages: [{role: "user", content: $("prompt").value}],
                fastforward: {method: method, options: options, trace: true}};
  try {
    const r = await fetch("/v1/chat/completions", {method: "POST", headers: {"Content-Type": "application/json"},
                                                   body: JSON.stringify(body)});
    if (!r.ok) { const e = await r.json(); throw new Error(e.error ? e.error.message : r.statusText); }
    const reader = r.body.getReader(), dec = new TextDecoder();
    let buf = "", tokens = 0;
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buf += dec.decode(value, {stream: true});
      let at;
      while ((at = buf.indexOf("\n\n")) >= 0) {
        const line = buf.slice(0, at).trim(); buf = buf.slice(at + 2);
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") continue;
        const msg = JSON.parse(data);
        if (msg.error) throw new Error(msg.error.message);
        const ff = msg.fastforward || {};
        for (const [text, depth] of (ff.pieces || [])) {
          if (!text) continue;
          const span = document.createElement("span");
          span.className = "d" + Math.min(depth, 7);
          span.dataset.depth = depth;
          span.title = depth ? "drafted, accepted at depth " + depth : "from the target's forward";
          span.textContent = text;
          out.appendChild(span);
        }
        if (ff.tokens !== undefined) tokens = ff.tokens;
        const secs = (performance.now() - t0) / 1000;
        if (ff.tau !== undefined) live.textContent = "tau " + fmt(ff.tau, 2) + " · " + fmt(tokens / secs, 1) + " tok/s";
        if (ff.stats) {
          const s = ff.stats;
          live.textContent = "tau " + fmt(s.tau, 2) + " · " + fmt(s.completion_tokens / secs, 1) + " tok/s";
          fin.textContent = s.completion_tokens + " tokens, " + s.target_forwards + " target forwards, tau " +
            fmt(s.tau, 2) + "; drafted " + s.num_draft_tokens + ", accepted " + s.num_accepted_draft_tokens +
            "; acceptance by depth " + s.acceptance_by_depth.slice(0, 6).map(a => fmt(a, 2)).join(" ") +
            "; finish: " + msg.choices[0].finish_reason;
          fin.dataset.tau = s.tau;
        }
      }
    }
  } catch (e) {
    fin.innerHTML = ""; const err = document.createElement("span"); err.className = "error";
    err.textContent = "error: " + e.message; fin.appendChild(err);
  }
  pane.dataset.done = "1";
}

$("go").onclick = () => {
  run($("p0"), $("m0").value, $("o0").value); run($("p1"), $("m1").value, $("o1").value);
};
init();
</script>
</body>
</html>
"""
