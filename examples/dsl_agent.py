"""A ReAct-style agent with two Python tools, as a weft program: the model thinks, picks an
action with `select` (a tool or "finish"), writes the tool's input under a regex, and the
program runs the tool and writes its answer in as an Observation, until the model finishes.

python examples/dsl_agent.py [--url http://127.0.0.1:30000]
"""

from __future__ import annotations

import ast
import operator
from typing import Any

from dsl_common import backend_from_args, close

import weft

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
}
WEATHER = {"paris": "12 C, light rain", "tokyo": "18 C, clear", "cairo": "31 C, sunny"}


def calculator(expression: str) -> str:
    """Arithmetic (+ - * / and parentheses) on numbers, without eval."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("not arithmetic")

    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"
    return f"{result:g}"


def weather(city: str) -> str:
    return WEATHER.get(city.strip().lower(), f"no weather for {city.strip()!r}")


TOOLS = {"calculator": calculator, "weather": weather}
# what each tool's input may look like: the model cannot write anything else there
INPUTS = {"calculator": r"[0-9(][0-9+\-*/(). ]{0,39}", "weather": r"[A-Z][a-z]{1,20}"}
SYSTEM = """You answer the user's question with tools. At each step write a Thought, then an \
Action: calculator (its Input is an arithmetic expression), weather (its Input is a city) or \
finish (then write the Answer). Each tool's answer follows as an Observation.

Examples:
Question: What is 6 * (2 + 5)?
Thought: I need to compute 6 * (2 + 5).
Action: calculator
Input: 6 * (2 + 5)
Observation: 42
Thought: I know the answer now.
Action: finish
Answer: 6 * (2 + 5) is 42.

Question: How warm is it in Cairo?
Thought: I need the weather in Cairo.
Action: weather
Input: Cairo
Observation: 31 C, sunny
Thought: I know the answer now.
Action: finish
Answer: It is 31 C and sunny in Cairo."""


@weft.function
def agent(s, question: str, max_steps: int = 3):
    s += weft.system(SYSTEM)
    s += weft.user(question)
    with s.assistant():  # one turn: the scratchpad, with the tools' observations written in
        for _ in range(max_steps):
            s += "Thought: " + weft.gen("thought", max_tokens=24, stop="\n")
            s += "\nAction: " + weft.select("action", [*TOOLS, "finish"])
            if s["action"] == "finish":
                s += "\nAnswer: " + weft.gen("answer", max_tokens=40, stop="\n")
                return
            s += "\nInput: " + weft.gen("input", regex=INPUTS[s["action"]])
            observation = TOOLS[s["action"]](s["input"])
            s["observations"] = [*s.variables.get("observations", []), observation]
            s += f"\nObservation: {observation}\n"


def main(backend: Any) -> list[Any]:
    questions = ["What is 17 * 23 + 4?", "What is the weather in Tokyo today?"]
    states = []
    for question in questions:
        s = agent.run(question=question, backend=backend, temperature=0)
        print(f"Q: {question}")
        print("  " + s.messages()[-1]["content"].replace("\n", "\n  "))
        states.append(s)
    return states


if __name__ == "__main__":
    backend, args = backend_from_args(__doc__ or "")
    try:
        main(backend)
    finally:
        close(backend)
