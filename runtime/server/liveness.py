"""Is the scheduler alive and advancing its requests? Told from its heartbeats (`Heartbeat`, sent
every second by a thread of the scheduler process): none for HEARTBEAT_TIMEOUT_S is a frozen
scheduler; requests pending and no step for STALL_HEALTH_S a stuck one. /health fails while
either lasts; past --watchdog-timeout the tokenizer manager gives up on the scheduler."""

from __future__ import annotations

import time

from weft.runtime.messages.common import Heartbeat

HEARTBEAT_TIMEOUT_S = 5.0  # no scheduler heartbeat (sent every second) this long: frozen
STALL_HEALTH_S = 30.0  # requests pending and no scheduler step this long: /health fails


class SchedulerClock:
    """The scheduler's last heartbeat and last step while requests were pending (monotonic)."""

    def __init__(self) -> None:
        self.heartbeat_at = time.monotonic()
        self.progress_at = self.heartbeat_at
        self._steps = -1

    def restart(self) -> None:
        """The stall clock counts from now (the server starts; the first request is pending)."""
        self.heartbeat_at = self.progress_at = time.monotonic()

    def on_heartbeat(self, beat: Heartbeat, pending: int) -> None:
        """The stall clock runs while requests are pending and the scheduler either has work to
        step and takes no step, or holds none of them (they were lost). Requests that only wait
        for their grammars are not a stall: the scheduler bounds that wait itself."""
        now = time.monotonic()
        self.heartbeat_at = now
        grammars_only = beat.runnable == 0 and beat.held > 0
        if beat.steps != self._steps or not pending or grammars_only:
            self._steps = beat.steps
            self.progress_at = now

    @property
    def silent_s(self) -> float:
        return time.monotonic() - self.heartbeat_at

    def liveness(self, pending: int, watchdog_s: float) -> tuple[str | None, float]:
        stuck = time.monotonic() - self.progress_at if pending else 0.0
        return scheduler_liveness(self.silent_s, stuck, pending, watchdog_s)


def scheduler_liveness(
    silent_s: float, stuck_s: float, pending: int, watchdog_s: float
) -> tuple[str | None, float]:
    """(why /health fails, or None; for how long the scheduler has not advanced) from the time
    since its last heartbeat, and since its last step while requests were pending."""
    if silent_s > HEARTBEAT_TIMEOUT_S:
        why = f"the scheduler process has not answered for {silent_s:.0f} s"
    elif pending and stuck_s > min(STALL_HEALTH_S, watchdog_s or float("inf")):
        why = (
            f"the scheduler holds {pending} pending request(s) and has not stepped for "
            f"{stuck_s:.0f} s"
        )
    else:
        why = None
    return why, max(silent_s, stuck_s if pending else 0.0)
