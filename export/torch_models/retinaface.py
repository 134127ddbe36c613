"""RetinaFace (Deng et al. 2019) in the layout of biubug6's Pytorch_Retinaface.

Module and parameter names follow that project so that its published checkpoints
(``mobilenet0.25_Final.pth``, ``Resnet50_Final.pth``) load with ``strict=True`` once a ``module.``
prefix is removed. Written from the architecture description; torchvision is not needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

NUM_ANCHORS = 2


@dataclass(frozen=True)
class RetinaFaceConfig:
    """Backbone choice and the channel widths of the FPN."""

    backbone: str
    in_channel: int
    out_channel: int


CONFIGS: dict[str, RetinaFaceConfig] = {
    "mobilenet0.25": RetinaFaceConfig("mobilenet0.25", in_channel=32, out_channel=64),
    "resnet50": RetinaFaceConfig("resnet50", in_channel=256, out_channel=256),
}


def conv_bn(inp: int, oup: int, stride: int = 1, leaky: float = 0.0) -> nn.Sequential:
    """3x3 convolution, batch norm, leaky ReLU."""
    return nn.Sequential(
        nn.Conv2d(inp, oup, 3, stride, 1, bias=False), nn.BatchNorm2d(oup), nn.LeakyReLU(leaky, inplace=True)
    )


def conv_bn_no_relu(inp: int, oup: int, stride: int = 1) -> nn.Sequential:
    """3x3 convolution and batch norm."""
    return nn.Sequential(nn.Conv2d(inp, oup, 3, stride, 1, bias=False), nn.BatchNorm2d(oup))


def conv_bn1x1(inp: int, oup: int, stride: int = 1, leaky: float = 0.0) -> nn.Sequential:
    """1x1 convolution, batch norm, leaky ReLU."""
    return nn.Sequential(
        nn.Conv2d(inp, oup, 1, stride, 0, bias=False), nn.BatchNorm2d(oup), nn.LeakyReLU(leaky, inplace=True)
    )


def conv_dw(inp: int, oup: int, stride: int, leaky: float = 0.1) -> nn.Sequential:
    """Depthwise-separable block: depthwise 3x3 then pointwise 1x1, each with BN and leaky ReLU."""
    return nn.Sequential(
        nn.Conv2d(inp, inp, 3, stride, 1, groups=inp, bias=False),
        nn.BatchNorm2d(inp),
        nn.LeakyReLU(leaky, inplace=True),
        nn.Conv2d(inp, oup, 1, 1, 0, bias=False),
        nn.BatchNorm2d(oup),
        nn.LeakyReLU(leaky, inplace=True),
    )


class MobileNetV1Body(nn.Module):
    """MobileNetV1 at width 0.25 up to stride 32; returns the stride 8, 16 and 32 maps."""

    def __init__(self) -> None:
        super().__init__()
        self.stage1 = nn.Sequential(
            conv_bn(3, 8, 2, leaky=0.1),
            conv_dw(8, 16, 1),
            conv_dw(16, 32, 2),
            conv_dw(32, 32, 1),
            conv_dw(32, 64, 2),
            conv_dw(64, 64, 1),
        )
        self.stage2 = nn.Sequential(conv_dw(64, 128, 2), *(conv_dw(128, 128, 1) for _ in range(5)))
        self.stage3 = nn.Sequential(conv_dw(128, 256, 2), conv_dw(256, 256, 1))

    def forward(self, x: Tensor) -> list[Tensor]:
        c3 = self.stage1(x)
        c4 = self.stage2(c3)
        return [c3, c4, self.stage3(c4)]


class Bottleneck(nn.Module):
    """torchvision's ResNet v1.5 bottleneck (stride on the 3x3 convolution), same parameter names."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        width = planes
        self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: Tensor) -> Tensor:
        identity: Tensor = x if self.downsample is None else self.downsample(x)
        out: Tensor = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return torch.relu(out + identity)


class ResNet50Body(nn.Module):
    """ResNet-50 trunk with torchvision's names; returns layer2, layer3 and layer4 (strides 8/16/32)."""

    def __init__(self) -> None:
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = self._make_layer(64, 3, 1)
        self.layer2 = self._make_layer(128, 4, 2)
        self.layer3 = self._make_layer(256, 6, 2)
        self.layer4 = self._make_layer(512, 3, 2)

    def _make_layer(self, planes: int, blocks: int, stride: int) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * Bottleneck.expansion:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes * Bottleneck.expansion, 1, stride, bias=False),
                nn.BatchNorm2d(planes * Bottleneck.expansion),
            )
        layers = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * Bottleneck.expansion
        layers += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: Tensor) -> list[Tensor]:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        c3 = self.layer2(self.layer1(x))
        c4 = self.layer3(c3)
        return [c3, c4, self.layer4(c4)]


class FPN(nn.Module):
    """Top-down feature pyramid: 1x1 laterals, nearest upsampling to the lateral's size, 3x3 merges."""

    def __init__(self, in_channels: list[int], out_channels: int) -> None:
        super().__init__()
        leaky = 0.1 if out_channels <= 64 else 0.0
        self.output1 = conv_bn1x1(in_channels[0], out_channels, leaky=leaky)
        self.output2 = conv_bn1x1(in_channels[1], out_channels, leaky=leaky)
        self.output3 = conv_bn1x1(in_channels[2], out_channels, leaky=leaky)
        self.merge1 = conv_bn(out_channels, out_channels, leaky=leaky)
        self.merge2 = conv_bn(out_channels, out_channels, leaky=leaky)

    def forward(self, features: list[Tensor]) -> list[Tensor]:
        output1 = self.output1(features[0])
        output2 = self.output2(features[1])
        output3 = self.output3(features[2])
        up3 = F.interpolate(output3, size=[output2.size(2), output2.size(3)], mode="nearest")
        output2 = self.merge2(output2 + up3)
        up2 = F.interpolate(output2, size=[output1.size(2), output1.size(3)], mode="nearest")
        output1 = self.merge1(output1 + up2)
        return [output1, output2, output3]


class SSH(nn.Module):
    """Single Stage Headless context module: 3x3, 5x5 and 7x7 receptive-field branches, concatenated."""

    def __init__(self, in_channel: int, out_channel: int) -> None:
        super().__init__()
        if out_channel % 4 != 0:
            raise ValueError(f"SSH out_channel must be a multiple of 4, got {out_channel}")
        leaky = 0.1 if out_channel <= 64 else 0.0
        quarter = out_channel // 4
        self.conv3X3 = conv_bn_no_relu(in_channel, out_channel // 2)
        self.conv5X5_1 = conv_bn(in_channel, quarter, leaky=leaky)
        self.conv5X5_2 = conv_bn_no_relu(quarter, quarter)
        self.conv7X7_2 = conv_bn(quarter, quarter, leaky=leaky)
        self.conv7x7_3 = conv_bn_no_relu(quarter, quarter)

    def forward(self, x: Tensor) -> Tensor:
        branch5_1 = self.conv5X5_1(x)
        branch7_2 = self.conv7X7_2(branch5_1)
        out = torch.cat([self.conv3X3(x), self.conv5X5_2(branch5_1), self.conv7x7_3(branch7_2)], dim=1)
        return F.relu(out)


class Head(nn.Module):
    """1x1 convolution predicting ``values`` numbers per anchor; output [N, H*W*anchors, values]."""

    def __init__(self, in_channels: int, values: int, num_anchors: int = NUM_ANCHORS) -> None:
        super().__init__()
        self.values = values
        self.conv1x1 = nn.Conv2d(in_channels, num_anchors * values, 1, 1, 0)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.conv1x1(x).permute(0, 2, 3, 1).contiguous()
        return out.reshape(out.shape[0], -1, self.values)


class RetinaFace(nn.Module):
    """RetinaFace returning (loc [N,A,4], softmaxed conf [N,A,2], landmarks [N,A,10]).

    Anchors are ordered level (stride 8, 16, 32), then row, column and anchor size, which is the
    order of ``facecore.processing.prior_boxes``.
    """

    def __init__(self, backbone: str = "mobilenet0.25") -> None:
        super().__init__()
        if backbone not in CONFIGS:
            raise ValueError(f"unknown RetinaFace backbone {backbone!r}; choose from {sorted(CONFIGS)}")
        config = CONFIGS[backbone]
        self.body: nn.Module = MobileNetV1Body() if backbone == "mobilenet0.25" else ResNet50Body()
        stage = config.in_channel
        out = config.out_channel
        self.fpn = FPN([stage * 2, stage * 4, stage * 8], out)
        self.ssh1 = SSH(out, out)
        self.ssh2 = SSH(out, out)
        self.ssh3 = SSH(out, out)
        self.ClassHead = nn.ModuleList(Head(out, 2) for _ in range(3))
        self.BboxHead = nn.ModuleList(Head(out, 4) for _ in range(3))
        self.LandmarkHead = nn.ModuleList(Head(out, 10) for _ in range(3))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        pyramid = self.fpn(self.body(x))
        features = [self.ssh1(pyramid[0]), self.ssh2(pyramid[1]), self.ssh3(pyramid[2])]
        loc = torch.cat([head(f) for head, f in zip(self.BboxHead, features, strict=True)], dim=1)
        conf = torch.cat([head(f) for head, f in zip(self.ClassHead, features, strict=True)], dim=1)
        landmarks = torch.cat([head(f) for head, f in zip(self.LandmarkHead, features, strict=True)], dim=1)
        return loc, F.softmax(conf, dim=-1), landmarks
