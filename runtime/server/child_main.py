"""Entry points of the server's child processes.

NOTE: spawn passes a child's target by reference, so the child first imports the module that
holds it: this one imports nothing, and each entry point imports its process's module (torch,
the model) itself, while the launcher imports the HTTP stack meanwhile.
"""

from __future__ import annotations

from typing import Any


def scheduler_main(*args: Any) -> None:
    from weft.runtime.scheduler_process import run_scheduler_process

    run_scheduler_process(*args)


def detokenizer_main(*args: Any) -> None:
    from weft.runtime.detokenizer_process import run_detokenizer_process

    run_detokenizer_process(*args)


def rank_main(*args: Any) -> None:
    from weft.runtime.tp_processes import run_rank

    run_rank(*args)
