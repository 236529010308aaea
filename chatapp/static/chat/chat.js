// Streams replies into the page over Server-Sent Events, and sends on Enter.
// A reply element carries its event URL and the last stream entry already shown
// (data-after), so a reload or a dropped connection resumes without losing or
// repeating text (EventSource resends the last id it saw when it reconnects).
(function () {
  "use strict";

  function follow(reply) {
    if (reply.dataset.following) return;
    reply.dataset.following = "1";
    var text = reply.querySelector(".text");
    var status = reply.querySelector(".status");
    var source = new EventSource(reply.dataset.events + "?after=" + encodeURIComponent(reply.dataset.after));
    function finish() {
      source.close();
      document.body.dataset.lastStreamed = text.textContent;  // what the stream showed, for checking
      htmx.ajax("GET", reply.dataset.final, { target: reply, swap: "outerHTML" });
    }
    function showStored() {
      // The server refused the stream (its live updates are down): show what is stored, which follows
      // the stream again if the reply is still being written.
      source.close();
      setTimeout(function () { htmx.ajax("GET", reply.dataset.final, { target: reply, swap: "outerHTML" }); }, 2000);
    }
    source.addEventListener("start", function (e) {
      var event = JSON.parse(e.data);
      if (event.attempt > 0) text.textContent = "";  // sent again to another node: its reply starts over
      if (status) status.textContent = "";
    });
    source.addEventListener("token", function (e) {
      text.textContent += JSON.parse(e.data).text;
      if (status) status.textContent = "";
    });
    source.addEventListener("done", finish);
    source.addEventListener("error", function (e) {
      if (e.data) finish();  // the turn failed
      else if (source.readyState === EventSource.CLOSED) showStored();  // refused: not reconnecting
      // otherwise a dropped connection: EventSource reconnects and resumes by itself
    });
  }

  function sendOnEnter(event) {
    var box = event.target;
    if (box.name !== "text" || event.key !== "Enter" || event.shiftKey || event.isComposing) return;
    event.preventDefault();
    if (!box.disabled && box.value.trim()) box.form.requestSubmit();
  }

  function highlightDropped(event) {
    var inspector = event.target;
    if (!inspector.matches || !inspector.matches("details.inspector")) return;
    (inspector.dataset.dropped || "").split(",").filter(Boolean).forEach(function (id) {
      var message = document.getElementById("message-" + id);
      if (message) message.classList.toggle("dropped", inspector.open);
    });
  }

  function start(root) {
    if (root.matches && root.matches("[data-events]")) follow(root);  // htmx passes each swapped element
    root.querySelectorAll("[data-events]").forEach(follow);
    var box = document.querySelector("#composer textarea");
    if (box && !box.disabled) box.focus();
  }

  document.addEventListener("keydown", sendOnEnter);
  document.addEventListener("toggle", highlightDropped, true);
  htmx.onLoad(start);
})();
