// kvtier's status page: fetch the live part every few seconds and put it in place.
// No libraries and no build step; the server renders everything, this only refreshes it.
"use strict";
(() => {
  const every = Number(document.body.dataset.refreshMs) || 2000;
  const patience = Math.max(2 * every, 5000); // a server that never answers is one that fails
  const stale = document.getElementById("stale");
  let busy = false;

  function say(text) {
    stale.textContent = text;
    stale.hidden = !text;
  }

  // Replace <main id="live"> with a fresh one; resolves true once it is in place.
  async function refresh() {
    if (busy) return false;
    busy = true;
    let timer;
    try {
      // bounded: without it a hung server froze the page (a controller, not
      // AbortSignal.timeout, which browsers before 2022 lack)
      const stop = new AbortController();
      timer = setTimeout(() => stop.abort(), patience);
      // origin + path, not a relative URL: a page opened at http://:KEY@host/ has the key in
      // its own URL, and fetch refuses a URL with credentials in it (the browser still sends
      // the ones it took for this origin)
      const response = await fetch(location.origin + location.pathname + "?part=main", {
        cache: "no-store",
        credentials: "same-origin",
        signal: stop.signal,
      });
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      const parsed = new DOMParser().parseFromString(await response.text(), "text/html");
      const next = parsed.getElementById("live");
      if (next === null) throw new Error("no live part in the answer");
      document.getElementById("live").replaceWith(document.adoptNode(next));
      document.body.dataset.refreshes = String(Number(document.body.dataset.refreshes) + 1);
      say("");
      return true;
    } catch (error) {
      const why = error.name === "AbortError" ? `no answer in ${patience / 1000} s` : error.message;
      say(`Not updating: ${why}. The figures below are from the time shown.`);
      return false;
    } finally {
      clearTimeout(timer);
      busy = false;
    }
  }

  window.kvtierRefresh = refresh;
  setInterval(() => {
    if (!document.hidden) refresh();
  }, every);
})();
