"""The command line: draw an expression's device grid for any device count.

    python -m einshard 'a b -> 2 a2* b*' --shape 4,8 --devices 16

prints a one-line summary and the picture ``jax.debug.visualize_array_sharding``
would print for the array placed on that many devices. No devices are created
or needed. A mistake in the expression is reported on stderr with exit status 2.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Sequence

from ._language import _layout
from ._language._errors import EinshardError
from ._language._layout import Layout
from ._sharding._picture import MAX_DEVICES_DRAWN, MAX_SCALE, MAX_WIDTH, picture

__all__ = ["main", "summary"]

_EPILOG = f"""\
examples:
  python -m einshard 'a b -> * a2 b' --shape 4,8 --devices 16
  python -m einshard 'x y -> x y*' --shape 128,256 --devices 256 --platform tpu
  python -m einshard 'b s d -> b* s d' --shape 32,1024,512 --devices 8

Arrays of rank 1 and 2 give one grid; for higher ranks the last two axes are
drawn, one grid per block of the leading axes. Cells are labelled with device
positions 0..N-1 in the einshard device order (the ids of jax.devices() on one host).
Pictures are drawn for at most {MAX_DEVICES_DRAWN} devices (the summary line for any count),
with --scale above 0 and at most {MAX_SCALE:g}, and --width from 1 to {MAX_WIDTH} columns.
Exit status: 0 on success, 2 for a bad expression or arguments, 1 if 'rich' is missing.
"""


def summary(layout: Layout, shape: Sequence[int]) -> str:
    """One line saying how ``layout`` splits an array of ``shape``.

    Args:
        layout: The layout.
        shape: The array's shape (already checked against the layout).

    Returns:
        The expression, the shape and device count, then how many shards of
        which shape there are (and, for rank 2 and more, how each axis is
        split) and how many devices hold each.

    >>> import einshard
    >>> print(summary(einshard.layout('a b -> 2 a2* b*', (4, 8), n_devices=16), (4, 8)))
    'a b -> 2 a2* b*': shape (4, 8) on 16 devices: 8 shards of shape (1, 4) (split 4 × 2), each on 2 devices
    """
    shape = tuple(shape)
    n = layout.n_devices
    head = f"{layout.expression.text!r}: shape {shape} on {n} device{'s' if n != 1 else ''}"
    n_shards = math.prod(layout.shards)
    if n_shards == 1:
        whole = "every device holds" if n > 1 else "the device holds"
        return f"{head}: not split, {whole} the whole array"
    split = f" (split {' × '.join(map(str, layout.shards))})" if len(shape) > 1 else ""
    replication = layout.replication
    each = "each on 1 device" if replication == 1 else f"each on {replication} devices"
    return f"{head}: {n_shards} shards of shape {layout.shard_shape(shape)}{split}, {each}"


def _shape(text: str) -> tuple[int, ...]:
    """Parses ``4,8``, ``4x8``, ``'4 8'`` or ``(4, 8)``; an empty string is a scalar."""
    stripped = text.strip().strip("()[]").strip()
    if len(stripped) > 100_000:
        raise argparse.ArgumentTypeError(f"a shape of {len(stripped)} characters is too long")
    if not stripped:
        return ()
    parts = [p for p in re.split(r"[,x×\s]+", stripped) if p]
    if not all(p.isascii() and p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a shape; write the sizes separated by commas, e.g. 4,8"
        )
    if any(len(p) > _MAX_DIGITS for p in parts):
        raise argparse.ArgumentTypeError(f"a size of more than {_MAX_DIGITS} digits is too large")
    return tuple(int(p) for p in parts)


# Digits in a number on the command line: Python's int() refuses more than 4300 by default, and
# no device count or size comes near this.
_MAX_DIGITS = 100


def _count(text: str) -> int:
    if len(text) > _MAX_DIGITS:
        raise argparse.ArgumentTypeError(f"a count of {len(text)} characters is too long")
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive device count")
    return int(text)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= MAX_SCALE:  # NaN fails this too
        raise argparse.ArgumentTypeError(f"{text!r} is not a number above 0 and at most {MAX_SCALE:g}")
    return value


def _width(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or len(text) > 6 or not 1 <= int(text) <= MAX_WIDTH:
        raise argparse.ArgumentTypeError(f"{text!r} is not a width from 1 to {MAX_WIDTH} columns")
    return int(text)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m einshard",
        description="Draw which device holds which block of an array sharded by an einshard "
        "expression, for any device count, without the devices (the picture "
        "jax.debug.visualize_array_sharding prints for the placed array).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("expression", help="an einshard expression, e.g. 'x y -> x y*' (quote it)")
    parser.add_argument(
        "--shape",
        required=True,
        type=_shape,
        metavar="SIZES",
        help="the array's shape: sizes separated by commas (4,8), by x (4x8) or by spaces ('4 8'), "
        "optionally in parentheses or brackets ('(4, 8)'); '' for a scalar",
    )
    parser.add_argument(
        "--devices",
        required=True,
        type=_count,
        metavar="N",
        help="the number of devices to lay the array out on (a count; no devices are needed)",
    )
    parser.add_argument(
        "--platform",
        default="cpu",
        help="the platform named in the cells, e.g. tpu or gpu (default: cpu)",
    )
    parser.add_argument(
        "--scale",
        type=_positive_float,
        default=1.0,
        help=f"scale the grid's height, above 0 and at most {MAX_SCALE:g} (default: 1)",
    )
    parser.add_argument(
        "--width",
        type=_width,
        default=80,
        metavar="COLUMNS",
        help=f"the widest the picture may be, in characters, at most {MAX_WIDTH} (default: 80)",
    )
    parser.add_argument("--no-summary", action="store_true", help="print only the picture")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line.

    Args:
        argv: The arguments, without the program name; defaults to ``sys.argv[1:]``.

    Returns:
        The exit status: 0 on success, 2 for an expression that does not fit
        (the message goes to stderr), 1 if ``rich`` is not installed.
        Malformed arguments exit with status 2 through argparse.
    """
    args = _parser().parse_args(argv)
    try:
        layout = _layout.layout(args.expression, args.shape, n_devices=args.devices)
        if args.devices > MAX_DEVICES_DRAWN and not args.no_summary:
            print(summary(layout, args.shape))  # the answer, though the picture is too large to draw
        text = picture(
            args.expression,
            args.shape,
            n_devices=args.devices,
            platform=args.platform,
            scale=args.scale,
            max_width=args.width,
        )
    except EinshardError as error:
        print(f"einshard: error: {error}", file=sys.stderr)
        return 2
    except ImportError as error:
        print(f"einshard: error: {error}", file=sys.stderr)
        return 1
    if not args.no_summary:
        print(summary(layout, args.shape))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
