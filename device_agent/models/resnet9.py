"""Factorized-FL's ResNet-9 (seed 000, Table 3): eight conv-BN-ReLU layers and one classifier.

Conv 2 is 5x5 stride 2; convs 3-4 and 6-7 are residual pairs; 2x2 max-pool after conv 5 and an
adaptive max-pool after conv 8. The reference code gives conv 8 no padding, which breaks on
inputs smaller than 24x24; here every 3x3 conv is padded, which changes no parameter count.
"""

from __future__ import annotations

from torch import Tensor, nn

from device_agent.models.width import scaled_channels


class ConvBNReLU(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 3, stride: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride, kernel_size // 2, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.relu(self.bn(self.conv(x)))


class ResNet9(nn.Module):
    def __init__(self, num_classes: int = 10, in_channels: int = 3, width: float = 1.0) -> None:
        super().__init__()
        c64, c128, c256 = (scaled_channels(c, width) for c in (64, 128, 256))
        self.conv1 = ConvBNReLU(in_channels, c64)
        self.conv2 = ConvBNReLU(c64, c128, kernel_size=5, stride=2)
        self.conv3 = ConvBNReLU(c128, c128)
        self.conv4 = ConvBNReLU(c128, c128)
        self.conv5 = ConvBNReLU(c128, c256)
        self.pool = nn.MaxPool2d(2)
        self.conv6 = ConvBNReLU(c256, c256)
        self.conv7 = ConvBNReLU(c256, c256)
        self.conv8 = ConvBNReLU(c256, c256)
        self.global_pool = nn.AdaptiveMaxPool2d(1)
        self.fc = nn.Linear(c256, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv2(self.conv1(x))
        x = x + self.conv4(self.conv3(x))
        x = self.pool(self.conv5(x))
        x = x + self.conv7(self.conv6(x))
        x = self.global_pool(self.conv8(x))
        return self.fc(x.flatten(1))


def resnet9(num_classes: int = 10, in_channels: int = 3, width: float = 1.0) -> ResNet9:
    return ResNet9(num_classes, in_channels, width)
