"""Framework integrations: ``einshard.integrations.flax``, ``.equinox``, ``.optax`` and ``.orbax``.

Each lives in its own module and imports its framework itself, so that
``import einshard`` imports none of them.
"""

PATH_CONVENTIONS = {"flax": "einshard.integrations.flax"}
"""Integrations that register how their framework's leaf paths read, by the framework's module.

The core imports one when its framework is in ``sys.modules`` (and the tree has nodes the
core does not know), so paths read the same whether or not the user imported the integration.
"""
