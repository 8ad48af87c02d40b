"""Planted bugs: the format of each lesson's catalogue, and how an entry's edit is made.

Each lesson lists the classic mistakes its tests must catch in ``tests/lNN_name/planted_bugs.py``
(a list ``BUGS`` of :class:`Bug`). An entry is one exact edit of one solution file, anchored to
the code it breaks, with the tests that must fail on it::

    Bug("05.3-no-mean", "05_ddp_from_scratch/naive_ddp.py", where="05.3",
        find="            p.grad.div_(self.world_size)\n", replace="",
        tests=(T05 + "test_naive_matches_single_process_and_torch_ddp",),
        expect=r"missing divide by world size",
        why="the gradients are summed, not averaged: the step is N times too big")

``where`` names the span the edit lies in, so that an entry keeps pointing at the code it
means when the file around it changes:

- a task id, ``"NN.K"``: the body of the file's ``# BEGIN SOLUTION NN.K`` block (the lines
  between the markers; every block of that task in the file, when there are several). The
  entry's id starts with that task. A block carried from an earlier lesson (``03.2`` in lesson
  04's script) is named by its definition instead, since the id names the lesson's own task;
- a dotted name, ``"main"``, ``"Trainer.__init__"``, ``"main.worker"``: the definition of that
  function, class or method (decorators included), found with ``ast``; ids ``NN.0`` are such
  code around the tasks;
- ``"<module>"``: the module's own statements, outside every function and class.

``find`` must occur exactly once inside that span and touch code only: no comment text, which
is reworded freely, and no solution marker. A mistake that needs two places changed (a line
moved past a comment, or out of a block) lists the others in ``more``; every edit is found in
the original text. :func:`problems` says what is wrong with an entry;
``tests/harness/test_plant_bugs.py`` runs it on every entry, and ``tools/plant_bugs.py``
plants each entry in a copy of ``solutions/`` and runs its tests.
"""

from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
import types
from dataclasses import KW_ONLY, dataclass, field

TASK = re.compile(r"\d\d\.\d+[a-z]?")
BEGIN = re.compile(r"^[ \t]*# BEGIN SOLUTION (?P<task>\d\d\.\d+[a-z]?): ")
END = re.compile(r"^[ \t]*# END SOLUTION\s*$")
MODULE = "<module>"


class PlantError(ValueError):
    """An entry whose edit cannot be made: its span or its text is not where it says."""


@dataclass(frozen=True)
class Bug:
    id: str  # "<task>-<short name>"; task NN.0 is code outside the task blocks
    file: str  # relative to solutions/, e.g. "05_ddp_from_scratch/naive_ddp.py"
    _: KW_ONLY
    where: str  # "NN.K" (a solution block), "Class.method" / "function", or "<module>"
    find: str  # exact code, present exactly once inside ``where``
    replace: str
    tests: tuple[str, ...]  # pytest node ids, relative to the repository root
    expect: str | None = None  # regex the failure output must contain (the right reason)
    why: str = ""  # the mistake, in a student's terms
    keywords: tuple[str, ...] = field(default=())  # -k filter for parametrized tests, if any
    # Further edits of the same file, made with this one, each ``(where, find, replace)``: for a
    # mistake that moves code past a comment or out of a block (all found in the original text).
    more: tuple[tuple[str, str, str], ...] = field(default=())

    @property
    def lesson(self) -> str:
        return self.file[:2]

    @property
    def task(self) -> str:
        return self.id.split("-", 1)[0]

    def edits(self) -> list[tuple[str, str, str]]:
        """Every ``(where, find, replace)`` of this entry, its main edit first."""
        return [(self.where, self.find, self.replace), *self.more]


def _lines(text: str) -> list[str]:
    """The lines of ``text`` as Python counts them (split at newlines only), ends kept."""
    return io.StringIO(text).readlines()


def _line_offsets(text: str) -> list[int]:
    """Character offset of the start of each line (1-based index; [0] unused), plus the end."""
    offsets = [0, 0]
    for line in _lines(text):
        offsets.append(offsets[-1] + len(line))
    return offsets


def block_spans(text: str, task: str) -> list[tuple[int, int]]:
    """``(start, end)`` character spans of the bodies of the ``task`` solution blocks."""
    spans, start, current = [], None, None
    pos = 0
    for line in _lines(text):
        m = BEGIN.match(line)
        if m:
            current, start = m["task"], pos + len(line)
        elif END.match(line) and current is not None:
            if current == task:
                spans.append((start, pos))
            current = None
        pos += len(line)
    return spans


@functools.lru_cache(maxsize=8)
def _parse(text: str) -> ast.Module:
    return ast.parse(text)


def _definition(tree: ast.Module, dotted: str) -> ast.AST | None:
    node: ast.AST = tree
    for name in dotted.split("."):
        body = getattr(node, "body", [])
        node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                        ast.ClassDef)) and n.name == name), None)
        if node is None:
            return None
    return node


def definition_span(text: str, dotted: str) -> list[tuple[int, int]]:
    """The span of the definition ``dotted`` names (decorators included), or ``[]``."""
    node = _definition(_parse(text), dotted)
    if node is None:
        return []
    offsets = _line_offsets(text)
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    return [(offsets[first], offsets[node.end_lineno + 1])]


def module_spans(text: str) -> list[tuple[int, int]]:
    """The spans of the module's statements that are not function or class definitions."""
    offsets = _line_offsets(text)
    spans = []
    for node in _parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        spans.append((offsets[node.lineno], offsets[node.end_lineno + 1]))
    return spans


def spans(text: str, where: str) -> list[tuple[int, int]]:
    """The character spans ``where`` names in ``text`` (see the module docstring)."""
    if TASK.fullmatch(where):
        return block_spans(text, where)
    if where == MODULE:
        return module_spans(text)
    return definition_span(text, where)


def locate(text: str, where: str, find: str, label: str = "") -> int:
    """The offset of ``find`` inside ``where`` in ``text``; PlantError unless there once."""
    found = spans(text, where)
    if not found:
        kind = "solution block" if TASK.fullmatch(where) else "definition"
        raise PlantError(f"{label}has no {kind} {where!r}")
    if not find:
        raise PlantError(f"{label}empty 'find'")
    hits = []
    for start, end in found:
        at = text.find(find, start, end)
        while at != -1:
            hits.append(at)
            at = text.find(find, at + 1, end)
    if len(hits) != 1:
        raise PlantError(f"{label}the text to replace occurs {len(hits)} times in {where!r} "
                         "(expected once)")
    return hits[0]


def apply(bug: Bug, text: str) -> str:
    """``text`` (the solution file) with ``bug``'s edits made; PlantError if one cannot be.

    Every edit is found in the original text first, so one may not overlap another."""
    label = f"{bug.id}: {bug.file}: "
    cuts = sorted((locate(text, where, find, label), find, replace)
                  for where, find, replace in bug.edits())
    for (a, find, _), (b, _, _) in zip(cuts, cuts[1:]):
        if a + len(find) > b:
            raise PlantError(f"{label}two of its edits overlap")
    for at, find, replace in reversed(cuts):
        text = text[:at] + replace + text[at + len(find):]
    return text


@functools.lru_cache(maxsize=8)
def _tokens(text: str) -> tuple[list[tuple[int, int, str]], list[tuple[int, int, str]]]:
    """``text``'s comments and its code tokens, each as ``(start, end, string)``."""
    offsets = _line_offsets(text)
    comments, code = [], []
    blank = (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        a = offsets[tok.start[0]] + tok.start[1]
        b = offsets[tok.end[0]] + tok.end[1]
        if tok.type == tokenize.COMMENT:
            comments.append((a, b, tok.string))
        elif tok.type not in blank:
            code.append((a, b, tok.string))
    return comments, code


def _code_key(code: types.CodeType) -> tuple:
    """What ``code`` does, without its line numbers: equal for edits of comments or spacing."""
    consts = tuple(_code_key(c) if isinstance(c, types.CodeType) else (type(c), repr(c))
                   for c in code.co_consts)
    return (code.co_code, code.co_names, code.co_varnames, code.co_exceptiontable, consts)


@functools.lru_cache(maxsize=8)
def _compiled(text: str, name: str) -> tuple:
    return _code_key(compile(text, name, "exec", dont_inherit=True))


def comments_in(text: str, start: int, end: int) -> list[str]:
    """The comments that ``text[start:end]`` touches (a solution marker is a comment too)."""
    return [c for a, b, c in _tokens(text)[0] if a < end and b > start]


def has_code(text: str, start: int, end: int) -> bool:
    """Whether ``text[start:end]`` touches a code token (not only comments and white space)."""
    return any(a < end and b > start for a, b, _ in _tokens(text)[1])


def problems(bug: Bug, text: str) -> list[str]:
    """What is wrong with ``bug`` as an edit of ``text`` (its solution file); [] when sound.

    Every edit must lie once inside its ``where``, touch code and no comment (comment text is
    reworded freely; a marker line is not the student's), and the edits must change the code.
    An id's task must be the block it edits (``NN.0``: code outside the blocks)."""
    out = []
    try:
        changed = apply(bug, text)
    except PlantError as exc:
        return [str(exc)]
    for where, find, _ in bug.edits():
        at = locate(text, where, find)
        if not has_code(text, at, at + len(find)):
            out.append(f"{bug.id}: its find {find[:40]!r} is only comments or white space")
        elif comments_in(text, at, at + len(find)):
            out.append(f"{bug.id}: its find {find[:40]!r} includes comment text "
                       f"{comments_in(text, at, at + len(find))[0][:40]!r}: anchor it to code")
        if TASK.fullmatch(where) and where != bug.task:
            out.append(f"{bug.id}: edits block {where}, so its id must start {where}-")
    try:
        after = _code_key(compile(changed, bug.file, "exec", dont_inherit=True))
    except SyntaxError as exc:
        return [*out, f"{bug.id}: the edited file does not compile ({exc.msg}, line {exc.lineno}):"
                      " the tests would fail on that, not on the mistake"]
    if after == _compiled(text, bug.file):
        out.append(f"{bug.id}: the edit changes no code")
    return out
