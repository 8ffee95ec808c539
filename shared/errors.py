"""What a task group's failure was, as one exception: the first one it holds (the others are the
cancellations it caused, or failures of the same kind). Stdlib only: this runs on nodes too."""

from __future__ import annotations


def first_error(group: BaseExceptionGroup) -> BaseException:
    """The first exception in ``group``, however deeply nested: its own error, not a group of one."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc
