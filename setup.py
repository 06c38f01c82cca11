"""Package discovery (metadata lives in pyproject.toml): every package under amp_rewrite/ is found
automatically, and the top-level op_lists/ folder (data, not code) ships as amp_rewrite.op_lists.
Pure Python: the wheel is one for every platform."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["amp_rewrite", "amp_rewrite.*"]) + ["amp_rewrite.op_lists"],
    package_dir={"amp_rewrite.op_lists": "op_lists"},
)
