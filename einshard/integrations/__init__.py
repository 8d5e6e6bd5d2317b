"""Framework integrations: ``einshard.integrations.flax``, ``.equinox`` and ``.optax``.

Each lives in its own module and imports its framework itself, so that
``import einshard`` imports none of them.
"""
