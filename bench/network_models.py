"""The networks of bench.network in torch: torchvision's resnet50 and mobilenet_v2 where torchvision imports,
else definitions of the same shapes here (torchvision's layer order and names, so from_torch sees the same
graph). ``shrink`` divides the channel widths (smoke runs and tests); ``blocks`` limits the blocks per stage."""

from __future__ import annotations

MODELS = ("resnet50", "mobilenet_v2")


def _nn():
    import torch.nn as nn
    return nn


def _bottleneck(inp: int, planes: int, stride: int, expansion: int = 4):
    nn = _nn()
    import torch  # noqa: F401

    class Bottleneck(nn.Module):
        def __init__(self):
            super().__init__()
            out = planes * expansion
            self.conv1, self.bn1 = nn.Conv2d(inp, planes, 1, bias=False), nn.BatchNorm2d(planes)
            self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(planes)
            self.conv3, self.bn3 = nn.Conv2d(planes, out, 1, bias=False), nn.BatchNorm2d(out)
            self.relu = nn.ReLU(inplace=True)
            self.downsample = None
            if stride != 1 or inp != out:
                self.downsample = nn.Sequential(nn.Conv2d(inp, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))

        def forward(self, x):
            identity = x if self.downsample is None else self.downsample(x)
            y = self.relu(self.bn1(self.conv1(x)))
            y = self.relu(self.bn2(self.conv2(y)))
            y = self.bn3(self.conv3(y))
            return self.relu(y + identity)
    return Bottleneck()


def resnet50(num_classes: int = 1000, shrink: int = 1, blocks=(3, 4, 6, 3)):
    """ResNet-50's shapes (torchvision's resnet50 layout): 7x7 stem, max pool, 4 stages of bottlenecks, avg pool, fc."""
    nn = _nn()
    import torch
    w = max(1, 64 // shrink)

    class ResNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, w, 7, stride=2, padding=3, bias=False)
            self.bn1, self.relu = nn.BatchNorm2d(w), nn.ReLU(inplace=True)
            self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
            inp, stages = w, []
            for i, n in enumerate(blocks):
                planes = w * 2 ** i
                layer = [_bottleneck(inp, planes, 1 if i == 0 else 2)]
                inp = planes * 4
                layer += [_bottleneck(inp, planes, 1) for _ in range(n - 1)]
                stages.append(nn.Sequential(*layer))
            self.layer1, self.layer2, self.layer3, self.layer4 = stages
            self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
            self.fc = nn.Linear(inp, num_classes)

        def forward(self, x):
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            return self.fc(torch.flatten(self.avgpool(x), 1))
    return ResNet()


def _conv_bn(inp: int, out: int, k: int, stride: int, groups: int = 1, act: bool = True):
    nn = _nn()
    layers = [nn.Conv2d(inp, out, k, stride, (k - 1) // 2, groups=groups, bias=False), nn.BatchNorm2d(out)]
    return nn.Sequential(*layers, *([nn.ReLU6(inplace=True)] if act else []))


def mobilenet_v2(num_classes: int = 1000, shrink: int = 1, blocks: int | None = None):
    """MobileNet-v2's shapes (torchvision's layout): inverted residuals with depthwise 3x3 convs and relu6."""
    nn = _nn()
    import torch
    F = torch.nn.functional
    c = lambda v: max(1, v // shrink)  # noqa: E731
    settings = [[1, 16, 1, 1], [6, 24, 2, 2], [6, 32, 3, 2], [6, 64, 4, 2], [6, 96, 3, 1], [6, 160, 3, 2],
                [6, 320, 1, 1]]

    class InvertedResidual(nn.Module):
        def __init__(self, inp, oup, stride, t):
            super().__init__()
            hid = inp * t
            self.use_res_connect = stride == 1 and inp == oup
            layers = [_conv_bn(inp, hid, 1, 1)] if t != 1 else []
            layers += [_conv_bn(hid, hid, 3, stride, groups=hid), _conv_bn(hid, oup, 1, 1, act=False)]
            self.conv = nn.Sequential(*layers)

        def forward(self, x):
            return x + self.conv(x) if self.use_res_connect else self.conv(x)

    class MobileNetV2(nn.Module):
        def __init__(self):
            super().__init__()
            inp, feats = c(32), [_conv_bn(3, c(32), 3, 2)]
            for t, ch, n, s in settings:
                for i in range(n if blocks is None else min(n, blocks)):
                    feats.append(InvertedResidual(inp, c(ch), s if i == 0 else 1, t))
                    inp = c(ch)
            feats.append(_conv_bn(inp, c(1280), 1, 1))
            self.features = nn.Sequential(*feats)
            self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(c(1280), num_classes))

        def forward(self, x):
            x = F.adaptive_avg_pool2d(self.features(x), (1, 1))
            return self.classifier(torch.flatten(x, 1))
    return MobileNetV2()


def build(name: str, shrink: int = 1, seed: int = 0, prefer_torchvision: bool = True):
    """(module in eval mode with random weights and batch-norm statistics, where it came from)."""
    import torch
    torch.manual_seed(seed)
    source = "bench.network_models"
    model = None
    if prefer_torchvision and shrink == 1:
        try:
            import torchvision
            model, source = getattr(torchvision.models, name)(weights=None), f"torchvision {torchvision.__version__}"
        except ImportError:
            pass
    if model is None:
        model = {"resnet50": resnet50, "mobilenet_v2": mobilenet_v2}[name](shrink=shrink)
    with torch.no_grad():
        for m in model.modules():  # statistics away from the identity, so that folding them is tested
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.0)
                m.bias.uniform_(-0.1, 0.1)
    return model.eval(), source
