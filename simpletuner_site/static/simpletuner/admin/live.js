/* Keeps the orchestrator's admin pages current without reloading.
 *
 * Listens to the operators' change feed (SSE). When a `changes` event names a row shown on a list
 * page, when the feed (re)connects, and every 10 s in any case, it fetches the live cells of the shown
 * rows from `<list>/live/?ids=...` and swaps them in; blocks marked `data-live-fragment` are re-fetched
 * whole, and an object's own page re-reads its live fields (`live/?detail=1&ids=<pk>`). Ages
 * ("12 s ago") tick every second against the server's clock. Only pages that say where their rows
 * refresh from (meta simpletuner-live-rows / simpletuner-live-object) are refreshed.
 */
(function () {
  "use strict";
  var REFRESH_MS = 10000;
  var DEBOUNCE_MS = 150;

  function start() {
    var meta = document.querySelector('meta[name="simpletuner-live"]');
    if (!meta || typeof EventSource === "undefined") { return; }
    var rowsMeta = document.querySelector('meta[name="simpletuner-live-rows"]');
    var table = rowsMeta ? document.getElementById("result_list") : null;
    var objectMeta = document.querySelector('meta[name="simpletuner-live-object"]');
    var fragments = Array.prototype.slice.call(document.querySelectorAll("[data-live-fragment]"));
    if (!table && !objectMeta && !fragments.length) { return; }
    var indicator = document.getElementById("st-live");
    var skewMs = 0;
    var pending = null;
    var inflight = false;

    function setLive(on) {
      if (!indicator) { return; }
      indicator.className = "st-live " + (on ? "st-live-on" : "");
      indicator.textContent = on ? "live" : "reconnecting";
    }

    function rowsById() {
      var rows = {};
      if (!table) { return rows; }
      table.querySelectorAll("input.action-select").forEach(function (box) {
        rows[box.value] = box.closest("tr");
      });
      return rows;
    }

    function formatAgo(seconds) {  // as simpletuner_site/humanize.py's ago()
      if (seconds < 120) { return seconds + " s ago"; }
      if (seconds < 120 * 60) { return Math.floor(seconds / 60) + " min ago"; }
      if (seconds < 48 * 3600) { return Math.floor(seconds / 3600) + " h ago"; }
      return Math.floor(seconds / 86400) + " d ago";
    }

    function tick() {
      var now = Date.now() + skewMs;
      document.querySelectorAll("time[data-ago]").forEach(function (el) {
        var at = Date.parse(el.getAttribute("datetime"));
        if (!isNaN(at)) { el.textContent = formatAgo(Math.max(0, Math.floor((now - at) / 1000))); }
      });
    }

    function applyRows(data) {
      if (data.now) { skewMs = Date.parse(data.now) - Date.now(); }
      var rows = rowsById();
      Object.keys(data.rows).forEach(function (pk) {
        var row = rows[pk];
        if (!row) { return; }
        var cells = data.rows[pk];
        Object.keys(cells).forEach(function (field) {
          var cell = row.querySelector(".field-" + field);
          if (cell && cell.innerHTML !== cells[field]) { cell.innerHTML = cells[field]; }
        });
      });
      (data.missing || []).forEach(function (pk) {
        if (rows[pk]) { rows[pk].classList.add("st-gone"); rows[pk].style.opacity = "0.45"; }
      });
    }

    function applyObject(data) {
      if (data.now) { skewMs = Date.parse(data.now) - Date.now(); }
      var fields = data.rows[objectMeta.getAttribute("data-id")];
      if (!fields) { return; }
      Object.keys(fields).forEach(function (field) {
        var box = document.querySelector(".form-row .field-" + field + " .readonly, .form-row.field-" + field + " .readonly");
        if (box && box.innerHTML !== fields[field]) { box.innerHTML = fields[field]; }
      });
    }

    function fetchJson(url) {
      return fetch(url, { credentials: "same-origin", redirect: "error", headers: { Accept: "application/json" } }).then(function (r) {
        if (!r.ok) { throw new Error("HTTP " + r.status); }
        return r.json();
      });
    }

    function refresh() {
      pending = null;
      if (inflight) { schedule(); return; }
      inflight = true;
      var work = [];
      var ids = Object.keys(rowsById());
      if (ids.length) {
        var url = rowsMeta.getAttribute("content") + "?ids=" + encodeURIComponent(ids.join(","));
        work.push(fetchJson(url).then(applyRows));
      }
      if (objectMeta) {
        var objectUrl = objectMeta.getAttribute("content") + "?detail=1&ids=" + encodeURIComponent(objectMeta.getAttribute("data-id"));
        work.push(fetchJson(objectUrl).then(applyObject));
      }
      fragments.forEach(function (el) {
        work.push(fetch(el.getAttribute("data-live-fragment"), { credentials: "same-origin", redirect: "error" }).then(function (r) {
          if (!r.ok) { throw new Error("HTTP " + r.status); }
          return r.text();
        }).then(function (html) { el.innerHTML = html; }));
      });
      Promise.all(work).catch(function () { /* the next event or timer tries again */ }).then(function () {
        inflight = false;
        tick();
      });
    }

    function schedule() {
      if (pending === null) { pending = window.setTimeout(refresh, DEBOUNCE_MS); }
    }

    var source = new EventSource(meta.getAttribute("content"));
    source.addEventListener("stream-open", function () { setLive(true); schedule(); });
    source.addEventListener("changes", function (event) {
      var data;
      try { data = JSON.parse(event.data); } catch (e) { return; }
      if (data.many || fragments.length) { schedule(); return; }
      var shown = rowsById();
      if (objectMeta) { shown[objectMeta.getAttribute("data-id")] = true; }
      if ((data.targets || []).some(function (t) { return Object.prototype.hasOwnProperty.call(shown, t.id); })) { schedule(); }
    });
    source.addEventListener("error", function () { setLive(false); });
    window.setInterval(refresh, REFRESH_MS);
    window.setInterval(tick, 1000);
    window.addEventListener("pagehide", function () { source.close(); });
  }

  if (document.readyState === "loading") { document.addEventListener("DOMContentLoaded", start); } else { start(); }
})();
