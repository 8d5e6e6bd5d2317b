"""Which frame of a call stack is the user's: the first one outside installed libraries.

A report names the user's line: a loop's own, or the model's call that leads into library code,
never a file inside JAX, Flax or Equinox. A frame's file belongs to a library when it lies in an
installed package's folder (``site-packages``, ``dist-packages``), in Python's own library, or
in JAX's or einshard's source tree (installed or not). Pure text: a program's stack saved on
another machine reads the same.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence

__all__ = ["is_library_file", "user_frame", "user_stacklevel"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # einshard's own folder
# Installed packages, Python's own library (``/usr/lib/python3.12/contextlib.py``), and the source
# trees of JAX and jaxlib outside an installation (an editable install).
_LIBRARY = re.compile(r"[/\\](?:site-packages|dist-packages|python3\.\d+|jax[/\\]_src|jaxlib)[/\\]")
_OWN = re.compile(r"[/\\](?:jax|jaxlib|einshard)[/\\]")  # what no user line is, whatever the caller


def is_library_file(path: str) -> bool:
    """Whether a frame's file is a library's (see the module), not the user's.

    >>> is_library_file('/venv/lib/python3.12/site-packages/flax/linen/linear.py')
    True
    >>> is_library_file('/home/me/model.py'), is_library_file('<stdin>')
    (False, False)
    """
    return path.startswith(_PACKAGE) or path.startswith("<frozen ") or bool(_LIBRARY.search(path))


def user_frame(frames: Sequence[tuple[str, int]]) -> tuple[str, int] | None:
    """The user's frame of a stack given innermost first: ``(file, line)``.

    The first frame outside every library; where the whole stack is library code (a model
    installed as a package, called from its own scripts), the first outside JAX and einshard;
    ``None`` for an empty stack.
    """
    for file, line in frames:
        if not is_library_file(file):
            return file, line
    for file, line in frames:
        if not _is_own(file):
            return file, line
    return frames[0] if frames else None


def _is_own(path: str) -> bool:
    """Whether a file is JAX's, jaxlib's or einshard's: never a line a user wrote."""
    return path.startswith(_PACKAGE) or bool(_OWN.search(path))


def user_stacklevel() -> int:
    """``warnings.warn``'s ``stacklevel`` for the user's line: the first frame outside einshard.

    Asked where the warning is raised (not in a helper that calls it): however many of einshard's
    own frames stand between (an entry point's decorators, the child's pool), the warning names
    the line that called einshard.
    """
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        level, frame = level + 1, frame.f_back
    return level
