"""HTTP to a running vLLM server, with the standard library: every failure named, with what to do.

:class:`ServerClient` makes one request per call (``http.client``, a fresh connection each
time, so a server that restarted is simply reached again), bounded by ``timeout_s`` per
socket operation, with vLLM's ``Authorization: Bearer <api_key>`` when a key is given. Every
failure raises :class:`ServerCallError` naming the URL and the route, with its HTTP status
as data (``None`` when no answer came) and what to set, so no caller reads error text::

    client = ServerClient("http://127.0.0.1:8000", api_key=None, timeout_s=300)
    client.get("/get_world_size", {"include_dp": "false"})    # -> {"world_size": 1}
    client.post("/pause", query={"mode": "keep"})

Plain ``http://`` goes only to a loopback address unless ``allow_insecure_http=True``: the
API key and weightsync's calls (sealed, not encrypted) would cross the network in clear
(docs/security.md). ``https://`` checks the server's certificate against the system's
authorities, or ``ca_file``.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import socket
import ssl
import urllib.parse
from typing import Any

from weightsync import SettingsError, WeightSyncError
from weightsync.core.wire.settings import DEFAULT_ENGINE_TIMEOUT_S

#: Routes vLLM's server has only with ``VLLM_SERVER_DEV_MODE=1``: a 404 on one says that.
DEV_ROUTES = frozenset(
    {
        "/pause",
        "/resume",
        "/is_paused",
        "/init_weight_transfer_engine",
        "/shutdown_weight_transfer_engine",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/update_weight_version",
        "/weight_info",
        "/get_world_size",
        "/server_info",
    }
)


class ServerCallError(WeightSyncError):
    """A request to a vLLM server failed: no connection, no answer within the timeout, or an
    HTTP error status. ``status`` is the HTTP status (``None`` when no answer came)."""

    def __init__(self, message: str, url: str = "", route: str = "", status: int | None = None) -> None:
        super().__init__(message)
        self.url = url
        self.route = route
        self.status = status


def is_loopback(host: str) -> bool:
    """True when ``host`` is a loopback address, or a name that resolves only to loopback ones."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(str(a).split("%")[0]).is_loopback for a in addresses)


class ServerClient:
    """Requests to the vLLM server at ``url`` (``http(s)://host:port``, optionally a path prefix)."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        timeout_s: float = DEFAULT_ENGINE_TIMEOUT_S,
        allow_insecure_http: bool = False,
        ca_file: str | None = None,
    ) -> None:
        parts = urllib.parse.urlsplit(url) if isinstance(url, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or parts.query:
            raise SettingsError(f"url must be http://host:port or https://host:port of a vLLM server, got {url!r}")
        if api_key is not None and (not isinstance(api_key, str) or not api_key):
            raise SettingsError("api_key must be a non-empty string (the server's --api-key) or None")
        if not timeout_s > 0:
            raise SettingsError(f"timeout_s must be positive, got {timeout_s!r}")
        self.host = parts.hostname
        self.loopback = is_loopback(self.host)
        if parts.scheme == "http" and not self.loopback and not allow_insecure_http:
            raise SettingsError(
                f"{url}: plain http to {self.host}, which is not a loopback address, would send the API key and "
                "weightsync's calls in clear; serve https (vLLM's --ssl-certfile/--ssl-keyfile) or, on a network "
                "you trust, pass allow_insecure_http=True"
            )
        self.url = url.rstrip("/")
        self.secure = parts.scheme == "https"
        self.port = parts.port or (443 if self.secure else 80)
        self._prefix = parts.path.rstrip("/")
        self._api_key = api_key
        self.timeout_s = float(timeout_s)
        self._tls = ssl.create_default_context(cafile=ca_file) if self.secure else None

    def get(self, route: str, query: dict[str, str] | None = None, timeout_s: float | None = None) -> Any:
        """The JSON the server answers ``GET route``."""
        return _json(self._request("GET", route, query, None, timeout_s), self.url, route)

    def post(
        self,
        route: str,
        body: dict[str, Any] | None = None,
        query: dict[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        """The JSON the server answers ``POST route`` (None for an empty answer)."""
        data = self._request("POST", route, query, body, timeout_s)
        return _json(data, self.url, route) if data.strip() else None

    def text(self, route: str, timeout_s: float | None = None) -> str:
        """The text the server answers ``GET route`` (``/metrics``)."""
        return self._request("GET", route, None, None, timeout_s).decode("utf-8", "replace")

    def _request(
        self, method: str, route: str, query: dict[str, str] | None, body: Any, timeout_s: float | None
    ) -> bytes:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        path = self._prefix + route + ("?" + urllib.parse.urlencode(query) if query else "")
        headers = {"Accept": "application/json", "Connection": "close"}
        if self._api_key is not None:
            headers["Authorization"] = f"Bearer {self._api_key}"
        payload = None
        if body is not None:
            payload = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        conn: http.client.HTTPConnection
        if self._tls is not None:
            conn = http.client.HTTPSConnection(self.host, self.port, timeout=timeout, context=self._tls)
        else:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            conn.request(method, path, body=payload, headers=headers)
            response = conn.getresponse()
            data = response.read()
        except (OSError, http.client.HTTPException) as exc:
            raise self._no_answer(route, exc, timeout) from exc
        finally:
            conn.close()
        if response.status >= 400:
            raise self._refused(route, response.status, response.reason, data)
        return data

    def _no_answer(self, route: str, exc: BaseException, timeout: float) -> ServerCallError:
        where = f"{self.url} ({route})"
        if isinstance(exc, TimeoutError):
            why = f"gave no answer within {timeout:.3g}s: the server stopped answering (or is far too slow)"
        elif isinstance(exc, ConnectionRefusedError):
            why = "refused the connection: is the vLLM server running there? (docs/vllm.md shows how to start one)"
        elif isinstance(exc, ssl.SSLError):
            why = f"failed the TLS handshake ({exc}); if its certificate is your own, pass ca_file="
        elif isinstance(exc, socket.gaierror):
            why = f"cannot be resolved ({exc})"
        else:
            why = f"dropped the connection ({type(exc).__name__}: {exc}): the server stopped or crashed"
        return ServerCallError(f"{where} {why}", self.url, route)

    def _refused(self, route: str, status: int, reason: str, data: bytes) -> ServerCallError:
        said = _message(data)
        what = f"{self.url} answered {route} with HTTP {status} {reason}".rstrip()
        if status in (401, 403):
            hint = "the server wants an API key: pass api_key= (the server's --api-key or VLLM_API_KEY)"
        elif status == 404 and route in DEV_ROUTES:
            hint = "the server has no RL routes: start it with VLLM_SERVER_DEV_MODE=1 in its environment"
        elif status == 404:
            hint = "is this the URL of a vLLM server?"
        else:
            hint = f"the server said: {said}" if said else "the server said nothing more"
        return ServerCallError(f"{what}; {hint}", self.url, route, status)


def _message(data: bytes) -> str:
    """What the server's error body says, for a message (vLLM: {"error": {"message"}} or {"detail"})."""
    try:
        body = json.loads(data)
    except ValueError:
        return data.decode("utf-8", "replace")[:500].strip()
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])[:2000]
        for key in ("error", "detail", "message"):
            if key in body:
                return str(body[key])[:2000]
    return str(body)[:500]


def _json(data: bytes, url: str, route: str) -> Any:
    try:
        return json.loads(data)
    except ValueError as exc:
        raise ServerCallError(
            f"{url} answered {route} with something other than JSON: {data[:200]!r}", url, route
        ) from exc


__all__ = ["DEV_ROUTES", "ServerCallError", "ServerClient", "is_loopback"]
