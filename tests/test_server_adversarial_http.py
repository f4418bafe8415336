"""Hostile HTTP against the real server: bodies that are not UTF-8 JSON get a 400 naming the
problem on every route that takes one (never a 500), and a client that sends its request
headers slowly or without end is cut off (a 408 or a 431, and the connection closed) while
others are served. The server keeps serving after each."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import msgspec
import pytest
import requests

from weft.runtime.server.errors import ApiError, decode_body
from weft.runtime.server.launch import MAX_HEADER_BYTES
from weft.runtime.server_config import ServerConfig

from server_utils import ServerProcess, stories_args

OK_NATIVE = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 2}}
# stories260K has no chat template of its own
TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"

# each route that takes a body, with a body whose one string is `%s` (the field it reads)
ROUTES = {
    "/generate": b'{"text": "%s", "sampling_params": {"max_new_tokens": 2}}',
    "/v1/completions": b'{"prompt": "%s", "max_tokens": 2}',
    "/v1/chat/completions": b'{"messages": [{"role": "user", "content": "%s"}], "max_tokens": 2}',
    "/abort_request": b'{"rid": "%s"}',
}


# NOTE: shorter than the default (10 s), which the cut-off tests would wait three times over
HEADER_TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def server(stories_dir):
    srv = ServerProcess(
        *stories_args(stories_dir, "--chat-template", TEMPLATE),
        "--header-timeout-s",
        str(HEADER_TIMEOUT_S),
    )
    yield srv
    srv.assert_kv_intact()
    assert srv.stop() == 0
    assert "Traceback" not in srv.output, srv.output


def post_raw(srv: ServerProcess, path: str, body: bytes) -> requests.Response:
    headers = {"content-type": "application/json"}
    return requests.post(srv.url + path, data=body, headers=headers, timeout=60)


def check_400(srv: ServerProcess, r: requests.Response, words: list[str]) -> dict[str, Any]:
    """A 400 in OpenAI's shape naming the problem; then the server still serves."""
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    for word in words:
        assert word in error["message"], error
    after = srv.post("/generate", OK_NATIVE)
    assert after.status_code == 200, after.text
    return error


# ---- bodies -----------------------------------------------------------------------------------

# (what the string holds, its bytes on the wire, words the error names)
BAD_STRINGS = [
    # msgspec raised UnicodeDecodeError, not DecodeError, for these: a 500 with a traceback
    ("a lone surrogate's raw bytes", b"\xed\xb3\xbf", ["not valid UTF-8", "invalid continuation"]),
    ("a byte no UTF-8 starts with", b"\xff", ["not valid UTF-8", "invalid start byte"]),
    ("a cut UTF-8 sequence", b"\xc3", ["not valid UTF-8"]),
    # no tokenizer could encode it: refused by the JSON decoder, as before
    ("an escaped lone surrogate", b"\\udcff", ["malformed JSON", "surrogate"]),
    ("a raw NUL", b"\x00", ["malformed JSON", "invalid character"]),
]


@pytest.mark.parametrize("path", list(ROUTES))
@pytest.mark.parametrize("raw,words", [c[1:] for c in BAD_STRINGS], ids=[c[0] for c in BAD_STRINGS])
def test_a_bad_string_is_a_400_on_every_route(server, path, raw, words):
    check_400(server, post_raw(server, path, ROUTES[path] % raw), words)


def test_the_error_names_the_byte(server):
    r = post_raw(server, "/generate", b'{"text": "\xed\xb3\xbf"}')
    error = check_400(server, r, [])
    assert error["message"] == (
        "malformed JSON body: not valid UTF-8 at byte 10 (invalid continuation byte)"
    )


@pytest.mark.parametrize("path", list(ROUTES))
def test_bytes_that_are_not_utf8_are_refused_in_any_field(server, path):
    """Even in a field the route ignores (msgspec skips those unchecked), as json.loads would."""
    body = ROUTES[path] % b"Hi"
    body = body[:-1] + b', "unknown_field": "\xed\xb3\xbf"}'
    check_400(server, post_raw(server, path, body), ["not valid UTF-8"])


# (case, the whole body from the route's good one, words the error names)
BAD_BODIES = [
    ("invalid JSON", lambda ok: b"{text: 1}", ["malformed JSON"]),
    ("truncated", lambda ok: ok[:-5], ["malformed JSON", "truncated"]),
    ("trailing bytes", lambda ok: ok + b" {}", ["malformed JSON", "trailing"]),
    ("a NUL after the object", lambda ok: ok + b"\x00", ["malformed JSON", "trailing"]),
    ("only a NUL", lambda ok: b"\x00", ["malformed JSON"]),
    ("an array", lambda ok: b"[" + ok + b"]", ["Expected `object`, got `array`"]),
    ("a string", lambda ok: b'"Hi"', ["Expected `object`, got `str`"]),
    ("null", lambda ok: b"null", ["Expected `object`, got `null`"]),
    ("a number", lambda ok: b"42", ["Expected `object`, got `int`"]),
]


@pytest.mark.parametrize("path", list(ROUTES))
@pytest.mark.parametrize("body,words", [c[1:] for c in BAD_BODIES], ids=[c[0] for c in BAD_BODIES])
def test_a_bad_body_is_a_400_on_every_route(server, path, body, words):
    check_400(server, post_raw(server, path, body(ROUTES[path] % b"Hi")), words)


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_an_escaped_nul_is_text(server, path):
    """ "\\u0000" is valid JSON for a NUL character: tokenized like any other text."""
    r = post_raw(server, path, ROUTES[path] % b"Once\\u0000 upon")
    assert r.status_code == 200, r.text


def test_a_dicts_value_is_no_field():
    """msgspec names a dict's value `$[...]`: no field to name (`param` was "[...]")."""
    with pytest.raises(ApiError) as exc:
        decode_body(b'{"rid": 1e999}', dict[str, Any])
    assert (exc.value.status, exc.value.param) == (400, None)

    class Body(msgspec.Struct):
        text: Any = None

    with pytest.raises(ApiError) as exc:
        decode_body(b'{"text": 1e999}', Body)
    assert (exc.value.status, exc.value.param) == (400, "text")


# ---- request headers --------------------------------------------------------------------------


def test_the_header_timeout_is_ten_seconds_unless_set():
    assert ServerConfig().header_timeout_s == 10.0
    with pytest.raises(ValueError, match="header_timeout_s must be > 0, got 0"):
        ServerConfig(header_timeout_s=0)


def connect(srv: ServerProcess) -> socket.socket:
    host, port = srv.url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=HEADER_TIMEOUT_S + 10)


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (socket.timeout if it never does)."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def assert_cut_off(sock: socket.socket, since: float, status: bytes | None) -> None:
    """The server answers `status` (None: nothing) and closes, HEADER_TIMEOUT_S after `since`."""
    reset = False
    try:
        reply = read_until_closed(sock)
    except ConnectionResetError:
        # NOTE: a byte a trickling client sends after the server's answer and close makes the
        # server's end reset the connection, and the reset can discard the unread answer (seen
        # once in a full CPU run): the cut-off's timing is then the proof
        reply, reset = b"", True
    took = time.monotonic() - since
    assert HEADER_TIMEOUT_S - 0.5 < took < HEADER_TIMEOUT_S + 5, took
    if status is None:
        assert reply == b""
    elif not reset:
        assert reply.startswith(b"HTTP/1.1 " + status), reply


def test_slow_headers_are_cut_off_and_others_are_served(server):
    started = time.monotonic()
    slow = []  # (socket, when it connected)
    for _ in range(200):
        sock = connect(server)
        slow.append((sock, time.monotonic()))
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: weft\r\nContent-Le")
    silent = connect(server), time.monotonic()  # never sends a byte
    blank = connect(server), time.monotonic()
    blank[0].sendall(b"\r\n\r\n")  # CRLFs before a request begin none
    trickle = connect(server), time.monotonic()
    stop = threading.Event()

    def send_a_byte_at_a_time() -> None:
        for byte in b"GET /health HTTP/1.1\r\nHost: weft\r\nX-Slow: " + b"a" * 60:
            if stop.wait(0.5):
                return
            try:
                trickle[0].send(bytes([byte]))
            except OSError:
                return  # cut off

    sender = threading.Thread(target=send_a_byte_at_a_time)
    sender.start()
    try:
        # while they hang, a normal client is served
        assert server.post("/generate", OK_NATIVE).status_code == 200
        assert time.monotonic() - started < HEADER_TIMEOUT_S - 1, "the test itself was too slow"
        for sock, since in slow:
            assert_cut_off(sock, since, b"408")
        assert_cut_off(*silent, None)
        assert_cut_off(*blank, None)
        assert_cut_off(*trickle, b"408")  # its deadline is never pushed back
    finally:
        stop.set()
        sender.join()
        for sock, _ in [*slow, silent, blank, trickle]:
            sock.close()
    assert server.post("/generate", OK_NATIVE).status_code == 200


def test_a_kept_alive_connections_next_request_has_its_own_deadline(server):
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: weft\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        # within uvicorn's keep-alive (5 s), the next request begins and never ends its headers
        time.sleep(1.0)
        started = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\nHo")
        assert_cut_off(sock, started, b"408")


def test_a_slow_body_is_not_cut_off(server):
    """The deadline is on the headers only: a body may take longer (the handler reads it)."""
    body = ROUTES["/generate"] % b"Once upon a time"
    with connect(server) as sock:
        sock.sendall(
            b"POST /generate HTTP/1.1\r\nHost: weft\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body[:10]
        )
        time.sleep(HEADER_TIMEOUT_S + 1)
        sock.sendall(body[10:])
        assert read_until_closed(sock).startswith(b"HTTP/1.1 200")


def test_endless_headers_are_refused(server):
    head = b"GET /health HTTP/1.1\r\nHost: weft\r\nX-Filler: "
    with connect(server) as sock:
        # NOTE: not a byte more than the bound: bytes still unread when the server closes
        # would make it reset the connection, and the reply could be lost
        sock.sendall(head + b"a" * (MAX_HEADER_BYTES + 1 - len(head)))
        reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 431"), reply
    # headers well within the bound are served
    cookie = {"Cookie": "a=" + "b" * (MAX_HEADER_BYTES // 2)}
    assert server.get("/health", headers=cookie).status_code == 200
