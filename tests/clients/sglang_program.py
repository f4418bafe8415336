"""An SGLang frontend program run against a server: `python sglang_program.py URL`.

Imports `sglang.lang` without running `sglang/__init__.py` (which pulls in the whole SGLang
server stack): the frontend alone needs only requests, aiohttp and a few small packages.
Prints one JSON object with what the program produced.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types

spec = importlib.util.find_spec("sglang")
assert spec is not None and spec.submodule_search_locations
package = types.ModuleType("sglang")
package.__path__ = list(spec.submodule_search_locations)
sys.modules["sglang"] = package

from sglang.lang.api import function, gen, select  # noqa: E402
from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint  # noqa: E402


@function
def story(s, name):
    s += "Once upon a time, there was a little " + select("animal", choices=["cat", "dog", "tree"])
    s += f" named {name}. " + gen("rest", max_tokens=24, temperature=0, stop=".")


def main() -> None:
    backend = RuntimeEndpoint(sys.argv[1])
    state = story.run(name="Tim", backend=backend)
    streamed = story.run(name="Tim", backend=backend, stream=True)
    pieces = list(streamed.text_iter())
    batch = story.run_batch([{"name": "Ann"}, {"name": "Bob"}], backend=backend)
    print(
        json.dumps(
            {
                "animal": state["animal"],
                "rest": state["rest"],
                "text": state.text(),
                "streamed_text": "".join(pieces),
                "batch": [s["rest"] for s in batch],
                "model": backend.get_model_name(),
            }
        )
    )


if __name__ == "__main__":
    main()
