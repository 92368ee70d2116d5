"""``kvbench.records.frozen_record`` against the dataclass ``__init__`` it replaces.

- Every decorated record keeps the plain ``__init__``'s parameters (names, kinds, order,
  defaults).
- Every record built in real simulation runs (a Mooncake trace with prefix caching, an
  Azure trace) is built again with the same arguments through both ``__init__``s; the
  two instances must hold the same field values: the very objects passed, equal fresh
  ones from default factories, equal ones where ``__post_init__`` replaced a value.
- The decorator's contract on small classes: defaults, default factories called per
  instance, keyword-only fields, ``__post_init__`` (its errors too), frozenness, and the
  classes it refuses.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import pkgutil
import typing
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sim_workloads import mooncake_head

from kvbench.engines.paged import PagedEngine
from kvbench.engines.sim.executor import CostModelExecutor
from kvbench.records import PLAIN_INITS, frozen_record
from kvbench.runner import SimClock, replay
from kvbench.specs import HardwareSpec, ModelSpec
from kvbench.types import EngineContext
from kvbench.workloads.traces import load_trace

TRACES = Path(__file__).parent / "fixtures" / "traces"


def _decorating_modules() -> list[str]:
    """Every kvbench module whose source uses ``@frozen_record`` (importing them fills
    PLAIN_INITS), found by reading the sources, so that a new one is covered too."""
    names = []
    for package_name in ("kvbench", "kvbench.engines", "kvbench.workloads"):  # installed apart
        package = importlib.import_module(package_name)
        for info in pkgutil.walk_packages(package.__path__, package_name + "."):
            spec = importlib.util.find_spec(info.name)
            origin = spec.origin if spec is not None else None
            if (
                origin
                and origin.endswith(".py")
                and "@frozen_record" in Path(origin).read_text(encoding="utf-8")
            ):
                names.append(info.name)
    return sorted(set(names))


DECORATING_MODULES = _decorating_modules()
for _module in DECORATING_MODULES:
    importlib.import_module(_module)
DECORATED = sorted(PLAIN_INITS, key=lambda cls: cls.__qualname__)
MAX_CALLS_PER_CLASS = 300  # rebuilt both ways per class (the runs make thousands)


def test_the_hot_records_are_decorated():
    assert "kvbench.engines.sched.scheduler" in DECORATING_MODULES  # the search sees engines/ too
    names = {cls.__qualname__ for cls in DECORATED}
    assert {"StepStats", "KVUsage", "StepOutput", "SchedulerOutput", "PrefixMatch"} <= names
    # Records a run keeps per request stay plain: the dict costs them memory (records.py).
    assert not {"Request", "HashBlockPrompt", "RandomPrompt", "TraceRecord"} & names


@pytest.mark.parametrize("cls", DECORATED, ids=lambda cls: cls.__qualname__)
def test_same_parameters_as_the_dataclass_init(cls):
    fast = list(inspect.signature(cls.__init__).parameters.values())
    plain = list(inspect.signature(PLAIN_INITS[cls]).parameters.values())
    assert [(p.name, p.kind) for p in fast] == [(p.name, p.kind) for p in plain]
    factories = {f.name for f in dataclasses.fields(cls) if f.default_factory is not dataclasses.MISSING}
    for mine, theirs in zip(fast, plain):
        if mine.name in factories:  # each init's own "call the factory" sentinel
            assert mine.default is not inspect.Parameter.empty
        else:
            assert mine.default is theirs.default, mine.name
    # Annotations resolve where the class's do (its module), as the plain init's; a name
    # its module imports only for type checkers fails the same way in both.
    assert _type_hints(cls.__init__) == _type_hints(PLAIN_INITS[cls])


def _type_hints(function: Any) -> dict[str, Any] | tuple[str, str]:
    """``typing.get_type_hints(function)``, or the error's type and message."""
    try:
        return typing.get_type_hints(function)
    except NameError as error:
        return type(error).__name__, str(error)


def _capture_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> dict[type, list[tuple[tuple[Any, ...], dict[str, Any]]]]:
    """Record the arguments of every decorated record's construction from now on."""
    calls: dict[type, list[tuple[tuple[Any, ...], dict[str, Any]]]] = defaultdict(list)
    for cls in DECORATED:
        fast = cls.__init__

        def recording(self, *args, _cls=cls, _fast=fast, **kwargs):  # type: ignore[no-untyped-def]
            if len(calls[_cls]) < MAX_CALLS_PER_CLASS:
                calls[_cls].append((args, kwargs))
            _fast(self, *args, **kwargs)

        monkeypatch.setattr(cls, "__init__", recording)
    return calls


def _sim_run(workload, **params):  # type: ignore[no-untyped-def]
    spec = ModelSpec()
    ctx = EngineContext(spec, HardwareSpec(step_overhead_s=5e-3), None, "cpu", "fp32", 0, "sim")
    engine = PagedEngine(ctx, executor=CostModelExecutor.from_context(ctx, block_size=16), **params)
    return replay(engine, workload, SimClock())


def test_records_of_real_runs_build_the_same_both_ways(monkeypatch):
    calls = _capture_calls(monkeypatch)
    vocab = ModelSpec().vocab_size
    mooncake = mooncake_head(40)
    _sim_run(mooncake, num_blocks=160, max_num_seqs=12, max_num_batched_tokens=256, prefix_cache="block_hash")
    azure = load_trace(TRACES / "azure_llm_2023_conv_head500.csv", vocab_size=vocab, max_requests=20)
    _sim_run(azure, num_blocks=400, max_num_seqs=8, prefix_cache="none")
    monkeypatch.undo()

    missing = {cls.__qualname__ for cls in DECORATED} - {cls.__qualname__ for cls in calls}
    assert not missing, f"the runs built no {sorted(missing)}: the test no longer covers them"
    for cls, recorded in calls.items():
        factories = {f.name for f in dataclasses.fields(cls) if f.default_factory is not dataclasses.MISSING}
        plain_signature = inspect.signature(PLAIN_INITS[cls])
        for args, kwargs in recorded:
            passed = plain_signature.bind(None, *args, **kwargs).arguments
            plain = object.__new__(cls)
            PLAIN_INITS[cls](plain, *args, **kwargs)
            fast = object.__new__(cls)
            cls.__init__(fast, *args, **kwargs)
            assert vars(fast).keys() == vars(plain).keys(), cls.__qualname__
            for name, value in vars(plain).items():
                mine = vars(fast)[name]
                if name in factories and name not in passed:
                    assert mine is not value and mine == value, f"{cls.__qualname__}.{name}"
                else:  # the object passed, or what __post_init__ made of it (a new array)
                    assert _same(mine, value), f"{cls.__qualname__}.{name}"


def _same(mine: Any, theirs: Any) -> bool:
    """The same object, or equal values of one type (arrays: same dtype, flags, values)."""
    if mine is theirs:
        return True
    if type(mine) is not type(theirs):
        return False
    if isinstance(mine, np.ndarray):
        return (
            mine.dtype == theirs.dtype
            and mine.flags.writeable == theirs.flags.writeable
            and np.array_equal(mine, theirs)
        )
    return bool(mine == theirs)


# ---------------------------------------------------------------- the decorator's contract
@frozen_record
class _Point:
    x: int
    y: int = 2
    tags: dict[str, int] = dataclasses.field(default_factory=dict)
    label: str = dataclasses.field(default="p", kw_only=True)

    def __post_init__(self) -> None:
        if self.x < 0:
            raise ValueError(f"x: must be >= 0, got {self.x}")


@frozen_record(eq=False)
class _Ticket:
    number: int


def test_defaults_factories_keyword_only_and_post_init():
    p = _Point(1)
    assert (p.x, p.y, p.tags, p.label) == (1, 2, {}, "p")
    assert _Point(1).tags is not p.tags  # the factory runs per instance
    assert _Point(3, 4, {"a": 1}, label="q") == _Point(x=3, y=4, tags={"a": 1}, label="q")
    with pytest.raises(TypeError):
        _Point(1, 2, {}, "q")  # label is keyword-only
    with pytest.raises(TypeError):
        _Point()  # x is required
    with pytest.raises(TypeError):
        _Point(1, z=3)
    with pytest.raises(ValueError, match="x: must be >= 0, got -1"):
        _Point(-1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.x = 5  # type: ignore[misc]
    assert dataclasses.replace(p, y=7) == _Point(1, 7)
    assert repr(p) == "_Point(x=1, y=2, tags={}, label='p')"
    assert inspect.get_annotations(_Point.__init__) == inspect.get_annotations(PLAIN_INITS[_Point])
    assert _Ticket(1) != _Ticket(1)  # eq=False: identity, as the option says


class _Doubling:
    """A data descriptor as a field's default: dataclass's __init__ calls its __set__."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = "_" + name

    def __get__(self, obj: Any, owner: type) -> Any:
        return 0 if obj is None else obj.__dict__[self.name]

    def __set__(self, obj: Any, value: int) -> None:
        obj.__dict__[self.name] = 2 * value


class _SlotBase:
    __slots__ = ("x", "__dict__")


def test_refuses_what_it_does_not_reproduce():
    def defines_init():
        class OwnInit:
            x: int

            def __init__(self, x: int) -> None:
                object.__setattr__(self, "x", int(x))

        return OwnInit

    def with_init_var():
        class WithInitVar:
            x: int
            scale: dataclasses.InitVar[int] = 1

        return WithInitVar

    def not_in_init():
        class NotInInit:
            x: int
            y: int = dataclasses.field(default=0, init=False)

        return NotInInit

    def descriptor_default():
        class Described:
            x: _Doubling = _Doubling()

        return Described

    def slot_of_a_base():
        class Slotted(_SlotBase):
            x: int

        return Slotted

    for make, options, reason in (
        (with_init_var, {}, "InitVar"),
        (not_in_init, {}, "init=False"),
        (defines_init, {}, "defines __init__"),
        (descriptor_default, {}, "data descriptor"),
        (slot_of_a_base, {}, "_SlotBase defines it as a data descriptor"),
    ):
        with pytest.raises(TypeError, match=reason):
            frozen_record(**options)(make())
    for options in ({"slots": True}, {"frozen": False}, {"init": True}):
        with pytest.raises(TypeError, match="frozen_record's to set"):
            frozen_record(**options)  # at the call, before any class
