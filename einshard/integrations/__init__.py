"""Framework integrations: ``einshard.integrations.flax``, ``.equinox``, ``.optax`` and ``.orbax``.

Each lives in its own module and imports its framework itself, so that
``import einshard`` imports none of them. This package imports no framework either; it tells
the core which integrations change how their framework's leaf paths read, so that the core
imports one when its framework is in use (and a tree has nodes the core does not know): paths
then read the same whether or not the user imported the integration.
"""

from .._trees._paths import register_wrapper_finder as _register_wrapper_finder

# By the framework's module: the integration that registers its value wrappers.
_PATH_CONVENTIONS = {"flax": "einshard.integrations.flax"}


def _import_path_conventions() -> None:
    """Imports the integrations that register a path convention, for the frameworks in use."""
    import importlib
    import sys

    for framework, integration in _PATH_CONVENTIONS.items():
        if framework in sys.modules and integration not in sys.modules:
            importlib.import_module(integration)


_register_wrapper_finder(_import_path_conventions)
