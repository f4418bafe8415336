"""Ask the weft server a question over its OpenAI-compatible API (standard library only).

    weft serve --port 30000 &          # in one shell (the embedded default model)
    python examples/quickstart.py      # in another

or let the example start (and stop) the server itself:

    python examples/quickstart.py --launch
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def wait_healthy(base: str, server: subprocess.Popen | None, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server is not None and server.poll() is not None:
            raise SystemExit(f"the server exited with code {server.returncode}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5):
                return
        except (urllib.error.URLError, ConnectionError):
            time.sleep(1)
    raise SystemExit(f"no server answered at {base} within {timeout:.0f} s")


def launch(port: int) -> tuple[subprocess.Popen, str]:
    """Start `weft serve` on a free port (port 0) and read the address from its ready line."""
    cmd = [
        sys.executable,
        "-m",
        "weft.launch_server",
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--max-total-tokens",
        "8192",
    ]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert server.stdout is not None
    for line in server.stdout:
        print(line, end="", file=sys.stderr)
        found = re.search(r"ready, serving .* at (http://\S+)", line)
        if found:
            return server, found.group(1).rstrip("/ ")
    raise SystemExit(f"the server exited with code {server.wait()}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:30000")
    p.add_argument("--launch", action="store_true", help="start weft serve for this run")
    p.add_argument("--max-tokens", type=int, default=200)
    args = p.parse_args()
    server = None
    base = args.url
    if args.launch:
        server, base = launch(0)
    try:
        wait_healthy(base, server)
        with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as resp:
            model = json.loads(resp.read())["data"][0]["id"]
        question = "Write a Python function that checks whether a string is a palindrome."
        t = time.perf_counter()
        out = post(
            f"{base}/v1/chat/completions",
            {
                "model": model,
                "messages": [{"role": "user", "content": question}],
                "temperature": 0,
                "max_tokens": args.max_tokens,
            },
        )
        elapsed = time.perf_counter() - t
        print(f"Q: {question}\n")
        print(out["choices"][0]["message"]["content"])
        usage = out["usage"]
        print(
            f"\n[{usage['completion_tokens']} tokens in {elapsed:.1f} s, "
            f"finish_reason={out['choices'][0]['finish_reason']}]"
        )
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)


if __name__ == "__main__":
    main()
