"""The one exception type that means "the user can fix this".

Anything raised as `UsageError` reaches the user as a single line on stderr and a non-zero exit code
(see `main.py`), instead of a traceback. Everything else is a bug and keeps its traceback.
"""


class UsageError(Exception):
    """A problem with the user's configuration, data or environment, explained in one line."""


def first_line(error: object) -> str:
    """The first non-blank line of an error's text: library errors often run on over many lines."""
    return next((line.strip() for line in str(error).splitlines() if line.strip()), "")


def describe(error: BaseException) -> str:
    """`Type: first line`, for one-line reports of errors that come from libraries (fsspec, s3fs, torch)."""
    return f"{type(error).__name__}: {first_line(error)}"
