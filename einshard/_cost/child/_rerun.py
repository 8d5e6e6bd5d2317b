"""The script being run, run again in a child process to find a step defined in it.

A step defined in the script a user runs (``python train.py``) lives in that script's
``__main__``, and pickle names it there: a child process finds it only by running the script's
top level again, as ``multiprocessing``'s spawn does, under the name ``__mp_main__`` (work under
``if __name__ == '__main__':`` does not run again). This module decides when that second run
happens and what it does:

* only when the payload needs a name of ``__main__`` (:func:`pickled` records them while it
  pickles): a step importable from a module crosses without it;
* it stops at the script's first call of ``explain_step``, ``plan`` or ``plan_batches``
  (:func:`stop_if_rerunning`, asked by those functions' decorator): the script has then defined
  what the parent had when it called, and the call itself would compile again, or start a child
  of its own;
* it runs with the parent's ``sys.argv``; the child leaves out the device settings it makes
  (``_child``: the child's devices are made already);
* a script that fails there is an error naming its line and the guard that avoids the second run
  (:func:`script_error`), and so is a name the step needs that the second run did not define
  (:func:`undefined_error`).
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import sys
import time
import traceback
import types
from typing import Any

from ..._language._errors import EinshardError

__all__ = [
    "Rerun",
    "Script",
    "ScriptStopped",
    "defined",
    "pickled",
    "run_script",
    "script_error",
    "script_of_main",
    "stop_if_rerunning",
    "undefined_error",
]

_GUARD = (
    "put the script's work under `if __name__ == '__main__':`, or define the step in a module the "
    "script imports (or give it as 'module:function'): then the script does not run again"
)

_rerunning = False  # whether this process is running the parent's script again, now


class ScriptStopped(BaseException):  # not an Exception: a script's `except Exception` lets it through
    """Raised at the script's first ``explain_step``, ``plan`` or ``plan_batches`` call in its second run."""


def stop_if_rerunning(caller: str) -> None:
    """Ends the script's second run here, at its first call of a cost-wing entry point.

    Raises:
        ScriptStopped: In a child process running the parent's script again.
    """
    if _rerunning:
        raise ScriptStopped(caller)


class _Pickler(pickle.Pickler):
    """A pickler that records the qualified names of the ``__main__`` objects it pickles by name."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.DEFAULT_PROTOCOL)
        self.main_names: list[str] = []

    def reducer_override(self, obj: Any) -> Any:
        try:
            module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
        except Exception:  # an object whose attributes fail to be read: pickled as it would be
            return NotImplemented
        if module == "__main__" and isinstance(name, str) and name not in self.main_names:
            self.main_names.append(name)
        return NotImplemented  # pickled as usual


def pickled(payload: Any) -> tuple[bytes, tuple[str, ...]]:
    """The payload pickled, and the names of the running script's ``__main__`` it refers to.

    Raises:
        Exception: As :func:`pickle.dumps` would, for what does not pickle.
    """
    buffer = io.BytesIO()
    pickler = _Pickler(buffer)
    pickler.dump(payload)
    return buffer.getvalue(), tuple(pickler.main_names)


@dataclasses.dataclass(frozen=True)
class Script:
    """The running script, as a child process runs it again.

    Attributes:
        path: Its file.
        argv: The parent's ``sys.argv``: the script's second run parses the same arguments.
        package: The package it was run from with ``python -m``, else ``''``.
        names: The names of its ``__main__`` the step and its arguments need.
    """

    path: str
    argv: tuple[str, ...]
    package: str
    names: tuple[str, ...]


def script_of_main(names: tuple[str, ...], n_devices: int) -> Script | None:
    """The running script, when ``names`` of its ``__main__`` must cross into a child; else ``None``.

    Raises:
        EinshardError: When ``__main__`` is no file a child could run (a notebook, the REPL,
            ``python -c``).
    """
    if not names:
        return None
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not isinstance(path, str) or not os.path.isfile(path):
        listed = ", ".join(repr(name) for name in names)
        raise EinshardError(
            f"the step cannot cross into a child process with {n_devices} devices: it needs {listed}, "
            "defined in an interactive session (a notebook, the REPL), which the child cannot run again",
            hint="Define the step (and what it needs) in a module and import it, or give it as "
            "'module:function'; or compile it in this process: without n_devices= (or at this "
            "machine's device count) and without a target.",
        )
    spec = getattr(main, "__spec__", None)
    package = getattr(spec, "parent", None) or ""
    return Script(os.path.abspath(path), tuple(sys.argv), package, names)


@dataclasses.dataclass(frozen=True)
class Rerun:
    """What the script's second run did.

    Attributes:
        module: Its namespace, as ``__main__`` and ``__mp_main__``.
        stopped_at: Where it stopped (``'its first explain_step call (train.py:14)'``), or
            ``None``: it ran to its end.
        seconds: How long it ran.
    """

    module: types.ModuleType
    stopped_at: str | None
    seconds: float


def run_script(script: Script) -> Rerun:
    """Runs the script's top level again as ``__mp_main__``, up to its first cost-wing call.

    Raises:
        EinshardError: The script failed there (:func:`script_error`).
    """
    global _rerunning
    module = types.ModuleType("__mp_main__")
    module.__dict__.update(__file__=script.path, __package__=script.package, __spec__=None, __loader__=None)
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module
    argv, sys.argv = sys.argv, list(script.argv)
    stopped_at = None
    start = time.perf_counter()
    _rerunning = True
    try:
        with open(script.path, "rb") as file:
            code = compile(file.read(), script.path, "exec", dont_inherit=True)
        exec(code, module.__dict__)
    except ScriptStopped as stop:
        where = _script_frames(stop.__traceback__, script.path)
        line = f" ({os.path.basename(script.path)}:{where[-1].lineno})" if where else ""
        stopped_at = f"its first {stop.args[0]} call{line}"
    except SystemExit as done:
        if done.code not in (None, 0):
            raise script_error(script, done) from None
    except Exception as error:
        raise script_error(script, error) from None
    finally:
        _rerunning = False
        sys.argv = argv
    return Rerun(module, stopped_at, time.perf_counter() - start)


def _script_frames(trace: types.TracebackType | None, path: str) -> list[traceback.FrameSummary]:
    """The frames of a traceback that are the script's own lines, outermost first."""
    return [frame for frame in traceback.extract_tb(trace) if frame.filename == path]


def script_error(script: Script, error: BaseException) -> EinshardError:
    """The error of a script that failed when a child process ran its top level again."""
    frames = _script_frames(error.__traceback__, script.path)
    name = os.path.basename(script.path)
    if frames:
        inner, outer = frames[-1], frames[0]
        where = f"{name}:{inner.lineno} ({(inner.line or '').strip()})"
        if outer.lineno != inner.lineno:
            where += f", reached from line {outer.lineno} ({(outer.line or '').strip()})"
    else:
        where = name
    message = str(error).strip().splitlines()
    failure = f"{type(error).__name__}: {message[0][:300]}" if message else type(error).__name__
    return EinshardError(
        f"the script's top level ran again in a child process, to find the step defined in it, and "
        f"failed at {where}: {failure}",
        hint=f"A step defined in the script you run is found by running the script again in the child "
        f"process, as multiprocessing does: {_GUARD}.",
    )


def undefined_error(script: Script, rerun: Rerun, name: str) -> EinshardError:
    """The error for a name of the script that its second run did not define."""
    when = (
        f"by {rerun.stopped_at}, where that run stops"
        if rerun.stopped_at is not None
        else "by its end (is it defined under `if __name__ == '__main__':`?)"
    )
    return EinshardError(
        f"the script's top level ran again in a child process, to find {name!r} defined in it, and "
        f"{name!r} was not defined {when}",
        hint=f"Define it at the top level of {os.path.basename(script.path)}, before its first "
        "explain_step, plan or plan_batches call, or in a module the script imports (or give the "
        "step as 'module:function').",
    )


def defined(module: types.ModuleType, name: str) -> bool:
    """Whether a qualified name (``'step'``, ``'Model.apply'``) is defined in the module."""
    found: Any = module
    for part in name.split("."):
        found = getattr(found, part, _MISSING)
        if found is _MISSING:
            return False
    return True


_MISSING = object()
