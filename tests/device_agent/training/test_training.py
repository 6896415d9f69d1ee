import torch
from torch import nn

from device_agent.clients.base import ClientProgram, trainable_state
from device_agent.clients.spec import FedFacSpec, ModelSpec
from device_agent.emulation.limits import Throttle
from device_agent.training.optimizer import TrainConfig, masked_cross_entropy, train_local


def test_masked_cross_entropy_ignores_absent_classes_and_has_finite_gradients():
    logits = torch.randn(4, 5, requires_grad=True)
    labels = torch.tensor([0, 2, 2, 0])
    absent = torch.tensor([False, True, False, True, True])
    loss = masked_cross_entropy(logits, labels, absent)
    present = logits[:, [0, 2]]
    expected = nn.functional.cross_entropy(present, torch.tensor([0, 1, 1, 0]))
    assert torch.allclose(loss, expected)
    loss.backward()
    assert torch.isfinite(logits.grad).all()
    assert torch.all(logits.grad[:, absent] == 0)


def test_a_one_class_batch_learns_only_when_absent_logits_are_held_at_zero():
    labels = torch.tensor([1, 1, 1])
    absent = torch.tensor([True, False, True])
    logits = torch.tensor([[0.5, 0.2, -0.3]] * 3, requires_grad=True)

    assert masked_cross_entropy(logits, labels, absent, "-inf").item() == 0  # nothing to tell apart

    zero = masked_cross_entropy(logits, labels, absent, "zero")
    expected = nn.functional.cross_entropy(torch.tensor([[0.0, 0.2, 0.0]] * 3), labels)
    assert torch.allclose(zero, expected)
    zero.backward()
    assert torch.all(logits.grad[:, 1] < 0) and torch.all(logits.grad[:, absent] == 0)  # own class raised


SPEC = FedFacSpec(strategy="fedfac", model=ModelSpec("linear", 3, 1, 2), level=1.0)


class Linear(ClientProgram, register=False):
    Spec = FedFacSpec
    reuse_model = False  # its load writes nothing: the fresh model's own weights

    def __init__(self, spec, tensors, local=None):
        super().__init__(spec, tensors, local)
        self.penalty_calls = 0

    def load(self, tensors, local):
        """A freshly initialized model: nothing is sent to it."""

    @classmethod
    def build_model(cls, spec):
        return nn.Sequential(nn.Flatten(), nn.Linear(4, 3))

    def regularizer(self):
        self.penalty_calls += 1
        return 0.0 * self.model[1].weight.sum()

    def upload(self):
        return trainable_state(self.model)


def test_train_local_runs_epochs_records_classes_and_adds_the_regularizer():
    program = Linear(SPEC, {})
    x, y = torch.randn(10, 1, 2, 2), torch.tensor([0, 2] * 5)
    before = program.model[1].weight.detach().clone()
    result = train_local(program, (x, y), TrainConfig(epochs=2, batch_size=4))
    assert result.samples == 10 and result.steps == 6 and program.penalty_calls == 6
    assert program.local_classes.tolist() == [0, 2]
    assert not torch.equal(before, program.model[1].weight)
    assert torch.isfinite(torch.tensor(result.mean_loss))


def test_the_step_hook_wraps_every_optimizer_step_so_a_throttle_paces_each_one():
    program = Linear(SPEC, {})
    x, y = torch.randn(10, 1, 2, 2), torch.tensor([0, 2] * 5)
    naps: list[float] = []
    throttle = Throttle(3.0, min_sleep=0.0, sleep=naps.append)
    result = train_local(program, (x, y), TrainConfig(epochs=2, batch_size=4), step=throttle.step)
    assert len(naps) == result.steps == 6  # owed idle time is paid inside training, step by step
    assert throttle.busy_seconds > 0 and sum(naps) > 0


def test_train_local_tells_progress_its_start_and_every_step_of_every_epoch():
    program = Linear(SPEC, {})
    x, y = torch.randn(10, 1, 2, 2), torch.tensor([0, 2] * 5)
    heard: list[tuple[int, int]] = []
    result = train_local(program, (x, y), TrainConfig(epochs=2, batch_size=4), progress=lambda *p: heard.append(p))
    assert heard == [(step, 6) for step in range(0, 7)] and result.steps == 6
