"""Counting the bytes of a training step from its tensors: model state, saved activations, every live tensor, the
process's RSS and the CUDA allocator's statistics (lessons 01, 05, 07).

- :func:`model_state_bytes` (parameters, gradients, optimizer state counted from the tensors themselves, exact);
- :class:`SavedActivations` (bytes that autograd keeps for the backward pass, counted with saved-tensor hooks);
- :func:`live_tensor_bytes` (every tensor alive, or created since a :class:`LiveTensors` snapshot), :func:`rss_bytes`
  and :func:`cuda_memory_stats`;
- :func:`tensor_bytes` and :func:`unique_bytes` (storages counted once), which the others build on.

The formulas these counts are checked against live in `course_lib.theory.memory`.
"""

from __future__ import annotations

from typing import Iterable

import torch

def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's elements (not of the whole storage it may be a view of)."""
    return t.numel() * t.element_size()


def unique_bytes(tensors: Iterable[torch.Tensor], seen: set) -> int:
    """Bytes of the storages behind ``tensors`` that are not in ``seen`` yet (``seen`` is updated): a storage
    shared by several tensors (tied weights, views) counts once; a DTensor counts its local shard. None,
    non-tensors and tensors without memory of their own (the fake and functional tensors that `torch.compile`'s
    tracing leaves alive) are skipped."""
    total = 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        if hasattr(t, "to_local"):                 # a DTensor (FSDP2, DTensor TP): this rank's shard
            t = t.to_local()
        try:
            ptr = t.untyped_storage().data_ptr()
        except RuntimeError:                       # "Cannot access data pointer of Tensor (e.g. FakeTensor, ...)"
            continue
        key = (t.device, ptr)
        if key in seen or t.untyped_storage().nbytes() == 0:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Exact bytes of the model's training state, counted from the tensors.

    Returns ``dict(params=, grads=, optimizer=, optimizer_scalars=, total=)``; ``optimizer`` includes
    ``optimizer_scalars`` (0-dim tensors such as Adam's per-parameter ``step`` counter, 4 bytes each).
    Storages are deduplicated, so tied weights (embedding = LM head) count once.
    For Adam in fp32 after one step: params 4P, grads 4P, optimizer 8P + 4 x (number of parameter tensors).
    """
    seen: set = set()
    params = list(model.parameters())
    p_bytes = unique_bytes(params, seen)
    g_bytes = unique_bytes([p.grad for p in params], seen)
    o_bytes = o_scalars = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    b = unique_bytes([v], seen)
                    o_bytes += b
                    if v.dim() == 0:
                        o_scalars += b
    return dict(params=p_bytes, grads=g_bytes, optimizer=o_bytes, optimizer_scalars=o_scalars,
                total=p_bytes + g_bytes + o_bytes)


def _live_tensors(device: torch.device | str | None) -> list[torch.Tensor]:
    """Every tensor alive in this process on `device` (default: this rank's, `dist.device()`), after a gc pass.

    It first sleeps 20 ms without the GIL: a gloo worker thread holds a finished collective's tensors a moment after
    ``wait()`` returns, and to drop the last reference to a tensor that Python has seen it needs the GIL."""
    import gc
    import time

    from course_lib import dist

    device = torch.device(device) if device is not None else dist.device()   # this rank's device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    time.sleep(0.02)
    gc.collect()
    tensors = []
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and not obj.is_meta:
                local = obj.to_local() if hasattr(obj, "to_local") else obj
                if local.device == device:
                    tensors.append(obj)
        except Exception:  # noqa: BLE001 - objects half torn down by gc
            continue
    return tensors


class LiveTensors:
    """The tensors alive now, held by weak references: ``live_tensor_bytes(since=snapshot)`` then counts only
    storages that none of them still holds. Subtracting two byte counts instead would let a tensor that was alive
    at the snapshot and freed since (a collective's buffer, see `_live_tensors`) lower the later count by its bytes."""

    def __init__(self, device: torch.device | str | None = None):
        import weakref

        self._refs = [weakref.ref(t) for t in _live_tensors(device)]

    def still_alive(self) -> set:
        """The (device, data_ptr) keys of the snapshot's storages that one of its tensors still holds."""
        seen: set = set()
        for ref in self._refs:
            unique_bytes([ref()], seen)
        return seen


def live_tensor_bytes(device: torch.device | str | None = None, since: LiveTensors | None = None) -> int:
    """Bytes of every tensor alive in this process on `device` (storages deduplicated; DTensors counted by their local
    shard; ``device`` defaults to this rank's, `dist.device()`); with ``since``, only storages that no tensor of
    that snapshot still holds (what was created since). The one measurement that treats every library alike,
    on a CPU and on a GPU: whatever it keeps (buckets, flat buffers, optimizer state), it keeps in tensors. Not the
    CUDA allocator's count, which adds its rounding and caches and so differs from the formulas by more than the
    model state of a small model. A walk over every Python object: about 0.3 s on a CPU (lesson 05)."""
    seen = since.still_alive() if since is not None else set()
    return unique_bytes(_live_tensors(device), seen)


class SavedActivations:
    """Count the bytes autograd saves for backward inside the ``with`` block (saved-tensor hooks).

    Storages are deduplicated by ``data_ptr`` (the input of a Linear that is also the output of
    the ReLU before it is one storage and counts once). Parameters saved for backward (a Linear
    saves its weight) are not activations: they are counted apart, in ``params_saved_bytes``.

    >>> lin = torch.nn.Linear(4, 3)
    >>> with SavedActivations() as acts:
    ...     y = torch.relu(lin(torch.randn(2, 4, requires_grad=True)))
    >>> acts.bytes    # input (2x4) + relu output (2x3), fp32
    56

    Attributes: ``bytes`` (activation bytes), ``params_saved_bytes``, ``n_saved`` (pack calls),
    ``by_shape`` (list of (shape, dtype, bytes) for each new storage).
    """

    def __init__(self, model: torch.nn.Module | None = None, exclude: Iterable[torch.Tensor] = ()):
        self._param_ptrs: set | None = None
        self._model = model
        self._exclude = list(exclude)
        self.bytes = 0
        self.params_saved_bytes = 0
        self.n_saved = 0
        self.by_shape: list[tuple] = []
        self._seen: set = set()

    def _is_param(self, t: torch.Tensor) -> bool:
        if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
            return True  # a parameter, or a view of one (a Linear saves weight.t())
        return (t.device, t.untyped_storage().data_ptr()) in self._param_ptrs

    def _pack(self, t: torch.Tensor):
        self.n_saved += 1
        key = (t.device, t.untyped_storage().data_ptr())
        if key not in self._seen:
            self._seen.add(key)
            nbytes = t.untyped_storage().nbytes()
            if self._is_param(t):
                self.params_saved_bytes += nbytes
            else:
                self.bytes += nbytes
                self.by_shape.append((tuple(t.shape), t.dtype, nbytes))
        return t

    @staticmethod
    def _unpack(t):
        return t

    def __enter__(self) -> "SavedActivations":
        # Every parameter the block can see: the given model's, plus any nn.Parameter saved directly.
        tensors = list(self._model.parameters()) if self._model is not None else []
        tensors += self._exclude
        self._param_ptrs = {(t.device, t.untyped_storage().data_ptr()) for t in tensors}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def rss_bytes() -> int:
    """Resident set size of this process (bytes): everything, including the Python interpreter and torch."""
    import psutil
    return psutil.Process().memory_info().rss


def cuda_memory_stats(device: torch.device | str | None = None) -> dict:
    """Allocator statistics (bytes): allocated now, peak allocated, reserved now, peak reserved."""
    s = torch.cuda.memory_stats(device)
    return dict(allocated=s["allocated_bytes.all.current"], peak_allocated=s["allocated_bytes.all.peak"],
                reserved=s["reserved_bytes.all.current"], peak_reserved=s["reserved_bytes.all.peak"])
