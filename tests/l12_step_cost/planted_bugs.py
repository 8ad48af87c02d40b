"""Lesson 12's planted bugs: the mistakes its tests must catch, each for the right reason.

The format and how an edit is made: ``tests/planted.py``. Plant them with
``make plant-bugs LESSON=12`` (``tools/plant_bugs.py``). One list per part of the lesson.
"""

from tests.l12_step_cost.bugs_bandwidth import BUGS as BANDWIDTH
from tests.l12_step_cost.bugs_crossover import BUGS as CROSSOVER
from tests.l12_step_cost.bugs_flops import BUGS as FLOPS
from tests.l12_step_cost.bugs_memory_calc import BUGS as MEMORY_CALC

BUGS = [*FLOPS, *BANDWIDTH, *CROSSOVER, *MEMORY_CALC]
