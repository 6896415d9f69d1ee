"""The agent's SGD equals torch.optim.SGD bit for bit, and training with it never imports the compiler stack."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from device_agent.models import build_model
from device_agent.training.sgd import SGD
from tests.paths import REPO_ROOT


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_steps_equal_torch_optim_sgd_bit_for_bit(momentum: float) -> None:
    torch.manual_seed(0)
    ours, theirs = build_model("cnn"), build_model("cnn")
    theirs.load_state_dict(ours.state_dict())

    def groups(model):  # two groups as FedHM makes them: L2 on some parameters, none on others
        params = list(model.parameters())
        return [{"params": params[::2], "weight_decay": 5e-4}, {"params": params[1::2], "weight_decay": 0.0}]

    optimizers = (
        SGD(groups(ours), lr=0.05, momentum=momentum),
        torch.optim.SGD(groups(theirs), lr=0.05, momentum=momentum),
    )
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.rand(6, 1, 8, 8, generator=generator), torch.randint(0, 10, (6,), generator=generator)
        for model, optimizer in zip((ours, theirs), optimizers, strict=True):
            optimizer.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    for (name, mine), their in zip(ours.state_dict().items(), theirs.state_dict().values(), strict=True):
        assert torch.equal(mine, their), name


def test_a_training_round_leaves_torch_dynamo_unimported() -> None:
    code = (
        "import sys, torch\n"
        "from device_agent.models import build_model\n"
        "from device_agent.training.sgd import SGD\n"
        "model = build_model('cnn')\n"
        "optimizer = SGD([{'params': list(model.parameters()), 'weight_decay': 5e-4}], lr=0.05, momentum=0.9)\n"
        "torch.nn.functional.cross_entropy(model(torch.rand(4, 1, 8, 8)), torch.tensor([0, 1, 2, 3])).backward()\n"
        "optimizer.step()\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
