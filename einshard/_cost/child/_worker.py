"""A compile in a child process, the child's side: what runs in ``python -c "... import main; main()"``.

It makes its devices first (``N`` simulated CPU devices, or a target's compile-only ones), runs
the user's script again where the step is defined there (``_rerun``, with the script's own
device settings left out), then reads the pickled step and each table's index from stdin and
writes its records (ready, compiling, warnings, memory, answer, or an error) to stdout, for the
parent's side (:mod:`._child`) to read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import pickle
import resource
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any

from ..._language._errors import EinshardError, EinshardWarning
from ..._sharding._devices import use_devices
from ..._tracing._batch_layout import use_strategy
from ..._tracing._call import StepCall
from ..hardware._compilers import target_devices
from ..pipeline._analysis import answer
from ._rerun import defined, run_script, undefined_error

__all__ = ["main"]


def main() -> None:
    """The child process: reads the payload, then each table's index, from stdin; writes records to stdout."""
    started = time.perf_counter()
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # stray prints of the step must not corrupt the answer
    import jax

    count = int(os.environ["JAX_NUM_CPU_DEVICES"])
    with contextlib.suppress(AttributeError):  # older JAX: XLA_FLAGS does it
        jax.config.update("jax_num_cpu_devices", count)
    jax.devices()  # start the backend now: the parent's script sets its own devices when it runs again
    stream = sys.stdin.buffer  # the payload, then each table's index as the parent sends it
    try:
        script = pickle.load(stream)
        if script is not None:
            with _parents_device_settings_left_out():
                rerun = run_script(script)
            _write(out, ("script", rerun.seconds))
            for name in script.names:
                if not defined(rerun.module, name):
                    raise undefined_error(script, rerun, name)
        payload = pickle.load(stream)
        call = StepCall.of(payload["fn"], payload["args"], payload["kwargs"])
        call = dataclasses.replace(call, donate=payload.get("donate", True))
    except EinshardError as error:
        _write(out, ("error", error))
        return
    except Exception as error:
        _write(out, ("error", f"{type(error).__name__}: {error}"))
        return
    target = payload.get("target")
    strategy = payload.get("strategy")
    devices = None
    if target is not None:
        try:
            devices = target_devices(target)
        except EinshardError as error:
            _write(out, ("error", error))
            return
    _write(out, ("ready", time.perf_counter() - started))
    while (index := _next_index(stream)) is not None:
        _write(out, ("compiling", index))
        with contextlib.ExitStack() as within:
            if devices is not None:
                within.enter_context(use_devices(devices))
            if strategy is not None:
                within.enter_context(use_strategy(strategy))
            warned = within.enter_context(warnings.catch_warnings(record=True))
            warnings.simplefilter("always", EinshardWarning)
            try:
                result = answer(call, payload["tables"][index], target)
            except Exception as error:  # einshard's own, reading the program: raised in the parent
                _write(out, ("raised", _crossing(error)))
                return
        # einshard's warnings of this compile (like_batch on another axis than the batch's ...)
        # are the user's to see: the parent warns them again, in order.
        mine = [
            (str(w.message), w.category, w.filename, w.lineno)
            for w in warned
            if issubclass(w.category, EinshardWarning)
        ]
        if mine:
            _write(out, ("warnings", mine))
        # The candidate's traces, lowerings and compiled program are not needed again: JAX's
        # caches would keep them all, and the child's memory would grow by each candidate's.
        jax.clear_caches()
        gc.collect()
        _write(out, ("memory", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))
        _write(out, ("answer", result))
        del result


def _crossing(error: Exception) -> Exception:
    """The error as the parent raises it: itself where it pickles, else an ``AssertionError`` of its text."""
    import traceback

    where = "".join(traceback.format_exception(error)[-6:])
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return AssertionError(f"{type(error).__name__}: {error} (please report it)\n{where}")
    with contextlib.suppress(Exception):
        error.add_note(f"raised in einshard's child process:\n{where}")
    return error


def _next_index(stream: Any) -> int | None:
    """The next table to compile, as the parent sends it; ``None`` at the end (or a parent gone)."""
    try:
        return pickle.load(stream)
    except Exception:
        return None


# What the user's script sets of the devices (JAX_NUM_CPU_DEVICES=8 at its top, as JAX's docs
# show) is the parent's business: the child's devices (its count, or the target's) are made
# before the script runs again, and JAX refuses a device count changed after that.
_DEVICE_OPTIONS = frozenset({"jax_num_cpu_devices", "jax_platforms", "jax_platform_name"})


_DEVICE_VARIABLES = ("XLA_FLAGS", "JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES")


@contextlib.contextmanager
def _parents_device_settings_left_out() -> Iterator[None]:
    """While the script runs again, its device settings do nothing: they are the parent's.

    A ``jax.config.update`` of a device option is left out, and the environment's device
    variables are the child's again afterwards. ``jax.config`` is one object, which the script's
    ``jax.config.update`` and ``from jax import config`` both reach: its ``update`` is shadowed
    by an attribute of the object for the while (``tests/test_child_script.py`` runs such a
    script, and fails if JAX's config stops taking the attribute).
    """
    import jax

    config: Any = jax.config
    update = config.update

    def update_unless_devices(name: str, value: Any) -> None:
        if name not in _DEVICE_OPTIONS:
            update(name, value)

    environment = {name: os.environ.get(name) for name in _DEVICE_VARIABLES}
    config.update = update_unless_devices
    try:
        yield
    finally:
        del config.update
        for name, value in environment.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _write(out: Any, record: tuple[str, Any]) -> None:
    out.write(pickle.dumps(record))
    out.flush()
