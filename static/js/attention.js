// Notifications in the browser (docs/notifications.md), on every page of a logged-in user:
// - registers the service worker (/sw.js, root scope) that shows Web Push notifications;
// - on an agent's page, tells the server while the page is visible ("viewing" heartbeat
//   every 15 s by default, ended when hidden or closed), so nothing is pushed about that agent then;
// - when the user turned them on (a click, never on its own), shows the `notification`
//   frames of the live stream as browser notifications, except for the agent in view;
// - on /settings/notifications/, the buttons that ask for permission and subscribe to
//   push (PushManager.subscribe with the instance's VAPID key) or unsubscribe.
(function () {
  if (!document.querySelector("header form.logout")) return; // not logged in

  var HEARTBEAT_MS = 15000;
  var TAB_KEY = "dispatch.tab-notifications";
  var headers = { "Content-Type": "application/json" };
  try {
    var hx = JSON.parse(document.body.getAttribute("hx-headers") || "{}");
    if (hx["X-CSRFToken"]) headers["X-CSRFToken"] = hx["X-CSRFToken"];
  } catch (error) {}

  function api(method, path, body, keepalive) {
    return fetch("/api/v1/notifications/" + path, {
      method: method, headers: headers, credentials: "same-origin", keepalive: !!keepalive,
      body: body === undefined ? undefined : JSON.stringify(body),
    });
  }

  // --- the service worker ----------------------------------------------------------------
  var swReady = null;
  if ("serviceWorker" in navigator && window.isSecureContext) {
    swReady = navigator.serviceWorker.register("/sw.js", { scope: "/" }).then(function () {
      return navigator.serviceWorker.ready;
    }).catch(function () { return null; });
  }

  // --- viewing heartbeat -----------------------------------------------------------------
  var match = window.location.pathname.match(/^\/agents\/([A-Za-z0-9_-]+)\/$/);
  var viewedAgent = match ? match[1] : null;
  var clientId = null;
  try {
    clientId = sessionStorage.getItem("dispatch.client-id");
    if (!clientId) {
      clientId = (window.crypto && crypto.randomUUID) ? crypto.randomUUID() : String(Math.random()).slice(2) + Date.now();
      sessionStorage.setItem("dispatch.client-id", clientId);
    }
  } catch (error) { clientId = String(Math.random()).slice(2) + Date.now(); }

  // The server says how soon to renew (a third of its time to live; 15 s by default).
  var beating = null;
  function beat() {
    beating = setTimeout(beat, HEARTBEAT_MS);
    api("POST", "viewing", { client_id: clientId, agent_id: viewedAgent }).then(function (response) {
      return response.ok ? response.json() : null;
    }).then(function (answer) {
      if (answer && answer.renew_after && beating !== null) {
        clearTimeout(beating);
        beating = setTimeout(beat, Math.max(answer.renew_after, 1) * 1000);
      }
    }).catch(function () {});
  }
  function stopViewing() {
    if (beating !== null) { clearTimeout(beating); beating = null; }
    api("POST", "viewing", { client_id: clientId, agent_id: null }, true).catch(function () {});
  }
  function followVisibility() {
    if (document.visibilityState === "visible") {
      if (beating === null) beat();
    } else if (beating !== null) {
      stopViewing();
    }
  }
  if (viewedAgent) {
    document.addEventListener("visibilitychange", followVisibility);
    window.addEventListener("pagehide", function () { if (beating !== null) stopViewing(); });
    window.addEventListener("pageshow", followVisibility);
    followVisibility();
  }

  // --- notifications in open tabs --------------------------------------------------------
  function tabNotificationsOn() {
    try { return "Notification" in window && Notification.permission === "granted" && localStorage.getItem(TAB_KEY) === "on"; }
    catch (error) { return false; }
  }
  var stream = null;
  function listen() {
    if (stream !== null || !tabNotificationsOn() || !window.EventSource) return;
    stream = new EventSource("/api/v1/events");
    stream.addEventListener("notification", function (message) {
      var data;
      try { data = JSON.parse(message.data); } catch (error) { return; }
      // The page of that agent is in front of the user: it already shows what happened.
      if (viewedAgent && data.agent_id === viewedAgent && document.visibilityState === "visible") return;
      var shown = new Notification(data.title || "Dispatch", {
        body: data.body || "", tag: data.id, icon: "/static/favicon.svg", data: { url: data.url },
      });
      shown.onclick = function () { window.focus(); if (data.url) window.location.href = data.url; shown.close(); };
    });
  }
  listen();

  // --- the settings page's buttons -------------------------------------------------------
  var state = document.querySelector("[data-notify-state]");
  if (!state) return;
  var tabButton = document.querySelector("[data-enable-tab-notifications]");
  var pushButton = document.querySelector("[data-enable-push]");
  var offButton = document.querySelector("[data-disable-push]");
  var zone = document.querySelector("[data-default-timezone]");
  if (zone && zone.value === "UTC" && window.Intl) {
    var local = Intl.DateTimeFormat().resolvedOptions().timeZone;
    if (local) zone.placeholder = local;
  }
  function say(text) { state.textContent = text; }

  function b64urlToBytes(text) {
    var padded = (text + "===".slice((text.length + 3) % 4)).replace(/-/g, "+").replace(/_/g, "/");
    var raw = atob(padded);
    var bytes = new Uint8Array(raw.length);
    for (var i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
    return bytes;
  }

  function currentSubscription() {
    if (!swReady) return Promise.resolve(null);
    return swReady.then(function (registration) { return registration ? registration.pushManager.getSubscription() : null; });
  }

  function refresh() {
    if (!("Notification" in window)) { say("This browser has no notifications (on iPhone and iPad: add Dispatch to the Home Screen first)."); return; }
    var parts = [];
    parts.push(tabNotificationsOn() ? "Open tabs show notifications." : "Open tabs do not show notifications.");
    if (!swReady) parts.push(window.isSecureContext ? "This browser has no Web Push." : "Web Push needs HTTPS (or localhost).");
    if (Notification.permission === "denied") parts.push("Notifications are blocked for this site in the browser's settings.");
    say(parts.join(" "));
    if (!swReady) { pushButton.disabled = true; return; }
    currentSubscription().then(function (subscription) {
      pushButton.hidden = !!subscription;
      offButton.hidden = !subscription;
      if (subscription) say(state.textContent + " Push is on for this device.");
    });
  }

  tabButton.addEventListener("click", function () {
    Notification.requestPermission().then(function (permission) {
      if (permission === "granted") { localStorage.setItem(TAB_KEY, "on"); listen(); }
      refresh();
    });
  });

  pushButton.addEventListener("click", function () {
    pushButton.disabled = true;
    Notification.requestPermission().then(function (permission) {
      if (permission !== "granted") throw new Error("notifications were not allowed");
      return Promise.all([swReady, api("GET", "settings").then(function (r) { return r.json(); })]);
    }).then(function (both) {
      var registration = both[0];
      if (!registration) throw new Error("the service worker did not start");
      return registration.pushManager.subscribe({ userVisibleOnly: true, applicationServerKey: b64urlToBytes(both[1].vapid_public_key) });
    }).then(function (subscription) {
      return api("POST", "push-subscriptions", subscription.toJSON());
    }).then(function (response) {
      if (!response.ok) throw new Error("the server refused the subscription (" + response.status + ")");
      refresh();
    }).catch(function (error) {
      say("Push was not enabled: " + error.message);
    }).then(function () { pushButton.disabled = false; });
  });

  offButton.addEventListener("click", function () {
    currentSubscription().then(function (subscription) {
      if (!subscription) return null;
      var endpoint = subscription.endpoint;
      return subscription.unsubscribe().then(function () { return api("DELETE", "push-subscriptions", { endpoint: endpoint }); });
    }).then(refresh);
  });

  refresh();
})();
