"""Package discovery (metadata lives in pyproject.toml): every package under amp_rewrite/ is found
automatically, and the top-level op_lists/ folder (data, not code) ships as amp_rewrite.op_lists.

One optional C extension, amp_rewrite.training._blocks (training/block_loop.py): the CPU step's
optimizer update as a fused loop. `optional=True`: without a C compiler the install goes on and
the update runs as numpy calls, the same numbers more slowly. Each op stays one IEEE operation:
no contraction into FMA, no fast-math."""

import sys

from setuptools import Extension, find_packages, setup

FLAGS = [] if sys.platform == "win32" else ["-ffp-contract=off", "-fno-math-errno"]

setup(
    packages=find_packages(include=["amp_rewrite", "amp_rewrite.*"]) + ["amp_rewrite.op_lists"],
    package_dir={"amp_rewrite.op_lists": "op_lists"},
    ext_modules=[
        Extension(
            "amp_rewrite.training._blocks",
            ["amp_rewrite/training/_blocks.c"],
            extra_compile_args=FLAGS,
            optional=True,
        )
    ],
)
