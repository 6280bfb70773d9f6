"""The one exception type that means "the user can fix this".

Anything raised as `UsageError` reaches the user as a single line on stderr and a non-zero exit code
(see `main.py`), instead of a traceback. Everything else is a bug and keeps its traceback.
"""


class UsageError(Exception):
    """A problem with the user's configuration, data or environment, explained in one line."""
