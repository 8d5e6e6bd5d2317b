"""einshard: shard JAX arrays, and whole models, from einsum-like expressions.

>>> import jax.numpy as jnp
>>> from einshard import einshard
>>> w1 = einshard(jnp.zeros((128, 256)), 'x y -> x y*')  # split y over all devices
"""

from . import integrations as integrations  # it registers the integrations' path conventions
from . import strategies as strategies
from ._arrays._arrays import einshard as einshard
from ._arrays._arrays import make_sharding as make_sharding
from ._arrays._multihost import from_process_local as from_process_local
from ._cost._step import Finding as Finding
from ._cost._step import Hardware as Hardware
from ._cost._step import StepReport as StepReport
from ._cost._step import StepRow as StepRow
from ._cost._step import explain_step as explain_step
from ._cost.pipeline._analysis import DoesNotFitError as DoesNotFitError
from ._cost.pipeline._program import constrain_loops as constrain_loops
from ._language._errors import EinshardDeprecationWarning as EinshardDeprecationWarning
from ._language._errors import EinshardError as EinshardError
from ._language._errors import EinshardWarning as EinshardWarning
from ._language._expression import Expression as Expression
from ._language._expression import parse as parse
from ._language._layout import Layout as Layout
from ._language._layout import layout as layout
from ._planning.search._batches import BatchPlan as BatchPlan
from ._planning.search._batches import BatchRow as BatchRow
from ._planning.search._batches import plan_batches as plan_batches
from ._planning.search._planner import Plan as Plan
from ._planning.search._planner import PlanRow as PlanRow
from ._planning.search._planner import plan as plan
from ._sharding._devices import use_devices as use_devices
from ._sharding._picture import picture as picture
from ._sharding._picture import visualize as visualize
from ._tracing._batch_layout import like_batch as like_batch
from ._tracing._batch_layout import use_strategy as use_strategy
from ._trees._explain import Report as Report
from ._trees._explain import ReportRow as ReportRow
from ._trees._explain import explain as explain
from ._trees._pytrees import init_sharded as init_sharded
from ._trees._pytrees import pytree_shardings as pytree_shardings
from ._trees._pytrees import shard_pytree as shard_pytree
from ._trees._pytrees import shardings_of as shardings_of
from ._trees._rules import Rule as Rule
from ._trees._rules import Rules as Rules

__version__ = "0.3.0"
