"""The exception types the user sees, and which errors another attempt may fix.

Anything raised as `UsageError` reaches the user as a single line on stderr and a non-zero exit code
(see `main.py`), instead of a traceback. Everything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno


class UsageError(Exception):
    """A problem with the user's configuration, data or environment, explained in one line."""

    exit_code = 2


class Diverged(UsageError):
    """Training went non-finite for good (trainer_config.max_skipped_steps steps in a row, or a non-finite mean or
    validation loss): one line naming the newest good snapshot and what to change; its own exit code, so that a
    scheduler's script can tell it from a mistake in the settings."""

    exit_code = 3


def first_line(error: object) -> str:
    """The first non-blank line of an error's text: library errors often run on over many lines."""
    return next((line.strip() for line in str(error).splitlines() if line.strip()), "")


def describe(error: BaseException) -> str:
    """`Type: first line`, for one-line reports of errors that come from libraries (fsspec, s3fs, torch)."""
    return f"{type(error).__name__}: {first_line(error)}"


class CorruptSnapshot(Exception):
    """A snapshot that cannot be read back as written (truncated, damaged, not a snapshot at all)."""


# Errors another attempt cannot fix: fail the save at once instead of retrying into the same wall.
PERMANENT_ERRNOS = frozenset({errno.EROFS, errno.EFBIG, errno.EACCES, errno.EPERM, errno.ENAMETOOLONG,
                              errno.ENOTDIR, errno.EISDIR})


def is_permanent(error: BaseException) -> bool:
    """True for a write error that trying again cannot fix (read-only, too large, no permission, no bucket)."""
    if isinstance(error, (PermissionError, FileNotFoundError, NotADirectoryError, IsADirectoryError)):
        return True
    return isinstance(error, OSError) and error.errno in PERMANENT_ERRNOS
