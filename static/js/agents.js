// Agents pages: the parts that talk to the REST API directly (docs/agents.md#the-rest-api).
// - The launch form with a location (a linked instance) posts to POST /api/v1/agents:
//   a launch on a peer waits on that peer, so it goes through the API, not the page view.
//   Without a location the form posts to the page as before.
// - A form with data-api-action (a shadow agent's message box) posts {content} to that
//   API route (POST /api/v1/agents/<id>/messages, delivered through the outbox); the
//   message then shows with its state under Messages, live.
// Session auth: the CSRF token of the form goes in X-CSRFToken.
(function () {
  function csrf(form) {
    var field = form.querySelector("input[name=csrfmiddlewaretoken]");
    return field ? field.value : "";
  }

  function show(box, text) {
    if (!box) { window.alert(text); return; }
    box.textContent = text;
    box.hidden = !text;
  }

  async function postJSON(form, url, body) {
    var response = await fetch(url, {
      method: "POST",
      credentials: "same-origin",
      headers: { "Content-Type": "application/json", "Accept": "application/json", "X-CSRFToken": csrf(form) },
      body: JSON.stringify(body),
    });
    var data = {};
    try { data = await response.json(); } catch (e) {}
    if (!response.ok) {
      var error = (data && data.error && data.error.message) || ("the server answered " + response.status);
      throw new Error(error);
    }
    return data;
  }

  var launch = document.getElementById("launch-form");
  if (launch) {
    launch.addEventListener("submit", async function (event) {
      var location = launch.elements.location ? launch.elements.location.value : "";
      if (!location) return; // this instance: the page view launches it
      event.preventDefault();
      var box = document.getElementById("launch-error");
      var button = launch.querySelector("button[type=submit]");
      show(box, "");
      button.disabled = true;
      try {
        var agent = await postJSON(launch, "/api/v1/agents", {
          type: launch.elements.type.value,
          name: launch.elements.name.value.trim(),
          prompt: launch.elements.prompt.value,
          cwd: launch.elements.cwd.value.trim(),
          location: location,
          full_access: !!(launch.elements.full_access && launch.elements.full_access.checked),
        });
        window.location.href = "/agents/" + encodeURIComponent(agent.id) + "/";
      } catch (error) {
        show(box, "Could not launch on " + location + ": " + error.message);
        button.disabled = false;
      }
    });
  }

  document.querySelectorAll("form[data-api-action]").forEach(function (form) {
    form.addEventListener("submit", async function (event) {
      event.preventDefault();
      var box = document.getElementById("message-error");
      var button = form.querySelector("button[type=submit]");
      show(box, "");
      button.disabled = true;
      try {
        await postJSON(form, form.getAttribute("data-api-action"), { content: form.elements.content.value });
        form.reset();
        document.body.dispatchEvent(new CustomEvent("dispatch:live", { detail: { event: "message.created", data: {} } }));
      } catch (error) {
        show(box, error.message);
      } finally {
        button.disabled = false;
      }
    });
  });
})();
