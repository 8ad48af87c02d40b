"""Put a lesson's reference answers in place of the student's code, one task at a time.

The references are generated from ``solutions/`` by ``make exercises`` into
``tests/<lesson tests>/_references.py`` (``tools/derive_references.py``; a drift test keeps them equal
to the solutions). This module reads them: :func:`reference` gives one task's definition bound
to the module of the lesson tree under test (its global names, ``torch`` or a helper or another
task's function, are looked up there, as for the code it replaces; its decorators are applied
there), and :func:`put` sets it where the student's definition is.
"""

from __future__ import annotations

import importlib
import types

from tests.lessons import load

# lesson folder -> the package of its tests (where _references.py is)
PACKAGES = {"05_ddp_from_scratch": "tests.l05_ddp_from_scratch",
            "09_fsdp": "tests.l09_fsdp",
            "10_inside_a_step": "tests.l10_inside_a_step",
            "11_time_to_accuracy": "tests.l11_time_to_accuracy",
            "12_step_cost": "tests.l12_step_cost",
            "13_local_sgd": "tests.l13_local_sgd"}


def generated(lesson: str) -> types.ModuleType:
    """The generated ``_references`` module of ``lesson``."""
    return importlib.import_module(f"{PACKAGES[lesson]}._references")


def places(lesson: str, task: str) -> tuple[tuple[str, str], ...]:
    """``(lesson file, dotted name)`` of each definition that holds ``task``."""
    tasks = generated(lesson).TASKS
    if task not in tasks:
        raise KeyError(f"no reference for task {task} in {PACKAGES[lesson]}._references "
                       f"(it has {', '.join(tasks)}): run `make exercises`")
    return tasks[task]


def bound(lesson: str, stem: str, dotted: str):
    """The reference definition ``dotted`` of ``<lesson>/<stem>.py``, its globals those of the
    loaded lesson module, decorated as in the lesson."""
    refs = generated(lesson)
    fn = refs
    for part in dotted.split("."):
        fn = getattr(fn, part)
    module = load(lesson, stem)
    new = types.FunctionType(fn.__code__, vars(module), fn.__name__, fn.__defaults__,
                             fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__, new.__doc__, new.__module__ = fn.__qualname__, fn.__doc__, module.__name__
    new.__reference__ = dotted  # the tests can tell a reference from the student's code
    for decorator in reversed(refs.DECORATORS.get(dotted, ())):
        new = eval(decorator, vars(module))(new)  # noqa: S307 - generated from solutions/
    return new


def reference(lesson: str, task: str):
    """The reference of a task held by one definition (e.g. ``rank_slice``)."""
    (stem, dotted), *more = places(lesson, task)
    if more:
        raise ValueError(f"task {task} is {len(more) + 1} definitions; use put()")
    return bound(lesson, stem, dotted)


def owner(lesson: str, stem: str, dotted: str):
    """The object that holds ``dotted`` in the loaded lesson module, and the attribute."""
    *path, attr = dotted.split(".")
    obj = load(lesson, stem)
    for part in path:
        obj = getattr(obj, part)
    return obj, attr


def put(lesson: str, tasks, set_attr=setattr) -> None:
    """Put the reference of each task in ``tasks`` in place of the lesson's code: for good with
    ``setattr`` (a rank process), or ``monkeypatch.setattr`` (restored after the test)."""
    for task in tasks:
        for stem, dotted in places(lesson, task):
            obj, attr = owner(lesson, stem, dotted)
            set_attr(obj, attr, bound(lesson, stem, dotted))
