"""Errors a user can trigger, each one line: what went wrong, and what to do about it.

Every error raised for user input or user state (paths, checkpoints, caches, disks) is an
``MmapOffloadError``. The CLI prints ``str(err)`` on one line and exits with ``err.exit_code``
(2 for bad input, 1 for a cache that failed verification); it never prints a traceback for them.
Code paths that are bugs keep raising ordinary exceptions.

    MmapOffloadError
    ├── CheckpointError        missing path, no safetensors, no MoE experts, malformed files
    ├── UnsupportedError       quantization or shape the layout cannot take (names tensor + rule)
    ├── CacheError             a cache directory that cannot be used
    │   ├── StaleCacheError    made for another checkpoint / quantization / TP / layout version
    │   ├── CorruptCacheError  checksum mismatch, truncated or malformed file (exit 1)
    │   └── CacheLockedError   another warm-up holds the lock
    └── StorageError           disk full, read-only or unwritable directory
"""

from __future__ import annotations


class MmapOffloadError(Exception):
    """Base of every user-facing error. ``str(err)`` is the one line the CLI prints."""

    exit_code = 2

    def __init__(self, message: str, fix: str | None = None):
        self.message = message
        self.fix = fix
        super().__init__(f"{message}: {fix}" if fix else message)


class CheckpointError(MmapOffloadError):
    pass


class UnsupportedError(MmapOffloadError):
    pass


class CacheError(MmapOffloadError):
    pass


class StaleCacheError(CacheError):
    pass


class CorruptCacheError(CacheError):
    exit_code = 1


class CacheLockedError(CacheError):
    pass


class StorageError(MmapOffloadError):
    pass


def mapped_read_error(path, offset: int, what: str | None, fix: str) -> CacheError:
    """The one line of a read of a mapped cache file that raised SIGBUS: the file, the offset, what lay
    there (a Copy's label, or layer / expert / tensor), the cause, and ``fix`` (the transfer engine's and
    the host kernel's readers say the same)."""
    return CacheError(f"reading cache file {path} at offset {offset}{f' ({what})' if what else ''} failed: the "
                      "file was truncated, or the disk returned an I/O error, while it was mapped (SIGBUS)", fix)
