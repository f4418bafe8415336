"""Small async HTTP helpers shared by the HTTP backends (JSON in, JSON or SSE out)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from weft.frontend.backend import BackendError

TIMEOUT = httpx.Timeout(600.0, connect=30.0)


def headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _error(resp: httpx.Response, body: bytes) -> BackendError:
    try:
        data = json.loads(body)
        err = data.get("error", data) if isinstance(data, dict) else data
        message = err.get("message", body.decode()) if isinstance(err, dict) else str(err)
    except ValueError:
        message = body.decode(errors="replace")
    return BackendError(f"HTTP {resp.status_code} from {resp.request.url.path}: {message}")


async def post_json(url: str, body: dict[str, Any], api_key: str | None) -> Any:
    return _json_of(await _request("POST", url, api_key, body))


async def get_json(url: str, api_key: str | None) -> Any:
    return _json_of(await _request("GET", url, api_key))


async def _request(
    method: str, url: str, api_key: str | None, body: dict[str, Any] | None = None
) -> httpx.Response:
    # NOTE: one client per call: a client is bound to the event loop it first ran on, and
    # programs may run on different loops (sync run vs. run_async).
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        try:
            return await client.request(method, url, json=body, headers=headers(api_key))
        except httpx.HTTPError as exc:
            raise BackendError(f"cannot reach {url}: {exc}") from exc


def get_json_sync(url: str, api_key: str | None) -> Any:
    """GET from sync code (setting a backend up, outside any program's loop)."""
    return _json_of(_request_sync("GET", url, api_key))


def post_sync(url: str, api_key: str | None) -> bool:
    """An empty POST from sync code: True on 200, False on 400 (the server said not now)."""
    resp = _request_sync("POST", url, api_key)
    if resp.status_code not in (200, 400):
        raise _error(resp, resp.content)
    return resp.status_code == 200


def _request_sync(method: str, url: str, api_key: str | None) -> httpx.Response:
    try:
        return httpx.request(method, url, headers=headers(api_key), timeout=TIMEOUT)
    except httpx.HTTPError as exc:
        raise BackendError(f"cannot reach {url}: {exc}") from exc


def _json_of(resp: httpx.Response) -> Any:
    if resp.status_code != 200:
        raise _error(resp, resp.content)
    return resp.json()


async def post_sse(url: str, body: dict[str, Any], api_key: str | None) -> AsyncIterator[Any]:
    """The parsed `data:` events of a streamed response, up to `data: [DONE]`."""
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        try:
            async with client.stream("POST", url, json=body, headers=headers(api_key)) as resp:
                if resp.status_code != 200:
                    raise _error(resp, await resp.aread())
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data.strip() == "[DONE]":
                        return
                    event = json.loads(data)
                    if isinstance(event, dict) and "error" in event:
                        raise BackendError(str(event["error"]))
                    yield event
        except httpx.HTTPError as exc:
            raise BackendError(f"cannot reach {url}: {exc}") from exc
