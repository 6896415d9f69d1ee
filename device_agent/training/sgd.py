"""SGD with optional heavy-ball momentum, the agent's default optimizer, without ``torch.optim``.

``torch.optim``'s ``step`` imports ``torch._dynamo`` (the compiler stack) on its first call, even when
nothing is compiled: about 80 MiB more resident per process and seconds of import at the first
training step, in every emulation worker and on every device (a Raspberry Pi 4 with 1 GB feels
both). The update is ``torch.optim.SGD``'s with dampening 0 and no Nesterov term, per parameter:
``d = grad + weight_decay * p``; the momentum buffer ``b = d`` at the first step, then
``b = momentum * b + d``; ``p -= lr * b`` (``p -= lr * d`` without momentum). The tests hold it equal
to ``torch.optim.SGD`` bit for bit. Adam stays ``torch.optim.Adam``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor


class SGD:
    """``param_groups``: dicts with ``params`` and ``weight_decay`` (a program's groups); ``lr`` and
    ``momentum`` apply to every group, as the fleet's training section gives them."""

    def __init__(self, groups: Sequence[dict[str, Any]], lr: float, momentum: float = 0.0) -> None:
        self.param_groups = [
            {**group, "params": list(group["params"]), "lr": lr, "momentum": momentum} for group in groups
        ]
        self.buffers: dict[Tensor, Tensor] = {}
        """Each parameter's momentum buffer, once it has one (batched steps read and write them too)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if set_to_none:
                    param.grad = None
                elif param.grad is not None:
                    param.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            lr, momentum, weight_decay = group["lr"], group["momentum"], group.get("weight_decay", 0.0)
            for param in group["params"]:
                if param.grad is None:
                    continue
                step = param.grad if weight_decay == 0 else param.grad.add(param, alpha=weight_decay)
                if momentum != 0:
                    buffer = self.buffers.get(param)
                    if buffer is None:
                        buffer = self.buffers[param] = torch.clone(step).detach()
                    else:
                        buffer.mul_(momentum).add_(step)
                    step = buffer
                param.add_(step, alpha=-lr)


__all__ = ["SGD"]
