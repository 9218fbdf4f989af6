"""The scripts in examples/ as modules, for the tests that check them: examples/ is not a package, and the tests
never add it to the import path. What the scripts share lives in the installed packages (``models.training``,
``models.bench_drafts``, ``jspec.bench``), so each script imports on its own."""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def load_example(name: str, fresh: bool = False) -> ModuleType:
    """``examples/<name>.py`` imported as the module ``examples_<name>`` (its ``main()`` not run), once per
    process as ``import`` would, or anew with ``fresh``."""
    key = f"examples_{name}"
    if fresh or key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, os.path.join(EXAMPLES, f"{name}.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[key] = mod
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            del sys.modules[key]
            raise
    return sys.modules[key]
