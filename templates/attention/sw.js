// Dispatch's service worker (docs/notifications.md#web-push), served at /sw.js so its
// scope is the whole site. It shows each push (a JSON {id, kind, title, body, url,
// agent_id}) as a notification and opens its URL when the notification is clicked.
// Answering an approval still needs a login: the link opens the page, nothing more.
self.addEventListener("install", function () { self.skipWaiting(); });
self.addEventListener("activate", function (event) { event.waitUntil(self.clients.claim()); });

self.addEventListener("push", function (event) {
  var data = {};
  try { data = event.data ? event.data.json() : {}; } catch (error) { data = { body: event.data ? event.data.text() : "" }; }
  var options = {
    body: data.body || "",
    icon: "/static/favicon.svg",
    badge: "/static/favicon.svg",
    data: { url: data.url || "/" },
    // The same tag as the open tab's own notification: one notification, not two.
    tag: data.id || undefined,
    requireInteraction: data.kind === "approval",
  };
  event.waitUntil(self.registration.showNotification(data.title || "Dispatch", options));
});

self.addEventListener("notificationclick", function (event) {
  event.notification.close();
  var url = (event.notification.data && event.notification.data.url) || "/";
  event.waitUntil(self.clients.matchAll({ type: "window", includeUncontrolled: true }).then(function (windows) {
    for (var i = 0; i < windows.length; i++) {
      if (windows[i].url === url && "focus" in windows[i]) return windows[i].focus();
    }
    return self.clients.openWindow(url);
  }));
});
