"""Submitting a job to a Ray job server with token authentication, through Ray's job SDK.

The token travels as an HTTP header (``Authorization: Bearer <token>``), which is what
``ray job submit`` sends when ``RAY_AUTH_MODE=token`` and a token is found
(``RAY_AUTH_TOKEN``, the file named by ``RAY_AUTH_TOKEN_PATH``, or ``~/.ray/auth_token``).
Passing it explicitly keeps this process independent of whatever token the environment
or the user's home directory holds for other clusters.

Call order: ``JobServer(url, token)`` -> :meth:`JobServer.submit` ->
:meth:`JobServer.follow` (prints the log as it grows, returns the final status).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

import requests

#: Statuses after which a job never changes again.
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


@dataclass(frozen=True)
class JobServer:
    """A Ray dashboard's job API (``http://host:port``) and the token it accepts."""

    url: str
    token: str = field(repr=False)

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"JobServer.url must be the dashboard's http(s) address, got {self.url!r}")
        if not self.token:
            raise ValueError(f"JobServer.token is empty for {self.url}: token authentication needs the head's token")

    def client(self) -> Any:
        from ray.job_submission import JobSubmissionClient

        return JobSubmissionClient(self.url, headers={"Authorization": f"Bearer {self.token}"})

    def reachable(self) -> bool:
        """True once the job API answers with this token (a wrong token raises, not False)."""
        try:
            self.client().list_jobs()
        except (ConnectionError, requests.RequestException, RuntimeError):
            return False  # not up yet: refused connection, 5xx or 404 while the dashboard starts
        return True

    def submit(self, entrypoint: str, runtime_env: dict[str, Any] | None = None) -> str:
        return str(self.client().submit_job(entrypoint=entrypoint, runtime_env=runtime_env))

    def follow(self, job_id: str, timeout_s: float, out: TextIO = sys.stdout, poll_s: float = 1.0) -> str:
        """Print the job's log as it grows until the job ends; stop it at ``timeout_s``.

        Returns the final status name (``SUCCEEDED``, ``FAILED``, ``STOPPED``).
        """
        client = self.client()
        deadline = time.monotonic() + timeout_s
        shown = 0
        while True:
            status = str(client.get_job_status(job_id).value)
            logs = client.get_job_logs(job_id)
            out.write(logs[shown:])
            out.flush()
            shown = len(logs)
            if status in TERMINAL:
                return status
            if time.monotonic() > deadline:
                client.stop_job(job_id)
                raise TimeoutError(
                    f"job {job_id} still {status} after {timeout_s:.0f}s; stopped it (raise --timeout to wait longer)"
                )
            time.sleep(poll_s)
