"""Equinox integration: whole modules by rule tables, and per-layer decorators.

This module imports Equinox; ``import einshard`` does not.

**Rule tables.** An Equinox module is a pytree whose leaf paths are its
field names and sequence indices joined with ``/`` (``layers/0/weight``,
``attn/query_proj/weight``). :func:`shard_module` places every array field
by the first rule that matches its path, as :func:`einshard.shard_pytree`
does; functions, static fields and other non-array leaves are untouched.
:func:`create_sharded` builds a module **born sharded**: it is compiled with
the rules' shardings as outputs, so no sharded leaf ever exists whole on one
device.

**Decorators.** :func:`sharded` attaches expressions to a module class's
fields (``@sharded(weight='o i -> o* i', bias='o -> o*')`` on a subclass of
``eqx.nn.Linear`` is a column-parallel layer). Instances are placed when they
are built: outside a trace the fields become placed arrays, inside one
(``jax.jit``, ``eqx.filter_eval_shape``, ``eqx.filter_vmap``) sharding
constraints. An optional ``output=`` expression constrains what the layer's
``__call__`` returns. :func:`module_rules` composes the decorated layers of a
model into one model-wide :class:`einshard.Rules` table (one rule per
decorated field of each layer instance), for :func:`einshard.explain`,
:func:`shard_module` and :func:`create_sharded`, which use it when given no
rules.

>>> import jax, equinox as eqx, einshard
>>> from einshard.integrations.equinox import module_rules, sharded
>>> @sharded(weight='o i -> o* i', bias='o -> o*')
... class ColumnLinear(eqx.nn.Linear):
...     pass
>>> layer = ColumnLinear(4, 16, key=jax.random.key(0))
>>> layer.weight.sharding.shard_shape((16, 4))
(2, 4)
>>> module_rules(layer)
Rules([
    ('(^|/)weight$', 'o i -> o* i'),
    ('(^|/)bias$', 'o -> o*'),
    ('.*', '... -> * ...'),
])

A model's table, and a whole module by hand-written rules:

>>> from einshard.integrations.equinox import shard_module
>>> mlp = eqx.nn.MLP(8, 8, 64, 1, key=jax.random.key(0))
>>> rules = [(r'layers/0/weight$', 'o i -> o* i'), (r'layers/1/weight$', 'o i -> o i*'),
...          (r'.*', '... -> * ...')]
>>> mlp = shard_module(mlp, rules)
>>> mlp.layers[1].weight.sharding.shard_shape((8, 64)), mlp.activation is jax.nn.relu
((8, 8), True)
"""

from __future__ import annotations

try:  # first, so a missing framework says how to get it (as the pictures do for rich)
    import equinox as eqx
except ModuleNotFoundError as error:
    if error.name != "equinox":
        raise  # Equinox is installed but something it imports is not: its own error says what
    raise ImportError(
        "einshard.integrations.equinox needs Equinox, which is not installed; "
        "install it with: pip install equinox (or pip install '.[equinox]' in einshard's source folder)"
    ) from error

import dataclasses
import functools
import re
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import jax

from .._arrays._arrays import einshard
from .._arrays._leaves import is_array
from .._language._errors import EinshardError
from .._language._expression import REPLICATE as _REPLICATE
from .._language._expression import parse
from .._sharding._devices import Devices
from .._trees import _pytrees
from .._trees._calls import rule_table, table_second
from .._trees._paths import flatten_with_paths, path_string
from .._trees._rules import Rules, RulesLike

__all__ = ["create_sharded", "field_expressions", "module_rules", "shard_module", "sharded"]

T = TypeVar("T")
Layer = TypeVar("Layer")

_OWN = "__einshard_fields__"  # a decorated class's own expressions, in its __dict__
_OUTPUT = "output"  # the key of the activation expression among them
_WRAPPED = "__einshard_inner__"  # on our __call__ wrappers: the __call__ they wrap


# --- the decorator --------------------------------------------------------------------------


def sharded(
    fields: Mapping[str, str | None] | None = None,
    /,
    *,
    output: str | None = None,
    **expressions: str | None,
) -> Callable[[type[Layer]], type[Layer]]:
    """A class decorator attaching einshard expressions to an Equinox module's fields.

    Every instance is placed when it is built, after its ``__init__`` (and
    converters) ran: each named field holding an array is placed by its
    expression; outside a trace it becomes a placed ``jax.Array``, inside
    one (``jax.jit``, ``eqx.filter_jit``, ``eqx.filter_eval_shape``,
    ``eqx.filter_vmap``) a sharding constraint. Instances made by
    ``tree_unflatten`` (``jit`` outputs, ``eqx.tree_at``, gradients) are not
    re-placed. The decorator returns a subclass of the class, of the same
    name, fields and ``__init__``, built by Equinox's own metaclass with a
    ``__check_init__`` that places (and, with ``output=``, a ``__call__`` that
    constrains): Equinox sees both when it builds the class, and the class
    you wrote is not changed.

    Subclasses inherit the expressions and may override them by decorating
    again (``None`` removes an inherited one). :func:`module_rules` turns the
    decorated layers of a model into one rule table.

    **Stacked layers.** Write ``'... o i -> ... o* i'`` for a layer that may
    also be built with a leading layer axis (``eqx.filter_vmap`` over keys):
    ``...`` takes the stacked axis, unsharded, and nothing on a single layer.

    **The output and vmap.** ``output=`` constrains the value ``__call__``
    returns, with :func:`einshard.einshard`: under ``jit`` a sharding
    constraint. Equinox layers are usually called on one example under
    ``jax.vmap``; there the expression sees the **per-example** rank
    (``eqx.nn.Linear``'s output is ``(out_features,)``, so
    ``output='o -> o*'``), and JAX leaves the vmapped batch axis
    unconstrained, so a data-parallel batch stays split. A layer called on a
    batch directly sees the batch axis (``'b o -> b o*'``). Only the
    outermost decorated ``__call__`` of an instance applies its expression.

    Args:
        fields: The expressions as a mapping from field name, for fields whose
            name is not a Python keyword argument (or is ``output``).
        output: An expression for the value ``__call__`` returns (one array).
        **expressions: ``field_name='expression'``, e.g. ``weight='o i -> o* i'``.

    Returns:
        The decorator: it returns the placing subclass.

    Raises:
        EinshardError: A class that is not an ``eqx.Module`` subclass of your
            own, a name that is not one of its fields, a static field, or an
            expression that does not parse.

    >>> import jax, equinox as eqx
    >>> from einshard.integrations.equinox import sharded
    >>> @sharded(weight='o i -> o i*', output='o -> * o')
    ... class RowLinear(eqx.nn.Linear):
    ...     pass
    >>> layer = RowLinear(64, 8, use_bias=False, key=jax.random.key(0))
    >>> layer.weight.sharding.shard_shape((8, 64))
    (8, 8)
    >>> jax.vmap(layer)(jax.numpy.ones((2, 64))).shape
    (2, 8)
    """
    table: dict[str, str | None] = dict(fields or {})
    table.update(expressions)
    if output is not None:
        table[_OUTPUT] = output
    for name, expression in table.items():
        if expression is None:
            continue
        if not isinstance(expression, str):
            kind = type(expression).__name__
            raise EinshardError(
                f"the expression for {name!r} is {'an' if kind[0] in 'aeiou' else 'a'} {kind}, not a string",
                hint="Write it like weight='o i -> o* i'.",
            )
        try:
            parse(expression)
        except EinshardError as error:
            raise error.add_context(f"in @sharded({name}={expression!r})") from None

    def decorate(cls: type[Layer]) -> type[Layer]:
        _check_class(cls, table)
        # A subclass made through Equinox's own metaclass, so that Equinox sees the hook when it
        # builds the class (its development line collects __check_init__ methods then, once).
        namespace: dict[str, Any] = {
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
            _OWN: dict(table),
            "__check_init__": _check_init(),
        }
        if {**field_expressions(cls), **table}.get(_OUTPUT) is not None:
            namespace["__call__"] = _output_call(cls.__call__)  # pyright: ignore[reportAttributeAccessIssue]
        subclass = type(cls)(cls.__name__, (cls,), namespace)
        assert issubclass(subclass, cls)  # what the metaclass makes of (cls,): a subclass of it
        return subclass

    return decorate


def _public_name(cls: type) -> str:
    """``equinox.nn.Linear`` rather than ``equinox.nn._linear.Linear``: the shortest importable path."""
    parts = cls.__module__.split(".")
    for end in range(1, len(parts) + 1):
        module = sys.modules.get(".".join(parts[:end]))
        if module is not None and getattr(module, cls.__name__, None) is cls:
            return f"{module.__name__}.{cls.__qualname__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _check_class(cls: Any, table: Mapping[str, str | None]) -> None:
    if not (isinstance(cls, type) and issubclass(cls, eqx.Module)):
        raise EinshardError(
            f"@sharded decorates an eqx.Module subclass, not {cls!r}",
            hint="Put it on a class: @sharded(weight='o i -> o* i') class ColumnLinear(eqx.nn.Linear): pass",
        )
    if cls.__module__.split(".")[0] == "equinox":
        raise EinshardError(
            f"@sharded would change {_public_name(cls)} for every user of it",
            hint=f"Decorate a subclass of your own: @sharded(...) class Sharded{cls.__name__}"
            f"({_public_name(cls)}): pass",
        )
    fields = {field.name: field for field in dataclasses.fields(cls)}
    for name in table:
        if name == _OUTPUT and name not in fields:
            continue
        field = fields.get(name)
        if field is None:
            raise EinshardError(
                f"{cls.__name__} has no field {name!r}",
                hint=f"Its fields are: {', '.join(fields) or '(none)'}.",
            )
        if field.metadata.get("static", False):
            raise EinshardError(
                f"field {name!r} of {cls.__name__} is static: it holds no arrays to shard",
                hint="Attach expressions to array fields, such as weight and bias.",
            )


def field_expressions(cls: type) -> dict[str, str]:
    """The expressions a class's instances are placed by: its own and its decorated bases'.

    The ``'output'`` key, if present, is the expression for ``__call__``'s
    result (unless the class has a field named ``output``).

    >>> import equinox as eqx
    >>> from einshard.integrations.equinox import field_expressions, sharded
    >>> @sharded(weight='o i -> o* i', bias='o -> o*')
    ... class ColumnLinear(eqx.nn.Linear):
    ...     pass
    >>> @sharded(bias=None)
    ... class NoBiasSplit(ColumnLinear):
    ...     pass
    >>> field_expressions(NoBiasSplit)
    {'weight': 'o i -> o* i'}
    """
    merged: dict[str, str | None] = {}
    for kls in reversed(cls.__mro__):
        merged.update(kls.__dict__.get(_OWN, {}))
    return {name: expression for name, expression in merged.items() if expression is not None}


def _first_decorated(cls: type) -> type | None:
    for kls in cls.__mro__:
        if _OWN in kls.__dict__:
            return kls
    return None


def _check_init() -> Callable[[Any], None]:
    def __check_init__(self: Any) -> None:
        # Every decorated class in the MRO has one; the most derived places, once.
        owner = _first_decorated(type(self))
        if owner is not None and owner.__dict__.get("__check_init__") is __check_init__:
            _place(self)

    return __check_init__


def _place(module: Any) -> None:
    """Places the decorated fields of a module being built (it is still mutable to us)."""
    names = {field.name for field in dataclasses.fields(module)}
    for name, expression in field_expressions(type(module)).items():
        if name not in names:
            continue  # the output expression
        value = getattr(module, name)
        if not is_array(value):
            continue  # None (no bias), Python numbers, ...
        try:
            placed = einshard(value, expression)
        except EinshardError as error:
            raise error.add_context(
                f"while building {type(module).__name__}: field {name!r} (shape {tuple(value.shape)})"
            ) from None
        object.__setattr__(module, name, placed)


def _output_call(call: Callable[..., Any]) -> Callable[..., Any]:
    inner = getattr(call, _WRAPPED, call)

    @functools.wraps(inner)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        outer = _active.__dict__.setdefault("ids", set())
        if id(self) in outer:  # a decorated subclass's __call__ is running: it constrains
            return inner(self, *args, **kwargs)
        outer.add(id(self))
        try:
            out = inner(self, *args, **kwargs)
        finally:
            outer.discard(id(self))
        expression = field_expressions(type(self)).get(_OUTPUT)
        if expression is None or _OUTPUT in {field.name for field in dataclasses.fields(self)}:
            return out
        try:
            return einshard(out, expression)
        except EinshardError as error:
            shape = tuple(getattr(out, "shape", ()))
            raise error.add_context(
                f"while constraining the output of {type(self).__name__} (shape {shape}); "
                "under jax.vmap the expression sees one example"
            ) from None

    setattr(__call__, _WRAPPED, inner)
    return __call__


_active = threading.local()  # ids of the modules whose decorated __call__ is running


# --- rule tables -------------------------------------------------------------------------------


def module_rules(model: Any, *, default: str | None = "... -> * ...") -> Rules:
    """The model-wide rule table its decorated layers compose into.

    One rule per decorated array field of each layer instance, anchored to
    the end of its path and to a path boundary (``('(^|/)layers/0/weight$',
    'o i -> o* i')``), in tree order, then ``(r'.*', default)`` for every other
    leaf. The ``(^|/)`` anchor lets the same table shard the model itself and a
    step's arguments in :func:`einshard.explain_step` and :func:`einshard.plan`,
    whose paths begin with the argument's name (``model/layers/0/weight``). A
    rule that would also take another leaf of this model (a nested layer whose
    path ends the same way) is anchored at the start too (``'^...$'``). Works on a concrete model and
    on an abstract one (``eqx.filter_eval_shape``), so it can plan a model
    that was never built. Combine it with other rules by ``+``.

    Args:
        model: An Equinox module, or any pytree holding modules.
        default: The expression for the leaves no decorator covers
            (replicated by default); ``None`` adds no catch-all rule, so
            those leaves fall to the table's ``unmatched`` policy (an error).

    Returns:
        The table, a :class:`einshard.Rules`.

    >>> import jax, equinox as eqx, einshard
    >>> from einshard.integrations.equinox import module_rules, sharded
    >>> @sharded(weight='o i -> o* i')
    ... class ColumnLinear(eqx.nn.Linear):
    ...     pass
    >>> class Model(eqx.Module):
    ...     layers: list
    ...     def __init__(self, key):
    ...         self.layers = [ColumnLinear(4, 8, key=key), eqx.nn.Linear(8, 4, key=key)]
    >>> abstract = eqx.filter_eval_shape(Model, jax.random.key(0))
    >>> report = einshard.explain(abstract, module_rules(abstract))
    >>> for row in report.rows:
    ...     print(row.path, row.expression, row.shard_shape)
    layers/0/weight o i -> o* i (1, 4)
    layers/0/bias ... -> * ... (8,)
    layers/1/weight ... -> * ... (4, 8)
    layers/1/bias ... -> * ... (4,)
    """
    decorated = list(_decorated_leaves(model))
    _, every_path, _ = flatten_with_paths(model)
    taken: set[str] = set()
    pairs = []
    for path, expression in decorated:
        pattern = f"(^|/){re.escape(path)}$"
        others = [p for p in every_path if p != path and p not in taken and re.search(pattern, p)]
        pairs.append((f"^{re.escape(path)}$" if others else pattern, expression))
        taken.add(path)
    if default is not None:
        pairs.append((r".*", default))
    return Rules(pairs)


def _decorated_leaves(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[str, str]]:
    if isinstance(node, eqx.Module):
        expressions = field_expressions(type(node))
        names = {field.name for field in dataclasses.fields(node)}
        for name, expression in expressions.items():
            if name in names and is_array(getattr(node, name, None)):
                yield path_string((*path, jax.tree_util.GetAttrKey(name))), expression
    children, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda child: child is not node)
    if len(children) == 1 and children[0][0] == ():
        return  # a leaf
    for key_path, child in children:
        if _has_module(child):
            yield from _decorated_leaves(child, (*path, *key_path))


def _has_module(tree: Any) -> bool:
    found = jax.tree_util.tree_leaves(tree, is_leaf=lambda node: isinstance(node, eqx.Module))
    return any(isinstance(leaf, eqx.Module) for leaf in found)


def _rules_for(model: Any, rules: RulesLike | None) -> RulesLike:
    if rules is not None:
        return rules
    table = module_rules(model, default=None)
    if not len(table):
        raise EinshardError(
            f"no rules given, and {type(model).__name__} has no layers decorated with @sharded",
            hint="Pass a rule table, e.g. [(r'weight$', 'o i -> o* i'), (r'.*', '... -> * ...')], "
            "or build the model from @sharded layers.",
        )
    return Rules([*table.pairs(), (r".*", _REPLICATE)])


# --- whole modules -----------------------------------------------------------------------------


def shard_module(module: T, rules: RulesLike | None = None, *, devices: Devices | None = None) -> T:
    """An Equinox module with every array field placed by a rule table.

    Paths are field names and sequence indices joined with ``/``
    (``layers/0/weight``). Functions, static fields and non-array leaves are
    untouched; scalars are replicated. The result is a module of the same
    type, for ``eqx.filter_jit``, ``eqx.filter_grad`` and
    ``eqx.apply_updates``. Inside a trace the fields become sharding
    constraints.

    Args:
        module: An Equinox module (or any pytree holding modules).
        rules: The rule table, with its policies (see
            :func:`einshard.shard_pytree`; a :class:`einshard.Rules` with
            ``unmatched=`` etc. changes them). ``None``: the table the
            model's :func:`sharded` layers compose into (:func:`module_rules`),
            other leaves replicated.
        devices: The devices, in order (see :func:`einshard.make_sharding`).

    Returns:
        The module, value for value, each array field placed.

    Raises:
        EinshardError: ``rules=None`` and no decorated layer; a leaf no rule
            matches, or one its rule does not fit (the path, shape and rule named).

    >>> import jax, equinox as eqx
    >>> from einshard.integrations.equinox import shard_module
    >>> emb = shard_module(eqx.nn.Embedding(100, 64, key=jax.random.key(0)), {'weight': 'v d -> v d*'})
    >>> emb.weight.sharding.shard_shape((100, 64))
    (100, 8)
    """
    table_second("shard_module", module, rules, noun="the module", is_target=_has_module)
    table = _rules_for(module, rules)
    try:
        return _pytrees.shard_pytree(module, table, devices=devices)
    except EinshardError as error:
        raise error.add_context(f"in {type(module).__name__}") from None


def create_sharded(
    factory: Callable[..., T], rules: RulesLike | None = None, /, *args: Any, **kwargs: Any
) -> T:
    """Builds ``factory(*args, **kwargs)`` born sharded: no sharded leaf is ever whole on one device.

    The model's shapes are found abstractly (``eqx.filter_eval_shape``), the
    rules give each array leaf its sharding, and the construction is
    compiled with those as ``out_shardings`` (through
    :func:`einshard.init_sharded`, over the array part of the module): each
    device computes only its own shards. The values are those an unsharded
    ``factory(*args, **kwargs)`` gives; functions and static fields are
    those of the construction. Array arguments (PRNG keys) are traced; other
    arguments are passed as they are.

    The arguments come in the order of every born-sharded builder (Flax's
    :func:`einshard.integrations.flax.create_sharded`,
    :func:`einshard.init_sharded`): the factory, the rules, then the factory's
    own arguments. ``rules=`` after them is refused with an error showing
    that call, unless the factory has a parameter called ``rules`` itself.

    Args:
        factory: A module class, or any function returning a module (or a
            pytree of them).
        rules: The rule table; ``None``: the table the model's
            :func:`sharded` layers compose into (:func:`module_rules`), other
            leaves replicated.
        *args: Positional arguments for ``factory``.
        **kwargs: Keyword arguments for ``factory``.

    Returns:
        The module, each array leaf placed by its rule.

    Raises:
        EinshardError: As :func:`shard_module` would, before anything is
            computed; the rules given by keyword, or a factory argument in
            their place.

    >>> import jax, equinox as eqx
    >>> from einshard.integrations.equinox import create_sharded
    >>> rules = [('weight', 'o i -> o* i'), ('bias', 'o -> o*')]
    >>> layer = create_sharded(eqx.nn.Linear, rules, 4, 16, key=jax.random.key(0))
    >>> sorted({shard.data.shape for shard in layer.weight.addressable_shards})
    [(2, 4)]
    """
    checked = rule_table(
        "create_sharded",
        factory,
        rules,
        args,
        kwargs,
        noun="the factory",
        none="the table its @sharded layers compose into",
    )
    abstract = eqx.filter_eval_shape(factory, *args, **kwargs)
    table = _rules_for(abstract, checked)
    _pytrees.pytree_shardings(abstract, table)  # fail on a bad table before compiling anything
    statics: list[Any] = []

    def build(call_args: tuple[Any, ...], call_kwargs: dict[str, Any]) -> Any:
        arrays, static = eqx.partition(factory(*call_args, **call_kwargs), eqx.is_array)
        statics.append(static)
        return arrays

    # The factory's arguments go packed, so that any names they have (rules=, init_fn=) stay theirs.
    arrays = _pytrees.init_sharded(build, table, args, kwargs)
    return eqx.combine(arrays, statics[-1])
