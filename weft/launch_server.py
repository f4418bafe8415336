"""`python -m weft.launch_server --model-path ...`: the same as `weft serve` (SGLang's spelling)."""

from __future__ import annotations

import sys

from weft.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
