"""CIFAR-style ResNet-18/34 as used by FedHM (seed 004, Tables B.8/B.9).

3x3 stride-1 stem with no max-pool, four stages of BasicBlocks (64, 128, 256, 512 channels),
1x1 conv + BN downsample shortcuts, global average pool, linear classifier. The global pool
makes any input size from 8x8 up work.
"""

from __future__ import annotations

from torch import Tensor, nn

from device_agent.models.width import scaled_channels


class BasicBlock(nn.Module):
    def __init__(self, in_channels: int, channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_channels != channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(channels),
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return self.relu(out + shortcut)


class ResNet(nn.Module):
    def __init__(
        self, blocks: tuple[int, int, int, int], num_classes: int = 10, in_channels: int = 3, width: float = 1.0
    ) -> None:
        super().__init__()
        widths = tuple(scaled_channels(c, width) for c in (64, 128, 256, 512))
        self.conv1 = nn.Conv2d(in_channels, widths[0], 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        stages = []
        current = widths[0]
        for stage, (width, count) in enumerate(zip(widths, blocks, strict=True)):
            layers = []
            for index in range(count):
                stride = 2 if stage > 0 and index == 0 else 1
                layers.append(BasicBlock(current, width, stride))
                current = width
            stages.append(nn.Sequential(*layers))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(widths[-1], num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.pool(x).flatten(1))


def resnet18(num_classes: int = 10, in_channels: int = 3, width: float = 1.0) -> ResNet:
    return ResNet((2, 2, 2, 2), num_classes, in_channels, width)


def resnet34(num_classes: int = 10, in_channels: int = 3, width: float = 1.0) -> ResNet:
    return ResNet((3, 4, 6, 3), num_classes, in_channels, width)
