// The Machines page's live panels (docs/live-operations.md#the-machines-page): run a command on one machine, several
// or all of the session's (the output arrives as it is printed, each line labelled by its
// machine when several run it), cancel it, see each machine's result; the operations in
// flight, each with Cancel; a copy between machines with a progress bar.
//
// It speaks the REST routes with the page's session cookie and CSRF token:
//   POST <ops>                      {op, payload, stream: true, request_id, target_machine(s)}
//                                   → text/event-stream: started, output, result | error, done
//   POST <ops>/<request_id>/cancel  → 202
//   GET  <ops>                      → {operations: [...]}
//   POST <copy>                     {..., stream: true, request_id} → progress, result | error
// The server's output is untrusted text: it only ever reaches the page as textContent.
(function () {
  "use strict";
  var root = document.getElementById("live-operations");
  if (!root || !window.fetch || !window.TextDecoder) return;

  var OPS_URL = root.getAttribute("data-ops-url");
  var COPY_URL = root.getAttribute("data-copy-url");
  var MACHINES_URL = root.getAttribute("data-machines-url");
  var CSRF = (root.querySelector("input[name=csrfmiddlewaretoken]") || {}).value || "";
  var REFRESH = 3000; // ms between two looks at the operations in flight and the machines
  var MAX_LINES = 5000; // lines kept in the output pane (the oldest go first)

  function byId(id) { return document.getElementById(id); }

  function newRequestId() {
    if (window.crypto && crypto.randomUUID) return crypto.randomUUID();
    // crypto.randomUUID needs a secure context; plain http on a LAN address has only this.
    var bytes = crypto.getRandomValues(new Uint8Array(16));
    bytes[6] = (bytes[6] & 0x0f) | 0x40;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    var hex = Array.prototype.map.call(bytes, function (b) { return (b + 0x100).toString(16).slice(1); }).join("");
    return hex.slice(0, 8) + "-" + hex.slice(8, 12) + "-" + hex.slice(12, 16) + "-" + hex.slice(16, 20) + "-" + hex.slice(20);
  }

  function post(url, body, signal) {
    return fetch(url, {
      method: "POST",
      credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-CSRFToken": CSRF, "Accept": "text/event-stream, application/json" },
      body: JSON.stringify(body),
      signal: signal,
    });
  }

  function cancelUrl(requestId) { return OPS_URL + "/" + encodeURIComponent(requestId) + "/cancel"; }

  // "CODE: message" of a JSON error answer, or the HTTP status.
  async function errorOf(response) {
    try {
      var body = await response.json();
      if (body && body.error) return body.error.code + ": " + body.error.message;
    } catch (e) { /* not JSON */ }
    return "HTTP " + response.status + " " + response.statusText;
  }

  function isEventStream(response) {
    return (response.headers.get("Content-Type") || "").indexOf("text/event-stream") === 0;
  }

  // Read a text/event-stream body, calling onEvent(name, data) per event (data parsed as JSON).
  async function readEvents(response, onEvent) {
    var reader = response.body.getReader();
    var decoder = new TextDecoder();
    var buffer = "", name = "", data = [];
    function line(text) {
      if (text === "") {
        if (data.length) {
          var parsed = null;
          try { parsed = JSON.parse(data.join("\n")); } catch (e) { parsed = null; }
          if (parsed !== null) onEvent(name || "message", parsed);
        }
        name = ""; data = [];
        return;
      }
      if (text.charAt(0) === ":") return; // a keep-alive comment
      var colon = text.indexOf(":");
      var field = colon < 0 ? text : text.slice(0, colon);
      var value = colon < 0 ? "" : text.slice(colon + 1);
      if (value.charAt(0) === " ") value = value.slice(1);
      if (field === "event") name = value;
      else if (field === "data") data.push(value);
    }
    for (;;) {
      var chunk = await reader.read();
      if (chunk.done) break;
      buffer += decoder.decode(chunk.value, { stream: true });
      var lines = buffer.split("\n");
      buffer = lines.pop();
      lines.forEach(function (text) { line(text.replace(/\r$/, "")); });
    }
    buffer += decoder.decode();
    if (buffer) line(buffer.replace(/\r$/, ""));
    line("");
  }

  function decodeData(event) {
    if (event.encoding !== "base64") return event.data || "";
    var raw = atob(event.data || "");
    var bytes = new Uint8Array(raw.length);
    for (var i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
    return new TextDecoder().decode(bytes);
  }

  function setStatus(element, text, state) {
    element.textContent = text;
    element.className = "run-status" + (state ? " " + state : "");
  }

  function showError(element, text) {
    element.textContent = text || "";
    element.hidden = !text;
  }

  // --- the Run panel -----------------------------------------------------------------------

  var form = byId("run-form");
  var startButton = byId("run-start");
  var cancelButton = byId("run-cancel");
  var statusLine = byId("run-status");
  var errorLine = byId("run-error");
  var output = byId("run-output");
  var results = byId("run-results");
  var allBox = byId("run-all");
  var current = null; // the run in progress: {requestId, controller, labelled, partial, names, cancelling}

  function chosenTargets() {
    if (allBox.checked) return "*";
    var boxes = form.querySelectorAll("input[name=machine]:checked:not(:disabled)");
    return Array.prototype.map.call(boxes, function (box) { return box.value; });
  }

  // "every attached machine" ticks (and locks) every machine with a shell; unticking it
  // clears them all, so what is ticked afterwards is exactly what the user picks.
  allBox.addEventListener("change", function () {
    form.querySelectorAll("input[name=machine]").forEach(function (box) {
      if (box.hasAttribute("data-no-shell")) return;
      box.disabled = allBox.checked;
      box.checked = allBox.checked;
    });
  });

  function appendLine(run, machineId, stream, text) {
    var atBottom = output.scrollTop + output.clientHeight >= output.scrollHeight - 4;
    var row = document.createElement("span");
    row.className = "run-line " + stream;
    row.setAttribute("data-machine", machineId || "");
    if (run.labelled) {
      var label = document.createElement("span");
      label.className = "run-machine";
      label.textContent = "[" + (run.names[machineId] || machineId || "?") + "] ";
      row.appendChild(label);
    }
    row.appendChild(document.createTextNode(text + "\n"));
    output.appendChild(row);
    while (output.childNodes.length > MAX_LINES) output.removeChild(output.firstChild);
    if (atBottom) output.scrollTop = output.scrollHeight;
  }

  // Output arrives in chunks that do not follow lines: keep each (machine, stream)'s
  // unfinished line until its newline (or the end of the operation).
  function addOutput(run, event) {
    var key = (event.machine_id || "") + "\u0000" + event.stream;
    var pieces = ((run.partial[key] || "") + decodeData(event)).split("\n");
    run.partial[key] = pieces.pop();
    pieces.forEach(function (text) { appendLine(run, event.machine_id, event.stream, text.replace(/\r$/, "")); });
  }

  function flushOutput(run, machineId) {
    Object.keys(run.partial).forEach(function (key) {
      var parts = key.split("\u0000");
      if (machineId !== undefined && parts[0] !== (machineId || "")) return;
      if (run.partial[key]) appendLine(run, parts[0], parts[1], run.partial[key]);
      delete run.partial[key];
    });
  }

  function addResult(run, machineId, name, exitCode, text, failed) {
    run.finished += 1;
    var row = document.createElement("tr");
    row.setAttribute("data-machine", machineId || "");
    [name || machineId || "—", exitCode === null || exitCode === undefined ? "—" : String(exitCode), text].forEach(
      function (value, index) {
        var cell = document.createElement("td");
        cell.textContent = value;
        if (index === 0) cell.className = "result-machine";
        if (index === 1) cell.className = "exit-code" + (failed ? " exit-failed" : "");
        if (index === 2) cell.className = "result-text" + (failed ? " op-error" : "");
        row.appendChild(cell);
      }
    );
    results.querySelector("tbody").appendChild(row);
    results.hidden = false;
  }

  function onRunEvent(run, name, event) {
    if (name === "started") {
      run.names[event.machine_id] = event.name || event.machine_id;
      run.started += 1;
      setStatus(statusLine, "Running on " + Object.keys(run.names).map(function (id) { return run.names[id]; }).join(", ") + "…", "running");
    } else if (name === "output") {
      if (event.name) run.names[event.machine_id] = event.name;
      addOutput(run, event);
    } else if (name === "result") {
      flushOutput(run, event.machine_id);
      var payload = event.payload || {};
      var words = [];
      if (payload.cancelled) { words.push("cancelled"); run.cancelled = true; }
      if (payload.timed_out) words.push("timed out");
      if (payload.stream_truncated || payload.output_truncated) words.push("output cut");
      if (!words.length) words.push(payload.exit_code === 0 ? "ok" : "failed");
      addResult(run, event.machine_id, event.name || run.names[event.machine_id], payload.exit_code, words.join(", "),
        payload.exit_code !== 0);
    } else if (name === "error") {
      flushOutput(run, event.machine_id);
      if (event.code === "CANCELLED") run.cancelled = true;
      run.failed = true;
      addResult(run, event.machine_id, event.name || run.names[event.machine_id], null,
        event.code + ": " + event.message, true);
    } else if (name === "done") {
      run.done = true;
    }
  }

  function runFinished(run, problem) {
    flushOutput(run);
    current = null;
    startButton.disabled = false;
    cancelButton.disabled = true;
    if (problem) {
      setStatus(statusLine, run.cancelled ? "Cancelled" : "Stopped", run.cancelled ? "cancelled" : "failed");
      showError(errorLine, problem);
    } else if (run.cancelled) {
      setStatus(statusLine, "Cancelled", "cancelled");
    } else if (run.finished === 0) {
      setStatus(statusLine, "Stopped", "failed");
      showError(errorLine, "The stream ended before any result: the server or the connection went away.");
    } else {
      setStatus(statusLine, run.failed ? "Finished, with errors" : "Finished", run.failed ? "failed" : "finished");
    }
    refreshOperations();
  }

  form.addEventListener("submit", async function (event) {
    event.preventDefault();
    if (current) return;
    var command = byId("run-command").value;
    var targets = chosenTargets();
    showError(errorLine, "");
    if (!command.trim()) { showError(errorLine, "Type a command to run."); return; }
    if (targets !== "*" && targets.length === 0) { showError(errorLine, "Choose a machine (or every attached machine)."); return; }
    var payload = { command: command };
    var cwd = byId("run-cwd").value.trim();
    if (cwd) payload.cwd = cwd;
    var run = {
      requestId: newRequestId(),
      controller: new AbortController(),
      labelled: targets === "*" || targets.length > 1,
      partial: {}, names: {}, started: 0, finished: 0, cancelled: false, failed: false, done: false,
    };
    var body = { op: "EXECUTE_COMMAND", payload: payload, stream: true, request_id: run.requestId };
    if (targets === "*" || targets.length > 1) body.target_machines = targets;
    else body.target_machine = targets[0];
    current = run;
    root.setAttribute("data-request-id", run.requestId);
    output.textContent = "";
    output.hidden = false;
    results.querySelector("tbody").textContent = "";
    results.hidden = true;
    startButton.disabled = true;
    cancelButton.disabled = false;
    setStatus(statusLine, "Starting…", "running");
    var problem = "";
    try {
      var response = await post(OPS_URL, body, run.controller.signal);
      if (!response.ok || !isEventStream(response)) {
        problem = response.ok ? "The server did not answer with a stream." : await errorOf(response);
      } else {
        setTimeout(refreshOperations, 300);
        await readEvents(response, function (name, data) { onRunEvent(run, name, data); });
      }
    } catch (error) {
      if (error && error.name === "AbortError") run.cancelled = true;
      else problem = "The connection to the server failed: " + error;
    }
    runFinished(run, problem);
  });

  cancelButton.addEventListener("click", async function () {
    var run = current;
    if (!run || run.cancelling) return;
    run.cancelling = true;
    cancelButton.disabled = true;
    setStatus(statusLine, "Cancelling…", "running");
    try {
      var response = await post(cancelUrl(run.requestId), {});
      if (response.status === 404 && current === run) {
        // Not (or no longer) in flight: closing the stream cancels whatever is left.
        run.controller.abort();
      } else if (!response.ok) {
        showError(errorLine, "Cancel refused: " + (await errorOf(response)));
        run.cancelling = false;
        cancelButton.disabled = current !== run;
      }
    } catch (error) {
      run.controller.abort();
    }
  });

  // --- machines attached to the session, refreshed --------------------------------------------

  function targetLabel(machine) {
    var label = document.createElement("label");
    label.className = "check run-target";
    label.setAttribute("data-target", machine.machine_id);
    var box = document.createElement("input");
    box.type = "checkbox";
    box.name = "machine";
    box.value = machine.machine_id;
    box.setAttribute("data-name", machine.display_name);
    var shell = (machine.capabilities || []).indexOf("shell") >= 0;
    if (!shell) { box.disabled = true; box.setAttribute("data-no-shell", ""); }
    else if (allBox.checked) box.disabled = true;
    label.appendChild(box);
    label.appendChild(document.createTextNode(" " + machine.display_name));
    if (!shell) {
      var hint = document.createElement("small");
      hint.className = "hint";
      hint.textContent = " (no shell)";
      label.appendChild(hint);
    }
    return label;
  }

  function fillMachineSelect(select, machines) {
    var chosen = select.value;
    select.textContent = "";
    machines.forEach(function (machine) {
      if ((machine.capabilities || []).indexOf("files") < 0) return;
      var option = document.createElement("option");
      option.value = machine.machine_id;
      option.textContent = machine.display_name;
      select.appendChild(option);
    });
    if (chosen) select.value = chosen;
  }

  var knownMachines = Array.prototype.map.call(
    form.querySelectorAll("input[name=machine]"), function (box) { return box.value; }
  ).sort().join(" ");
  form.querySelectorAll("input[name=machine]:disabled").forEach(function (box) { box.setAttribute("data-no-shell", ""); });

  async function refreshMachines() {
    var response = await fetch(MACHINES_URL, { credentials: "same-origin", headers: { "Accept": "application/json" } });
    if (!response.ok) return;
    var machines = ((await response.json()) || {}).machines || [];
    var ids = machines.map(function (machine) { return machine.machine_id; }).sort().join(" ");
    if (ids === knownMachines) return; // only a change of the set rebuilds the choices
    knownMachines = ids;
    var list = byId("run-target-list");
    var checked = {};
    list.querySelectorAll("input:checked").forEach(function (box) { checked[box.value] = true; });
    list.textContent = "";
    machines.forEach(function (machine) {
      var label = targetLabel(machine);
      if (checked[machine.machine_id]) label.querySelector("input").checked = true;
      list.appendChild(label);
    });
    byId("run-no-machines").hidden = machines.length > 0;
    byId("run-all-label").hidden = machines.length === 0;
    fillMachineSelect(byId("copy-source-machine"), machines);
    fillMachineSelect(byId("copy-destination-machine"), machines);
  }

  // --- operations in flight -------------------------------------------------------------------

  var opsTable = byId("ops-table");
  var opsEmpty = byId("ops-empty");
  var opsError = byId("ops-error");
  var shownOperations = null;

  function cell(row, text, className) {
    var td = document.createElement("td");
    td.textContent = text;
    if (className) td.className = className;
    row.appendChild(td);
    return td;
  }

  function renderOperations(operations) {
    var body = opsTable.querySelector("tbody");
    body.textContent = "";
    operations.forEach(function (operation) {
      var row = document.createElement("tr");
      row.setAttribute("data-request-id", operation.request_id);
      var started = new Date(operation.started_at);
      cell(row, isNaN(started) ? String(operation.started_at || "") : started.toLocaleTimeString([], {hour: "2-digit", minute: "2-digit", second: "2-digit", hour12: false}));
      cell(row, operation.kind || operation.op || "");
      cell(row, (operation.machines || operation.machine_ids || []).join(", "));
      cell(row, operation.summary || "", "op-summary");
      cell(row, operation.caller || "");
      var actions = cell(row, "", "actions");
      var button = document.createElement("button");
      button.type = "button";
      button.className = "danger op-cancel";
      button.textContent = "Cancel";
      button.setAttribute("data-request-id", operation.request_id);
      button.setAttribute("aria-label", "Cancel " + (operation.summary || operation.request_id));
      actions.appendChild(button);
      body.appendChild(row);
    });
    opsTable.hidden = operations.length === 0;
    opsEmpty.hidden = operations.length > 0;
  }

  var refreshing = false;
  async function refreshOperations() {
    if (refreshing) return;
    refreshing = true;
    try {
      var response = await fetch(OPS_URL, { credentials: "same-origin", headers: { "Accept": "application/json" } });
      if (!response.ok) { showError(opsError, "Cannot list the operations in flight: " + (await errorOf(response))); return; }
      var operations = ((await response.json()) || {}).operations || [];
      showError(opsError, "");
      var text = JSON.stringify(operations);
      if (text === shownOperations) return; // unchanged: leave the buttons (and their focus) alone
      shownOperations = text;
      renderOperations(operations);
    } catch (error) {
      showError(opsError, "Cannot reach the server to list the operations in flight.");
    } finally {
      refreshing = false;
    }
  }

  opsTable.addEventListener("click", async function (event) {
    var button = event.target.closest("button.op-cancel");
    if (!button) return;
    button.disabled = true;
    button.textContent = "Cancelling…";
    try {
      var response = await post(cancelUrl(button.getAttribute("data-request-id")), {});
      if (!response.ok && response.status !== 404) {
        showError(opsError, "Cancel refused: " + (await errorOf(response)));
        button.disabled = false;
        button.textContent = "Cancel";
      }
    } catch (error) {
      showError(opsError, "Cannot reach the server to cancel.");
      button.disabled = false;
      button.textContent = "Cancel";
    }
    setTimeout(refreshOperations, 500);
  });

  function tick() {
    if (document.hidden) return;
    refreshOperations();
    refreshMachines().catch(function () { /* the operations line says when the server is away */ });
  }
  tick();
  setInterval(tick, REFRESH);
  document.addEventListener("visibilitychange", tick);

  // --- copy with a progress bar ----------------------------------------------------------------

  var copyForm = byId("copy-form");
  var copyStart = byId("copy-start");
  var copyCancel = byId("copy-cancel");
  var copyStatus = byId("copy-status");
  var copyError = byId("copy-error");
  var copyProgress = byId("copy-progress");
  var copying = null;

  function size(bytes) {
    var units = ["bytes", "KiB", "MiB", "GiB", "TiB"];
    var value = Number(bytes) || 0, unit = 0;
    while (value >= 1024 && unit < units.length - 1) { value /= 1024; unit += 1; }
    return (unit ? value.toFixed(1) : String(value)) + " " + units[unit];
  }

  copyForm.addEventListener("submit", async function (event) {
    event.preventDefault();
    if (copying) return;
    showError(copyError, "");
    var copy = { requestId: newRequestId(), controller: new AbortController(), result: null, error: null };
    var body = {
      source_machine: byId("copy-source-machine").value,
      source_path: byId("copy-source-path").value,
      destination_machine: byId("copy-destination-machine").value,
      destination_path: byId("copy-destination-path").value,
      overwrite: byId("copy-overwrite").checked,
      stream: true,
      request_id: copy.requestId,
    };
    copying = copy;
    copyStart.disabled = true;
    copyCancel.disabled = false;
    copyProgress.hidden = false;
    copyProgress.removeAttribute("value"); // indeterminate until the first progress event
    setStatus(copyStatus, "Starting…", "running");
    try {
      var response = await post(COPY_URL, body, copy.controller.signal);
      if (!response.ok || !isEventStream(response)) {
        copy.error = response.ok ? "The server did not answer with a stream." : await errorOf(response);
      } else {
        setTimeout(refreshOperations, 300);
        await readEvents(response, function (name, data) {
          if (name === "progress") {
            var total = Number(data.bytes_total) || 0, done = Number(data.bytes_done) || 0;
            if (total > 0) { copyProgress.max = total; copyProgress.value = Math.min(done, total); }
            setStatus(copyStatus, "Copied " + size(done) + (total > 0 ? " of " + size(total) : "") + "…", "running");
          } else if (name === "result") {
            copy.result = data.payload || data;
          } else if (name === "error") {
            copy.error = data.code + ": " + data.message;
          }
        });
      }
    } catch (error) {
      copy.error = error && error.name === "AbortError" ? "CANCELLED: the copy was cancelled" : "The connection to the server failed: " + error;
    }
    copying = null;
    copyStart.disabled = false;
    copyCancel.disabled = true;
    if (copy.result && !copy.error) {
      copyProgress.max = 1;
      copyProgress.value = 1;
      setStatus(copyStatus, "Copied " + size(copy.result.size_bytes) + (copy.result.sha256 ? ", SHA-256 " + copy.result.sha256 : ""), "finished");
    } else {
      copyProgress.hidden = true;
      var cancelled = /^CANCELLED/.test(copy.error || "");
      setStatus(copyStatus, cancelled ? "Cancelled" : "Failed", cancelled ? "cancelled" : "failed");
      if (!cancelled) showError(copyError, copy.error || "The stream ended before the result.");
    }
    refreshOperations();
  });

  copyCancel.addEventListener("click", async function () {
    var copy = copying;
    if (!copy) return;
    copyCancel.disabled = true;
    setStatus(copyStatus, "Cancelling…", "running");
    try {
      var response = await post(cancelUrl(copy.requestId), {});
      if (response.status === 404) copy.controller.abort();
      else if (!response.ok) showError(copyError, "Cancel refused: " + (await errorOf(response)));
    } catch (error) {
      copy.controller.abort();
    }
  });
})();
