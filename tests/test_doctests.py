"""Every module's doctests, found by walking the package: an example in a docstring is a test
wherever it is written (a module no test file names included)."""
import doctest
import importlib
import pkgutil

import forerun


def test_every_modules_doctests_pass():
    attempted, failed = 0, []
    for info in pkgutil.walk_packages(forerun.__path__, "forerun."):
        result = doctest.testmod(importlib.import_module(info.name), report=False)
        attempted += result.attempted
        if result.failed:
            failed.append(f"{info.name}: {result.failed} of {result.attempted}")
    assert not failed, failed
    assert attempted > 100  # the walk reached the package's modules
