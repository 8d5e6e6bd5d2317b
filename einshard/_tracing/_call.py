"""The step and its arguments, named once: a :class:`StepCall`.

Every part of the step report needs the arguments' leaves in the order ``jax.jit`` flattens them
(the program's parameter order) and their paths ``name/key/...`` (``fn``'s parameter names in
front, the paths rule tables match). They are flattened and named here, once per call.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from .._arrays._leaves import is_jax_array, is_traced, nbytes
from .._language._errors import EinshardError, EinshardWarning
from .._language._sources import user_stacklevel
from .._sharding._devices import call_devices
from .._trees._assign import TableAssignment, as_rules, assign_leaves
from .._trees._paths import flatten_with_paths
from .._trees._pytrees import assignment_shardings
from .._trees._rules import RulesLike
from ._batch_layout import like_batch_calls
from ._blocks import Blocks, repeated_blocks

__all__ = ["StepCall", "Trace", "abstract", "kept_trace", "resolve_step", "trace", "trace_key"]


def resolve_step(fn: Callable[..., Any] | str) -> Callable[..., Any]:
    """The step itself: a ``'module:function'`` string is imported, a callable is returned."""
    if not isinstance(fn, str):
        return fn
    module, _, name = fn.partition(":")
    try:
        target: Any = importlib.import_module(module)
        for part in name.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError, ValueError) as error:
        raise EinshardError(
            f"cannot import the step {fn!r}: {error}",
            hint="Name a module-level function as 'package.module:function', importable from sys.path.",
        ) from None
    return target


def abstract(tree: Any) -> Any:
    """Array leaves become plain ``ShapeDtypeStruct``s; other leaves stay.

    Without shardings: those name this process's devices, and do not cross into a child process.
    """
    import jax

    return jax.tree_util.tree_map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, traced_dtype(leaf.dtype)) if is_traced(leaf) else leaf,
        tree,
    )


def traced_dtype(dtype: Any) -> Any:
    """The dtype JAX computes a leaf in: float64 NumPy data is float32 unless ``jax_enable_x64`` is on.

    Asked once per leaf here, so JAX does not warn of it once per struct and compile.
    """
    import jax

    return jax.dtypes.canonicalize_dtype(dtype)


def _warn_if_wide(paths: list[str], leaves: list[Any]) -> None:
    """One ``EinshardWarning`` naming the leaves JAX computes in a narrower dtype than they hold."""
    import warnings

    import numpy as np

    wide = [
        (path, leaf.dtype)
        for path, leaf in zip(paths, leaves, strict=True)
        if is_traced(leaf) and np.dtype(traced_dtype(leaf.dtype)) != np.dtype(leaf.dtype)
    ]
    if wide:
        path, dtype = wide[0]
        warnings.warn(
            f"{len(wide)} of the step's arguments are {dtype} (the first: {path!r}), which JAX computes "
            f"as {np.dtype(traced_dtype(dtype))} without jax_enable_x64: the report is of that step",
            EinshardWarning,
            stacklevel=user_stacklevel(),
        )


def _names(fn: Callable[..., Any], n_args: int, kwargs: dict) -> tuple[str, ...]:
    """Names for the top-level arguments: ``fn``'s parameter names where it has them."""
    names = [str(i) for i in range(n_args)]
    target = getattr(fn, "__wrapped__", fn)
    try:
        parameters = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        parameters = []
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for i, parameter in enumerate(positional[:n_args]):
        names[i] = parameter.name
    if parameters and parameters[0].kind == parameters[0].VAR_POSITIONAL:
        names = [f"{parameters[0].name}/{i}" for i in range(n_args)]
    return (*names, *kwargs)


@dataclasses.dataclass(frozen=True, eq=False)
class StepCall:
    """A step with its arguments, flattened and named once.

    Attributes:
        given: The step as the user gave it (a callable or a ``'module:function'`` string): what
            crosses into a child process.
        fn: The step itself.
        args: The positional arguments.
        kwargs: The keyword arguments.
        names: The top-level arguments' names, positional then keyword (``params``, ``batch``).
        leaves: Every leaf of ``(args, kwargs)``, in ``jax.jit``'s flattening order.
        paths: Each leaf's path, ``name/key/...`` (``params/layers/0/kernel``).
        layouts: Each leaf's ``Assignment`` under the rules that gave the arguments their shardings
            (``None`` for a leaf that is not an array), or ``None`` without rules.
        table: Those rules, or ``None``.
        unmatched: Their *unmatched* rules: those whose regex matches no path of the arguments'
            array leaves (a catch-all never is one).
        batch_layout: The batch expression of the strategy that laid the arguments out (its
            ``.batch``), when the step has a batch argument: the compile keeps the step's
            batch-major loop carries in it (``_tracing._loops``); else ``None``.
        donate: Whether the compile donates the first argument when the step returns it updated.
        traces: The step's programs traced with no ``like_batch`` in them (every strategy's),
            by their arrays' types (:func:`trace_key`), each a :class:`Trace`: kept by
            :func:`trace` and by the compile (``_cost.pipeline._program``), and shared by every
            call made from this one (``with_rules``, ``with_leaves``), so that a plan traces the
            step once, not once per candidate.
    """

    given: Callable[..., Any] | str
    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    names: tuple[str, ...]
    leaves: tuple[Any, ...]
    paths: tuple[str, ...]
    _keys: tuple[tuple[str, tuple], ...]  # (argument name, key path below it) of each leaf
    _treedef: Any
    layouts: tuple[Any, ...] | None = None
    table: Any = None
    unmatched: tuple[Any, ...] = ()
    batch_layout: str | None = None
    donate: bool = True
    traces: dict = dataclasses.field(default_factory=dict, repr=False)

    def donating(self, donate: Any) -> StepCall:
        """The call with ``donate=`` as given: ``True`` or ``False``, nothing else.

        (``"no"`` is truthy: ``bool()`` would donate where the user asked not to.)
        """
        if not isinstance(donate, bool):
            raise EinshardError(
                f"donate= takes True or False, not {donate!r} ({type(donate).__name__}).",
                hint="donate=False compiles the step without donating its first argument; "
                "the default, True, donates it when the step returns it updated.",
            )
        return dataclasses.replace(self, donate=donate)

    @classmethod
    def of(cls, fn: Callable[..., Any] | str, args: tuple, kwargs: dict) -> StepCall:
        """Resolves the step and names its arguments."""
        import jax

        step = resolve_step(fn)
        names = _names(step, len(args), kwargs)
        arguments = (tuple(args), dict(kwargs))
        flat, treedef = jax.tree_util.tree_flatten_with_path(arguments)
        # The paths rules see come from the one path-maker (framework wrappers left out); the key
        # paths give the names JAX writes in the program's metadata.
        _, rule_paths, _ = flatten_with_paths(arguments)
        keys, paths, leaves = [], [], []
        for (path, leaf), rule_path in zip(flat, rule_paths, strict=True):
            # path[0]: args or kwargs; path[1]: the argument's index or keyword; then its own path.
            top = names[path[1].idx] if path[0].idx == 0 else str(path[1].key)
            keys.append((top, tuple(path[2:])))
            rest = rule_path.split("/", 2)[2:]
            paths.append(f"{top}/{rest[0]}" if rest else top)
            leaves.append(leaf)
        _warn_if_wide(paths, leaves)
        return cls(
            fn, step, tuple(args), dict(kwargs), names, tuple(leaves), tuple(paths), tuple(keys), treedef
        )

    @functools.cached_property
    def arrays(self) -> tuple[int, ...]:
        """The positions of the array leaves (the compiled program's parameters, in order)."""
        return tuple(i for i, leaf in enumerate(self.leaves) if is_traced(leaf))

    def argument_leaves(self, position: int) -> range:
        """The positions of the leaves of one top-level argument (``0``: the step's first)."""
        name = self.names[position]
        inside = [i for i, (top, _) in enumerate(self._keys) if top == name]
        return range(inside[0], inside[-1] + 1) if inside else range(0)

    @property
    def batch_name(self) -> str | None:
        """The name of the step's batch argument, or ``None``.

        The argument named ``batch`` (by position or keyword), else the last positional one
        when there are two or more: ``step(params, batch)`` as ``plan`` calls it, and
        ``step(params, opt_state, tokens)``. A step of one argument has no batch.
        """
        if "batch" in self.names:
            return "batch"
        positional = self.names[: len(self.args)]
        return positional[-1] if len(positional) > 1 else None

    @property
    def array_paths(self) -> list[str]:
        """The paths of the array leaves, in the program's parameter order."""
        return [self.paths[i] for i in self.arrays]

    @property
    def array_bytes(self) -> dict[str, int]:
        """Each array leaf's bytes (the whole array), by path."""
        return {self.paths[i]: nbytes(self.leaves[i].shape, self.leaves[i].dtype) for i in self.arrays}

    def array_jax_names(self) -> list[str]:
        """The names JAX gives the array leaves in the program's metadata: ``params['w1']``."""
        import jax

        return [f"{self._keys[i][0]}{jax.tree_util.keystr(self._keys[i][1])}" for i in self.arrays]

    def rebuilt(self, arrays: Any) -> tuple[tuple, dict]:
        """``(args, kwargs)`` with the array leaves replaced by ``arrays`` (in order)."""
        import jax

        full = list(self.leaves)
        for i, array in zip(self.arrays, arrays, strict=True):
            full[i] = array
        return jax.tree_util.tree_unflatten(self._treedef, full)

    def with_leaves(self, leaves: list[Any]) -> StepCall:
        """The same step with other leaves of the same structure (names and paths kept)."""
        import jax

        args, kwargs = jax.tree_util.tree_unflatten(self._treedef, leaves)
        return dataclasses.replace(self, args=tuple(args), kwargs=dict(kwargs), leaves=tuple(leaves))

    @functools.cached_property
    def _abstract_leaves(self) -> tuple[Any, ...]:
        return tuple(abstract(leaf) for leaf in self.leaves)  # what the compile traces, and rules see

    @functools.cached_property
    def _assignments(self) -> dict[tuple[int, int], tuple[Any, Any]]:
        return {}  # (id of the table, device count) -> (the table, its assignment or its error)

    def assigned(self, rules: RulesLike, n_devices: int) -> TableAssignment:
        """The table's assignment of the arguments' leaves for ``n_devices`` devices, made once per table.

        The compile's (:meth:`with_rules`) and the planner's split shares share it.

        Raises:
            EinshardError: As the table raises for these leaves (raised again on every ask).
        """
        table = as_rules(rules)
        key = (id(table), n_devices)  # the table is held with its answer: its id is not reused
        if key not in self._assignments:
            try:
                done: Any = assign_leaves(self.paths, self._abstract_leaves, table, n_devices=n_devices)
            except EinshardError as error:
                done = error
            self._assignments[key] = (table, done)
        done = self._assignments[key][1]
        if isinstance(done, EinshardError):
            raise done
        return done

    def fitted(self, rules: RulesLike, n_devices: int) -> TableAssignment | None:
        """:meth:`assigned`, or ``None`` when the table does not fit the arguments (the compile says why)."""
        try:
            return self.assigned(rules, n_devices)
        except EinshardError:
            return None

    def with_rules(self, rules: RulesLike) -> StepCall:
        """The arguments as ``ShapeDtypeStruct`` leaves with the shardings the rules give them.

        The rules see the leaves' paths (``params/layers/0/kernel``), from this call's one
        flattening: the arguments are not flattened again per table, nor assigned again.
        """
        import jax

        target = call_devices(None)
        assignment = self.assigned(rules, target.count)
        shardings = assignment_shardings(assignment, target)
        placed = [
            jax.ShapeDtypeStruct(leaf.shape, traced_dtype(leaf.dtype), sharding=sharding)
            if sharding is not None and is_traced(leaf)
            else leaf
            for leaf, sharding in zip(self._abstract_leaves, shardings, strict=True)
        ]
        layouts = tuple(leaf for _, leaf in assignment.leaves)
        batch = getattr(rules, "batch", None) if self.batch_name is not None else None
        return dataclasses.replace(
            self.with_leaves(placed),
            layouts=layouts,
            table=assignment.table,
            unmatched=assignment.unmatched,
            batch_layout=batch if isinstance(batch, str) else None,
        )

    def batch_arrays(self) -> list[bool]:
        """For each array leaf (the program's parameters, in order): whether it is of the batch argument."""
        name = self.batch_name
        if name is None:
            return [False] * len(self.arrays)
        inside = set(self.argument_leaves(self.names.index(name)))
        return [i in inside for i in self.arrays]


@dataclasses.dataclass(frozen=True)
class Trace:
    """A step's program as traced, kept in :attr:`StepCall.traces` for the compile to lower again.

    Attributes:
        jaxpr: The program over the array leaves (a ``ClosedJaxpr``).
        result: The step's result tree, and its leaves (``ShapeDtypeStruct`` for the arrays).
    """

    jaxpr: Any
    result: tuple[Any, list[Any]]

    @classmethod
    def of(cls, jaxpr: Any, structure: Any, leaves: list[Any]) -> Trace:
        """The trace kept with its result's arrays as shapes and dtypes alone (no traced value)."""
        import jax

        kept = [
            jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) if is_jax_array(leaf) else leaf for leaf in leaves
        ]
        return cls(jaxpr, (structure, kept))

    @functools.cached_property
    def blocks(self) -> Blocks | str:
        """The program's repeated layers, or why it has none to cut (``repeated_blocks``), found once."""
        return repeated_blocks(self.jaxpr)

    @functools.cached_property
    def depths(self) -> dict[int, Any]:
        """The step's calls at smaller depths made from this trace, by depth (``_depth.call_at_depth``)."""
        return {}


def trace_key(donate: bool, arrays: Sequence[Any]) -> tuple:
    """What a step's trace depends on besides the strategy: its arrays' types, and the donation."""
    types = [
        (getattr(leaf, "shape", None), str(getattr(leaf, "dtype", type(leaf).__name__))) for leaf in arrays
    ]
    weak = [bool(getattr(leaf, "weak_type", False)) for leaf in arrays]
    return donate, tuple(types), tuple(weak)


def trace(call: StepCall) -> Any:
    """``jax.make_jaxpr`` of the step over its array leaves (as ``ShapeDtypeStruct``s), in order.

    When no :func:`~einshard.like_batch` ran in it, the program is every strategy's: it is kept
    in ``call.traces`` (a :class:`Trace`), and each candidate's compile lowers it.

    Raises:
        EinshardError: When tracing the step fails (it branches on array values, say).
    """
    import jax
    import numpy as np

    result: list[Any] = []

    def flat(*arrays: Any) -> Any:
        args, kwargs = call.rebuilt(arrays)
        out = call.fn(*args, **kwargs)
        result[:] = [jax.tree_util.tree_structure(out), jax.tree_util.tree_leaves(out)]
        return [leaf for leaf in result[1] if is_jax_array(leaf)]

    leaves = call.leaves
    abstract = [jax.ShapeDtypeStruct(np.shape(leaves[i]), traced_dtype(leaves[i].dtype)) for i in call.arrays]
    called = like_batch_calls()
    try:
        closed = jax.make_jaxpr(flat)(*abstract)
    except Exception as error:
        if isinstance(error, EinshardError):  # the step's own einshard call: its message stands
            raise
        raise EinshardError(
            f"cannot read the step's dataflow: tracing step(params, batch) failed: "
            f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}",
            hint="The step is traced with jax.make_jaxpr on ShapeDtypeStructs: it must not branch in "
            "Python on array values or read them (float(x), x.item()). Or give the table by layer "
            "names: einshard.strategies.tensor_parallel(column=[...], row=[...]).",
        ) from None
    if like_batch_calls() == called:
        call.traces.setdefault(trace_key(call.donate, abstract), Trace.of(closed, *result))
    return closed


def kept_trace(call: StepCall) -> Trace | None:
    """The step's trace that every strategy shares (traced now if it was not), or ``None``.

    ``None`` when the step calls :func:`~einshard.like_batch`: each strategy's program is then its own.

    Raises:
        EinshardError: As :func:`trace`.
    """
    import jax
    import numpy as np

    leaves = call.leaves
    abstract = [jax.ShapeDtypeStruct(np.shape(leaves[i]), traced_dtype(leaves[i].dtype)) for i in call.arrays]
    key = trace_key(call.donate, abstract)
    if key not in call.traces:
        trace(call)
    return call.traces.get(key)
