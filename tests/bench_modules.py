"""Load a helper module of ``tests/benchmarks/`` (not a package, and not on the test
path) by file, for the tests of the benchmarks' own machinery."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parent / "benchmarks"


def load_benchmark_module(name: str) -> ModuleType:
    """``tests/benchmarks/{name}.py`` as module ``name``, registered in ``sys.modules``
    (dataclasses resolve their module by name)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
