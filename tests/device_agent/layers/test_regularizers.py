import torch

from device_agent.layers.factorized import FactorizedLinear, reconstruct
from device_agent.layers.hybrid import hybrid
from device_agent.layers.regularizers import apply_frobenius_decay_, frobenius_penalty, parameter_groups


def factor_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_frobenius_decay_gradient_equals_autograd_of_the_penalty():
    torch.manual_seed(0)
    model = hybrid("cnn", 0.5).double()
    strength = 0.3
    frobenius_penalty(model, strength).backward()
    autograd = factor_grads(model)
    model.zero_grad(set_to_none=True)
    apply_frobenius_decay_(model, strength)
    closed_form = factor_grads(model)
    assert set(closed_form) == set(autograd) == {"conv2.reduce", "conv2.expand", "conv3.reduce", "conv3.expand"}
    for name in autograd:
        torch.testing.assert_close(closed_form[name], autograd[name], rtol=1e-10, atol=1e-12)


def test_penalty_is_half_lambda_times_the_squared_norm_of_the_product():
    torch.manual_seed(1)
    layer = FactorizedLinear(12, 9, rank=4).double()
    dense = reconstruct(layer.reduce, layer.expand, layer.weight_shape)
    expected = 0.5 * 0.1 * dense.pow(2).sum()
    torch.testing.assert_close(frobenius_penalty(layer, 0.1), expected)


def test_decay_adds_to_existing_gradients():
    torch.manual_seed(2)
    layer = FactorizedLinear(6, 5, rank=2).double()
    layer(torch.randn(3, 6, dtype=torch.float64)).sum().backward()
    loss_grad = layer.expand.grad.clone()
    apply_frobenius_decay_(layer, 0.5)
    a, b = layer.expand.detach(), layer.reduce.detach()
    torch.testing.assert_close(layer.expand.grad, loss_grad + 0.5 * a @ (b @ b.T))


def test_factors_get_no_l2_weight_decay():
    model = hybrid("cnn", 0.5)
    dense_group, factor_group = parameter_groups(model, weight_decay=5e-4)
    assert dense_group["weight_decay"] == 5e-4 and factor_group["weight_decay"] == 0.0
    assert len(factor_group["params"]) == 4
    assert len(dense_group["params"]) + len(factor_group["params"]) == len(list(model.parameters()))
    torch.optim.SGD(parameter_groups(model, 5e-4), lr=0.1, momentum=0.9)
