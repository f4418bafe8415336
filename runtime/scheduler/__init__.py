"""The scheduler and its parts: `scheduler` (the loop), `arrivals` (requests in), `admission`
(which requests run, by the memory budget), `batch_builder`, `constrained` (grammar masks and
drafts), `overlap` (tokens read back during the next forward), `output_processor`, `memory`."""

from weft.runtime.scheduler.admission import chunk_size_for_memory, default_chunk_size
from weft.runtime.scheduler.overlap import overlap_schedule
from weft.runtime.scheduler.scheduler import Scheduler, build_scheduler

__all__ = [
    "Scheduler",
    "build_scheduler",
    "chunk_size_for_memory",
    "default_chunk_size",
    "overlap_schedule",
]
