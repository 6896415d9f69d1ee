"""Client programs with a bug, for the tests that a program's exception fails its round and nothing more.

:func:`with_first_upload_bug` wraps a program class so that the first ``upload()`` of any of its
instances raises ``TypeError``, the kind of slip (a ``None`` where a tensor belongs) a new strategy
ships with; later rounds upload normally.
"""

from __future__ import annotations

import torch

from device_agent.clients.base import ClientProgram

BUG = "unsupported operand type(s) for *: 'NoneType' and 'Tensor'"


def with_first_upload_bug(program: type[ClientProgram]) -> type[ClientProgram]:
    uploads = 0

    class FirstUploadBug(program):  # type: ignore[valid-type, misc]
        def upload(self) -> dict[str, torch.Tensor]:
            nonlocal uploads
            uploads += 1
            if uploads == 1:
                raise TypeError(BUG)
            return super().upload()

    return FirstUploadBug
