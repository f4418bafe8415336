"""A first weft program: constant text and a gen are sent as one request.

python examples/dsl_quickstart.py                 # the embedded default model, in-process
python examples/dsl_quickstart.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

from typing import Any

from dsl_common import backend_from_args, close

import weft


@weft.function
def explain(s, name: str, max_tokens: int):
    s += f"# A Python function named {name}\n"
    s += f"def {name}(" + weft.gen("signature", max_tokens=12, stop=":") + ":\n"
    s += '    """' + weft.gen("docstring", max_tokens=max_tokens, stop='"""') + '"""\n'


def main(backend: Any, max_tokens: int = 48) -> weft.frontend.ProgramState:
    print(explain.trace(name="fibonacci", max_tokens=max_tokens), "\n")
    s = explain.run(name="fibonacci", max_tokens=max_tokens, backend=backend, temperature=0)
    print(s.text())
    print("signature:", repr(s["signature"]))
    print("finish_reason:", s.get_meta_info("docstring")["finish_reason"])
    return s


if __name__ == "__main__":
    backend, args = backend_from_args(__doc__ or "")
    try:
        main(backend, args.max_tokens)
    finally:
        close(backend)
