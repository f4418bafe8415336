"""Kernel tests. NOTE: a package on purpose: its conftest.py then imports as `kernels.conftest`
and does not replace the `conftest` module that tests/*.py import helpers from."""
