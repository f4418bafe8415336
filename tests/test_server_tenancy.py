"""API-key tenants (--api-keys-file): who may call, and the proof that no tenant ever gets a
prefix-cache hit on another tenant's KV while a tenant does hit its own (cache_salt splits a
tenant further); the routes that reach every tenant take the admin key (--admin-api-key)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from weft.runtime.server.middleware import cache_namespace, read_api_keys_file
from weft.runtime.server_config import ServerConfig

from server_utils import ServerProcess, stories_args

KEYS = {"key-alpha": "alpha", "key-beta": "beta"}
SINGLE_KEY = "key-single"  # --api-key: tenant "default"
ADMIN_KEY = "key-admin"  # --admin-api-key: tenant "admin"
MAX_BODY = 64 * 1024


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


class KeyedServer(ServerProcess):
    """GETs carry the admin key (the KV audit's /get_server_info among them); POSTs only the
    headers a test gives."""

    def get(self, path: str, **kwargs: Any) -> requests.Response:
        kwargs.setdefault("headers", bearer(ADMIN_KEY))
        return super().get(path, **kwargs)


@pytest.fixture(scope="module")
def server(stories_dir, tmp_path_factory):
    keys_file = tmp_path_factory.mktemp("keys") / "keys.json"
    keys_file.write_text(json.dumps(KEYS))
    srv = KeyedServer(
        *stories_args(stories_dir),
        "--context-length",
        "4096",
        "--served-model-name",
        "stories",
        "--api-keys-file",
        str(keys_file),
        "--api-key",
        SINGLE_KEY,
        "--admin-api-key",
        ADMIN_KEY,
        "--enable-metrics",
        "--max-request-body-bytes",
        str(MAX_BODY),
    )
    yield srv
    srv.assert_kv_intact()
    assert srv.stop() == 0


def generate(srv: ServerProcess, key: str, body: dict) -> requests.Response:
    return srv.post("/generate", body, headers=bearer(key))


def test_every_key_is_accepted_and_no_other(server):
    body = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}
    r = server.post("/generate", body)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert generate(server, "key-gamma", body).status_code == 401
    assert generate(server, "key-alph", body).status_code == 401  # a prefix is not the key
    for key in [*KEYS, SINGLE_KEY, ADMIN_KEY]:
        r = generate(server, key, body)
        assert r.status_code == 200, (key, r.text)
    assert requests.get(server.url + "/health", timeout=10).status_code == 200  # no key needed
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="key-beta", max_retries=0)
    assert client.completions.create(model="stories", prompt="Hi", max_tokens=2).choices


def test_server_info_shows_no_key(server):
    r = server.get("/get_server_info")
    assert r.status_code == 200
    info = r.json()
    assert info["api_key"] == info["api_keys_file"] == info["admin_api_key"] == "<set>"
    for key in [*KEYS, SINGLE_KEY, ADMIN_KEY]:
        assert key not in r.text


@pytest.mark.parametrize(
    "method,path",
    [
        ("get", "/get_server_info"),
        ("get", "/server_info"),
        ("get", "/flush_cache"),
        ("post", "/flush_cache"),
    ],
)
def test_routes_reaching_every_tenant_take_the_admin_key(server, method, path):
    for key in ["key-alpha", SINGLE_KEY]:
        r = requests.request(method, server.url + path, headers=bearer(key), timeout=30)
        assert r.status_code == 403, (key, r.text)
        error = r.json()["error"]
        assert error["code"] == "admin_key_required"
        assert "reaches every tenant" in error["message"] and "--admin-api-key" in error["message"]
    assert requests.request(method, server.url + path, timeout=30).status_code == 401
    r = requests.request(method, server.url + path, headers=bearer(ADMIN_KEY), timeout=30)
    assert r.status_code == 200, r.text
    paths = server.get("/openapi.json").json()["paths"]
    assert "403" in paths[path][method]["responses"] and "401" in paths[path][method]["responses"]
    assert "403" not in paths["/generate"]["post"]["responses"]  # a tenant's route


def _prompt(first: int) -> list[int]:
    """300 token ids starting with a token no other prompt here starts with."""
    return [first] + [(7 * i + first) % 500 + 5 for i in range(299)]


def _cached(server: ServerProcess, key: str, ids: list[int], salt: str | None = None) -> int:
    body: dict = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}
    if salt is not None:
        body["cache_salt"] = salt
    r = generate(server, key, body)
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]["cached_tokens"]


def test_tenants_never_hit_each_others_prefix_cache(server):
    ids = _prompt(501)
    full = len(ids) - 1  # a repeat reuses all but the last prompt token
    assert _cached(server, "key-alpha", ids) == 0
    assert _cached(server, "key-beta", ids) == 0  # alpha's KV is not beta's
    assert _cached(server, SINGLE_KEY, ids) == 0  # nor the default tenant's
    assert _cached(server, ADMIN_KEY, ids) == 0  # nor the admin's
    assert _cached(server, "key-alpha", ids) == full  # each tenant hits its own
    assert _cached(server, "key-beta", ids) == full
    assert _cached(server, SINGLE_KEY, ids) == full
    assert _cached(server, ADMIN_KEY, ids) == full


def test_tenants_in_the_openai_api(server):
    ids = _prompt(502)

    def cached(key: str) -> int:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
        out = client.completions.create(model="stories", prompt=ids, max_tokens=1)
        assert out.usage is not None and out.usage.prompt_tokens_details is not None
        return out.usage.prompt_tokens_details.cached_tokens or 0

    assert cached("key-beta") == 0
    assert cached("key-alpha") == 0
    assert cached("key-beta") == len(ids) - 1


def test_cache_salt_splits_a_tenant(server):
    ids = _prompt(503)
    full = len(ids) - 1
    assert _cached(server, "key-alpha", ids, salt="s1") == 0
    assert _cached(server, "key-alpha", ids, salt="s2") == 0
    assert _cached(server, "key-alpha", ids) == 0  # no salt is a namespace of its own
    assert _cached(server, "key-beta", ids, salt="s1") == 0  # same salt, another tenant
    assert _cached(server, "key-alpha", ids, salt="s1") == full
    assert _cached(server, "key-beta", ids, salt="s1") == full


def _alpha_stream(server: ServerProcess, rid: str) -> tuple[threading.Thread, list[bytes]]:
    """A long stream of tenant alpha's (~10 s or more), started: its events as they come."""
    events: list[bytes] = []
    first = threading.Event()

    def run() -> None:
        body = {
            "input_ids": [1, 5, 9],
            "stream": True,
            "rid": rid,
            "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True},
        }
        with requests.post(
            server.url + "/generate",
            json=body,
            headers=bearer("key-alpha"),
            stream=True,
            timeout=60,
        ) as r:
            for line in r.iter_lines():
                if line.startswith(b"data: "):
                    events.append(line[6:])
                    first.set()

    thread = threading.Thread(target=run)
    thread.start()
    assert first.wait(30)
    return thread, events


def test_a_tenant_aborts_its_own_requests_only_and_the_admin_anyones(server):
    streams = [_alpha_stream(server, rid) for rid in ("alpha-run", "alpha-run-2")]
    r = server.post("/abort_request", {"rid": "alpha-run"}, headers=bearer("key-beta"))
    assert r.status_code == 404  # beta does not see alpha's request
    assert server.post("/abort_request", {"abort_all": True}, headers=bearer("key-beta")).ok
    assert server.server_info()["num_pending"] == 2
    assert all(thread.is_alive() for thread, _ in streams)
    r = server.post("/abort_request", {"rid": "alpha-run"}, headers=bearer("key-alpha"))
    assert r.status_code == 200
    r = server.post("/abort_request", {"abort_all": True}, headers=bearer(ADMIN_KEY))
    assert r.status_code == 200  # every tenant's: alpha-run-2 too
    for thread, events in streams:
        thread.join(30)
        assert events[-1] == b"[DONE]"
        assert json.loads(events[-2])["meta_info"]["finish_reason"]["type"] == "abort"


def test_rids_are_scoped_per_tenant(server):
    # a tenant could learn that another's rid was live (a 400 "already in use") and take rids
    # first; each tenant now has a rid space of its own
    thread, events = _alpha_stream(server, "shared-rid")
    body = {"text": "Hi", "rid": "shared-rid", "sampling_params": {"max_new_tokens": 3}}
    r = server.post("/generate", body, headers=bearer("key-beta"))
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["id"] == "shared-rid"
    r = server.post("/generate", body, headers=bearer("key-alpha"))  # alpha's own is running
    assert r.status_code == 400 and r.json()["error"]["param"] == "rid"
    r = server.post("/abort_request", {"rid": "shared-rid"}, headers=bearer("key-beta"))
    assert r.status_code == 404  # beta's has finished; alpha's is not beta's to find
    assert thread.is_alive()
    r = server.post("/abort_request", {"rid": "shared-rid"}, headers=bearer("key-alpha"))
    assert r.status_code == 200
    thread.join(30)
    assert json.loads(events[-2])["meta_info"]["id"] == "shared-rid"
    assert json.loads(events[-2])["meta_info"]["finish_reason"]["type"] == "abort"


def test_cache_namespaces_are_distinct():
    names = {
        cache_namespace(None, None),
        cache_namespace("a", None),
        cache_namespace(None, "a"),
        cache_namespace("a", "b"),
        cache_namespace("b", "a"),
        cache_namespace("a", "b/salt:c"),
    }
    assert len(names) == 6
    assert cache_namespace("a", "b") == "tenant:a/salt:b"


@pytest.mark.parametrize(
    "text,words",
    [
        ("{", ["not valid JSON"]),
        ('["k"]', ["JSON object"]),
        ("{}", ["non-empty JSON object"]),
        ('{"k": 5}', ["non-empty string"]),
        ('{"k": ""}', ["non-empty string"]),
        ('{"": "t"}', ["empty key"]),
        ('{"k": "a/b"}', ["'/'"]),
        ('{"k": "a", "k": "b"}', ["twice", "'a'", "'b'"]),
    ],
)
def test_a_bad_keys_file_says_why(tmp_path, text, words):
    path = tmp_path / "keys.json"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        read_api_keys_file(path)
    for word in words:
        assert word in str(err.value)
    assert str(path) in str(err.value)


def test_the_single_key_must_not_name_another_tenant(tmp_path):
    from weft.runtime.server.middleware import load_api_keys

    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"k1": "alpha", "k2": "default"}))
    config = ServerConfig(api_keys_file=str(path), api_key="k2")
    assert load_api_keys(config) == {"k1": "alpha", "k2": "default"}
    with pytest.raises(ValueError, match="ambiguous"):
        load_api_keys(ServerConfig(api_keys_file=str(path), api_key="k1"))


def test_the_admin_key_is_a_key_of_its_own(tmp_path):
    from weft.runtime.server.middleware import load_api_keys

    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"k1": "alpha"}))
    config = ServerConfig(api_keys_file=str(path), api_key="k2", admin_api_key="k3")
    assert load_api_keys(config) == {"k1": "alpha", "k2": "default", "k3": "admin"}
    for admin in ("k1", "k2"):
        with pytest.raises(ValueError, match="admin key must be a key of its own"):
            load_api_keys(ServerConfig(api_keys_file=str(path), api_key="k2", admin_api_key=admin))
    path.write_text(json.dumps({"k1": "admin"}))
    with pytest.raises(ValueError, match="names a tenant 'admin'"):
        load_api_keys(ServerConfig(api_keys_file=str(path), admin_api_key="k3"))


def test_a_missing_keys_file_stops_the_start(tmp_path):
    missing: Path = tmp_path / "none.json"
    proc = subprocess.run(
        [sys.executable, "-m", "weft.launch_server", "--api-keys-file", str(missing)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "weft: cannot start: cannot read --api-keys-file" in proc.stderr
    assert str(missing) in proc.stderr


def _errors(srv: ServerProcess) -> dict[str, float]:
    text = srv.get("/metrics").text
    return {
        s.labels["kind"]: s.value
        for family in text_string_to_metric_families(text)
        if family.name == "weft:num_errors"
        for s in family.samples
        if s.name.endswith("_total")
    }


def test_refusals_are_counted_by_kind(server):
    """401s and 403s are counted apart from bad requests (the key middleware answers the 401s,
    the body-size middleware the 413s, before any handler)."""
    before = _errors(server)
    assert server.post("/generate", {"text": "hi"}).status_code == 401
    assert generate(server, "key-gamma", {"text": "hi"}).status_code == 401
    assert server.post("/flush_cache", headers=bearer("key-alpha")).status_code == 403
    big = {"text": "x" * (MAX_BODY + 1), "sampling_params": {"max_new_tokens": 1}}
    assert generate(server, "key-alpha", big).status_code == 413
    after = _errors(server)
    assert {k: after[k] - before[k] for k in after} == {
        "bad_request": 1,
        "unauthorized": 2,
        "forbidden": 1,
        "overloaded": 0,
        "timeout": 0,
        "internal": 0,
        "aborted": 0,
    }


CLIENT = "127.0.0.1:PORT"


def _refusals(srv: ServerProcess, start: int, count: int) -> list[str]:
    """The server's refusal lines from its output line `start` on, once `count` are there (the
    output is read by a thread), the client's port as PORT."""
    deadline = time.monotonic() + 10
    while True:
        found = [line for line in srv.lines[start:] if " WARNING refused " in line]
        if len(found) >= count or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return [re.sub(r":\d+ \(", ":PORT (", line.split(" WARNING ", 1)[1].rstrip()) for line in found]


def test_each_refusal_is_logged_without_the_key(server):
    lines = len(server.lines)
    assert generate(server, "key-secret-guess", {"text": "hi"}).status_code == 401
    r = server.post("/abort_request", {"abort_all": True}, headers={"Authorization": "Basic eA=="})
    assert r.status_code == 401
    assert server.post("/generate", {"text": "hi"}).status_code == 401
    assert server.post("/flush_cache", headers=bearer("key-beta")).status_code == 403
    assert _refusals(server, lines, 4) == [
        f"refused POST /generate from {CLIENT} (401): an unknown API key",
        f"refused POST /abort_request from {CLIENT} (401): not a Bearer credential",
        f"refused POST /generate from {CLIENT} (401): no Authorization header",
        f"refused POST /flush_cache from {CLIENT} (403): /flush_cache with a tenant's key ('beta')",
    ]
    assert "key-secret-guess" not in server.output and "eA==" not in server.output


def test_the_scheme_is_case_insensitive(server):
    body = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}
    for header in ["bearer key-alpha", "BEARER key-alpha", "Bearer   key-alpha"]:
        r = server.post("/generate", body, headers={"Authorization": header})
        assert r.status_code == 200, (header, r.text)
    # the key itself is exact: not its case, nor a space inside, nor no scheme
    for header in [
        "Bearer KEY-ALPHA",
        "Bearer key- alpha",
        "Token key-alpha",
        "key-alpha",
        "Bearer",
    ]:
        r = server.post("/generate", body, headers={"Authorization": header})
        assert r.status_code == 401, (header, r.text)
