"""Pictures: the device grid drawn from the layout alone, from Python and the command line."""

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import einshard
from conftest import N_DEVICES
from einshard import EinshardError
from einshard.__main__ import main, summary
from einshard._sharding._picture import picture, visualize

ROOT = Path(__file__).resolve().parents[1]

# The two pictures of the einshard 0.2.0 README (jax.debug.visualize_array_sharding of the
# arrays 0.2.0 placed on 16 CPU devices), copied verbatim with the README's indentation.
README_STAR = """
    ┌────────────────────────────────────────────────┐
    │                                                │
    │             CPU 0,2,4,6,8,10,12,14             │
    │                                                │
    │                                                │
    ├────────────────────────────────────────────────┤
    │                                                │
    │             CPU 1,3,5,7,9,11,13,15             │
    │                                                │
    │                                                │
    └────────────────────────────────────────────────┘
"""
README_TWO_STARS = """
    ┌───────────────────────┬───────────────────────┐
    │        CPU 0,8        │        CPU 1,9        │
    ├───────────────────────┼───────────────────────┤
    │       CPU 2,10        │       CPU 3,11        │
    ├───────────────────────┼───────────────────────┤
    │       CPU 4,12        │       CPU 5,13        │
    ├───────────────────────┼───────────────────────┤
    │       CPU 6,14        │       CPU 7,15        │
    └───────────────────────┴───────────────────────┘
"""
README_PICTURES = [("a b -> * a2 b", README_STAR), ("a b -> 2 a2* b*", README_TWO_STARS)]


def normalized(text: str) -> str:
    """Drops common indentation, trailing spaces and surrounding blank lines."""
    lines = [line.rstrip() for line in textwrap.dedent(text).splitlines()]
    return "\n".join(lines).strip("\n")


def printed_plainly(capsys, monkeypatch, draw) -> str:
    """What ``draw()`` prints, normalized; rich is kept from forcing a terminal (and colour)."""
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(name, raising=False)
    capsys.readouterr()
    draw()
    printed = capsys.readouterr().out
    assert "\x1b" not in printed  # plain text, so the comparison is of the drawing itself
    return normalized(printed)


def jax_picture(capsys, monkeypatch, shape, sharding, **kwargs) -> str:
    """What jax.debug.visualize_sharding prints for ``sharding``, without colour."""
    return printed_plainly(
        capsys,
        monkeypatch,
        lambda: jax.debug.visualize_sharding(shape, sharding, use_color=False, **kwargs),
    )


def jax_array_picture(capsys, monkeypatch, array) -> str:
    """What jax.debug.visualize_array_sharding prints for a placed array, without colour."""
    return printed_plainly(
        capsys, monkeypatch, lambda: jax.debug.visualize_array_sharding(array, use_color=False)
    )


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = dict(os.environ)
    environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [environ.get("PYTHONPATH")])])
    environ["PYTHONIOENCODING"] = "utf-8"
    environ.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "einshard", *args],
        capture_output=True,
        text=True,
        encoding="utf-8",
        env=environ,
        cwd=ROOT,
        timeout=120,
    )


# --- the README's pictures ------------------------------------------------------------


@pytest.mark.parametrize(("expression", "expected"), README_PICTURES)
def test_readme_pictures(expression, expected):
    assert picture(expression, (4, 8), n_devices=16) == normalized(expected)


@pytest.mark.parametrize(("expression", "expected"), README_PICTURES)
def test_readme_pictures_from_the_command_line(expression, expected):
    result = run_cli(expression, "--shape", "4,8", "--devices", "16")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    head, _, drawing = result.stdout.partition("\n")
    assert head.startswith(f"{expression!r}: shape (4, 8) on 16 devices")
    assert normalized(drawing) == normalized(expected)


# --- the same text as JAX, for the real devices of this process -------------------------

N = N_DEVICES
JAX_CASES = [
    ("x -> x*", (2 * N,)),
    ("x -> * x2", (6,)),
    ("x -> x2 *", (4,)),
    ("x -> x *", (5,)),
    ("x -> 2 x*", (N,)),
    ("x y -> x y*", (4, 8 * N)),
    ("x y -> x y*", (3, N)),
    ("x y -> x* y", (2 * N, 5)),
    ("x y -> x* y", (8 * N, 2)),  # tall: the widths hit min_width
    ("x y -> x y*", (2, 64 * N)),  # wide: the widths hit max_width
    ("x y -> x2 y*", (4, 3 * N)),
    ("x y -> y2 x*", (6 * N, 4)),
    ("a b -> * a2 b", (4, 8)),
    ("a b -> a2 b *", (4, 8)),
    ("a b -> 2 a* b", (2 * N, 8)),
    ("a b -> * a b", (3, 7)),
    ("a b -> 1 a* 1 b 1", (2 * N, 3)),
    ("a ... -> a* ...", (N, 3)),
    ("... -> * ...", (3, 5)),
]


@pytest.mark.parametrize(("expression", "shape"), JAX_CASES)
def test_same_text_as_jax_for_the_placed_array(capsys, monkeypatch, expression, shape):
    array = einshard.einshard(np.zeros(shape, np.float32), expression)
    ours = picture(expression, shape)
    assert ours == jax_array_picture(capsys, monkeypatch, array)
    # With the device count alone, positions label the cells; on one CPU host they are the ids.
    assert [device.id for device in jax.devices()] == list(range(N))
    assert picture(expression, shape, n_devices=N) == ours


def _is_square(n):
    return n > 0 and math.isqrt(n) ** 2 == n


# Each case with the device counts its two stars have an exact root on (checked by hand: 16 for
# the first two, 8 for the third, 6 for the last); on the others the root is an error.
@pytest.mark.parametrize(
    ("expression", "shape", "fits"),
    [
        ("a b -> a* b*", (4 * N, 4 * N), _is_square(N)),
        ("a b -> 2 a2* b*", (4 * N, 8 * N), N % 4 == 0 and _is_square(N // 4)),
        ("a b -> a* b* 2", (N, N), N % 2 == 0 and _is_square(N // 2)),
        ("a b -> a2* b3*", (12, 12), N % 6 == 0 and _is_square(N // 6)),
    ],
)
def test_same_text_as_jax_for_star_roots(capsys, monkeypatch, expression, shape, fits):
    if not fits:
        with pytest.raises(EinshardError, match=r"which is not a whole square|need a multiple of"):
            einshard.layout(expression, shape, n_devices=N)
        return
    array = einshard.einshard(np.zeros(shape, np.float32), expression)
    assert picture(expression, shape) == jax_array_picture(capsys, monkeypatch, array)


@pytest.mark.parametrize(
    "order",
    [
        pytest.param(lambda devices: devices[::-1], id="reversed"),
        pytest.param(lambda devices: devices[1::2] + devices[::2], id="interleaved"),
        pytest.param(lambda devices: devices[:4], id="first-four"),
    ],
)
@pytest.mark.parametrize(
    ("expression", "shape"),
    [("x y -> x2 y*", (4, 8 * N)), ("x y -> x* y", (4 * N, 2)), ("a b -> * a2 b", (4, 8))],
)
def test_same_text_as_jax_on_given_devices(capsys, monkeypatch, order, expression, shape):
    devices = order(list(jax.devices()))
    array = einshard.einshard(np.zeros(shape, np.float32), expression, devices=devices)
    ours = picture(expression, shape, devices=devices)
    assert ours == jax_array_picture(capsys, monkeypatch, array)


def test_labels_are_the_ids_of_the_given_devices():
    def labels(text):
        return [line.strip("│ ") for line in text.splitlines() if "CPU" in line]

    by_id = picture("x y -> x* y", (N, 2), devices=jax.devices()[::-1])
    by_position = picture("x y -> x* y", (N, 2), n_devices=N)
    assert labels(by_id) == [f"CPU {N - 1 - i}" for i in range(N)]
    assert labels(by_position) == [f"CPU {i}" for i in range(N)]


def test_same_text_as_jax_on_a_mesh(capsys, monkeypatch):
    mesh = Mesh(np.array(jax.devices()[::-1]).reshape(2, N // 2), ("data", "model"))
    shape = (N, 2)
    array = einshard.einshard(np.zeros(shape, np.float32), "x y -> x* y", devices=mesh)
    ours = picture("x y -> x* y", shape, devices=mesh)
    assert ours == jax_array_picture(capsys, monkeypatch, array)
    assert ours == picture("x y -> x* y", shape, devices=jax.devices()[::-1])  # its flat device order


def test_same_text_as_jax_under_an_ambient_mesh(capsys, monkeypatch):
    mesh = Mesh(np.array(jax.devices()[::-1]).reshape(2, N // 2), ("data", "model"))
    shape = (4, 2 * N)
    with jax.set_mesh(mesh):
        array = einshard.einshard(np.zeros(shape, np.float32), "x y -> x2 y*")
        ours = picture("x y -> x2 y*", shape)
    assert ours == jax_array_picture(capsys, monkeypatch, array)
    assert ours == picture("x y -> x2 y*", shape, devices=mesh)


@pytest.mark.parametrize(
    "sizes",
    [
        {"scale": 0.5},
        {"scale": 2.0},
        {"scale": 1.5, "min_width": 20},
        {"max_width": 40},
        {"min_width": 3, "max_width": 120},
    ],
)
@pytest.mark.parametrize(("expression", "shape"), [("x y -> x2 y*", (4, 2 * N)), ("x -> x*", (N,))])
def test_sizes_as_in_jax(capsys, monkeypatch, sizes, expression, shape):
    sharding = einshard.make_sharding(expression, shape=shape)
    ours = picture(expression, shape, n_devices=N, **sizes)
    assert ours == jax_picture(capsys, monkeypatch, shape, sharding, **sizes)


def test_the_default_devices_come_from_use_devices(capsys, monkeypatch):
    devices = jax.devices()[::-1]
    with einshard.use_devices(devices):
        ours = picture("x -> x*", (N,))
    assert ours == picture("x -> x*", (N,), devices=devices)
    sharding = einshard.make_sharding("x -> x*", shape=(N,), devices=devices)
    assert ours == jax_picture(capsys, monkeypatch, (N,), sharding)


# --- labels -------------------------------------------------------------------------------


def test_labels_name_the_platform():
    assert "│ CPU 0 │ CPU 1 │" in picture("x -> x*", (4,), n_devices=2)
    assert "│ TPU 0 │ TPU 1 │" in picture("x -> x*", (4,), n_devices=2, platform="tpu")
    assert "│ GPU 0 │" in picture("x -> x*", (4,), devices=jax.devices()[:1], platform="gpu")
    assert "│ CPU 0 │" in picture("x -> x*", (4,), devices=jax.devices()[:1])


def test_a_label_is_never_read_as_markup():
    # As markup, '[/]' would be a closing tag with nothing to close (a rich MarkupError).
    assert "│[/]X 0 │" in picture("x -> x*", (4,), n_devices=1, platform="[/]x")


def test_every_device_is_labelled_once_per_block():
    text = picture("a b -> * a2 b", (4, 8), n_devices=16)
    labels = [line.strip("│ ").removeprefix("CPU ") for line in text.splitlines() if "CPU" in line]
    assert [sorted(map(int, label.split(","))) for label in labels] == [
        list(range(0, 16, 2)),
        list(range(1, 16, 2)),
    ]


# --- ranks other than 1 and 2 --------------------------------------------------------------


def test_a_scalar_is_drawn_as_one_element():
    expected = """
        ┌───────────────────────┐
        │      CPU 0,1,2,3      │
        └───────────────────────┘
    """
    assert picture("-> *", (), n_devices=4) == normalized(expected)
    assert picture("... -> * ...", (), n_devices=4) == normalized(expected)
    assert picture("x -> * x", (1,), n_devices=4) == normalized(expected)


def test_rank_three_gives_one_grid_per_leading_block():
    expected = """
        array[0:2, :, :]
        ┌───────────────────────┬───────────────────────┐
        │                       │                       │
        │                       │                       │
        │                       │                       │
        │                       │                       │
        │        CPU 0,4        │        CPU 1,5        │
        │                       │                       │
        │                       │                       │
        │                       │                       │
        │                       │                       │
        └───────────────────────┴───────────────────────┘

        array[2:4, :, :]
        ┌───────────────────────┬───────────────────────┐
        │                       │                       │
        │                       │                       │
        │                       │                       │
        │                       │                       │
        │        CPU 2,6        │        CPU 3,7        │
        │                       │                       │
        │                       │                       │
        │                       │                       │
        │                       │                       │
        └───────────────────────┴───────────────────────┘
    """
    assert picture("a b c -> 2 a2 b c*", (4, 3, 6), n_devices=8) == normalized(expected)


def test_rank_three_grids_are_the_pictures_of_the_blocks():
    """Each grid is the 2-D picture of its block, on the devices that hold that block."""
    text = picture("a b c -> a2 b c*", (4, 2, N), devices=jax.devices())
    grids = text.split("\n\n")
    assert len(grids) == 2
    for index, grid in enumerate(grids):
        title, _, drawing = grid.partition("\n")
        assert title == ["array[0:2, :, :]", "array[2:4, :, :]"][index]
        block_devices = jax.devices()[index * N // 2 : (index + 1) * N // 2]
        assert drawing == picture("b c -> b c*", (2, N), devices=block_devices)


def test_rank_four_titles_in_row_major_order():
    text = picture("a b c d -> a2 b3 c d", (2, 6, 5, 7), n_devices=6)
    titles = [line for line in text.splitlines() if line.startswith("array[")]
    assert titles == [f"array[{a}:{a + 1}, {b}:{b + 2}, :, :]" for a in range(2) for b in range(0, 6, 2)]
    grids = text.split("\n\n")
    assert [grid.count("CPU") for grid in grids] == [1] * 6
    assert [f"CPU {i}" in grid for i, grid in enumerate(grids)] == [True] * 6


def test_rank_three_with_unsplit_leading_axes_gives_one_grid():
    text = picture("a b c -> a b c*", (3, 4, 8), n_devices=4)
    assert text.splitlines()[0] == "array[:, :, :]"
    assert text.count("array[") == 1
    assert text.split("\n", 1)[1] == picture("b c -> b c*", (4, 8), n_devices=4)


# --- visualize ------------------------------------------------------------------------------


def test_visualize_prints_the_picture(capsys, tmp_path):
    visualize("a b -> 2 a2* b*", (4, 8), n_devices=16)
    assert capsys.readouterr().out == normalized(README_TWO_STARS) + "\n"
    path = tmp_path / "picture.txt"
    with path.open("w", encoding="utf-8") as file:
        visualize("a b -> * a2 b", (4, 8), n_devices=16, file=file)
    assert path.read_text(encoding="utf-8") == normalized(README_STAR) + "\n"
    assert capsys.readouterr().out == ""


# --- errors ---------------------------------------------------------------------------------


def test_expression_errors_are_einshard_errors():
    with pytest.raises(EinshardError, match="axis 'c' is on the right-hand side but not on the left"):
        picture("a b -> a c*", (4, 8), n_devices=4)
    with pytest.raises(EinshardError, match="does not split into 3 shards") as info:
        picture("a b -> a3 b", (4, 8), n_devices=3)
    assert "for an array of shape (4, 8) on 3 devices" in str(info.value)
    with pytest.raises(EinshardError, match="needs exactly 2 devices, but there are 8"):
        picture("a b -> a2 b", (4, 8), n_devices=8)
    with pytest.raises(EinshardError, match="the expression names 2 axes, but the array has 1"):
        picture("a b -> a b*", (4,), n_devices=2)


def test_argument_errors_are_einshard_errors():
    with pytest.raises(EinshardError, match=r"n_devices=3 but devices= has 2 devices"):
        picture("x -> x*", (4,), n_devices=3, devices=jax.devices()[:2])
    with pytest.raises(EinshardError, match=r"not a jax\.Device"):
        picture("x -> x*", (4,), devices=[0, 1])
    with pytest.raises(EinshardError, match="negative size"):
        picture("x -> x*", (-4,), n_devices=2)
    with pytest.raises(EinshardError, match="shape must be a sequence of integers"):
        picture("x -> x*", 4, n_devices=2)  # type: ignore[arg-type]
    with pytest.raises(EinshardError, match="device count must be a positive integer"):
        picture("x -> x*", (4,), n_devices=0)


def block_rich(monkeypatch):
    """Makes ``import rich`` (and its submodules) fail, as if it were not installed."""
    for name in [name for name in sys.modules if name == "rich" or name.startswith("rich.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "rich", None)


def test_missing_rich_says_how_to_install_it(monkeypatch):
    block_rich(monkeypatch)
    # From the source at hand: 'einshard[pictures]' would fetch the index's older einshard.
    with pytest.raises(ImportError, match=r"pip install rich \(or pip install '\.\[pictures\]'") as info:
        picture("x -> x*", (4,), n_devices=2)
    assert "rich" in str(info.value)
    # Expression errors still come first, as EinshardError.
    with pytest.raises(EinshardError):
        picture("x -> y", (4,), n_devices=2)


def test_missing_rich_in_the_command_line(monkeypatch, capsys):
    block_rich(monkeypatch)
    assert main(["x -> x*", "--shape", "4", "--devices", "2"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "pip install '.[pictures]' in einshard's source folder" in captured.err
    assert "einshard[" not in captured.err


# --- the command line -----------------------------------------------------------------------


def test_cli_needs_no_devices():
    # The backend is never started: an unusable platform and more devices than exist are fine.
    result = run_cli("x y -> x* y", "--shape", "512,4", "--devices", "256", env={"JAX_PLATFORMS": "tpu"})
    assert result.returncode == 0, result.stderr
    head, *rows = result.stdout.splitlines()
    assert head == (
        "'x y -> x* y': shape (512, 4) on 256 devices: 256 shards of shape (2, 4) (split 256 × 1), "
        "each on 1 device"
    )
    assert [row.strip("│ ") for row in rows if "CPU" in row] == [f"CPU {i}" for i in range(256)]


def test_cli_bad_expression_exits_with_2_and_the_message():
    result = run_cli("a b -> a c*", "--shape", "4,8", "--devices", "16")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith(
        "einshard: error: axis 'c' is on the right-hand side but not on the left\n"
    )
    assert "    'a b -> a c*'\n" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_expression_that_does_not_fit_exits_with_2():
    result = run_cli("a b -> 2 a2* b*", "--shape", "4,8", "--devices", "8")
    assert result.returncode == 2
    assert "which is not a whole square" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_cli_help():
    result = run_cli("--help")
    assert result.returncode == 0
    for text in ("--shape", "--devices", "--platform", "expression", "python -m einshard 'a b -> * a2 b'"):
        assert text in result.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["x -> x*", "--shape", "4,q", "--devices", "2"],
        ["x -> x*", "--shape", "4", "--devices", "0"],
        ["x -> x*", "--shape", "4", "--devices", "two"],
        ["x -> x*", "--devices", "2"],
        ["x -> x*", "--shape", "4", "--devices", "2", "--scale", "-1"],
    ],
)
def test_cli_bad_arguments_exit_with_2(capsys, args):
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_cli_in_process(capsys):
    assert main(["a b c -> 2 a2 b c*", "--shape", "4,3,6", "--devices", "8", "--platform", "tpu"]) == 0
    head, _, drawing = capsys.readouterr().out.partition("\n")
    assert head == (
        "'a b c -> 2 a2 b c*': shape (4, 3, 6) on 8 devices: "
        "4 shards of shape (2, 3, 3) (split 2 × 1 × 2), each on 2 devices"
    )
    assert drawing == picture("a b c -> 2 a2 b c*", (4, 3, 6), n_devices=8, platform="tpu") + "\n"
    assert drawing.count("TPU 0,4") == 1 and drawing.count("array[") == 2


@pytest.mark.parametrize(
    ("shape_text", "shape"), [("4,8", (4, 8)), ("4x8", (4, 8)), ("(4, 8)", (4, 8)), ("4 8", (4, 8))]
)
def test_cli_shape_spellings(capsys, shape_text, shape):
    assert main(["a b -> * a2 b", "--shape", shape_text, "--devices", "16", "--no-summary"]) == 0
    assert capsys.readouterr().out == picture("a b -> * a2 b", shape, n_devices=16) + "\n"


def test_cli_scalar_and_sizes(capsys):
    assert main(["-> *", "--shape", "", "--devices", "4"]) == 0
    head, _, drawing = capsys.readouterr().out.partition("\n")
    assert head == "'-> *': shape () on 4 devices: not split, every device holds the whole array"
    assert "CPU 0,1,2,3" in drawing
    assert main(["x -> x*", "--shape", "8", "--devices", "2", "--scale", "2", "--width", "40"]) == 0
    out = capsys.readouterr().out
    assert out.split("\n", 1)[1] == picture("x -> x*", (8,), n_devices=2, scale=2, max_width=40) + "\n"


def test_summary():
    def line(expression, shape, n):
        return summary(einshard.layout(expression, shape, n_devices=n), shape)

    assert (
        line("x -> x*", (8,), 1)
        == "'x -> x*': shape (8,) on 1 device: not split, the device holds the whole array"
    )
    assert (
        line("x -> x*", (8,), 8)
        == "'x -> x*': shape (8,) on 8 devices: 8 shards of shape (1,), each on 1 device"
    )
    assert line("x y -> * x y", (4, 8), 2) == (
        "'x y -> * x y': shape (4, 8) on 2 devices: not split, every device holds the whole array"
    )
    assert line("x y -> x y*", (4, 8), 8) == (
        "'x y -> x y*': shape (4, 8) on 8 devices: 8 shards of shape (4, 1) (split 1 × 8), each on 1 device"
    )
    assert line("a b -> * a2 b", (4, 8), 16) == (
        "'a b -> * a2 b': shape (4, 8) on 16 devices: "
        "2 shards of shape (2, 8) (split 2 × 1), each on 8 devices"
    )
