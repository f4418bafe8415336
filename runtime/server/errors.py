"""API errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import re
from typing import Any

import msgspec


class ApiError(Exception):
    """An error a client gets back: the status code and a message naming the problem."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type or _default_type(status)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def _default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status >= 500:
        return "server_error" if status != 503 else "service_unavailable"
    return "invalid_request_error"


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(message, 400, param=param)


def not_supported(what: str, param: str | None = None) -> ApiError:
    return ApiError(f"{what} is not supported yet", 400, param=param, code="not_supported")


_AT = re.compile(r" - at `\$\.?([^`]*)`$")
_MISSING = re.compile(r"missing required field `([^`]*)`")


def from_decode_error(exc: msgspec.DecodeError) -> ApiError:
    """A JSON body that does not parse or does not have the expected types."""
    text = str(exc)
    if isinstance(exc, msgspec.ValidationError):
        match = _AT.search(text) or _MISSING.search(text)
        param = match.group(1) if match else None
        return ApiError(f"invalid request: {text}", 400, param=param or None)
    return ApiError(f"malformed JSON body: {text}", 400)
