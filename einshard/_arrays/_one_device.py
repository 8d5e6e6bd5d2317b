"""A one-time warning when every split collapses because einshard sees a single device.

On a laptop, ``jax.devices()`` is one CPU device: ``'x y -> x y*'`` then splits
``y`` into 1 shard and the array stays whole, which looks like a wrong answer
to someone following examples written for 8 devices. The warning says why and
how to simulate devices; it is shown once per process.
"""

from __future__ import annotations

import warnings

from .._language._errors import EinshardWarning
from .._language._layout import Layout

__all__ = ["warn_if_one_device"]

_warned = False


def warn_if_one_device(layout: Layout, stacklevel: int) -> None:
    """Warns, the first time only, if ``layout`` has a starred axis and there is one device.

    Args:
        layout: The layout of a call that used the default device order.
        stacklevel: Passed to :func:`warnings.warn`, so the warning points at the user's call.
    """
    global _warned
    if _warned or layout.n_devices != 1:
        return
    starred = [e for e in layout.expression.right if e.name is not None and e.star]
    if not starred:
        return
    _warned = True
    warnings.warn(
        f"einshard sees 1 device, so {layout.expression.text!r} splits nothing ('{starred[0]}' resolves "
        "to 1 shard) and the array stays whole on it. To try layouts without accelerators, simulate "
        "devices before JAX starts: jax.config.update('jax_num_cpu_devices', 8). (Shown once.)",
        EinshardWarning,
        stacklevel=stacklevel + 1,
    )
