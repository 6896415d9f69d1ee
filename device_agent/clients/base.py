"""What a device runs for one round of any strategy: a model rebuilt from an assignment.

A ``ClientProgram`` is built from its strategy's typed spec (``device_agent.clients.spec``) and
the tensors the coordinator sent (plus what the device kept from its previous round, for
personalized strategies), is trained by ``device_agent.training.optimizer.train_local``, and says what goes
back. Each program names the one spec class it consumes (``Spec``) and is registered under that
spec's strategy names when it is defined; the server strategy names the program (``Strategy.program``).
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import ClassVar

import torch
from torch import nn

from device_agent.clients.assignment_check import check_assignment
from device_agent.clients.pool import MODELS, Pooled
from device_agent.clients.registry import PROGRAMS, literal_names
from device_agent.clients.spec import SpecBase


def is_norm_statistic(key: str) -> bool:
    """BatchNorm running statistics: computed from data, never trained, never averaged."""
    return key.endswith(("running_mean", "running_var", "num_batches_tracked"))


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters (not its BN statistics), detached: the usual upload."""
    return {key: value.detach().clone() for key, value in model.state_dict().items() if not is_norm_statistic(key)}


def load_tensors(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Load an assignment into a model: every parameter must be there and fit; BN statistics may be absent."""
    state = model.state_dict()
    check_assignment(tensors, state, optional=[key for key in state if is_norm_statistic(key)])
    model.load_state_dict(dict(tensors), strict=False)


class KeptStateMissing(ValueError):
    """A personalized assignment that needs the part the device keeps, and the device has none for this run."""


class ClientProgram(ABC):
    """One round of local work for one strategy.

    ``local`` is what this device kept from its previous round (:meth:`keep`), None on its
    first round: personalized state that never leaves the device (e.g. Factorized-FL's v and mu).
    """

    Spec: ClassVar[type[SpecBase]]
    model: nn.Module
    reuse_model: ClassVar[bool | None] = None
    """Whether a model given back after a round (see :mod:`.pool`) may be reused by the next program of its spec.

    Reuse needs a :meth:`load` that writes every parameter and buffer: the default one does (add steps after it
    in :meth:`after_load`, which keeps reuse). A program that overrides :meth:`load` says which it is
    (``True``: it writes everything; ``False``: build a fresh model each round); left unsaid, the model is
    built fresh and a warning names the program, instead of reuse silently turning off."""

    def __init_subclass__(cls, register: bool = True, **kwargs: object) -> None:
        """A program whose spec names its strategies is registered under each name: nothing else to edit.

        ``class Double(ClientProgram, register=False)`` keeps a test double or a variant out of the registry.
        """
        super().__init_subclass__(**kwargs)
        if cls.load is not ClientProgram.load and cls.reuse_model is None:
            warnings.warn(
                f"{cls.__qualname__} overrides ClientProgram.load without saying whether its model may be reused "
                "across rounds: it is built fresh each round. Set reuse_model = True if load writes every parameter "
                "and buffer, reuse_model = False to keep this, or put the extra steps in after_load() instead.",
                stacklevel=2,
            )
        if register and "Spec" in cls.__dict__:
            for name in literal_names(cls.Spec):
                PROGRAMS.register(name, cls)

    def __init__(
        self,
        spec: SpecBase,
        tensors: Mapping[str, torch.Tensor],
        local: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        if not isinstance(spec, self.Spec):
            raise TypeError(f"{type(self).__name__} consumes {self.Spec.__name__}, got {type(spec).__name__}")
        self.spec = spec
        self.local_classes: torch.Tensor | None = None
        self._pooled: Pooled | None = None
        if self._reuses_model():
            key = self._pool_key()
            reused = MODELS.take(key) if key is not None else None
            self._pooled = reused or Pooled.fresh(self._uninitialized(spec))
            self.model = self._pooled.model
        else:
            self.model = self.build_model(spec)
        self.load(tensors, local)
        self.after_load(tensors, local)

    @classmethod
    def _reuses_model(cls) -> bool:
        return cls.reuse_model if cls.reuse_model is not None else cls.load is ClientProgram.load

    def _pool_key(self) -> tuple[type, SpecBase] | None:
        """Models of the same program and spec are interchangeable once loaded; None: a spec that cannot key."""
        spec = self.spec.model_copy(update={"clip": None})  # a clip norm that moves each round keeps the model
        try:
            hash(spec)
        except TypeError:
            return None
        return type(self), spec

    def release(self, sent: Mapping[str, torch.Tensor]) -> None:
        """The round is over: give the model back for the next program of this spec (see :mod:`.pool`).

        ``sent`` is what the round produced (upload, extras, kept state); a model sharing memory with any
        of it is not reused. ``self.model`` must not be used after this.
        """
        pooled, key = self._pooled, self._pool_key()
        self._pooled = None
        if pooled is None or key is None:
            return
        own = {t.untyped_storage().data_ptr() for t in (*pooled.model.parameters(), *pooled.model.buffers())}
        if any(t.untyped_storage().data_ptr() in own for t in sent.values()):
            return
        MODELS.give(key, pooled)

    def _uninitialized(self, spec: SpecBase) -> nn.Module:
        """The model without drawing initial weights the assignment overwrites anyway.

        :meth:`load` writes every parameter and buffer but the norm statistics, which start as a fresh model's.
        Drawing the initial weights (and, for a factorized model, the SVD of each layer) was a quarter of a
        1,000-device worker's time (py-spy). A model with buffers outside its state dict is built as usual.
        """
        with torch.device("meta"):
            model = self.build_model(spec)
        if set(dict(model.named_buffers())) != set(model.state_dict()) - {n for n, _ in model.named_parameters()}:
            return self.build_model(spec)
        model = model.to_empty(device="cpu")
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._NormBase):
                module.reset_running_stats()
        return model

    def load(self, tensors: Mapping[str, torch.Tensor], local: Mapping[str, torch.Tensor] | None) -> None:
        """Put the assignment (and what the device kept) into ``self.model``, refusing what does not fit.

        By default every parameter must come and BN statistics may be absent; programs that keep
        state or a frozen base override this, never the set-up around it.
        """
        load_tensors(self.model, tensors)

    def after_load(self, tensors: Mapping[str, torch.Tensor], local: Mapping[str, torch.Tensor] | None) -> None:  # noqa: B027
        """Steps after :meth:`load` (freezing a part, keeping a copy of what was received): overriding this, not
        ``load``, keeps a reused model (see :attr:`reuse_model`)."""

    @classmethod
    @abstractmethod
    def build_model(cls, spec: SpecBase) -> nn.Module:
        """The untrained model this program trains for ``spec`` (the planner sizes it on the meta device)."""

    def note_local_classes(self, classes: torch.Tensor) -> None:
        """Called by ``train_local`` with the sorted class indices present in the local data.

        Programs whose server needs them (HeteroFL's label-masked classifier rows) send them in
        :meth:`extras`.
        """
        self.local_classes = classes

    def regularizer(self) -> torch.Tensor | None:
        """Extra loss terms on LIVE parameters (e.g. L1 on mu); None if none."""
        return None

    def after_backward(self) -> None:  # noqa: B027
        """Gradient-side hooks between backward and step (e.g. Frobenius decay on factors)."""

    def gradient_penalty(self) -> torch.Tensor | None:
        """:meth:`after_backward` as a loss term on LIVE parameters whose gradient is what it adds; None if none.

        Batched training (:mod:`device_agent.training.batched`) computes gradients functionally and cannot call
        :meth:`after_backward`: a program that overrides it batches only when it gives this term.
        """
        return None

    def param_groups(self, weight_decay: float) -> list[dict]:
        """Optimizer parameter groups; by default plain L2 on everything."""
        return [{"params": [p for p in self.model.parameters() if p.requires_grad], "weight_decay": weight_decay}]

    @abstractmethod
    def upload(self) -> dict[str, torch.Tensor]:
        """ONLY what the strategy sends back (factors + full-rank + norm, or u vectors, ...)."""

    def extras(self) -> dict[str, torch.Tensor]:
        """Side information for the server (e.g. SimFed's criteria embedding); {} if none."""
        return {}

    def keep(self) -> dict[str, torch.Tensor]:
        """What the device keeps for its next round and never uploads; {} if nothing."""
        return {}

    def train_scale(self) -> float:
        """Factor on convolution outputs during training only (HeteroFL's 1/rate scaler); 1.0 = none."""
        return 1.0
