"""FedHM low-rank layers and the matrix view that ties them to full-rank weights.

A k x k convolution W (C_out, C_in, k, k) is viewed as the matrix
``W.permute(0, 2, 1, 3).reshape(C_out * k, C_in * k) = A @ B`` with A (C_out*k, r) and
B (r, C_in*k). B is a (1 x k) convolution C_in -> r (stride (1, s), padding (0, p)) and A a
(k x 1) convolution r -> C_out (stride (s, 1), padding (p, 0)); running them in that order is
exactly the dense convolution with the reconstructed weight, which is what lets the server
rebuild, average and re-factorize clients that trained different ranks.

A linear layer (out, in) is the same with k = 1: B is (r, in), A is (out, r).

Parameter names: ``reduce`` holds B (in its convolution shape), ``expand`` holds A, ``bias``
is the layer's bias. A full-rank layer at the same place has ``weight`` and ``bias``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def rank_for(gamma: float, out_channels: int) -> int:
    """FedHM rank: a fraction of the output channels, rounded half up, at least 1.

    Half-up rather than Python's banker's rounding so that e.g. gamma * C_out = 2.5 gives 3
    on every platform and in every language a device may use.
    """
    if not 0.0 < gamma <= 1.0:
        raise ValueError(f"rank ratio gamma must be in (0, 1], got {gamma}")
    return max(1, math.floor(gamma * out_channels + 0.5))


def weight_to_matrix(weight: Tensor) -> Tensor:
    """(C_out, C_in, k, k) conv or (out, in) linear weight -> its FedHM matrix view."""
    if weight.dim() == 2:
        return weight
    c_out, c_in, kh, kw = weight.shape
    if kh != kw:
        raise ValueError(f"FedHM factorizes square kernels only, got {kh}x{kw}")
    return weight.permute(0, 2, 1, 3).reshape(c_out * kh, c_in * kw)


def matrix_to_weight(matrix: Tensor, shape: torch.Size | tuple[int, ...]) -> Tensor:
    """Inverse of :func:`weight_to_matrix` for a weight of the given shape."""
    if len(shape) == 2:
        return matrix.reshape(shape)
    c_out, c_in, k, _ = shape
    return matrix.reshape(c_out, k, c_in, k).permute(0, 2, 1, 3).contiguous()


def factors_to_matrices(reduce: Tensor, expand: Tensor) -> tuple[Tensor, Tensor]:
    """Stored factor tensors -> (A, B) with W_matrix = A @ B."""
    if reduce.dim() == 2:
        return expand, reduce
    rank = reduce.shape[0]
    a = expand.permute(0, 2, 1, 3).reshape(-1, rank)
    b = reduce.reshape(rank, -1)
    return a, b


def matrices_to_factors(a: Tensor, b: Tensor, shape: torch.Size | tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """(A, B) -> (reduce, expand) tensors for a layer whose full weight has ``shape``."""
    rank = b.shape[0]
    if len(shape) == 2:
        return b.contiguous(), a.contiguous()
    c_out, c_in, k, _ = shape
    reduce = b.reshape(rank, c_in, 1, k).contiguous()
    expand = a.reshape(c_out, k, rank, 1).permute(0, 2, 1, 3).contiguous()
    return reduce, expand


def reconstruct(reduce: Tensor, expand: Tensor, shape: torch.Size | tuple[int, ...]) -> Tensor:
    """Full-rank weight of the given shape from its two factors (shape alignment)."""
    a, b = factors_to_matrices(reduce, expand)
    return matrix_to_weight(a @ b, shape)


class LowRankLayer(nn.Module):
    """What both factorized layers share: ``reduce`` / ``expand`` factors of a dense weight."""

    reduce: nn.Parameter
    expand: nn.Parameter
    rank: int
    weight_shape: tuple[int, ...]

    @torch.no_grad()
    def load_dense_(self, weight: Tensor) -> None:
        """Set the factors to the optimal rank-``rank`` approximation of a dense weight."""
        if weight.device.type == "meta":
            return
        a, b = spectral_factors(weight_to_matrix(weight), self.rank)
        reduce, expand = matrices_to_factors(a, b, self.weight_shape)
        self.reduce.copy_(reduce)
        self.expand.copy_(expand)


class FactorizedConv2d(LowRankLayer):
    """A k x k convolution as a (1 x k) conv to ``rank`` channels then a (k x 1) conv."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        rank: int,
        stride: int = 1,
        padding: int = 0,
        bias: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.rank = kernel_size, rank
        self.stride, self.padding = stride, padding
        self.weight_shape = (out_channels, in_channels, kernel_size, kernel_size)
        self.reduce = nn.Parameter(torch.empty(rank, in_channels, 1, kernel_size, device=device))
        self.expand = nn.Parameter(torch.empty(out_channels, rank, kernel_size, 1, device=device))
        self.bias = nn.Parameter(torch.zeros(out_channels, device=device)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Spectral init of a Kaiming-initialized dense weight, so training starts as FedHM's does."""
        dense = torch.empty(self.weight_shape, device=self.reduce.device)
        self.load_dense_(nn.init.kaiming_normal_(dense, mode="fan_out", nonlinearity="relu"))

    def forward(self, x: Tensor) -> Tensor:
        s, p = self.stride, self.padding
        y = F.conv2d(x, self.reduce, None, stride=(1, s), padding=(0, p))
        return F.conv2d(y, self.expand, self.bias, stride=(s, 1), padding=(p, 0))

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
            f"rank={self.rank}, stride={self.stride}, padding={self.padding}, bias={self.bias is not None}"
        )


class FactorizedLinear(LowRankLayer):
    """A linear layer as ``in -> rank -> out``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int,
        bias: bool = True,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.weight_shape = (out_features, in_features)
        self.reduce = nn.Parameter(torch.empty(rank, in_features, device=device))
        self.expand = nn.Parameter(torch.empty(out_features, rank, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        dense = torch.empty(self.weight_shape, device=self.reduce.device)
        self.load_dense_(nn.init.kaiming_uniform_(dense, a=math.sqrt(5)))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(F.linear(x, self.reduce), self.expand, self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, rank={self.rank}, bias={self.bias is not None}"


WIDE_SPECTRUM = 1e-4
"""Smallest kept eigenvalue of the Gram matrix, relative to the largest, that float32 resolves well.

Below it (a kept spectrum spanning more than two decades of singular values) the float32
eigendecomposition's absolute error, about eps * lambda_max, nears the kept eigenvalues: the
relative reconstruction error exceeds the optimal one by 2e-5 at three decades and 1.5e-4 at
four. Such layers are decomposed again in float64 (measurements in docs/factorization.md)."""


def spectral_factors(matrix: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """Top-``rank`` spectral factors A = U_r sqrt(S_r), B = sqrt(S_r) V_r^T of one matrix.

    Columns of A / rows of B come in decreasing singular value, so slicing the first r of them
    gives the optimal rank-r factors for every r <= rank: one decomposition serves all rank
    levels. Computed from the symmetric eigendecomposition of the smaller Gram matrix, about
    2-3x faster than an SVD on CPU; a float32 matrix whose kept spectrum is too wide for float32
    (:data:`WIDE_SPECTRUM`) is decomposed again in float64. Each component's scale is the norm of
    the matrix projected on its singular vector, not the square root of its eigenvalue: the two
    agree where the eigenvalue is accurate, and on (near-)null components, whose eigenvalues are
    rounding noise, it keeps ||A_i|| = ||B_i|| instead of leaving them orders of magnitude apart.
    A rank above min(m, n) (possible for a thin layer, since FedHM ranks follow C_out) is padded
    with zero components.
    """
    m, n = matrix.shape
    if rank > min(m, n):
        a, b = spectral_factors(matrix, min(m, n))
        pad = rank - min(m, n)
        return torch.cat([a, a.new_zeros(m, pad)], dim=1), torch.cat([b, b.new_zeros(pad, n)], dim=0)
    work = matrix if matrix.dtype in (torch.float32, torch.float64) else matrix.float()
    a, b, eigenvalues = _gram_factors(work, rank)
    if work.dtype != torch.float64 and float(eigenvalues[-1]) < WIDE_SPECTRUM * float(eigenvalues[0]):
        a, b, _ = _gram_factors(work.double(), rank)
    return a.to(matrix.dtype), b.to(matrix.dtype)


def _gram_factors(work: Tensor, rank: int) -> tuple[Tensor, Tensor, Tensor]:
    """Balanced factors from the Gram matrix's top eigenvectors, and the kept eigenvalues (largest first)."""
    tall = work.shape[0] >= work.shape[1]
    gram = work.T @ work if tall else work @ work.T
    eigenvalues, eigenvectors = torch.linalg.eigh(gram)
    top = eigenvectors[:, -rank:].flip(1)
    projected = work @ top if tall else top.T @ work
    root = projected.norm(dim=0 if tall else 1).sqrt()
    safe_root = root.clamp_min(torch.finfo(work.dtype).tiny)
    if tall:
        return projected / safe_root, root[:, None] * top.T, eigenvalues[-rank:].flip(0)
    return top * root, projected / safe_root[:, None], eigenvalues[-rank:].flip(0)
