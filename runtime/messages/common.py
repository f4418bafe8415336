"""Message types that travel on more than one channel (forwarded unchanged by the detokenizer)."""

from __future__ import annotations

from typing import Any

import msgspec

# (logprob, token id, top alternatives [(logprob, token id)]); the logprob of the first prompt
# token is None (nothing predicts it).
LogprobEntry = tuple[float | None, int, list[tuple[float, int]]]


class GrammarReport(msgspec.Struct, array_like=True):
    """A constrained request's decoding so far, as meta_info reports it (`weft.runtime.results`)."""

    backend: str  # the grammar backend that serves the request's constraint
    jump_forward_tokens: int  # forced tokens the model took from jump-forward drafts
    wait_s: float = 0.0  # from the request's arrival at the scheduler to its grammar's end
    cached: bool = False  # its grammar was in the compile cache when it came


class SpecReport(msgspec.Struct, array_like=True):
    """A speculating request's drafts so far, as meta_info reports them (`weft.runtime.results`)."""

    verify_ct: int  # forwards that verified a draft of the request
    draft_tokens: int  # draft tokens verified (past a grammar's forced ones)
    accepted_tokens: int  # of those, the ones the model kept


class ModelInfo(msgspec.Struct):
    """What the scheduler knows once the model is loaded; the server validates requests with it."""

    model_path: str
    architecture: str
    vocab_size: int
    context_length: int  # max prompt + output tokens of one request (model and KV pool bound)
    kv_pool_size: int
    dtype: str
    device: str


class Ready(msgspec.Struct, tag="ready"):
    info: ModelInfo


class Reply(msgspec.Struct, tag="reply"):
    """The answer to a query (server info, cache flush)."""

    query_id: int
    body: dict[str, Any]


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    """The scheduler process is alive (sent every HEARTBEAT_S by a thread of its own, so it
    comes during a long step too, and stops only when the whole process is frozen or gone)."""

    steps: int  # scheduler steps so far: progress
    runnable: int  # requests it could step (running or waiting; a step is due)
    held: int  # all the requests it holds (the runnable ones and those waiting for a grammar)


class Fatal(msgspec.Struct, tag="fatal"):
    """A child failed for good (it exits right after sending this)."""

    process: str
    message: str
