"""Plain ASGI middleware in front of the API: who may call (API keys -> tenants) and how much
one request may send (the body size). Plain ASGI: no per-request overhead beyond a compare and
a byte count, and a streamed body is counted as it arrives, never buffered here.

A tenant is the name an API key maps to. The key middleware puts it in the request's scope
(`TENANT_SCOPE_KEY`); the handlers pass it down to `TokenizerManager.build_request`, where it
becomes the request's prefix-cache namespace: tenants never reuse each other's KV.

With tenants (--api-keys-file), the routes that reach every tenant (/flush_cache, the server
info, aborting another tenant's requests) take the admin key only (--admin-api-key, tenant
"admin" on the other routes; `require_admin`). Without a keys file, any key may call them.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from weft.runtime.server.errors import ApiError
from weft.runtime.server_config import ServerConfig

logger = logging.getLogger("weft")

TENANT_SCOPE_KEY = "weft.tenant"
ADMIN_SCOPE_KEY = "weft.admin"  # True when the request carries the admin key
DEFAULT_TENANT = "default"  # the tenant of --api-key
ADMIN_TENANT = "admin"  # the tenant of --admin-api-key


def load_api_keys(config: ServerConfig) -> dict[str, str]:
    """key -> tenant, from --api-keys-file, --api-key and --admin-api-key; empty:
    authentication is off. Keys that cannot be used are a ValueError saying why (the server
    refuses to start)."""
    keys = read_api_keys_file(Path(config.api_keys_file)) if config.api_keys_file else {}
    if config.api_key is not None:
        tenant = keys.setdefault(config.api_key, DEFAULT_TENANT)
        if tenant != DEFAULT_TENANT:
            raise ValueError(
                f"--api-key is also in --api-keys-file, as tenant {tenant!r}: its tenant would "
                f"be ambiguous ({DEFAULT_TENANT!r} or {tenant!r})"
            )
    admin = config.admin_api_key
    if admin is not None:
        if admin in keys:
            raise ValueError(
                "--admin-api-key is also a tenant's key (--api-key or --api-keys-file): the "
                "admin key must be a key of its own"
            )
        if ADMIN_TENANT in keys.values():
            raise ValueError(
                f"--api-keys-file names a tenant {ADMIN_TENANT!r}: with --admin-api-key that "
                "name is the admin's (its prefix-cache namespace)"
            )
        keys[admin] = ADMIN_TENANT
    return keys


def read_api_keys_file(path: Path) -> dict[str, str]:
    """A JSON object {"KEY": "TENANT", ...}: non-empty strings, no key twice, and no '/' in a
    tenant (it separates the parts of a cache namespace, see `cache_namespace`)."""
    where = f"--api-keys-file {path}"
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {where}: {exc}") from None
    try:
        keys = json.loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where} is not valid JSON: {exc}") from None
    except ValueError as exc:  # from _unique_keys
        raise ValueError(f"{where}: {exc}") from None
    if not isinstance(keys, dict) or not keys:
        raise ValueError(f'{where} must be a non-empty JSON object {{"KEY": "TENANT", ...}}')
    for key, tenant in keys.items():
        if not key:
            raise ValueError(f"{where} has an empty key")
        if not isinstance(tenant, str) or not tenant:
            raise ValueError(f"{where}: the tenant of every key must be a non-empty string")
        if "/" in tenant:
            raise ValueError(f"{where}: tenant {tenant!r} must not contain '/'")
    return keys


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            # NOTE: never echo a key: the message goes to logs
            raise ValueError(f"a key is listed twice (tenants {out[key]!r} and {value!r})")
        out[key] = value
    return out


def tenant_of(request: Request) -> str | None:
    """The request's tenant (None when the server has no API keys)."""
    tenant = request.scope.get(TENANT_SCOPE_KEY)
    return tenant if isinstance(tenant, str) else None


def is_admin(request: Request) -> bool:
    """Whether the request carries --admin-api-key."""
    return request.scope.get(ADMIN_SCOPE_KEY) is True


def require_admin(request: Request, config: ServerConfig, what: str) -> None:
    """With tenants (--api-keys-file), `what` reaches every tenant: the admin key only. A
    tenant's key is a 403 (no key at all was a 401 already, in the key middleware)."""
    if config.api_keys_file is None or is_admin(request):
        return
    log_refused(request.scope, 403, f"{what} with a tenant's key ({tenant_of(request)!r})")
    missing = "" if config.admin_api_key is not None else "; this server has none"
    raise ApiError(
        f"{what} reaches every tenant: it takes the admin API key (--admin-api-key{missing}), "
        "not a tenant's",
        403,
        code="admin_key_required",
    )


def cache_namespace(tenant: str | None, cache_salt: str | None) -> str:
    """The prefix-cache namespace of a request: "tenant:T", "salt:S", "tenant:T/salt:S" or "".
    NOTE: unambiguous only because a tenant holds no '/' (checked when the keys are read)."""
    parts = []
    if tenant is not None:
        parts.append("tenant:" + tenant)
    if cache_salt is not None:
        parts.append("salt:" + cache_salt)
    return "/".join(parts)


class ApiKeyMiddleware:
    """'Authorization: Bearer KEY' on every route but /health* and /metrics (probes and
    scrapers carry no key), as SGLang does; the key's tenant (and whether it is `admin_key`)
    goes into the scope. The scheme is case-insensitive and may be followed by several spaces
    (RFC 7235: `auth-scheme 1*SP token68`); the key itself is compared exactly."""

    def __init__(
        self,
        app: ASGIApp,
        keys: Mapping[str, str],
        admin_key: str | None = None,
        on_error: Callable[[int], None] | None = None,
    ) -> None:
        self.app = app
        self.on_error = on_error
        self.keys = [(key.encode(), tenant, key == admin_key) for key, tenant in keys.items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _open_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization")
        scheme, _, key = (given or b"").partition(b" ")
        key = key.lstrip(b" ")
        bearer = scheme.lower() == b"bearer"
        tenant, admin = None, False
        for expected, name, is_admin_key in self.keys:
            # NOTE: constant time, and no early exit: the time taken says nothing about the key
            if hmac.compare_digest(key, expected) and bearer:
                tenant, admin = name, is_admin_key
        if tenant is None:
            log_refused(scope, 401, _why_refused(given, bearer, key))
            error = ApiError("invalid or missing API key", 401, code="invalid_api_key")
            await _error_response(error, self.on_error)(scope, receive, send)
            return
        await self.app({**scope, TENANT_SCOPE_KEY: tenant, ADMIN_SCOPE_KEY: admin}, receive, send)


def _why_refused(given: bytes | None, bearer: bool, key: bytes) -> str:
    if given is None:
        return "no Authorization header"
    if not bearer:
        return "not a Bearer credential"
    return "an unknown API key" if key else "an empty API key"


def log_refused(scope: Scope, status: int, why: str) -> None:
    """One line per refused request (401, 403): the route and who asked. NOTE: never the key;
    the path is escaped and cut short (a client must not write lines into the log)."""
    client = scope.get("client")
    who = f"{client[0]}:{client[1]}" if client else "an unknown client"
    path = scope["path"][:200].encode("unicode_escape").decode("ascii")
    logger.warning("refused %s %s from %s (%d): %s", scope["method"], path, who, status, why)


def _open_path(path: str) -> bool:
    return path.startswith("/health") or path == "/metrics"


class _BodyTooLarge(Exception):
    pass


class BodySizeLimitMiddleware:
    """A 413 for a body over `max_bytes`: at once from Content-Length, or as soon as a chunked
    body passes the limit while the handler reads it."""

    def __init__(
        self, app: ASGIApp, max_bytes: int, on_error: Callable[[int], None] | None = None
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await _error_response(self._error(), self.on_error)(scope, receive, send)
            return
        received = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge
            return message

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        except _BodyTooLarge:
            # NOTE: handlers read the whole body before they answer, so nothing is sent yet;
            # were it otherwise, a second response would corrupt the first
            if started:
                raise
            await _error_response(self._error(), self.on_error)(scope, receive, send)

    def _error(self) -> ApiError:
        return ApiError(
            f"the request body is too large: at most {self.max_bytes} bytes "
            "(--max-request-body-bytes)",
            413,
            code="request_too_large",
        )


def _error_response(error: ApiError, on_error: Callable[[int], None] | None) -> Response:
    """The error as a response; `on_error` hears of it (these never reach the app's handlers,
    which count the others)."""
    if on_error is not None:
        on_error(error.status)
    return Response(msgspec.json.encode(error.body()), error.status, media_type="application/json")
