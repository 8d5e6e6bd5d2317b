"""A device count this machine does not have: the step compiled in a child process, the parent's side.

The parent starts each child (``python -c "from einshard._cost.child._worker import main; main()"``,
with ``N`` simulated CPU devices or a target's compiler options), sends it the pickled step and
arguments and each table's index, reads its records back, starts more children beside a slow
first one where this machine's cores and memory hold them, and names a crash or a kill. The
child's own side is :mod:`._worker`.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from ..._language._errors import EinshardError, EinshardWarning
from ..._language._sources import user_stacklevel
from ..._language._text import seconds_text, size_text
from ..._tracing._batch_layout import current_batch
from ..._tracing._call import abstract
from ..._trees._rules import RulesLike
from ..hardware._target import Target
from ..pipeline._analysis import Answer
from ._progress import CompileEvents
from ._rerun import Script, pickled, script_of_main

__all__ = ["KILLED", "Crash", "Order", "child_error", "in_child", "in_turn", "killed_reason"]

_COMMAND = "from einshard._cost.child._worker import main; main()"

COMPILE_ONLY_GPU_FLAGS = {
    "xla_gpu_autotune_level": "0",
    "xla_gpu_disable_gpuasm_optimizations": "true",
    "xla_llvm_disable_expensive_passes": "true",
}
"""XLA's options for a compile-only GPU, each one that shortens the compile and leaves the program alone.

No gemm autotuning (a third of a large step's compile), ``ptxas`` without its optimizations and
LLVM without its expensive passes (the kernels' machine code, which a compile-only plan never
runs: about a fifth of what is left). The program's collectives, bytes, peak memory and simulated
time stay the same (a test compares them on the test GPT for 8 H100s, each option against XLA's
default); an option set in ``XLA_FLAGS`` is kept instead.
"""

KERNEL_CACHE_FLAG = "xla_gpu_kernel_cache_file"
"""XLA's file of compiled kernels, reused by a later compile whose fusion is the same (by its
fingerprint). Each child process of a GPU plan has its own (in a temporary folder, removed with
the plan), so a child's second candidate and after skip the kernels its first ones made: the
candidates share most of their fusions (the same model at the same per-device sizes). The
program is the same with it (a test compares the figures); ``XLA_FLAGS`` may set it (empty: none).
"""


Order = Callable[[dict[int, Answer], "frozenset[int]"], "int | None"]
"""Which table compiles next, given the answers so far by index and the tables compiling now
(``None``: no more)."""

MAX_CHILDREN = 4
"""The most child processes that compile a plan's tables side by side (each compile is on one core)."""

SECOND_CHILD_AFTER = 10.0
"""Seconds the first table's compile must take before more children start: below it, starting
one (importing JAX, reading the step: a second or more) would cost more than it saves."""

MEMORY_PER_CHILD = 2.0
"""A child is started only where this machine's available memory holds this many times the
first child's peak for it: the first child's next compile grows back to its peak too."""


class Crash(str):
    """Why a table has no answer when its child process died compiling it; ``killed``: from outside.

    A child killed with no message (``SIGKILL``: most likely this machine's memory) says nothing
    of the step; one XLA aborted (a failed check in its partitioner) does.
    """

    killed: bool

    def __new__(cls, text: str, *, killed: bool = False) -> Crash:
        self = super().__new__(cls, text)
        self.killed = killed
        return self

    def __reduce__(self) -> tuple:
        return (_crash, (str(self), self.killed))


def _crash(text: str, killed: bool) -> Crash:
    return Crash(text, killed=killed)


def in_child(
    fn: Callable[..., Any] | str,
    args: tuple,
    kwargs: dict,
    n_devices: int,
    tables: Sequence[RulesLike | None],
    target: Target | None = None,
    progress: CompileEvents | None = None,
    donate: bool = True,
    order: Order | None = None,
) -> dict[int, Answer]:
    """The answers of the tables compiled, by index, in a child process with ``n_devices`` CPU devices.

    The step crosses as it was given (resolved in the child); the arguments as plain
    ``ShapeDtypeStruct``s: their shardings come from the tables. A :func:`~einshard.use_strategy`
    block around the call crosses too: the child traces the step inside it, as this process
    would (``like_batch`` in the model follows it). With a GPU or TPU ``target``,
    the tables lay the arguments out over that target's ``n_devices`` compile-only devices, and
    its compiler compiles the step (the CPU devices count its flops).

    ``order`` says which table compiles next, given the answers so far and the tables compiling
    now (``None``: stop); without it, every table in turn. A child waits for each index, so a
    table ``order`` leaves out is never compiled. Where each compile is long, several children
    compile side by side (:class:`_Compiles`).
    """
    choose = order if order is not None else in_turn(len(tables))
    if target is not None and target.platform == "cpu":
        target = None
    payload = {
        "fn": fn,
        "args": abstract(args),
        "kwargs": abstract(kwargs),
        "tables": list(tables),
        "target": target,
        "donate": donate,
        "strategy": current_batch(),  # the use_strategy block the call is made in, or None
    }
    try:
        data, main_names = pickled(payload)
    except Exception as error:
        raise EinshardError(
            f"the step cannot cross into a child process with {n_devices} devices: {error}",
            hint="Give the step as an importable 'module:function' string (or a module-level function), "
            "and arguments that pickle: arrays or ShapeDtypeStructs in ordinary pytrees; "
            "give their shardings with rules=.",
        ) from None
    # A step defined in the script being run lives in __main__: the child runs that script again
    # first (_rerun), as multiprocessing's spawn does, so that pickle finds it there.
    script = script_of_main(main_names, n_devices)
    data = pickle.dumps(script) + data
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
        for option, value in COMPILE_ONLY_GPU_FLAGS.items():
            if option not in flags:
                env["XLA_FLAGS"] += f" --{option}={value}"
    if target is not None and target.platform == "tpu":
        # libtpu takes a lock file per machine: this process (a TPU VM's) may hold it already.
        env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    with contextlib.ExitStack() as stack:
        kernels = None
        if target is not None and target.platform == "gpu" and KERNEL_CACHE_FLAG not in flags:
            kernels = stack.enter_context(tempfile.TemporaryDirectory(prefix="einshard-kernels-"))
        compiles = _Compiles(choose, data, env, n_devices, target, progress, kernels)
        compiles.run()
    if script is not None and compiles.reruns and max(compiles.reruns) > SLOW_RERUN_SECONDS:
        _warn_slow_rerun(script, max(compiles.reruns))
    return compiles.answers


class _Compiles:
    """The tables' compiles, in one child process, or side by side in several on a larger machine.

    One child starts; when its first table took :data:`SECOND_CHILD_AFTER` seconds or more,
    more start (up to the cores, :data:`MAX_CHILDREN`, and what the memory holds at the first
    child's peak), each taking the next table ``choose`` gives when it is free. The answers are
    the same in any order: ``choose`` sees the tables compiling now, and never gives one twice.
    """

    def __init__(
        self,
        choose: Order,
        data: bytes,
        env: dict[str, str],
        n_devices: int,
        target: Target | None,
        progress: CompileEvents | None,
        kernels: str | None = None,
    ) -> None:
        self.choose, self.data, self.env = choose, data, env
        self.n_devices, self.target, self.progress = n_devices, target, progress
        self.kernels = kernels  # the folder of each child's kernel cache (KERNEL_CACHE_FLAG), or None
        self._children = 0
        self.answers: dict[int, Answer] = {}
        self.reruns: list[float] = []
        self._busy: set[int] = set()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._errors: list[BaseException] = []
        self._spread = False  # whether more children were considered (once, at the first answer)
        self._warned: set[tuple[str, type[Warning], str, int]] = set()

    def run(self) -> None:
        """Compiles until ``choose`` says no more; raises what a child process failed with."""
        first = self.take()
        if first is not None:
            self._compile_from(first)
        while True:
            with self._lock:
                waiting = [thread for thread in self._threads if thread.is_alive()]
            if not waiting:
                break
            for thread in waiting:
                thread.join()
        if self._errors:
            failed = self._errors[0]  # the first child's failure, raised in the caller's thread
            raise failed

    def warn_again(self, warned: Sequence[tuple[str, type[Warning], str, int]]) -> None:
        """The warnings of einshard in a child's compile, warned here at the line they name, once a run.

        Each is a message einshard warns where it is made (and ``docs/errors.md`` lists), again.
        """
        for text, category, filename, lineno in warned:
            with self._lock:
                seen = (text, category, filename, lineno) in self._warned
                self._warned.add((text, category, filename, lineno))
            if not seen:  # each table of a plan traces the same line: one warning, as in this process
                warnings.warn_explicit(text, category, filename, lineno)

    def child_env(self) -> dict[str, str]:
        """The environment of the next child process: its own kernel cache file, where there are any."""
        if self.kernels is None:
            return self.env
        with self._lock:
            self._children += 1
            number = self._children
        cache = os.path.join(self.kernels, f"child-{number}.bin")
        return {**self.env, "XLA_FLAGS": f"{self.env['XLA_FLAGS']} --{KERNEL_CACHE_FLAG}={cache}"}

    def take(self) -> int | None:
        """The next table to compile (now marked as compiling), or ``None``."""
        with self._lock:
            if self._errors:  # a child failed as a whole: the others finish their table and stop
                return None
            index = self.choose(self.answers, frozenset(self._busy))
            if index is not None:
                self._busy.add(index)
            return index

    def give(self, index: int, answer: Answer, seconds: float, peak_bytes: int) -> None:
        """Table ``index``'s answer, which took ``seconds`` in a child that peaked at ``peak_bytes``."""
        with self._lock:
            self.answers[index] = answer
            self._busy.discard(index)
            spread = not self._spread and peak_bytes > 0  # a child that died measured nothing
            self._spread |= spread
        if spread and seconds >= SECOND_CHILD_AFTER:
            for _ in range(_room_for_children(peak_bytes) - 1):
                if (next_index := self.take()) is None:
                    break
                thread = threading.Thread(target=self._compile_from, args=(next_index,), daemon=True)
                with self._lock:
                    self._threads.append(thread)
                thread.start()

    def _compile_from(self, first: int) -> None:
        """Child after child, starting with table ``first``, until ``take`` gives no more."""
        index: int | None = first
        try:
            while index is not None:
                crashed = _run_child(self, index)
                if crashed is not None:
                    # XLA aborts the whole process on some layouts (a failed CHECK in its
                    # partitioner): that table gets the reason, and a new child compiles the next.
                    crash_index, crash = crashed
                    self.give(crash_index, Answer(None, crash), 0.0, 0)
                    index = self.take()
                else:
                    index = None
        except BaseException as error:  # raised in the caller's thread by run()
            with self._lock:
                self._errors.append(error)


def _room_for_children(peak_bytes: int) -> int:
    """How many children this machine runs side by side, at most :data:`MAX_CHILDREN`.

    Its cores, and its available memory at :data:`MEMORY_PER_CHILD` times ``peak_bytes`` each.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        cores = os.cpu_count() or 1
    available = _available_memory()
    if available is None or peak_bytes <= 0:
        return 1
    return max(1, min(cores, MAX_CHILDREN, 1 + int(available // (MEMORY_PER_CHILD * peak_bytes))))


def _available_memory() -> int | None:
    """This machine's available memory (Linux's ``MemAvailable``), or ``None`` where unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def in_turn(count: int) -> Order:
    """Every table in turn: the first without an answer that is not compiling."""
    return lambda answers, busy: next((i for i in range(count) if i not in answers and i not in busy), None)


SLOW_RERUN_SECONDS = 5.0
"""A second run of the user's script longer than this is announced (an ``EinshardWarning``)."""


def _warn_slow_rerun(script: Script, seconds: float) -> None:
    name = os.path.basename(script.path)
    warnings.warn(
        f"the child process ran the top level of {name} again, to find the step defined in it, and that "
        f"took {seconds_text(seconds)}: put the script's work under `if __name__ == '__main__':`, or "
        "define the step in a module the script imports",
        EinshardWarning,
        stacklevel=user_stacklevel(),
    )


def _run_child(compiles: _Compiles, first: int) -> tuple[int, Crash] | None:
    """One child, compiling table ``first`` and then those ``compiles.take`` gives, into ``compiles``.

    Returns the table it died compiling and why, or ``None``. The parent sends each table's index
    when the one before is answered (``None``: the end); the child writes a ``('compiling', i)``
    record before each table and ``('answer', a)`` after it, so a child that dies names the table
    it was compiling when it died. The records are read as they come, for the progress shown. A
    child that ran the user's script again says how long that took first (``('script', seconds)``,
    added to ``compiles.reruns``).
    """
    data, env, progress = compiles.data, compiles.child_env(), compiles.progress
    n_devices, target = compiles.n_devices, compiles.target
    spawned = time.perf_counter()
    child = subprocess.Popen(
        [sys.executable, "-c", _COMMAND],
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

    def send(index: int | None) -> None:
        assert child.stdin is not None
        with contextlib.suppress(BrokenPipeError, ValueError):  # a child that died says why on stderr
            child.stdin.write(pickle.dumps(index))
            child.stdin.flush()
        if index is None:
            with contextlib.suppress(BrokenPipeError, ValueError):
                child.stdin.close()

    with contextlib.suppress(BrokenPipeError):
        child.stdin.write(data)
    send(first)
    compiling = None
    compiling_since = spawned
    peak = 0
    failure = None
    raised: Exception | None = None  # an error of einshard's own in the child, raised here
    unreadable: Exception | None = None  # a record the child wrote whole that this process cannot read
    while True:
        try:
            kind, value = pickle.load(child.stdout)
        except EOFError:  # the end, or a record cut short by the child's death
            break
        except Exception as error:
            unreadable = error
            break
        if kind == "error":
            failure = value
        elif kind == "raised":
            raised = value
        elif kind == "warnings":
            compiles.warn_again(value)
        elif kind == "script":
            compiles.reruns.append(value)
        elif kind == "ready":
            if progress is not None:
                progress.child_started(time.perf_counter() - spawned)
        elif kind == "memory":
            peak = value
            if progress is not None:
                progress.child_memory(value)
        elif kind == "compiling":
            compiling, compiling_since = value, time.perf_counter()
            if progress is not None:
                progress.compiling(value)
        else:
            assert compiling is not None
            if progress is not None:
                progress.finished(compiling, "compiled" if value.report is not None else "rejected")
            compiles.give(compiling, value, time.perf_counter() - compiling_since, peak)
            compiling = None
            send(compiles.take())
    stopped_here = unreadable is not None and child.poll() is None
    if stopped_here:
        child.kill()  # it would wait for the next table, or block writing to a pipe no one reads
    send(None)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = returncode = os.waitstatus_to_exitcode(status)
    drain.join()
    child.stdout.close()
    child.stderr.close()
    if progress is not None:
        progress.child_memory(usage.ru_maxrss * 1024)
    if failure is not None:
        raise child_error(failure, n_devices, target)
    if raised is not None:
        raise raised
    stderr = b"".join(errors).decode(errors="replace").strip()
    if unreadable is not None and (returncode == 0 or stopped_here):
        # A record written whole and still unreadable (a dying child's is cut short: a crash, below).
        raise AssertionError(
            f"einshard cannot read what its child process with {n_devices} devices answered "
            f"({type(unreadable).__name__}: {unreadable}); please report it"
        )
    if returncode == 0 and compiling is None:
        return None
    if compiling is None:
        raise EinshardError(
            f"the child process with {n_devices} devices failed (exit code {returncode})",
            hint=stderr[-2000:] or None,
        )
    if progress is not None:
        progress.finished(compiling, "not compiled")
    last = next((line for line in reversed(stderr.splitlines()) if "Check failed" in line), None)
    if last is None and returncode == -signal.SIGKILL:
        return compiling, Crash(killed_reason(usage.ru_maxrss * 1024), killed=True)
    if last is None and returncode < 0:
        with contextlib.suppress(ValueError):
            last = f"{signal.Signals(-returncode).name}, no message"
    last = last or (stderr.splitlines()[-1] if stderr else f"exit code {returncode}")
    return compiling, Crash(f"XLA aborted the process compiling it ({last.strip()[:300]})")


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
