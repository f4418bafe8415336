"""The same agent through the official openai client's `tools`, against `weft serve`: the server
constrains each call's arguments to the tool's schema and returns `message.tool_calls`; this
script runs the Python tool and sends the result back as a `tool` message.

    weft serve --port 30000 &
    python examples/openai_tools_agent.py --url http://127.0.0.1:30000

NOTE: the embedded 0.5B model, given `tool_choice="auto"`, answers in plain text (or bare
JSON) instead of calling a tool. The first turn here names the choice ("required": some tool
must be called), and the answer turn passes "none". Larger models call tools on "auto".
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from dsl_agent import TOOLS

TOOL_SPECS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression (+ - * / and parentheses).",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "pattern": r"^[0-9+\-*/(). ]+$"}},
                "required": ["expression"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Today's weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
]


SYSTEM = (
    "Answer the user's question; use a tool when it helps. Given a tool's result, answer in "
    "one plain English sentence."
)


def ask(client: Any, model: str, question: str) -> tuple[list[dict[str, Any]], str]:
    """(the calls made with their results, the final answer)."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": question},
    ]
    first = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=TOOL_SPECS,
        tool_choice="required",
        temperature=0,
        max_tokens=96,
    )
    message = first.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    calls = []
    for call in message.tool_calls or []:
        args = json.loads(call.function.arguments)
        result = TOOLS[call.function.name](*args.values())
        calls.append({"name": call.function.name, "arguments": args, "result": result})
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    final = client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=48
    )
    return calls, final.choices[0].message.content or ""


def main(url: str) -> list[tuple[list[dict[str, Any]], str]]:
    from openai import OpenAI

    client = OpenAI(base_url=url.rstrip("/") + "/v1", api_key="none")
    model = client.models.list().data[0].id
    out = []
    for question in ["What is 17 * 23 + 4?", "What is the weather in Tokyo today?"]:
        calls, answer = ask(client, model, question)
        print(f"Q: {question}")
        for c in calls:
            print(f"  called {c['name']}({c['arguments']}) -> {c['result']}")
        print(f"  A: {answer}")
        out.append((calls, answer))
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True, help="a running weft server")
    main(parser.parse_args().url)
