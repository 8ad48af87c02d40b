"""How many bytes of tensors a process holds, now and at its peak, on any device (the CPU too).

torch keeps allocator statistics for CUDA only (``torch.cuda.max_memory_allocated``); a CPU
process's resident size (RSS) mixes tensors with the interpreter, libraries and allocator
slack. :class:`MemoryTracker` counts tensors exactly, the way torch's own (private)
``torch.distributed._tools.mem_tracker`` does: a ``TorchDispatchMode`` sees every tensor an
operator returns, and a weak reference on each tensor's storage says when its memory is freed.
What it counts is the sum of ``nbytes`` over the live storages it knows of, with no allocator
rounding or caching in it: the same on every run and machine for the same sequence of
operations (an asynchronous collective that frees its buffers a little earlier or later can
move a peak by a few percent).

    with MemoryTracker() as mem:
        model = build(); opt = make_optimizer(model)    # created inside: counted
        mem.reset_peak()
        loss = model(x).sum(); loss.backward(); opt.step()
    mem.peak, mem.current                                # bytes

Tensors that existed before the tracker started are not counted unless given to
:meth:`MemoryTracker.track` (a module's parameters, an optimizer's state). Storages resized in
place (``untyped_storage().resize_``, as FSDP2 frees and re-allocates its gathered parameters)
are followed while the tracker is on. Not counted: memory that no tensor owns (a backend's own
buffers, gloo's staging copies made in its threads), and tensors created in other threads.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from functools import wraps

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

MiB = 2**20


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages behind ``t``: its own, or those of a wrapper subclass's inner tensors
    (a DTensor's local shard)."""
    todo, out = [t], []
    while todo:
        obj = todo.pop()
        if is_traceable_wrapper_subclass(obj):
            attrs, _ = obj.__tensor_flatten__()
            todo.extend(getattr(obj, a) for a in attrs
                        if isinstance(getattr(obj, a), torch.Tensor))
        else:
            out.append(obj.untyped_storage())
    return out


def _tensors_in(obj) -> Iterable[torch.Tensor]:
    """Tensors in a module (parameters, gradients, buffers), an optimizer (its state), a
    tensor, or any nesting of lists, tuples and dicts of those."""
    if isinstance(obj, torch.nn.Module):
        for p in obj.parameters():
            yield p
            if p.grad is not None:
                yield p.grad
        yield from obj.buffers()
    elif isinstance(obj, torch.optim.Optimizer):
        for state in obj.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))
    elif isinstance(obj, torch.Tensor):
        yield obj
    else:
        leaves, _ = tree_flatten(obj)
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor | torch.nn.Module | torch.optim.Optimizer):
                yield from _tensors_in(leaf)


class MemoryTracker(TorchDispatchMode):
    """Bytes of live tensor storages, now (:attr:`current`) and at the peak (:attr:`peak`).

    ``device_type`` ("cpu", "cuda"...) counts only storages on that kind of device; None
    (the default) counts all. Re-entering the same tracker is not supported; use one per
    measurement, or :meth:`reset_peak` between the parts of one.
    """

    def __init__(self, device_type: str | None = None):
        super().__init__()
        self.device_type = device_type
        self.current = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}  # id(storage) -> bytes counted for it
        self._refs: dict[int, weakref.ref] = {}
        self._orig_resize = None
        self.marks: list[tuple[str, int]] = []

    # -- bookkeeping ------------------------------------------------------------------------
    def _freed(self, key: int, _ref=None) -> None:
        self.current -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)

    def _count(self, st: torch.UntypedStorage) -> None:
        kind = st.device.type
        if kind == "meta" or (self.device_type is not None and kind != self.device_type):
            return  # a meta tensor has a shape and no memory
        key, nbytes = id(st), st.nbytes()
        ref = self._refs.get(key)
        if ref is not None and ref() is st:  # known: it may have been resized
            self.current += nbytes - self._sizes[key]
        else:
            self._refs[key] = weakref.ref(st, lambda r, key=key: self._freed(key, r))
            self.current += nbytes
        self._sizes[key] = nbytes
        if self.current > self.peak:
            self.peak = self.current

    def track(self, *objects) -> int:
        """Count tensors that already exist (modules, optimizers, tensors); returns
        :attr:`current`. Storages already counted are not counted twice."""
        for t in _tensors_in(objects):
            for st in _storages(t):
                self._count(st)
        return self.current

    def reset_peak(self) -> int:
        """Start a new peak from what is alive now; returns it."""
        self.peak = self.current
        return self.peak

    def mark(self, label: str) -> int:
        """Record (label, current bytes) in :attr:`marks`, e.g. after the forward."""
        self.marks.append((label, self.current))
        return self.current

    # -- the dispatch mode ------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # A wrapper subclass (DTensor) first turns into ops on its local tensors, which come
        # back here: those are the ones that allocate.
        if any(t is not torch.Tensor and issubclass(t, torch.Tensor)
               and hasattr(t, "__tensor_flatten__") for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        from torch._guards import active_fake_mode

        if active_fake_mode() is None:  # not a shape computation (DTensor's propagation)
            inputs, _ = tree_flatten((args, kwargs))
            given = {id(st) for t in inputs if isinstance(t, torch.Tensor) for st in _storages(t)}
            leaves, _ = tree_flatten(out)
            for leaf in leaves:
                if isinstance(leaf, torch.Tensor):
                    for st in _storages(leaf):
                        # A view or an in-place result shares an input's memory: nothing new,
                        # unless the op resized a storage this tracker already counts.
                        if id(st) not in given or id(st) in self._sizes:
                            self._count(st)
        return out

    def __enter__(self):
        if self._orig_resize is not None:
            raise RuntimeError("this MemoryTracker is already on; use a new one")
        self._orig_resize = orig = torch.UntypedStorage.resize_
        tracker = self

        @wraps(orig)
        def resize_(st, size):  # not an operator: the dispatch mode never sees it
            result = orig(st, size)
            tracker._count(st)
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize
        self._orig_resize = None
        return super().__exit__(*exc)


def allocator_peak(device: torch.device | str) -> int | None:
    """The CUDA caching allocator's peak of allocated bytes since its last reset (None on a
    device without allocator statistics, such as the CPU)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device)


def reset_allocator_peak(device: torch.device | str) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
