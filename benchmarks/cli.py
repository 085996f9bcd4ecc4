"""Argument types and checks that the benchmarks' command lines share: a bad value is a usage error
(exit 2) that names the option and what it takes, never a traceback from inside a run."""

import argparse

import torch

from .shapes import SHAPES


def shape_list(text: str) -> list:
    """``--shapes``: ``all``, or indices into :data:`benchmarks.shapes.SHAPES` separated by commas."""
    if text == "all":
        return list(SHAPES)
    try:
        indices = [int(i) for i in text.split(",")]
    except ValueError:
        indices = []
    if not indices or not all(0 <= i < len(SHAPES) for i in indices):
        raise argparse.ArgumentTypeError(f"takes 'all' or indices 0-{len(SHAPES) - 1} into benchmarks.shapes.SHAPES "
                                         f"separated by commas, got {text!r}")
    return [SHAPES[i] for i in indices]


def shape_index(text: str) -> int:
    """``--shape``: one index into :data:`benchmarks.shapes.SHAPES`."""
    try:
        index = int(text)
    except ValueError:
        index = -1
    if not 0 <= index < len(SHAPES):
        raise argparse.ArgumentTypeError(f"takes an index 0-{len(SHAPES) - 1} into benchmarks.shapes.SHAPES, "
                                         f"got {text!r}")
    return index


def padding_list(text: str) -> list[int]:
    """``--paddings``: MoonEP token paddings (rows a segment is padded to a multiple of), positive
    integers separated by commas."""
    try:
        paddings = [int(p) for p in text.split(",")]
    except ValueError:
        paddings = []
    if not paddings or min(paddings) < 1:
        raise argparse.ArgumentTypeError(f"takes positive integers separated by commas (e.g. 128,1), got {text!r}")
    return paddings


def names(choices) -> callable:
    """An argument type: names out of ``choices`` separated by commas, as a list."""
    choices = list(choices)

    def parse(text: str) -> list[str]:
        wanted = text.split(",")
        unknown = [name for name in wanted if name not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, unknown))}; "
                                             f"takes names out of {', '.join(choices)} separated by commas")
        return wanted

    return parse


def require_gpu(parser: argparse.ArgumentParser) -> None:
    """A usage error where no CUDA GPU is visible (every timing here runs on one)."""
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
