"""Lesson 13's planted bugs: the mistakes its tests must catch, each for the right reason.

The format and how an edit is made: ``tests/planted.py``. Plant them with
``make plant-bugs LESSON=13`` (``tools/plant_bugs.py``). One list per part of the lesson.
"""

from tests.l13_local_sgd.bugs_compress import BUGS as COMPRESS
from tests.l13_local_sgd.bugs_diloco import BUGS as DILOCO
from tests.l13_local_sgd.bugs_fault_tolerance import BUGS as FAULT_TOLERANCE
from tests.l13_local_sgd.bugs_local_sgd import BUGS as LOCAL_SGD
from tests.l13_local_sgd.bugs_streaming import BUGS as STREAMING

BUGS = [*LOCAL_SGD, *DILOCO, *STREAMING, *COMPRESS, *FAULT_TOLERANCE]
