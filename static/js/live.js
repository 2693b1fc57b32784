// One server-sent-event stream per tab (docs/agents.md#the-live-event-stream): when a page has live parts
// ([data-live]), listen to /api/v1/events and let htmx re-fetch them on a change.
// On a local CLI agent's page the same stream also carries its terminal pane
// (?pane=<agent id>): each `pane` frame replaces the text of the read-only <pre>.
(function () {
  if (!document.querySelector("[data-live]") || !window.EventSource) return;
  var pane = document.querySelector("[data-pane-agent]");
  var url = "/api/v1/events";
  if (pane) url += "?pane=" + encodeURIComponent(pane.getAttribute("data-pane-agent"));
  var source = new EventSource(url);
  // The live parts re-fetch on `dispatch:live`: at most once per INTERVAL, and always once
  // after the last change of a burst. (htmx's own `throttle` drops what arrives inside its
  // window, so "lost contact" quickly followed by "contact restored" left the page on the
  // first.)
  var INTERVAL = 500;
  var lastRing = 0;
  var trailing = null;
  function ring(detail) {
    lastRing = Date.now();
    document.body.dispatchEvent(new CustomEvent("dispatch:live", { detail: detail }));
  }
  function changed(detail) {
    var wait = lastRing + INTERVAL - Date.now();
    if (wait <= 0) { ring(detail); return; }
    if (trailing === null) trailing = setTimeout(function () { trailing = null; ring(detail); }, wait);
  }
  var names = ["agent.upsert", "agent.deleted", "agent.event", "run.updated", "message.created", "message.updated"];
  names.forEach(function (name) {
    source.addEventListener(name, function (message) {
      var detail = {};
      try { detail = JSON.parse(message.data); } catch (e) {}
      changed({ event: name, data: detail });
    });
  });
  // Every connection starts with a `snapshot`. The first one only confirms what the page
  // was rendered with; a later one means the stream reconnected (the server restarted, the
  // network dropped): whatever happened meanwhile was never sent, so re-fetch the live parts.
  var connections = 0;
  source.addEventListener("snapshot", function () {
    connections += 1;
    if (connections > 1) changed({ event: "snapshot", data: {} });
  });
  if (pane) {
    source.addEventListener("pane", function (message) {
      var frame;
      try { frame = JSON.parse(message.data); } catch (e) { return; }
      if (!frame || frame.agent_id !== pane.getAttribute("data-pane-agent")) return;
      var atBottom = pane.scrollTop + pane.clientHeight >= pane.scrollHeight - 4;
      pane.textContent = frame.text || "(the terminal is empty)";
      if (atBottom) pane.scrollTop = pane.scrollHeight;
    });
  }
  source.addEventListener("open", function () { document.body.classList.remove("offline"); });
  source.addEventListener("error", function () { document.body.classList.add("offline"); });
})();
