"""An exclusive lock beside a cache entry, so processes that need the same entry at once build
it one at a time: the first builds, the rest wait, then find it built (parallel test workers, or
several servers started together on a fresh machine).

NOTE: the builds stay atomic on their own (temp file or folder, then one rename): the lock only
saves the duplicate work, so where the file system refuses locks the block runs unlocked.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def cache_lock(entry: Path) -> Iterator[None]:
    """Hold an exclusive lock on `<entry>.lock` for the block; the file is removed at the end,
    so the cache holds nothing but its entries."""
    path = entry.with_name(entry.name + ".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released when fd closes, also if the process dies
        except OSError:
            break  # no locks on this file system
        # NOTE: the previous holder removed the file on its way out: a lock on a removed file
        # excludes nobody (a newcomer creates a new one), so lock the file now under the name
        with contextlib.suppress(FileNotFoundError):
            held, named = os.fstat(fd), os.stat(path)
            if (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino):
                break
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # before the unlock: a waiter then sees it gone and retries
        os.close(fd)
