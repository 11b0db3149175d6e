"""What a ServerWorker asks a vLLM server before feeding it, and how it reads its answers.

Each function takes a :class:`~weightsync.vllm.client.ServerClient` and raises
:class:`~weightsync.vllm.client.ServerCallError` naming the URL and what to set::

    size = check_server(client)          # RL routes, API key, weightsync's backend, TP only
    requests_in_flight(client)           # before a pause, for the hold's record
    field(client, "/weight_info", "weight_version")
"""

from __future__ import annotations

from typing import Any

from weightsync.vllm.client import ServerCallError, ServerClient
from weightsync.vllm.plugin import BACKEND

#: The Prometheus gauges of requests the server runs or holds (``/metrics``).
_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def field(client: ServerClient, route: str, key: str, query: dict[str, str] | None = None) -> Any:
    """Field ``key`` of the JSON object the server answers ``GET route``."""
    answer = client.get(route, query)
    if not isinstance(answer, dict) or key not in answer:
        raise ServerCallError(
            f"{client.url} answered {route} without {key!r} ({str(answer)[:200]}); is it a vLLM 0.32 server?",
            client.url,
            route,
        )
    return answer[key]


def check_server(client: ServerClient) -> int:
    """The number of TP ranks the server runs, once it is one a ServerWorker can feed: its RL
    routes answer (``VLLM_SERVER_DEV_MODE=1``; a 404 says so), the API key is right
    (``/v1/models``, where vLLM checks it: the RL routes take any), it runs weightsync's
    backend, and neither pipeline nor data parallelism."""
    size = field(client, "/get_world_size", "world_size", {"include_dp": "false"})
    client.get("/v1/models")
    config = field(client, "/server_info", "vllm_config", {"config_format": "json"}) or {}
    backend = (config.get("weight_transfer_config") or {}).get("backend")
    if backend != BACKEND:
        raise ServerCallError(
            f"{client.url} runs weight-transfer backend {backend!r}, not weightsync's: start it with "
            f'--weight-transfer-config \'{{"backend": "{BACKEND}"}}\' (weightsync installed beside vLLM)',
            client.url,
            "/server_info",
        )
    parallel = config.get("parallel_config") or {}
    other = {k: parallel.get(k) for k in ("pipeline_parallel_size", "data_parallel_size") if parallel.get(k) != 1}
    if other or not isinstance(size, int) or size < 1:
        raise ServerCallError(
            f"{client.url} runs {other or {'world_size': size}}: a ServerWorker feeds tensor parallel ranks only "
            "(one server per data parallel replica)",
            client.url,
            "/server_info",
        )
    return size


def requests_in_flight(client: ServerClient) -> int:
    """Requests the server runs or holds now (its ``/metrics`` gauges, summed over engines)."""
    total = 0.0
    for line in client.text("/metrics").splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in _GAUGES:
            total += float(line.rsplit(" ", 1)[-1])
    return int(total)


__all__ = ["check_server", "field", "requests_in_flight"]
