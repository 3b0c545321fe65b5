"""The live dashboard (`dashboard.serve=PORT`): the launcher serves the dashboard while the run goes.

Owns the listening socket (bound before training starts, so a port in use is a config error
with exit 2, not a lost dashboard), a Starlette app on uvicorn in a daemon thread, and its
clean stop at run end. The page is the dashboard's own body (`Dashboard.page`) plus a short
script that polls `/state.json` twice a second and re-fetches `/body` when the state moved, so
the file written at teardown and the live page come from one renderer. Every rank on every host
appears because the launcher's coordinator already receives what each rank reports.
Starlette and uvicorn (both arrive with mlflow) are imported only when a server starts. The
server holds at most MAX_CONNECTIONS connections: a flood of idle ones used to take every file
descriptor of the launcher and end the run.
"""

from __future__ import annotations

import logging
import math
import socket
import threading
from pathlib import Path
from typing import Any, Optional

from flodl_run.config.materialize import ConfigError
from flodl_run.config.schema import DashboardConfig
from flodl_run.config.validate import Problem
from flodl_run.contracts.summary import Summary
from flodl_run.observe.observer import Observer
from flodl_run.report.dashboard import Dashboard
from flodl_run.report.say import say

log = logging.getLogger(__name__)

POLL_MS = 500  # the page asks twice a second: every change shows within a second
STOP_WAIT_S = 5.0
MAX_CONNECTIONS = 64
"""Connections the server holds at once: a few browser tabs use one or two each. Far below the
launcher's 1,024 open files (the common limit), which the rest of the run needs."""

# Keeps the open rank tab across refreshes; says so when the server is gone (the run ended).
POLLER = """<div id="conn" class="muted"></div><script>
(function () {
  var live = document.getElementById("live"), conn = document.getElementById("conn");
  var seen = -1, polls = 0;
  function get(url) {
    return fetch(url, {cache: "no-store"}).then(function (r) {
      if (!r.ok) { throw new Error(url + ": HTTP " + r.status); }
      return r;
    });
  }
  function tick() {
    get("state.json").then(function (r) { return r.json(); }).then(function (state) {
      conn.textContent = "";
      if (state.version === seen) { return; }
      seen = state.version;
      return get("body").then(function (r) { return r.text(); }).then(function (html) {
        var open = document.querySelector("input[name=rank-tab]:checked");
        live.innerHTML = html;
        var again = open && document.getElementById(open.id);
        if (again) { again.checked = true; }
        live.setAttribute("data-polls", String(++polls));
      });
    }).catch(function () {
      conn.textContent = "not updating: the launcher's server is gone (the run ended?)";
    }).then(function () { setTimeout(tick, POLL_MS); });
  }
  setTimeout(tick, POLL_MS);
})();
</script>""".replace("POLL_MS", str(POLL_MS))


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/"


def make_app(board: Dashboard) -> Any:
    """The Starlette app: `/` the page, `/body` its body, `/state.json` the state."""
    from starlette.applications import Starlette
    from starlette.responses import HTMLResponse, JSONResponse
    from starlette.routing import Route

    headers = {"Cache-Control": "no-store"}

    def page(request: Any) -> HTMLResponse:  # sync handlers run in a worker thread, off the loop
        return HTMLResponse(board.page(POLLER), headers=headers)

    def body(request: Any) -> HTMLResponse:
        return HTMLResponse(board.body(), headers=headers)

    def state(request: Any) -> JSONResponse:
        return JSONResponse(_finite(board.state()), headers=headers)

    return Starlette(routes=[Route("/", page), Route("/body", body), Route("/state.json", state)])


def capped_protocol(max_connections: int = MAX_CONNECTIONS) -> type:
    """uvicorn's h11 protocol, holding at most `max_connections` connections: past the cap, a
    connection takes the place of the oldest one that has sent nothing yet (a browser sends
    its request as it connects: what sends nothing is a port scan or a flood), or is closed at
    once when every connection held has spoken. Said once, as a warning."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    said = []

    class CappedH11Protocol(H11Protocol):
        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            self.heard, self.opened_s, self.refused = False, self.loop.time(), False
            self.transport = transport
            if len(self.connections) >= max_connections and not self._make_room():
                self.refused = True
                transport.abort()
                return
            super().connection_made(transport)

        def _make_room(self) -> bool:
            """Close the oldest connection that has sent nothing (a request waiting unread, as
            in a batch of connections accepted at once, counts as sent); False when none."""
            if not said:
                said.append(True)
                log.warning("the live dashboard holds %d connections: it closes those that send "
                            "nothing to take new ones (a connection flood?)", max_connections)
            silent = sorted((c for c in self.connections if not getattr(c, "heard", True)),
                            key=lambda c: c.opened_s)
            for oldest in silent:
                if _waiting(oldest.transport):
                    oldest.heard = True
                    continue
                self.connections.discard(oldest)  # counted out now: it closes on the next turn
                oldest.transport.abort()
                return True
            return False

        def data_received(self, data: bytes) -> None:
            self.heard = True
            super().data_received(data)

        def connection_lost(self, exc: Optional[Exception]) -> None:
            if not self.refused:
                super().connection_lost(exc)

    return CappedH11Protocol


def _waiting(transport: Any) -> bool:
    """Whether bytes the peer sent wait unread on the transport's socket (peeked, not taken)."""
    fd = transport.get_extra_info("socket").fileno()
    if fd < 0:
        return False
    sock = socket.socket(fileno=fd)  # the transport's own descriptor: detached below, not closed
    try:
        return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except OSError:  # nothing yet (EAGAIN), or a reset: either way nothing to answer
        return False
    finally:
        sock.detach()


class LiveServer(Observer):
    """uvicorn serving `make_app(board)` on a socket bound up front, in a daemon thread. An
    output of the run: `finish` (after the dashboard's own) stops it."""

    output = "the live dashboard"

    def __init__(self, sock: socket.socket):
        self.sock, self.url = sock, url_of(sock)
        self._server: Any = None
        self._thread: Optional[threading.Thread] = None

    @classmethod
    def bind(cls, dashboard: DashboardConfig) -> "LiveServer":
        """Listen on `dashboard.host`:`dashboard.serve` now. Raises ConfigError naming the key
        when the address cannot be bound (port in use, address not on this host)."""
        port, host = dashboard.serve, dashboard.host
        try:
            family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        except OSError as exc:
            raise ConfigError([Problem("dashboard.host", host,
                                       f"must be an address of this host ({exc})")]) from None
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a previous run's TIME_WAIT
            sock.bind(address)
            sock.listen(64)
        except OSError as exc:
            sock.close()
            raise ConfigError([Problem("dashboard.serve", port, f"must be a port free on {host} "
                                       f"({exc.strerror or exc})")]) from None
        return cls(sock)

    def start(self, board: Dashboard, console: Any = None) -> "LiveServer":
        """Serve `board` from a daemon thread; says the URL once on `console`."""
        import uvicorn

        config = uvicorn.Config(make_app(board), log_level="warning", lifespan="off",
                                access_log=False, timeout_graceful_shutdown=1,
                                http=capped_protocol(), backlog=MAX_CONNECTIONS)
        # backlog: asyncio listens again with it and accepts up to that many in one go, each a
        # descriptor before any is seen; uvicorn's 2,048 took them all in a flood (EMFILE)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self.sock]},
                                        name="flodl_run-dashboard", daemon=True)
        self._thread.start()
        if console is not None:
            say(console, f"dashboard: {self.url} (live while the run goes)")
        return self

    def stop(self) -> None:
        """Stop serving and close the socket: the port is free again when this returns."""
        if self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=STOP_WAIT_S)
        self.sock.close()

    def finish(self, summary: Summary, run_dir: Path) -> None:
        self.stop()


def _finite(value: Any) -> Any:
    """JSON has no NaN/inf: such floats become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
