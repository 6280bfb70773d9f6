"""Writes that survive a crash, shared by the snapshot store, sharded snapshots and the token cache: a file or
folder is written under a hidden temporary name, fsynced, renamed into place, and the rename made durable with an
fsync of the folder."""

from __future__ import annotations

import os
import uuid


def fsync_folder(path: str | os.PathLike) -> None:
    """Make the entries of a folder (a rename into it) durable."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def temporary_name(name: str) -> str:
    """A hidden name beside `name` that no other writer (process or attempt) picks."""
    return f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
