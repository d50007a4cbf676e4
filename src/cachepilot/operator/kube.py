"""A small Kubernetes API client for the writes kopf does not make for us.

kopf watches (with its own reconnects, 410-Gone relists and error backoffs). The operator
itself only writes three things: the pool's status subresource, Events, and its Lease.
Those go through this client, built from the same ``kopf.ConnectionInfo`` the watcher logs
in with, and retried with backoff on 5xx, 429, timeouts and connection errors.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import ssl
import tempfile
from collections.abc import Sequence
from typing import Any

import aiohttp
import kopf

log = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


class Conflict(ApiError):
    """409: someone else changed or created the object first."""


class NotFound(ApiError):
    """404."""


def _ssl_context(info: kopf.ConnectionInfo) -> ssl.SSLContext | bool:
    if not info.server.startswith("https"):
        return False
    if info.insecure:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    else:
        cadata = (base64.b64decode(info.ca_data).decode()
                  if info.ca_data else None)
        ctx = ssl.create_default_context(cafile=info.ca_path, cadata=cadata)
    cert_path, key_path = info.certificate_path, info.private_key_path
    tmp: list[str] = []
    try:
        for data, _ in ((info.certificate_data, "cert"), (info.private_key_data, "key")):
            if data:
                fd, path = tempfile.mkstemp()
                os.write(fd, base64.b64decode(data))
                os.close(fd)
                tmp.append(path)
        if info.certificate_data:
            cert_path = tmp[0]
        if info.private_key_data:
            key_path = tmp[-1]
        if cert_path:
            ctx.load_cert_chain(cert_path, key_path)
    finally:
        for path in tmp:
            os.unlink(path)
    return ctx


class KubeClient:
    """JSON over aiohttp against one API server, with retries on transient failures."""

    def __init__(self, info: kopf.ConnectionInfo, *,
                 backoffs: Sequence[float] = (0.5, 1, 2, 4, 8),
                 timeout_s: float = 10.0) -> None:
        self.server = info.server.rstrip("/")
        headers = {"Accept": "application/json"}
        if info.token:
            headers["Authorization"] = f"{info.scheme or 'Bearer'} {info.token}"
        auth = (aiohttp.BasicAuth(info.username, info.password or "")
                if info.username and not info.token else None)
        self._session = aiohttp.ClientSession(
            headers=headers, auth=auth,
            connector=aiohttp.TCPConnector(ssl=_ssl_context(info)),
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        )
        self.backoffs = tuple(backoffs)

    async def close(self) -> None:
        await self._session.close()

    async def request(self, method: str, path: str, body: Any = None, *,
                      content_type: str = "application/json") -> Any:
        """One API call; transient failures retried with the backoffs, then raised."""
        url = self.server + path
        for attempt in range(len(self.backoffs) + 1):
            try:
                async with self._session.request(
                    method, url, json=body,
                    headers={"Content-Type": content_type} if body is not None else None,
                ) as resp:
                    if resp.status < 300:
                        return await resp.json(content_type=None)
                    text = await resp.text()
                    if resp.status == 404:
                        raise NotFound(404, text[:200])
                    if resp.status == 409:
                        raise Conflict(409, text[:200])
                    if resp.status not in RETRYABLE_STATUS:
                        raise ApiError(resp.status, text[:200])
                    error: Exception = ApiError(resp.status, text[:200])
            except (aiohttp.ClientError, TimeoutError) as e:
                error = e
            if attempt == len(self.backoffs):
                raise error
            log.info("%s %s failed (%s); retrying in %ss", method, path, error,
                     self.backoffs[attempt])
            await asyncio.sleep(self.backoffs[attempt])
        raise AssertionError("unreachable")

    async def get(self, path: str) -> Any:
        return await self.request("GET", path)

    async def create(self, path: str, body: Any) -> Any:
        return await self.request("POST", path, body)

    async def replace(self, path: str, body: Any) -> Any:
        return await self.request("PUT", path, body)

    async def merge_patch(self, path: str, body: Any) -> Any:
        return await self.request("PATCH", path, body,
                                  content_type="application/merge-patch+json")
