"""A small HTTP server in the nursery: /metrics, /healthz (liveness), /readyz."""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

_MAX_REQUEST = 8192

Route = Callable[[], tuple[int, str, bytes]]


def response(status: int, content_type: str, body: bytes) -> bytes:
    reason = {
        200: "OK",
        404: "Not Found",
        405: "Method Not Allowed",
        503: "Service Unavailable",
        400: "Bad Request",
    }.get(status, "")
    head = (
        f"HTTP/1.1 {status} {reason}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


def parse_request_line(data: bytes) -> tuple[str, str] | None:
    line = data.split(b"\r\n", 1)[0].decode("latin-1")
    parts = line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        return None
    return parts[0], parts[1].split("?", 1)[0]


class HttpServer:
    def __init__(self, routes: dict[str, Route]) -> None:
        self._routes = routes

    def answer(self, method: str, path: str) -> bytes:
        route = self._routes.get(path)
        if route is None:
            return response(404, "text/plain", b"not found\n")
        if method not in ("GET", "HEAD"):
            return response(405, "text/plain", b"GET only\n")
        status, content_type, body = route()
        return response(status, content_type, b"" if method == "HEAD" else body)

    async def handle(self, stream: trio.SocketStream) -> None:
        try:
            data = b""
            with trio.move_on_after(5):
                while b"\r\n\r\n" not in data and len(data) < _MAX_REQUEST:
                    chunk = await stream.receive_some(4096)
                    if not chunk:
                        break
                    data += chunk
            request = parse_request_line(data)
            if request is None:
                reply = response(400, "text/plain", b"bad request\n")
            else:
                reply = self.answer(*request)
            with trio.move_on_after(5):
                await stream.send_all(reply)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            await stream.aclose()

    async def serve(
        self, host: str, port: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
    ) -> None:
        listeners = await trio.open_tcp_listeners(port, host=host)
        bound = listeners[0].socket.getsockname()[1]
        log.info("metrics and health on http://%s:%d/metrics", host, bound)
        task_status.started(bound)
        await trio.serve_listeners(self.handle, listeners)


def metrics_route(registry: CollectorRegistry) -> Route:
    def route() -> tuple[int, str, bytes]:
        return 200, CONTENT_TYPE_LATEST, generate_latest(registry)

    return route
