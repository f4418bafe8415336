"""Soak test: minutes of mixed traffic against a weft server, then what the traffic left behind.

    python benchmarks/soak.py --launch "--model-path MODEL --max-total-tokens 8192"
    python benchmarks/soak.py --url http://127.0.0.1:30000 --duration-s 3600 --api-key KEY

Requests go out at a fixed rate (--request-rate), at most --max-concurrency at once, each of a
kind drawn from a seeded mix:

    native, native_stream    /generate
    openai, openai_stream    /v1/completions
    chat, chat_stream        /v1/chat/completions (when the model has a chat template)
    abort                    a stream the client drops after its first chunks
    json_schema, regex       constrained output, checked against its constraint when it stops
    long_prompt              a prompt that nearly fills the context
    bad                      a request the server must refuse with a given 4xx (counted apart)

Each request belongs to one of --tenants tenants: its own cache_salt (no prefix-cache hit across
tenants) and, with --api-key KEY[,KEY...], one of the keys; then 'bad' includes a wrong key.

Progress every --progress-every-s; at the end: requests and errors by kind, p50/p99 E2E and
TTFT, the RSS of the server and each child process at start and end, and the KV pool at start
and end once idle (free + cached + in use == total, and the server's own integrity audit).
Exits 1 on any unexpected error or a failed KV check. A 503 with Retry-After (the server refusing
work under load, --max-queued-requests) is counted apart as "busy", not as an error.

Needs aiohttp and psutil (pip install 'weft[bench]').
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import jsonschema
import psutil
from bench_serving import LaunchedServer, percentiles_ms

from common import shared_prefix_prompts

OK, EXPECTED, BUSY, UNEXPECTED = "ok", "expected 4xx", "busy", "unexpected"
MIX = {  # kind -> weight
    "native": 3,
    "native_stream": 3,
    "openai": 2,
    "openai_stream": 2,
    "chat": 1,
    "chat_stream": 1,
    "abort": 1,
    "json_schema": 1,
    "regex": 1,
    "long_prompt": 1,
    "bad": 1,
}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
REGEX = r"(yes|no), [a-z]{2,8}\."
IDLE_TIMEOUT_S = 60.0


@dataclass
class Outcome:
    kind: str
    result: str  # OK, EXPECTED, BUSY (a 503 with Retry-After) or UNEXPECTED
    message: str = ""
    e2e: float = 0.0
    ttft: float | None = None  # streams only


@dataclass
class Reply:
    status: int
    e2e: float
    data: Any = None  # the JSON body (no stream, or an error status)
    events: list[Any] = field(default_factory=list)  # a stream's data events, "[DONE]" included
    ttft: float | None = None
    retry_after: str | None = None  # the Retry-After header of a refusal

    @property
    def stream_error(self) -> str:
        errors = [e for e in self.events if isinstance(e, dict) and "error" in e]
        return str(errors[0]["error"].get("message")) if errors else ""


@dataclass
class Tenant:
    salt: str
    headers: dict[str, str]
    prompts: list[list[int]]


@dataclass
class BadRequest:
    what: str
    path: str
    status: int  # the status it must get
    body: Any = None
    raw: bytes | None = None  # sent as is instead of `body`
    headers: dict[str, str] | None = None  # instead of the tenant's


class Traffic:
    """Sends one request of a kind and judges the answer; a send never raises."""

    def __init__(
        self, session: aiohttp.ClientSession, url: str, info: dict[str, Any], args: Any
    ) -> None:
        self.session = session
        self.url = url
        self.max_new = args.max_new_tokens
        context, vocab = int(info["context_length"]), int(info["vocab_size"])
        pool = int(info.get("kv_pool_size") or context)
        # near the context, but at most half the KV pool: it must fit beside the other requests
        self.long_len = max(16, min(context, pool // 2) - 16)
        self.vocab = vocab
        self.rng = random.Random(args.seed)
        keys = args.api_key.split(",") if args.api_key else []
        system_len = min(64, context // 4)
        prompts = shared_prefix_prompts(args.tenants, 16, system_len, 16, vocab, args.seed)
        self.tenants = [
            Tenant(
                salt=f"soak-tenant-{i}",
                headers={"Authorization": f"Bearer {keys[i % len(keys)]}"} if keys else {},
                prompts=prompts[i * 16 : (i + 1) * 16],
            )
            for i in range(args.tenants)
        ]
        self.bad = _bad_requests(context, vocab, with_keys=bool(keys))
        self.sent_bad = 0
        self.kinds: dict[str, Callable[[Tenant], Awaitable[Outcome]]] = {
            "native": partial(self._native, stream=False),
            "native_stream": partial(self._native, stream=True),
            "openai": partial(self._completion, stream=False),
            "openai_stream": partial(self._completion, stream=True),
            "chat": partial(self._chat, stream=False),
            "chat_stream": partial(self._chat, stream=True),
            "abort": self._abort,
            "json_schema": self._json_schema,
            "regex": self._regex,
            "long_prompt": self._long_prompt,
            "bad": self._bad,
        }

    async def send(self, kind: str) -> Outcome:
        tenant = self.tenants[self.rng.randrange(len(self.tenants))]
        try:
            return await self.kinds[kind](tenant)
        except (aiohttp.ClientError, TimeoutError) as exc:
            return Outcome(kind, UNEXPECTED, f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # an answer of the wrong shape: count it, keep soaking
            return Outcome(kind, UNEXPECTED, f"bad answer: {type(exc).__name__}: {exc}")

    async def chat_available(self) -> bool:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
        reply = await self._post("/v1/chat/completions", body, self.tenants[0].headers)
        return reply.status == 200

    # ---- kinds --------------------------------------------------------------------------

    async def _native(self, tenant: Tenant, stream: bool) -> Outcome:
        kind = "native_stream" if stream else "native"
        body = {
            "input_ids": self.rng.choice(tenant.prompts),
            "sampling_params": {"max_new_tokens": self.max_new, "temperature": 0.7},
            "cache_salt": tenant.salt,
            "stream": stream,
        }
        reply = await self._post("/generate", body, tenant.headers, stream)
        return _judge(kind, reply, _native_final)

    async def _completion(self, tenant: Tenant, stream: bool) -> Outcome:
        kind = "openai_stream" if stream else "openai"
        body = {
            "prompt": self.rng.choice(tenant.prompts),
            "max_tokens": self.max_new,
            "temperature": 0.7,
            "cache_salt": tenant.salt,
            "stream": stream,
        }
        reply = await self._post("/v1/completions", body, tenant.headers, stream)
        return _judge(kind, reply, partial(_openai_final, chat=False))

    async def _chat(self, tenant: Tenant, stream: bool) -> Outcome:
        kind = "chat_stream" if stream else "chat"
        topic = self.rng.choice(("a cat", "a boat", "the moon", "a red ball"))
        body = {
            "messages": [{"role": "user", "content": f"Tell me a story about {topic}."}],
            "max_tokens": self.max_new,
            "cache_salt": tenant.salt,
            "stream": stream,
        }
        reply = await self._post("/v1/chat/completions", body, tenant.headers, stream)
        return _judge(kind, reply, partial(_openai_final, chat=True))

    async def _abort(self, tenant: Tenant) -> Outcome:
        body = {
            "input_ids": self.rng.choice(tenant.prompts),
            "sampling_params": {"max_new_tokens": 4 * self.max_new, "ignore_eos": True},
            "cache_salt": tenant.salt,
            "stream": True,
        }
        reply = await self._post("/generate", body, tenant.headers, True, drop_after=2)
        if _busy(reply):
            return Outcome("abort", BUSY, _error_text(reply), reply.e2e)
        if reply.status != 200 or reply.stream_error:
            return Outcome("abort", UNEXPECTED, _error_text(reply), reply.e2e)
        return Outcome("abort", OK, e2e=reply.e2e, ttft=reply.ttft)

    async def _json_schema(self, tenant: Tenant) -> Outcome:
        body = {
            "input_ids": self.rng.choice(tenant.prompts),
            "sampling_params": {"max_new_tokens": 64, "json_schema": json.dumps(SCHEMA)},
            "cache_salt": tenant.salt,
        }
        reply = await self._post("/generate", body, tenant.headers)

        def check(text: str) -> None:
            jsonschema.validate(json.loads(text), SCHEMA)

        return _judge("json_schema", reply, _native_final, check)

    async def _regex(self, tenant: Tenant) -> Outcome:
        body = {
            "prompt": self.rng.choice(tenant.prompts),
            "max_tokens": 32,
            "regex": REGEX,
            "cache_salt": tenant.salt,
        }
        reply = await self._post("/v1/completions", body, tenant.headers)

        def check(text: str) -> None:
            if re.fullmatch(REGEX, text) is None:
                raise ValueError(f"{text!r} does not match {REGEX!r}")

        return _judge("regex", reply, partial(_openai_final, chat=False), check)

    async def _long_prompt(self, tenant: Tenant) -> Outcome:
        lo = min(1000, self.vocab // 4)
        ids = [self.rng.randrange(lo, self.vocab) for _ in range(self.long_len)]
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 8},
            "cache_salt": tenant.salt,
        }
        reply = await self._post("/generate", body, tenant.headers)
        return _judge("long_prompt", reply, _native_final)

    async def _bad(self, tenant: Tenant) -> Outcome:
        bad = self.bad[self.sent_bad % len(self.bad)]
        self.sent_bad += 1
        headers = bad.headers if bad.headers is not None else tenant.headers
        reply = await self._post(bad.path, bad.body, headers, raw=bad.raw)
        error = reply.data.get("error") if isinstance(reply.data, dict) else None
        if reply.status == bad.status and isinstance(error, dict) and error.get("message"):
            return Outcome("bad", EXPECTED, f"{bad.what}: HTTP {reply.status}", reply.e2e)
        return Outcome(
            "bad", UNEXPECTED, f"{bad.what}: HTTP {reply.status}, not {bad.status}", reply.e2e
        )

    # ---- HTTP ---------------------------------------------------------------------------

    async def _post(
        self,
        path: str,
        body: Any,
        headers: dict[str, str],
        stream: bool = False,
        drop_after: int | None = None,
        raw: bytes | None = None,
    ) -> Reply:
        """`drop_after`: close the connection after that many stream events (a client abort)."""
        start = time.perf_counter()
        send: dict[str, Any] = {"data": raw} if raw is not None else {"json": body}
        async with self.session.post(self.url + path, headers=headers, **send) as resp:
            if resp.status != 200 or not stream:
                data = await resp.json(content_type=None)
                retry_after = resp.headers.get("Retry-After")
                return Reply(resp.status, time.perf_counter() - start, data, [], None, retry_after)
            reply = Reply(200, 0.0)
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if reply.ttft is None:
                    reply.ttft = time.perf_counter() - start
                reply.events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
                if drop_after is not None and len(reply.events) >= drop_after:
                    resp.close()  # NOTE: closes the connection: the server sees a disconnect
                    break
            reply.e2e = time.perf_counter() - start
            return reply


def _bad_requests(context: int, vocab: int, with_keys: bool) -> list[BadRequest]:
    bad = [
        BadRequest(
            "prompt longer than the context", "/generate", 400, {"input_ids": [1] * context}
        ),
        BadRequest(
            "negative temperature",
            "/generate",
            400,
            {"text": "Hi", "sampling_params": {"temperature": -1}},
        ),
        BadRequest("malformed JSON", "/generate", 400, raw=b'{"text": "Hi",'),
        BadRequest(
            "max_tokens beyond the context",
            "/v1/completions",
            400,
            {"prompt": "Hi", "max_tokens": 2 * context},
        ),
        BadRequest("token id outside the vocabulary", "/generate", 400, {"input_ids": [vocab]}),
        BadRequest("n of the wrong type", "/v1/completions", 400, {"prompt": "Hi", "n": "two"}),
        BadRequest(
            "unknown model", "/v1/completions", 404, {"model": "no-such-model", "prompt": "Hi"}
        ),
    ]
    if with_keys:
        bad.append(
            BadRequest(
                "wrong API key",
                "/generate",
                401,
                {"text": "Hi"},
                headers={"Authorization": "Bearer not-the-key"},
            )
        )
    return bad


# ---- judging answers ----------------------------------------------------------------------

Final = Callable[[Reply], tuple[str, str | None]]  # (output text, finish reason)


def _judge(
    kind: str, reply: Reply, final: Final, check: Callable[[str], None] | None = None
) -> Outcome:
    """A success has status 200, no error event, a complete stream and a normal finish; a
    constrained output that stopped (not cut by the length) must satisfy `check`."""
    if _busy(reply):
        return Outcome(kind, BUSY, _error_text(reply), reply.e2e)
    if reply.status != 200 or reply.stream_error:
        return Outcome(kind, UNEXPECTED, _error_text(reply), reply.e2e)
    if reply.events and reply.events[-1] != "[DONE]":
        return Outcome(kind, UNEXPECTED, "the stream ended without [DONE]", reply.e2e)
    text, finish = final(reply)
    if finish not in ("stop", "length"):
        return Outcome(kind, UNEXPECTED, f"finish reason {finish!r}", reply.e2e)
    if check is not None and finish == "stop":
        try:
            check(text)
        except (ValueError, jsonschema.ValidationError) as exc:
            message = str(exc).splitlines()[0]
            return Outcome(kind, UNEXPECTED, f"output breaks its constraint: {message}", reply.e2e)
    return Outcome(kind, OK, e2e=reply.e2e, ttft=reply.ttft)


def _busy(reply: Reply) -> bool:
    """An explicit refusal under load (--max-queued-requests): not an error of the server."""
    return reply.status == 503 and reply.retry_after is not None


def _native_final(reply: Reply) -> tuple[str, str | None]:
    last = reply.data if not reply.events else reply.events[-2]  # the last chunk, cumulative
    reason = last["meta_info"]["finish_reason"] or {}
    return str(last["text"]), reason.get("type")


def _openai_final(reply: Reply, chat: bool) -> tuple[str, str | None]:
    if not reply.events:
        choice = reply.data["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        return str(text or ""), choice["finish_reason"]
    text, finish = "", None
    for event in reply.events[:-1]:
        for choice in event.get("choices") or []:
            text += (choice["delta"].get("content") or "") if chat else choice["text"]
            finish = choice.get("finish_reason") or finish
    return text, finish


def _error_text(reply: Reply) -> str:
    if reply.status != 200:
        error = reply.data.get("error") if isinstance(reply.data, dict) else None
        message = error.get("message") if isinstance(error, dict) else reply.data
        return f"HTTP {reply.status}: {str(message)[:160]}"
    return f"error event: {reply.stream_error[:160]}"


# ---- the run --------------------------------------------------------------------------------


async def run_traffic(traffic: Traffic, mix: dict[str, int], args: Any) -> list[Outcome]:
    rng = random.Random(args.seed + 1)
    kinds, weights = list(mix), list(mix.values())
    gate = asyncio.Semaphore(args.max_concurrency)
    outcomes: list[Outcome] = []
    tasks: set[asyncio.Task[None]] = set()
    start = time.monotonic()
    end = start + args.duration_s

    async def one(kind: str) -> None:
        try:
            outcomes.append(await traffic.send(kind))
        finally:
            gate.release()

    async def progress() -> None:
        while True:
            await asyncio.sleep(args.progress_every_s)
            print(_progress_line(outcomes, len(tasks), time.monotonic() - start), flush=True)

    reporter = asyncio.create_task(progress())
    interval = 1.0 / args.request_rate
    next_send = start
    while (now := time.monotonic()) < end:
        if next_send > now:
            await asyncio.sleep(min(next_send, end) - now)
            continue
        await gate.acquire()  # at the concurrency cap: the rate drops, no burst follows
        if time.monotonic() >= end:
            gate.release()
            break
        task = asyncio.create_task(one(rng.choices(kinds, weights)[0]))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        next_send = max(next_send + interval, time.monotonic() - interval)
    await asyncio.gather(*tasks)
    reporter.cancel()
    print(_progress_line(outcomes, 0, time.monotonic() - start) + "  (load stopped)", flush=True)
    return outcomes


def _progress_line(outcomes: list[Outcome], in_flight: int, elapsed: float) -> str:
    n = Counter(o.result for o in outcomes)
    return (
        f"[{elapsed:6.0f} s] done {len(outcomes):6d}  unexpected errors {n[UNEXPECTED]}  "
        f"expected 4xx {n[EXPECTED]}  busy {n[BUSY]}  in flight {in_flight}"
    )


async def _get(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> Any:
    async with session.get(url, headers=headers) as resp:
        resp.raise_for_status()
        return await resp.json()


async def _idle_info(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str]
) -> dict[str, Any]:
    """Server info once nothing is pending, running or waiting (aborts end asynchronously)."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        info = dict(await _get(session, url + "/get_server_info", headers))
        busy = info["num_pending"] + info["num_running"] + info["num_waiting"]
        if busy == 0 or time.monotonic() > deadline:
            return info
        await asyncio.sleep(0.1)


async def soak(args: Any, url: str, server_pid: int | None) -> int:
    admin_key = args.admin_api_key or (args.api_key.split(",")[0] if args.api_key else None)
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        info = await _get(session, url + "/get_model_info", headers)
        traffic = Traffic(session, url, info, args)
        mix = dict(MIX)
        if not await traffic.chat_available():
            print("chat: off (the model has no chat template)")
            del mix["chat"], mix["chat_stream"]
        kv_start = await _idle_info(session, url, headers)
        rss_start = _rss(server_pid)
        print(
            f"soak: {args.duration_s:g} s at {args.request_rate:g} req/s, at most "
            f"{args.max_concurrency} at once, {args.tenants} tenants, model "
            f"{info.get('model_path')}",
            flush=True,
        )
        outcomes = await run_traffic(traffic, mix, args)
        kv_end = await _idle_info(session, url, headers)
        async with session.get(url + "/health") as resp:
            healthy = resp.status == 200
    rss_end = _rss(server_pid)
    return report(args, outcomes, (rss_start, rss_end), (kv_start, kv_end), healthy)


# ---- processes ------------------------------------------------------------------------------


def _local_server_pid(url: str) -> int | None:
    """The process listening on the URL's port, when the server runs on this machine."""
    parts = urlsplit(url)
    if parts.hostname not in ("127.0.0.1", "localhost", "::1", "0.0.0.0"):
        return None
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == parts.port:
                return conn.pid
    except psutil.AccessDenied:
        pass
    return None


def _rss(server_pid: int | None) -> dict[int, tuple[str, int]]:
    """pid -> (role, RSS bytes) of the server and its children."""
    if server_pid is None:
        return {}
    try:
        server = psutil.Process(server_pid)
        out = {server_pid: ("server", server.memory_info().rss)}
        children = server.children(recursive=True)
    except psutil.NoSuchProcess:
        return {}
    lines: dict[int, tuple[str, int]] = {}
    for child in children:
        with contextlib.suppress(psutil.Error):  # ended meanwhile
            lines[child.pid] = (" ".join(child.cmdline()), child.memory_info().rss)
    # the launcher spawns the scheduler first, then the detokenizer
    spawned = sorted(pid for pid, (line, _) in lines.items() if "spawn_main" in line)
    roles = dict(zip(spawned, ("scheduler", "detokenizer"), strict=False))
    for pid, (line, rss) in lines.items():
        other = "resource tracker" if "resource_tracker" in line else line[:24]
        out[pid] = (roles.get(pid, other), rss)
    return out


# ---- the report -----------------------------------------------------------------------------


def report(
    args: Any,
    outcomes: list[Outcome],
    rss: tuple[dict[int, tuple[str, int]], dict[int, tuple[str, int]]],
    kv: tuple[dict[str, Any], dict[str, Any]],
    healthy: bool,
) -> int:
    by_kind: dict[str, list[Outcome]] = defaultdict(list)
    for o in outcomes:
        by_kind[o.kind].append(o)
    print(f"\n===== soak: {len(outcomes)} requests in {args.duration_s:g} s =====")
    print(
        f"{'kind':<14}{'sent':>6}{'ok':>6}{'4xx ok':>8}{'busy':>6}{'errors':>8}"
        f"{'E2E p50':>10}{'E2E p99':>10}{'TTFT p50':>10}{'TTFT p99':>10}  (ms)"
    )
    for kind in sorted(by_kind):
        print(_kind_row(kind, by_kind[kind]))
    print(_kind_row("all", outcomes))
    unexpected = [o for o in outcomes if o.result == UNEXPECTED]
    for result, title in (
        (UNEXPECTED, "unexpected errors"),
        (EXPECTED, "expected 4xx"),
        (BUSY, "busy (503 + Retry-After)"),
    ):
        of_result = Counter((o.kind, o.message) for o in outcomes if o.result == result)
        print(f"\n{title}: {of_result.total()}")
        for (kind, message), n in of_result.most_common(10):
            print(f"  {n:5d} x {kind}: {message}")

    print(f"\n{'RSS (MiB)':<18}{'pid':>7}{'start':>9}{'end':>9}{'change':>9}")
    start, end = rss
    if not start:
        print("  n/a (the server does not run on this machine)")
    for pid, (role, before) in start.items():
        after = end.get(pid)
        shown = (
            f"{after[1] / 2**20:9.1f}{(after[1] - before) / 2**20:+9.1f}" if after else "     gone"
        )
        print(f"  {role:<16}{pid:>7}{before / 2**20:9.1f}{shown}")

    problems = [f"{len(unexpected)} unexpected errors"] if unexpected else []
    if not healthy:
        problems.append("/health is not 200 after the run")
    print("\nKV pool (once idle)")
    for when, info in zip(("start", "end"), kv, strict=True):
        line, problem = _kv_line(info)
        print(f"  {when:<6}{line}")
        if problem:
            problems.append(f"KV pool at {when}: {problem}")
    print("\nresult: " + ("PASS" if not problems else "FAIL: " + "; ".join(problems)))
    return 1 if problems else 0


def _kv_line(info: dict[str, Any]) -> tuple[str, str]:
    pool = info["kv_pool"]
    total, free, cached, in_use = pool["total"], pool["free"], pool["cached"], pool["in_use"]
    integrity = "integrity ok" if info["kv_integrity_ok"] else "INTEGRITY FAILED"
    line = f"total {total} = free {free} + cached {cached} + in use {in_use}   {integrity}"
    busy = info["num_pending"] + info["num_running"] + info["num_waiting"]
    if free + cached + in_use != total:
        return line, "free + cached + in use != total"
    if not info["kv_integrity_ok"]:
        return line, str(info.get("kv_integrity_error"))
    if busy or in_use:
        return line, f"not idle: {busy} requests, {in_use} slots in use"
    return line, ""


def _kind_row(kind: str, outcomes: list[Outcome]) -> str:
    n = Counter(o.result for o in outcomes)
    ok = [o for o in outcomes if o.result == OK]
    e2e = _p50_p99([o.e2e for o in ok])
    ttft = _p50_p99([o.ttft for o in ok if o.ttft is not None])
    return (
        f"{kind:<14}{len(outcomes):6d}{n[OK]:6d}{n[EXPECTED]:8d}{n[BUSY]:6d}{n[UNEXPECTED]:8d}"
        f"{e2e}{ttft}"
    )


def _p50_p99(seconds: list[float]) -> str:
    if not seconds:
        return f"{'-':>10}{'-':>10}"
    ms = percentiles_ms(seconds)
    return f"{ms['p50']:10.1f}{ms['p99']:10.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (or use --launch)")
    p.add_argument(
        "--launch",
        default=None,
        metavar="SERVER_ARGS",
        help='start `weft serve` with these flags, e.g. "--model-path M --max-total-tokens 8192"',
    )
    p.add_argument("--duration-s", type=float, default=600.0, help="how long the load runs")
    p.add_argument("--request-rate", type=float, default=4.0, help="requests per second")
    p.add_argument("--max-concurrency", type=int, default=32)
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--api-key", default=None, help="KEY[,KEY...]: the tenants' keys, in turn")
    p.add_argument(
        "--admin-api-key",
        default=None,
        help="the server's --admin-api-key (needed for /get_server_info when it has tenants)",
    )
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--progress-every-s", type=float, default=10.0)
    p.add_argument("--timeout", type=float, default=120.0, help="per request, in seconds")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    if (args.url is None) == (args.launch is None):
        p.error("give exactly one of --url and --launch")
    if args.request_rate <= 0 or args.max_concurrency < 1 or args.tenants < 1:
        p.error("--request-rate, --max-concurrency and --tenants must be positive")

    if args.url:
        url = args.url.rstrip("/")
        sys.exit(asyncio.run(soak(args, url, _local_server_pid(url))))
    server = LaunchedServer(args.launch)
    try:
        code = asyncio.run(soak(args, server.url, server.proc.pid))
    finally:
        server.stop()
    sys.exit(code)


if __name__ == "__main__":
    main()
