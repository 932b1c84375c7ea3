// fencegate console: a little progressive enhancement. Every page works without it.
// CSP: this file is the only script (script-src 'self'); nothing inline, no eval.
"use strict";

(function () {
  // Lease countdowns: the server's clock at render time, counted down locally.
  function countdowns() {
    var nodes = document.querySelectorAll(".countdown[data-expires-at]");
    if (!nodes.length) return;
    var started = Date.now();
    function tick() {
      nodes.forEach(function (node) {
        var left = Number(node.dataset.expiresAt) - Number(node.dataset.now) - (Date.now() - started);
        node.textContent = left > 0 ? Math.ceil(left / 1000) + " s left" : "expired";
      });
    }
    tick();
    setInterval(tick, 1000);
  }

  // The epoch bump's typed confirmation: the button waits for the current epoch.
  function typedConfirmation() {
    var input = document.getElementById("typed");
    var button = document.getElementById("bump");
    if (!input || !button) return;
    function check() { button.disabled = input.value.trim() !== input.dataset.expect; }
    input.addEventListener("input", check);
    check();
  }

  var SVG = "http://www.w3.org/2000/svg";
  var COLOURS = ["#1f4fa8", "#b3261e", "#1e6b34", "#8a5a00", "#6b3fa0", "#00796b", "#c2185b", "#455a64"];

  function el(name, attrs) {
    var node = document.createElementNS(SVG, name);
    Object.keys(attrs).forEach(function (key) { node.setAttribute(key, attrs[key]); });
    return node;
  }

  // Counters become per-minute rates between samples; gauges are drawn as they are.
  function rates(samples, read) {
    var points = [];
    for (var i = 1; i < samples.length; i++) {
      var minutes = (samples[i].t - samples[i - 1].t) / 60000;
      if (minutes <= 0) continue;
      points.push([samples[i].t, Math.max(0, read(samples[i]) - read(samples[i - 1])) / minutes]);
    }
    return points;
  }

  function draw(svg, lines, t0, t1) {
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    var w = 300, h = 120, pad = 18;
    var max = 1;
    lines.forEach(function (line) { line.points.forEach(function (p) { max = Math.max(max, p[1]); }); });
    svg.appendChild(el("line", { x1: pad, y1: h - pad, x2: w, y2: h - pad, stroke: "#c8ced6" }));
    var label = el("text", { x: 2, y: 12, "font-size": 10, fill: "#5b6675" });
    label.textContent = String(Math.round(max * 10) / 10);
    svg.appendChild(label);
    var zero = el("text", { x: 2, y: h - pad, "font-size": 10, fill: "#5b6675" });
    zero.textContent = "0";
    svg.appendChild(zero);
    var span = Math.max(1, t1 - t0);
    lines.forEach(function (line) {
      if (!line.points.length) return;
      var d = line.points.map(function (p, i) {
        var x = pad + (w - pad) * (p[0] - t0) / span;
        var y = (h - pad) - (h - pad - 4) * p[1] / max;
        return (i ? "L" : "M") + x.toFixed(1) + " " + y.toFixed(1);
      }).join(" ");
      svg.appendChild(el("path", { d: d, fill: "none", stroke: line.colour, "stroke-width": 2 }));
      var last = line.points[line.points.length - 1];
      svg.appendChild(el("circle", {
        cx: (pad + (w - pad) * (last[0] - t0) / span).toFixed(1),
        cy: ((h - pad) - (h - pad - 4) * last[1] / max).toFixed(1),
        r: 2.5, fill: line.colour,
      }));
    });
  }

  // The samples the gateway takes in the background (every few seconds from its start, so
  // the charts have the last minutes at once); every series' legend in the gateway's words.
  function charts() {
    var box = document.getElementById("charts");
    if (!box) return;
    function gauge(which) {
      return function (samples) {
        return samples.filter(function (s) { return typeof s[which] === "number"; })
          .map(function (s) { return [s.t, s[which]]; });
      };
    }
    function render(data) {
      var samples = data.samples || [], labels = data.labels || {};
      if (!samples.length) return;
      function words(name) { return labels[name] || name; }
      var t1 = samples[samples.length - 1].t, t0 = Math.min(samples[0].t, t1 - 60000);
      var keys = {};
      samples.forEach(function (s) { Object.keys(s.effects || {}).forEach(function (k) { keys[k] = true; }); });
      var names = Object.keys(keys).sort(function (a, b) { return words(a) < words(b) ? -1 : 1; });
      box.querySelectorAll("svg.chart").forEach(function (svg) {
        var which = svg.dataset.series;
        var lines;
        if (which === "effects") {
          lines = names.map(function (name, i) {
            return { name: name, colour: COLOURS[i % COLOURS.length],
                     points: rates(samples, function (s) { return (s.effects || {})[name] || 0; }) };
          });
        } else if (which === "fenced") {
          lines = [{ name: which, colour: COLOURS[1], points: rates(samples, function (s) { return s.fenced; }) }];
        } else {
          var parts = svg.dataset.lines ? svg.dataset.lines.split(" ") : [which];
          lines = parts.map(function (name, i) {
            return { name: name, colour: COLOURS[i % COLOURS.length], points: gauge(name)(samples) };
          });
        }
        draw(svg, lines, t0, t1);
        var legend = box.querySelector("[data-legend=" + which + "]");
        if (!legend) return;
        while (legend.firstChild) legend.removeChild(legend.firstChild);
        lines.forEach(function (line) {
          var item = document.createElement("li");
          item.textContent = words(line.name);
          item.style.setProperty("--swatch", line.colour);
          legend.appendChild(item);
        });
      });
    }
    var every = 5000;
    function poll() {
      fetch(box.dataset.source, { credentials: "same-origin", headers: { Accept: "application/json" } })
        .then(function (r) { return r.ok ? r.json() : null; })
        .then(function (data) {
          if (!data) return;
          render(data);
          if (data.everyMs > 0 && data.everyMs !== every) {
            every = data.everyMs;
            clearInterval(timer);
            timer = setInterval(poll, every);
          }
        })
        .catch(function () {});
    }
    var timer = setInterval(poll, every);
    poll();
  }

  // Needs attention: re-read this very page every few seconds and swap in its list, counts
  // and "as of" (one rendering, the server's; the same route, so the same session and role
  // checks). A late answer never overwrites a newer one; a failed read (the session ended,
  // the gateway is away) leaves the list as it was and says it is stale.
  function attention() {
    var box = document.getElementById("attention");
    if (!box) return;
    var every = Number(box.dataset.refreshMs) || 5000;
    var issued = 0, shown = 0;
    function stale(n) {
      if (n < shown) return;
      var asOf = document.getElementById("as-of");
      if (!asOf || asOf.classList.contains("stale")) return;
      asOf.classList.add("stale");
      asOf.textContent += " (not refreshed since: reload the page)";
    }
    function poll() {
      if (document.hidden) return;
      var n = ++issued;
      fetch(location.pathname + location.search, {
        credentials: "same-origin", cache: "no-store", redirect: "manual",
        headers: { Accept: "text/html" },
      })
        .then(function (r) { return r.ok ? r.text() : null; })
        .then(function (text) {
          var fresh = text ? new DOMParser().parseFromString(text, "text/html") : null;
          var next = fresh ? fresh.getElementById("attention") : null;
          var current = document.getElementById("attention");
          if (!next || !current) { stale(n); return; }
          if (n < shown) return;
          shown = n;
          current.replaceWith(document.adoptNode(next));
          document.title = fresh.title;
        })
        .catch(function () { stale(n); });
    }
    setInterval(poll, every);
    document.addEventListener("visibilitychange", function () { if (!document.hidden) poll(); });
  }

  document.addEventListener("DOMContentLoaded", function () {
    countdowns();
    typedConfirmation();
    charts();
    attention();
  });
})();
