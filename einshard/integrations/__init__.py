"""Framework integrations: ``einshard.integrations.flax``, ``.equinox``, ``.optax`` and ``.orbax``.

Each lives in its own module and imports its framework itself, so that
``import einshard`` imports none of them.
"""
