"""Lesson 10's planted bugs: the mistakes its tests must catch, each for the right reason.

The format and how an edit is made: ``tests/planted.py``. Plant them with
``make plant-bugs LESSON=10`` (``tools/plant_bugs.py``). One list per part of the lesson.
"""

from tests.l10_inside_a_step.bugs_compile import BUGS as COMPILE
from tests.l10_inside_a_step.bugs_hangs import BUGS as HANGS
from tests.l10_inside_a_step.bugs_hooks import BUGS as HOOKS
from tests.l10_inside_a_step.bugs_traces import BUGS as TRACES

BUGS = [*TRACES, *COMPILE, *HOOKS, *HANGS]
