"""The detokenizer process: token ids in, client-facing text out, one incremental decoder per
sample.

The text it produces is exactly the in-process Engine's: the same decoder class fed the same ids
one at a time, the same end-token and stop-string rules (told by the scheduler), and the same
hold-back of a possible stop-string prefix while a sample runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import assert_never

import zmq
from transformers import PreTrainedTokenizerBase

from weft.runtime.detokenize import IncrementalDecoder
from weft.runtime.ipc import (
    IpcNames,
    ParentWatch,
    exit_now,
    pull_socket,
    push_socket,
    setup_child,
)
from weft.runtime.messages import detokenizer_to_tokenizer as to_tm
from weft.runtime.messages import scheduler_to_detokenizer as from_sched
from weft.runtime.messages.common import Fatal, Ready, Reply
from weft.runtime.tokenizer import load_tokenizer, skipped_special_ids

logger = logging.getLogger("weft")

POLL_MS = 1000  # wake up this often to check that the parent is alive


@dataclass
class _Sample:
    decoder: IncrementalDecoder | None
    stop_hold: int
    sent: int = 0  # characters of decoder.text already sent


class Detokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.tokenizer = tokenizer
        # the tool-call markers are text (tokenizer.text_marker_ids), as the grammars see them
        self.skipped = skipped_special_ids(tokenizer) if tokenizer is not None else None
        self.samples: dict[str, _Sample] = {}

    def handle(self, msg: from_sched.ToDetokenizer) -> to_tm.ToTokenizer:
        """A step becomes text; control messages go on to the tokenizer manager unchanged."""
        match msg:
            case from_sched.Step():
                return self.step(msg)
            case Ready() | Reply() | Fatal():
                return msg
            case _:
                assert_never(msg)

    def step(self, step: from_sched.Step) -> to_tm.TextStep:
        for s in step.starts:
            decoder = None
            if self.tokenizer is not None:
                decoder = IncrementalDecoder(
                    self.tokenizer,
                    s.skip_special_tokens,
                    s.spaces_between_special_tokens,
                    self.skipped,
                )
            self.samples[s.rid] = _Sample(decoder, s.stop_hold)
        return to_tm.TextStep([self._update(u) for u in step.updates])

    def _update(self, u: from_sched.TokenUpdate) -> to_tm.TextUpdate:
        sample = self.samples.get(u.rid)
        if sample is None:  # cannot happen: starts travel in the same or an earlier step
            logger.error("detokenizer: update for unknown sample %s", u.rid)
            sample = self.samples[u.rid] = _Sample(None, 0)
        text = self._decode(sample, u)
        if u.finish is not None:
            del self.samples[u.rid]
        return to_tm.TextUpdate(
            rid=u.caller_rid,
            index=u.index,
            text=text,
            new_ids=u.new_ids,
            cached_tokens=u.cached_tokens,
            finish_reason=u.finish.reason if u.finish is not None else None,
            output_logprobs=u.output_logprobs,
            input_logprobs=u.input_logprobs,
            grammar=u.grammar,
            spec=u.spec,
        )

    @staticmethod
    def _decode(sample: _Sample, u: from_sched.TokenUpdate) -> str:
        decoder = sample.decoder
        if decoder is None:
            return ""
        ids = u.new_ids
        if u.finish is not None and not u.finish.decode_last:
            ids = ids[:-1]
        for tid in ids:  # one at a time, as the scheduler's decoder saw them
            decoder.push([tid])
        if u.finish is not None:
            if u.finish.text_len >= 0:
                decoder.text = decoder.text[: u.finish.text_len]
            else:
                decoder.flush()
            end = len(decoder.text)
        else:
            end = max(len(decoder.text) - sample.stop_hold, sample.sent)
        delta = decoder.text[sample.sent : end]
        sample.sent = end
        return delta


def run_detokenizer_process(
    tokenizer_folder: Path | None, log_level: str, ipc: IpcNames, parent_pid: int
) -> None:
    """Entry point of the child process (multiprocessing spawn); ends the process."""
    setup_child("detokenizer", log_level)
    ctx = zmq.Context()
    inbox = pull_socket(ctx, ipc.detokenizer)
    outbox = push_socket(ctx, ipc.tokenizer)
    watch = ParentWatch(parent_pid)
    try:
        detok = Detokenizer(load_tokenizer(tokenizer_folder) if tokenizer_folder else None)
        while True:
            if not inbox.poll(POLL_MS):
                if not watch.parent_alive():
                    logger.info("detokenizer: the server process is gone; exiting")
                    break
                continue
            outbox.send(to_tm.encoder.encode(detok.handle(from_sched.decoder.decode(inbox.recv()))))
            if watch.due() and not watch.parent_alive():
                break
    except SystemExit:  # SIGTERM: the server is stopping
        pass
    except Exception as exc:  # reported to the server, then the process exits
        logger.exception("detokenizer failed")
        outbox.send(to_tm.encoder.encode(Fatal("detokenizer", f"{type(exc).__name__}: {exc}")))
        outbox.close(linger=1000)
        exit_now(1)
    inbox.close()
    outbox.close()
    ctx.term()
    exit_now(0)
