"""Parallelism strategies as rule tables: ``einshard.strategies.fsdp()`` and friends.

Each returns a :class:`Strategy`, an ordinary :class:`~einshard.Rules` with the expression for
the batch that goes with it; :func:`einshard.plan` compiles a step under each and ranks them.
"""

from ._planning.tables._roles import LeafRole as LeafRole
from ._planning.tables._roles import Roles as Roles
from ._planning.tables._strategies import COLUMN as COLUMN
from ._planning.tables._strategies import ROW as ROW
from ._planning.tables._strategies import data_parallel as data_parallel
from ._planning.tables._strategies import defaults as defaults
from ._planning.tables._strategies import fsdp as fsdp
from ._planning.tables._strategies import hsdp as hsdp
from ._planning.tables._strategies import hybrid as hybrid
from ._planning.tables._strategies import roles as roles
from ._planning.tables._strategies import tensor_parallel as tensor_parallel
from ._trees._rules import ByShape as ByShape
from ._trees._strategy import SplitLargest as SplitLargest
from ._trees._strategy import Strategy as Strategy
