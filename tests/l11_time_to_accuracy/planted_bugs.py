"""Lesson 11's planted bugs: the mistakes its tests must catch, each for the right reason.

The format and how an edit is made: ``tests/planted.py``. Plant them with
``make plant-bugs LESSON=11`` (``tools/plant_bugs.py``). One list per part of the lesson.
"""

from tests.l11_time_to_accuracy.bugs_global_batch import BUGS as GLOBAL_BATCH
from tests.l11_time_to_accuracy.bugs_large_batch import BUGS as LARGE_BATCH
from tests.l11_time_to_accuracy.bugs_lr_scaling import BUGS as LR_SCALING
from tests.l11_time_to_accuracy.bugs_sync_bn import BUGS as SYNC_BN

BUGS = [*GLOBAL_BATCH, *SYNC_BN, *LR_SCALING, *LARGE_BATCH]
