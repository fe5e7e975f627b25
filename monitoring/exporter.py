"""HTTP endpoint of a peer: `GET /metrics` (Prometheus text format) and `GET /healthz`, plus any extra
pages it is given (the monitor's swarm page).

It serves one given `CollectorRegistry` (never prometheus_client's global one) from a
daemon thread, so a stuck scrape can never keep the process alive or block training.
It must not compute metrics or decide health itself: it renders the registry, asks
the health callable it was given, and serves what each extra route returns.
"""
from __future__ import annotations

import errno
import logging
import socket
import socketserver
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Dict, Optional, Tuple

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from monitoring.health import PAUSED_PREFIX, HealthCheck

__all__ = ["HealthCheck", "HealthFn", "MetricsExporter", "MetricsBindError"]

logger = logging.getLogger(__name__)

HealthFn = Callable[[], Tuple[bool, str]]
"""Returns (ok, reason); `/healthz` answers 200 "ok" when ok (with the reason when it says the peer is paused), else 503
with the reason."""

Route = Callable[[], Tuple[bytes, str]]
"""An extra page: returns (body, content type), called on every GET of its path."""

STOP_TIMEOUT_SECONDS = 5.0


class MetricsBindError(OSError):
    """The metrics endpoint cannot listen where it was told: the port is taken (by another process, or another
    peer on this machine), the host is not an address of this machine, or the port needs privileges."""


def check_can_listen(host: str, port: int) -> None:
    """Bind host:port for a moment as MetricsExporter.start() does (address reuse on), so that a peer can say
    before it builds anything that its endpoint cannot listen there.

    :raises MetricsBindError: why not, in one line (its strerror), with the fix
    """
    _bind(host, port).server_close()


def _bind(host: str, port: int) -> ThreadingHTTPServer:
    """A server bound to host:port and listening; raises MetricsBindError with why not."""
    server_class = _Server6 if ":" in host else _Server
    try:
        return server_class((host, port), _Handler)
    except OSError as e:
        raise MetricsBindError(e.errno, _why_not(host, port, e)) from e


def _why_not(host: str, port: int, error: OSError) -> str:
    if error.errno == errno.EADDRINUSE:
        return (f"metrics port {port} on {host} is already in use; choose another port with "
                f"--metrics-port, or --metrics-port 0 to pick a free one")
    if error.errno == errno.EADDRNOTAVAIL:
        return (f"--metrics-host {host} is not an address of this machine; use 0.0.0.0 (every interface), "
                f"127.0.0.1 (this machine only) or one of its own addresses")
    if error.errno == errno.EACCES:
        return (f"metrics port {port} needs root (ports below 1024 are privileged); choose a port above 1023 "
                f"with --metrics-port")
    return (f"cannot serve metrics on {host}:{port} ({error.strerror or error}); "
            f"fix --metrics-host / --metrics-port, or --metrics-port off")


def _always_healthy() -> Tuple[bool, str]:
    return True, "ok"


class MetricsExporter:
    """Serves /metrics and /healthz on host:port from a daemon thread; port 0 picks a free port."""

    def __init__(
        self,
        registry: CollectorRegistry,
        port: int,
        host: str = "0.0.0.0",
        health: Optional[HealthFn] = None,
        routes: Optional[Dict[str, Route]] = None,
    ) -> None:
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"metrics port must be an integer in 0..65535, 0 for any free port (got {port!r})")
        self.registry = registry
        self.port = port
        self.host = host
        self.health: HealthFn = health if health is not None else _always_healthy
        self.routes: Dict[str, Route] = dict(routes or {})
        self._server: Optional[ThreadingHTTPServer] = None
        self._thread: Optional[threading.Thread] = None

    def start(self) -> int:
        """Bind and start serving; returns the bound port. Raises MetricsBindError if it cannot listen there."""
        if self._server is not None:
            raise RuntimeError("metrics exporter is already started")
        server = _bind(self.host, self.port)
        server.exporter = self
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.5}, name="metrics-exporter", daemon=True
        )
        self._thread.start()
        bound_port = server.server_address[1]
        logger.info("serving /metrics and /healthz on http://%s:%d", self.host, bound_port)
        return bound_port

    @property
    def bound_port(self) -> Optional[int]:
        return self._server.server_address[1] if self._server is not None else None

    def stop(self, timeout_seconds: float = STOP_TIMEOUT_SECONDS) -> None:
        """Stop serving and close the socket, waiting at most about `timeout_seconds`. Safe to call twice."""
        server, thread = self._server, self._thread
        if server is None or thread is None:
            return
        self._server = self._thread = None
        # BaseServer.shutdown() waits with no timeout; run it aside so this join stays bounded.
        stopper = threading.Thread(target=server.shutdown, name="metrics-exporter-stop", daemon=True)
        stopper.start()
        stopper.join(timeout_seconds)
        thread.join(timeout_seconds)
        server.server_close()
        if thread.is_alive():
            logger.warning("metrics exporter thread did not stop within %.0fs; leaving it (daemon)", timeout_seconds)

    def __enter__(self) -> "MetricsExporter":
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a slow scraper must never keep the process alive
    exporter: MetricsExporter

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves the host's FQDN, which can stall for seconds without DNS.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = 10  # seconds a client may take to send its request

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        path, exporter = self.path.split("?", 1)[0], self.server.exporter
        if path == "/healthz":
            self._healthz()
        elif path == "/metrics":
            self._render(path, lambda: (generate_latest(exporter.registry), CONTENT_TYPE_LATEST))
        elif path in exporter.routes:
            self._render(path, exporter.routes[path])
        else:
            paths = ", ".join(["/metrics", "/healthz", *exporter.routes])
            self._reply(404, f"not found; try {paths}\n".encode())

    def _render(self, path: str, route: Route) -> None:
        try:
            body, content_type = route()
        except Exception as e:  # a broken collector or page must not kill the endpoint
            logger.exception("rendering %s failed", path)
            self._reply(500, f"rendering {path} failed: {type(e).__name__}\n".encode())
            return
        self._reply(200, body, content_type)

    def _healthz(self) -> None:
        try:
            ok, reason = self.server.exporter.health()
        except Exception as e:
            ok, reason = False, f"health check failed: {type(e).__name__}: {e}"
        if ok and reason.startswith(PAUSED_PREFIX):  # healthy, and a person reading the body learns why it is idle
            self._reply(200, f"ok: {' '.join(reason.split())}\n".encode())
        elif ok:
            self._reply(200, b"ok\n")
        else:
            line = " ".join(str(reason).split()) or "unhealthy"
            self._reply(503, (line + "\n").encode())

    def _reply(self, status: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (http.server's signature)
        logger.debug("%s %s", self.address_string(), format % args)
