"""API errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")


class ApiError(Exception):
    """An error a client gets back: the status code and a message naming the problem."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type or _default_type(status)
        self.headers = headers  # sent with the error response (e.g. Retry-After)

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


ERROR_KINDS = (
    "bad_request",
    "unauthorized",
    "forbidden",
    "overloaded",
    "timeout",
    "internal",
    "aborted",
)


def error_kind(status: int) -> str:
    """The kind of an error status, as metrics and the request log name it. A refused key (401)
    or a tenant's key on an admin route (403) is not a bad request: counted apart, an attack
    or a misconfigured client shows."""
    if status == 499:  # the client went away (nginx's code)
        return "aborted"
    if status == 401:
        return "unauthorized"
    if status == 403:
        return "forbidden"
    if status in (429, 503):
        return "overloaded"
    if status in (408, 504):
        return "timeout"
    return "internal" if status >= 500 else "bad_request"


_AT = re.compile(r" - at `\$\.([^`]*)`$")  # a field's path; not `$[...]`, a dict's value
_MISSING = re.compile(r"missing required field `([^`]*)`")


def from_decode_error(exc: msgspec.DecodeError | RecursionError) -> ApiError:
    """A JSON body that does not parse or does not have the expected types (a RecursionError:
    nested deeper than the decoder goes)."""
    if isinstance(exc, RecursionError):
        return ApiError("malformed JSON body: nested too deeply", 400)
    text = str(exc)
    if isinstance(exc, msgspec.ValidationError):
        match = _AT.search(text) or _MISSING.search(text)
        param = match.group(1) if match else None
        return ApiError(f"invalid request: {text}", 400, param=param or None)
    return ApiError(f"malformed JSON body: {text}", 400)


def decode_body(body: bytes, cls: type[T]) -> T:
    """A request's JSON body as `cls`; a body that is not UTF-8 JSON of that shape is a 400
    naming the problem. The one place request bodies are decoded.

    NOTE: msgspec raises UnicodeDecodeError, not DecodeError, for a string that is not UTF-8
    (a lone surrogate's raw bytes: a 500 once), and skips unknown fields' values unchecked; the
    body is checked first, as RFC 8259 asks and as json.loads does. An escaped lone surrogate
    ("\\udcff") is malformed JSON to msgspec: a 400 too (no tokenizer could encode it)."""
    if not body.isascii():
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ApiError(
                f"malformed JSON body: not valid UTF-8 at byte {exc.start} ({exc.reason})", 400
            ) from None
    try:
        return msgspec.json.decode(body, type=cls)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise from_decode_error(exc) from None
