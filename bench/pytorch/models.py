"""The two tutorial models and the benchmark setup, as in ../../../shared/seeds/ (seed 000's ResNet-18, seed 004's
ResNetBase with its Config defaults + linear head), for the reference benchmarks."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, in_channels, out_channels, stride=1):
        super().__init__()
        self.residual_function = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(inplace=True),
            nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
        )
        self.shortcut = nn.Sequential()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x):
        return torch.relu(self.residual_function(x) + self.shortcut(x))


class ResNet18(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.conv1 = nn.Sequential(
            nn.Conv2d(3, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True)
        )
        layers, channels = [], 64
        for out_channels, stride in [(64, 1), (128, 2), (256, 2), (512, 2)]:
            layers += [Block(channels, out_channels, stride), Block(out_channels, out_channels)]
            channels = out_channels
        self.layers = nn.Sequential(*layers)
        self.avg_pool = nn.AdaptiveAvgPool2d(1)
        self.dense_layer = nn.Linear(512, num_classes)

    def forward(self, x):
        return self.dense_layer(self.avg_pool(self.layers(self.conv1(x))).flatten(1))


class ShortcutProjection(nn.Module):
    def __init__(self, in_channels, out_channels, stride):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 1, stride)
        self.bn = nn.BatchNorm2d(out_channels)

    def forward(self, x):
        return self.bn(self.conv(x))


class Bottleneck(nn.Module):
    def __init__(self, in_channels, bottleneck, out_channels, stride):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(in_channels, bottleneck, 1), nn.BatchNorm2d(bottleneck)
        self.conv2 = nn.Conv2d(bottleneck, bottleneck, 3, stride, 1)
        self.bn2 = nn.BatchNorm2d(bottleneck)
        self.conv3, self.bn3 = nn.Conv2d(bottleneck, out_channels, 1), nn.BatchNorm2d(out_channels)
        self.shortcut = (
            ShortcutProjection(in_channels, out_channels, stride)
            if stride != 1 or in_channels != out_channels
            else nn.Identity()
        )

    def forward(self, x):
        shortcut = self.shortcut(x)
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return torch.relu(self.bn3(self.conv3(x)) + shortcut)


class ResNetBase(nn.Module):
    def __init__(self, n_blocks=(6, 6, 6), n_channels=(16, 32, 64), bottlenecks=(8, 16, 16)):
        super().__init__()
        self.conv = nn.Conv2d(3, n_channels[0], 3, 2, 1)
        self.bn = nn.BatchNorm2d(n_channels[0])
        blocks, previous = [], n_channels[0]
        for count, channels, bottleneck in zip(n_blocks, n_channels, bottlenecks):
            stride = 2 if not blocks else 1  # only the very first block, as in the tutorial
            blocks.append(Bottleneck(previous, bottleneck, channels, stride))
            blocks += [Bottleneck(channels, bottleneck, channels, 1) for _ in range(count - 1)]
            previous = channels
        self.blocks = nn.Sequential(*blocks)

    def forward(self, x):
        x = self.blocks(self.bn(self.conv(x)))
        return x.view(x.shape[0], x.shape[1], -1).mean(dim=-1)


def build(name):
    """The model, per-rank batch and optimizer of the issues' benchmark setup."""
    if name == "resnet18":
        model = ResNet18()
        return model, 128, lambda params: torch.optim.Adam(params, lr=0.01)
    model = nn.Sequential(ResNetBase(), nn.Linear(64, 10))
    return model, 256, lambda params: torch.optim.SGD(params, lr=1e-3)


def memory_format(layout):
    return torch.channels_last if layout == "channels_last" else torch.contiguous_format


def training_setup(name, layout, wrap=lambda model: model):
    """The issues' benchmark setup for `name` in `layout`: returns the model (after `wrap`,
    e.g. DDP), the batch size and a function that runs one training step on random data."""
    model, batch, make_optimizer = build(name)
    fmt = memory_format(layout)
    model = wrap(model.to(memory_format=fmt))
    optimizer = make_optimizer(model.parameters())
    images = torch.randn(batch, 3, 32, 32).to(memory_format=fmt)
    labels = torch.randint(0, 10, (batch,))

    def train_step():
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()

    return model, batch, train_step, images
