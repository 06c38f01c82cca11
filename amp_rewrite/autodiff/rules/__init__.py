"""Gradient rules, one small function per op type, grouped by family. Importing registers them."""

from . import elementwise, linalg, reduce, shape, nn, losses, resize, recurrent, control  # noqa: F401
