"""What every entry point of the cost wing does first, before any of its own work."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from .child._rerun import stop_if_rerunning
from .report._report import refuses_accelerator

__all__ = ["entry_point"]

_F = TypeVar("_F", bound=Callable[..., Any])


def entry_point(*, step_kwargs: bool = False) -> Callable[[_F], _F]:
    """The decorator of ``explain_step``, ``plan`` and ``plan_batches``.

    A call first ends a child process's second run of the user's script, when this is one, at
    its first call of an entry point there (:func:`~einshard._cost.child._rerun.stop_if_rerunning`);
    then ``accelerator=`` raises the error naming ``target=``
    (:func:`~einshard._cost.report._report.refuses_accelerator`, with ``step_kwargs``).
    """

    def decorator(fn: _F) -> _F:
        refusing = refuses_accelerator(step_kwargs=step_kwargs)(fn)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            stop_if_rerunning(fn.__name__)
            return refusing(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorator
