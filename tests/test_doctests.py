"""Every module's doctests, found by walking the package: an example in a docstring is a test
wherever it is written (a module no test file names included)."""
import doctest
import importlib
import importlib.util
import pkgutil

import forerun


def test_every_modules_doctests_pass():
    attempted, failed = 0, []
    for info in pkgutil.walk_packages(forerun.__path__, "forerun."):
        if not (importlib.util.find_spec(info.name).origin or "").endswith(".py"):
            continue  # a compiled extension (the installed kernels): no docstring examples, and importing it
            # beside a build the loader made at run time would register its types twice
        result = doctest.testmod(importlib.import_module(info.name), report=False)
        attempted += result.attempted
        if result.failed:
            failed.append(f"{info.name}: {result.failed} of {result.attempted}")
    assert not failed, failed
    assert attempted > 100  # the walk reached the package's modules
