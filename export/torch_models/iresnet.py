"""IResNet (Deng et al., ArcFace) in the layout of insightface's ``recognition/arcface_torch``.

Parameter names match that project's checkpoints (``backbone.pth``); the ``fp16`` autocast switch
of the original is left out. Input: RGB 112x112, normalized as (x - 127.5) / 127.5 outside.
Written from the architecture description.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

LAYERS: dict[int, tuple[int, int, int, int]] = {
    18: (2, 2, 2, 2),
    34: (3, 4, 6, 3),
    50: (3, 4, 14, 3),
    100: (3, 13, 30, 3),
}
INPUT_SIZE = 112
_FC_SCALE = 7 * 7
_EPS = 1e-5


def conv3x3(inp: int, out: int, stride: int = 1) -> nn.Conv2d:
    """3x3 convolution, padding 1, no bias."""
    return nn.Conv2d(inp, out, 3, stride, 1, bias=False)


class IBasicBlock(nn.Module):
    """Pre-activation residual block: BN, conv3x3, BN, PReLU, conv3x3 (stride), BN, plus shortcut."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(inplanes, eps=_EPS)
        self.conv1 = conv3x3(inplanes, planes)
        self.bn2 = nn.BatchNorm2d(planes, eps=_EPS)
        self.prelu = nn.PReLU(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn3 = nn.BatchNorm2d(planes, eps=_EPS)
        self.downsample = downsample

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.prelu(self.bn2(self.conv1(self.bn1(x))))
        out = self.bn3(self.conv2(out))
        identity: Tensor = x if self.downsample is None else self.downsample(x)
        return out + identity


class IResNet(nn.Module):
    """IResNet-18/34/50/100 producing an ``embedding_dim`` vector (not L2-normalized)."""

    def __init__(self, depth: int = 50, embedding_dim: int = 512, dropout: float = 0.0) -> None:
        super().__init__()
        if depth not in LAYERS:
            raise ValueError(f"unsupported IResNet depth {depth}; choose from {sorted(LAYERS)}")
        if embedding_dim <= 0:
            raise ValueError(f"embedding_dim must be positive, got {embedding_dim}")
        layers = LAYERS[depth]
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(64, eps=_EPS)
        self.prelu = nn.PReLU(64)
        self.layer1 = self._make_layer(64, layers[0])
        self.layer2 = self._make_layer(128, layers[1])
        self.layer3 = self._make_layer(256, layers[2])
        self.layer4 = self._make_layer(512, layers[3])
        self.bn2 = nn.BatchNorm2d(512, eps=_EPS)
        self.dropout = nn.Dropout(p=dropout)
        self.fc = nn.Linear(512 * _FC_SCALE, embedding_dim)
        self.features = nn.BatchNorm1d(embedding_dim, eps=_EPS)
        nn.init.constant_(self.features.weight, 1.0)
        self.features.weight.requires_grad = False

    def _make_layer(self, planes: int, blocks: int, stride: int = 2) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes, eps=_EPS)
            )
        layers = [IBasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes
        layers += [IBasicBlock(planes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        x = self.prelu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(self.bn2(x), 1)
        embedding: Tensor = self.features(self.fc(self.dropout(x)))
        return embedding
