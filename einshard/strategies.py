"""Parallelism strategies as rule tables: ``einshard.strategies.fsdp()`` and friends.

Each returns a :class:`Strategy`, an ordinary :class:`~einshard.Rules` with the expression for
the batch that goes with it; :func:`einshard.plan` compiles a step under each and ranks them.
"""

from ._cost._roles import LeafRole as LeafRole
from ._cost._roles import Roles as Roles
from ._cost._strategies import COLUMN as COLUMN
from ._cost._strategies import ROW as ROW
from ._cost._strategies import SplitLargest as SplitLargest
from ._cost._strategies import Strategy as Strategy
from ._cost._strategies import data_parallel as data_parallel
from ._cost._strategies import defaults as defaults
from ._cost._strategies import fsdp as fsdp
from ._cost._strategies import hybrid as hybrid
from ._cost._strategies import roles as roles
from ._cost._strategies import tensor_parallel as tensor_parallel
from ._trees._rules import ByShape as ByShape
