"""Response helpers both APIs share: JSON bodies, server-sent events, the client's disconnect."""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import Response

SSE_DONE = b"data: [DONE]\n\n"


async def client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body is read already: nothing else arrives)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def json_response(
    content: Any, status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    return Response(
        msgspec.json.encode(content), status, headers=headers, media_type="application/json"
    )


def sse(content: Any) -> bytes:
    return b"data: " + msgspec.json.encode(content) + b"\n\n"
