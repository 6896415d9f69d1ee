"""Out of memory, however the device says it: one test, so every device reports ``out_of_memory``.

The coordinator answers an ``out_of_memory`` round failure by planning the device one rank level
lower (``coordinator.planning.planner.after_out_of_memory``); any other failure is just a failed round. So
the agent must recognize an allocation failure on every backend, not only the emulated cap:

- CUDA: ``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError`` in older torch);
- CPU: ``RuntimeError: DefaultCPUAllocator: can't allocate memory`` (``not enough memory`` on Windows);
- MPS: ``RuntimeError: MPS backend out of memory``;
- Python itself, and the emulated cap (:class:`device_agent.emulation.limits.MemoryCapExceeded`): ``MemoryError``.
"""

from __future__ import annotations

import gc

import torch

_OOM_TYPES: tuple[type[BaseException], ...] = tuple(
    {
        kind
        for kind in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None))
        if kind is not None
    }
)
# Lower-case fragments of the allocators' RuntimeError messages (CUDA/MPS, CPU on Linux, CPU on Windows).
_OOM_MESSAGES = ("out of memory", "can't allocate memory", "not enough memory")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says the device ran out of memory (rather than some other failure)."""
    if isinstance(exc, (MemoryError, *_OOM_TYPES)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(fragment in text for fragment in _OOM_MESSAGES)


def free_memory() -> None:
    """Give back what a failed round left allocated, so the next (smaller) round can run.

    Call it once the exception is gone: its traceback holds the failed round's tensors.
    """
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    if torch.backends.mps.is_available():
        torch.mps.empty_cache()
