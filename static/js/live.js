// One server-sent-event stream per tab (ui.md): when a page has live parts
// ([data-live]), listen to /api/v1/events and let htmx re-fetch them on a change.
(function () {
  if (!document.querySelector("[data-live]") || !window.EventSource) return;
  var source = new EventSource("/api/v1/events");
  var names = ["agent.upsert", "agent.deleted", "agent.event", "run.updated", "message.created"];
  names.forEach(function (name) {
    source.addEventListener(name, function (message) {
      var detail = {};
      try { detail = JSON.parse(message.data); } catch (e) {}
      document.body.dispatchEvent(new CustomEvent("dispatch:live", { detail: { event: name, data: detail } }));
    });
  });
  source.addEventListener("open", function () { document.body.classList.remove("offline"); });
  source.addEventListener("error", function () { document.body.classList.add("offline"); });
})();
