"""A device count this machine does not have: the step compiled in a child process.

The child runs ``python -c "from einshard._cost._child import main; main()"`` with ``N``
simulated CPU devices, reads the pickled step and arguments from stdin, and writes its answers
to stdout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import io
import os
import pickle
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from .._language._errors import EinshardError
from .._language._text import size_text
from .._sharding._devices import use_devices
from .._trees._rules import RulesLike
from ._analysis import Answer, answer
from ._call import StepCall, abstract
from ._progress import Progress
from ._target import Target, target_devices

__all__ = ["KILLED", "child_error", "in_child", "killed_reason", "main"]

_COMMAND = "from einshard._cost._child import main; main()"

COMPILE_ONLY_GPU_FLAGS = "--xla_gpu_autotune_level=0"
"""XLA's options for a compile-only GPU: no gemm autotuning (a third of a large step's compile).

The program's collectives, bytes, peak memory and simulated time stay the same (a test compares
them on the test GPT for 8 H100s); an ``xla_gpu_autotune_level`` in ``XLA_FLAGS`` is kept instead.
"""


def in_child(
    fn: Callable[..., Any] | str,
    args: tuple,
    kwargs: dict,
    n_devices: int,
    tables: Sequence[RulesLike | None],
    target: Target | None = None,
    progress: Progress | None = None,
    donate: bool = True,
) -> list[Answer]:
    """One answer per table, compiled in a child process with ``n_devices`` simulated CPU devices.

    The step crosses as it was given (resolved in the child); the arguments as plain
    ``ShapeDtypeStruct``s: their shardings come from the tables. With a GPU or TPU ``target``,
    the tables lay the arguments out over that target's ``n_devices`` compile-only devices, and
    its compiler compiles the step (the CPU devices count its flops).
    """
    if target is not None and target.platform == "cpu":
        target = None
    payload = {
        "fn": fn,
        "args": abstract(args),
        "kwargs": abstract(kwargs),
        "tables": list(tables),
        "target": target,
        "donate": donate,
    }
    # A step defined in the script being run lives in __main__: the child runs that file as
    # __mp_main__ first, as multiprocessing's spawn does, so that pickle finds it there.
    main_module = sys.modules.get("__main__")
    main_file = getattr(main_module, "__file__", None)
    main_path = os.path.abspath(main_file) if main_file and main_file.endswith(".py") else None
    try:
        data = pickle.dumps(payload)
        if b"__main__" not in data:  # nothing from the running script: the child need not run it
            main_path = None
        data = pickle.dumps(main_path) + data
    except Exception as error:
        raise EinshardError(
            f"the step cannot cross into a child process with {n_devices} devices: {error}",
            hint="Give the step as an importable 'module:function' string (or a module-level function), "
            "and arguments that pickle: arrays or ShapeDtypeStructs in ordinary pytrees; "
            "give their shardings with rules=.",
        ) from None
    flags = os.environ.get("XLA_FLAGS", "")
    flags = " ".join(f for f in flags.split() if not f.startswith("--xla_force_host_platform_device_count"))
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JAX_NUM_CPU_DEVICES": str(n_devices),
        "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={n_devices}".strip(),
        "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path),
    }
    if target is not None and target.platform == "gpu":
        env["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"  # compile-only GPUs: no CUDA on this machine
        if "xla_gpu_autotune_level" not in flags:
            env["XLA_FLAGS"] += f" {COMPILE_ONLY_GPU_FLAGS}"
    if target is not None and target.platform == "tpu":
        # libtpu takes a lock file per machine: this process (a TPU VM's) may hold it already.
        env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    answers: list[Answer] = []
    while len(answers) < len(tables):
        done, crash = _run_child(data, env, len(answers), n_devices, target, progress)
        answers += done
        if crash is not None:
            # XLA aborts the whole process on some layouts (a failed CHECK in its partitioner):
            # that table gets the reason, and a new child compiles the ones after it.
            answers.append(Answer(None, crash))
    return answers


def _run_child(
    data: bytes,
    env: dict[str, str],
    start: int,
    n_devices: int,
    target: Target | None = None,
    progress: Progress | None = None,
) -> tuple[list[Answer], str | None]:
    """One child, compiling the tables from ``start`` on: its answers, and why it died compiling the next.

    The child writes a ``('compiling', i)`` record before each table and ``('answer', a)`` after
    it, so a child that dies names the table it was compiling when it died; the records are read
    as they come, for the progress shown.
    """
    child = subprocess.Popen(
        [sys.executable, "-c", _COMMAND, str(start)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert child.stdin is not None and child.stdout is not None and child.stderr is not None
    errors: list[bytes] = []
    # The child's stderr is drained beside its records: a full pipe would stop it.
    drain = threading.Thread(target=lambda: errors.append(child.stderr.read()), daemon=True)  # type: ignore[union-attr]
    drain.start()
    with contextlib.suppress(BrokenPipeError):  # a child that dies at once says why on stderr
        child.stdin.write(data)
    child.stdin.close()
    answers: list[Answer] = []
    compiling = None
    failure = None
    while True:
        try:
            kind, value = pickle.load(child.stdout)
        except Exception:  # the end, or a record cut short by the child's death
            break
        if kind == "error":
            failure = value
        elif kind == "compiling":
            compiling = value
            if progress is not None:
                progress.compiling(value)
        else:
            answers.append(value)
            if progress is not None and compiling is not None:
                progress.finished(compiling, "compiled" if value.report is not None else "rejected")
            compiling = None
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = returncode = os.waitstatus_to_exitcode(status)
    drain.join()
    child.stdout.close()
    child.stderr.close()
    if failure is not None:
        raise child_error(failure, n_devices, target)
    stderr = b"".join(errors).decode(errors="replace").strip()
    if returncode == 0 and compiling is None:
        return answers, None
    if compiling is None:
        raise EinshardError(
            f"the child process with {n_devices} devices failed (exit code {returncode})",
            hint=stderr[-2000:] or None,
        )
    if progress is not None:
        progress.finished(compiling, "not compiled")
    last = next((line for line in reversed(stderr.splitlines()) if "Check failed" in line), None)
    if last is None and returncode == -signal.SIGKILL:
        return answers, killed_reason(usage.ru_maxrss * 1024)
    if last is None and returncode < 0:
        with contextlib.suppress(ValueError):
            last = f"{signal.Signals(-returncode).name}, no message"
    last = last or (stderr.splitlines()[-1] if stderr else f"exit code {returncode}")
    return answers, f"XLA aborted the process compiling it ({last.strip()[:300]})"


KILLED = "killed while compiling it"
"""How the reason of a child killed from outside (SIGKILL) begins: not the program's fault."""


def killed_reason(peak_bytes: int) -> str:
    """Why a child was killed with no message: most likely this machine's memory, with its peak."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return (
        f"{KILLED} (SIGKILL, no message) at a peak of {size_text(peak_bytes)} of this machine's "
        f"{size_text(total)}: most likely this machine ran out of memory (the program may well compile "
        "on a larger one), not a fault of the step"
    )


def child_error(error: EinshardError | str, n_devices: int, target: Target | None = None) -> EinshardError:
    """What the parent raises for an error in the child (an ``EinshardError`` keeps its message)."""
    if isinstance(error, EinshardError):
        if target is not None:
            return error.add_context(f"in a child process compiling for {target.label}")
        return error.add_context(f"in a child process with {n_devices} simulated CPU devices")
    return EinshardError(
        f"compiling the step in a child process with {n_devices} devices failed: {error}",
        hint="Run the step on this machine first (without n_devices=) to see the error.",
    )


def main() -> None:
    """The child process: reads the payload from stdin, writes ``(status, answers)`` to stdout."""
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # stray prints of the step must not corrupt the answer
    import jax

    count = int(os.environ["JAX_NUM_CPU_DEVICES"])
    with contextlib.suppress(AttributeError):  # older JAX: XLA_FLAGS does it
        jax.config.update("jax_num_cpu_devices", count)
    jax.devices()  # start the backend now: the parent's script may set XLA_FLAGS when it runs
    try:
        stream = io.BytesIO(sys.stdin.buffer.read())
        main_path = pickle.load(stream)
        if main_path is not None:
            import runpy
            import types

            module = types.ModuleType("__mp_main__")
            module.__dict__.update(runpy.run_path(main_path, run_name="__mp_main__"))
            sys.modules["__main__"] = sys.modules["__mp_main__"] = module
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
    devices = None
    if target is not None:
        try:
            devices = target_devices(target)
        except EinshardError as error:
            _write(out, ("error", error))
            return
    start = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    for index in range(start, len(payload["tables"])):
        _write(out, ("compiling", index))
        with use_devices(devices) if devices is not None else contextlib.nullcontext():
            result = answer(call, payload["tables"][index], target)
        _write(out, ("answer", result))
        # The candidate's traces, lowerings and compiled program are not needed again: JAX's
        # caches would keep them all, and the child's memory would grow by each candidate's.
        del result
        jax.clear_caches()
        gc.collect()


def _write(out: Any, record: tuple[str, Any]) -> None:
    out.write(pickle.dumps(record))
    out.flush()
