"""``frozen_record``: a frozen dataclass with a cheaper constructor, for short-lived records
built every engine step.

A frozen dataclass's generated ``__init__`` stores every field with
``object.__setattr__(self, name, value)`` (the class's own ``__setattr__`` raises): one
call per field that looks the name up through the class's MRO, about 1,100
instructions a field. The engine builds a ``SchedulerOutput`` (7 fields) and a
``KVUsage`` (12) every step, and a simulated step's ``StepStats`` (23) and ``StepOutput``
(10) besides.

``@frozen_record`` (or ``@frozen_record(eq=False)``, any ``dataclass`` option but
``frozen``, ``init`` and ``slots``) is ``@dataclass(frozen=True, ...)`` whose ``__init__``
is then replaced by one of the same parameters (names, kinds, order, defaults, default
factories, annotations, resolved in the class's module as the generated one's are) that
writes the fields straight into the instance's ``__dict__``, one dict store each, then
calls ``__post_init__`` as the generated one does. ``__setattr__`` still raises
``FrozenInstanceError``, and ``__eq__``, ``__hash__``, ``__repr__``, ``replace`` and
pickling are the dataclass's.

The price: Python 3.11 keeps an instance's attributes inline until its ``__dict__`` is
read, and this ``__init__`` reads it. An instance is then 64 bytes larger and a field
read costs about 270 instructions more (a build saves about 1,060 a field). So it is for
records built often, read a few times and dropped (per step), not for records a run
keeps per request: on the replay benchmarks, decorating ``Request`` and the trace
prompts saved nothing and would have added 64 bytes each to a trace of millions.

A ``__dict__`` store is what ``object.__setattr__`` does for a name no class in the MRO
defines as a data descriptor, so a class where one does (a slot of a base, a property, a
descriptor as a field's default) is refused, as is one that writes its own ``__init__``.
(A subclass that is no dataclass inherits the ``__init__`` unchecked: give it its own
``@frozen_record`` or ``@dataclass``.)

The plain path stays reachable: ``PLAIN_INITS[cls]`` is the dataclass's own ``__init__``,
and tests/test_records.py builds every record of real simulation runs both ways and
compares.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Callable
from typing import Any, TypeVar, dataclass_transform, overload

T = TypeVar("T", bound=type)

# Record class -> the ``__init__`` dataclass generated for it (the differential test's
# plain path).
PLAIN_INITS: dict[type, Callable[..., None]] = {}

_PREFIX = "_frozen_record_"  # names the generated code uses besides the fields'
_OWN_OPTIONS = ("frozen", "init", "slots")  # what frozen_record decides itself


class _Factory:
    """The default of a field with a default factory: "call the factory" (dataclass uses a
    sentinel of its own the same way)."""

    def __repr__(self) -> str:
        return "<factory>"


_FACTORY = _Factory()


@overload
def frozen_record(cls: T, /) -> T: ...
@overload
def frozen_record(cls: None = None, /, **options: Any) -> Callable[[T], T]: ...
@dataclass_transform(frozen_default=True)
def frozen_record(cls: T | None = None, /, **options: Any) -> T | Callable[[T], T]:
    """``@dataclass(frozen=True, **options)`` with the dict-writing ``__init__`` (module
    docstring). Raises TypeError for ``frozen``, ``init`` or ``slots`` among ``options``
    (at the call), and, naming the class and the reason (the class statement then
    fails), for a class body that defines ``__init__``, a field a class in the MRO
    defines as a data descriptor, an ``InitVar``, a field left out of ``__init__``, or a
    field named like the generated code's own names. Mutates ``PLAIN_INITS``."""

    refused = sorted(set(options) & set(_OWN_OPTIONS))
    if refused:
        raise TypeError(f"frozen_record: {refused} are frozen_record's to set")

    def wrap(cls: T) -> T:
        return _make(cls, options)

    return wrap if cls is None else wrap(cls)


def _make(cls: T, options: dict[str, Any]) -> T:
    name = cls.__qualname__
    if "__init__" in cls.__dict__:
        raise TypeError(f"frozen_record: {name} defines __init__ (use a plain dataclass)")
    record = dataclasses.dataclass(frozen=True, **options)(cls)
    fields = dataclasses.fields(record)
    plain = record.__init__
    # The generated __init__'s parameters are the fields, in order, unless a field is
    # left out of it or an InitVar (no field) is in it.
    plain_params = list(inspect.signature(plain).parameters)[1:]
    if plain_params != [f.name for f in fields]:
        raise TypeError(
            f"frozen_record: {name}: __init__ takes {plain_params}, not its fields "
            f"{[f.name for f in fields]} (an InitVar or a field with init=False)"
        )
    for f in fields:
        if f.name.startswith(_PREFIX) or f.name == "self":
            raise TypeError(f"frozen_record: {name}.{f.name}: a name the generated __init__ uses")
        for klass in record.__mro__:
            attribute = klass.__dict__.get(f.name)
            if attribute is not None and hasattr(type(attribute), "__set__"):
                raise TypeError(
                    f"frozen_record: {name}.{f.name}: {klass.__qualname__} defines it as a data "
                    "descriptor (a slot, property or descriptor default), which object.__setattr__ calls"
                )

    namespace: dict[str, Any] = {f"{_PREFIX}factory": _FACTORY}
    positional: list[str] = []
    keyword_only: list[str] = []
    body = [f"    {_PREFIX}dict = self.__dict__"]
    for f in fields:
        if f.default is not dataclasses.MISSING:
            namespace[f"{_PREFIX}default_{f.name}"] = f.default
            param = f"{f.name}={_PREFIX}default_{f.name}"
        elif f.default_factory is not dataclasses.MISSING:
            namespace[f"{_PREFIX}make_{f.name}"] = f.default_factory
            param = f"{f.name}={_PREFIX}factory"
            body.append(f"    if {f.name} is {_PREFIX}factory:")
            body.append(f"        {f.name} = {_PREFIX}make_{f.name}()")
        else:
            param = f.name
        (keyword_only if f.kw_only else positional).append(param)
        body.append(f"    {_PREFIX}dict[{f.name!r}] = {f.name}")
    if hasattr(record, "__post_init__"):
        body.append("    self.__post_init__()")
    signature = ", ".join(["self", *positional, *(["*", *keyword_only] if keyword_only else [])])
    # Defined inside a maker whose parameters carry the defaults and factories, run in the
    # class's module globals: the __init__ then resolves its annotations where the class's
    # are (typing.get_type_hints), as dataclass's own does, and the module gains no names.
    helpers = ", ".join(namespace)
    source = (
        f"def {_PREFIX}maker({helpers}):\n"
        f"  def __init__({signature}):\n" + "\n".join("  " + line for line in body) + "\n  return __init__\n"
    )
    made: dict[str, Any] = {}
    exec(source, sys.modules[record.__module__].__dict__, made)  # noqa: S102
    init = made[f"{_PREFIX}maker"](**namespace)
    init.__qualname__ = f"{record.__qualname__}.__init__"
    init.__module__ = record.__module__
    init.__annotations__ = dict(plain.__annotations__)
    PLAIN_INITS[record] = plain
    record.__init__ = init  # type: ignore[misc]
    return record
