"""Issue 4's time-to-accuracy recipe in PyTorch, well tuned (data in memory, augmentation on
whole batches): the seed-004 model, SGD (momentum 0.9, Nesterov, lr 0.1, weight decay 5e-4,
one-cycle), batch 256, pad-4 crop + flip, 2 threads; prints each epoch's seconds and test
accuracy. python time_to_accuracy.py PATH/cifar-10-batches-bin.tar.gz default|channels_last"""
import argparse
import tarfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from models import ResNetBase, memory_format

parser = argparse.ArgumentParser()
parser.add_argument("archive")
parser.add_argument("layout", choices=["default", "channels_last"])
parser.add_argument("--epochs", type=int, default=15)
parser.add_argument("--threads", type=int, default=2)
args = parser.parse_args()
torch.set_num_threads(args.threads)
torch.manual_seed(0)


def load(archive, names):
    images, labels = [], []
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            if any(member.name.endswith(name) for name in names):
                raw = bytearray(tar.extractfile(member).read())
                records = torch.frombuffer(raw, dtype=torch.uint8).view(-1, 3073)
                labels.append(records[:, 0].long())
                images.append(records[:, 1:].view(-1, 3, 32, 32))
    return torch.cat(images), torch.cat(labels)


train_images, train_labels = load(args.archive, [f"data_batch_{i}.bin" for i in range(1, 6)])
test_images, test_labels = load(args.archive, ["test_batch.bin"])
mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
layout = memory_format(args.layout)


def normalize(images):
    return ((images.float() / 255 - mean) / std).contiguous(memory_format=layout)


def augment(images):
    count = images.shape[0]
    padded = F.pad(images, (4, 4, 4, 4))
    offsets = torch.arange(32)
    rows = (torch.randint(0, 9, (count,))[:, None] + offsets)[:, None, :, None]
    padded = padded.gather(2, rows.expand(count, 3, 32, 40))
    columns = (torch.randint(0, 9, (count,))[:, None] + offsets)[:, None, None, :]
    cropped = padded.gather(3, columns.expand(count, 3, 32, 32))
    flip = (torch.rand(count) < 0.5)[:, None, None, None]
    return torch.where(flip, cropped.flip(3), cropped).contiguous(memory_format=layout)


model = nn.Sequential(ResNetBase(), nn.Linear(64, 10)).to(memory_format=layout)
optimizer = torch.optim.SGD(
    model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4
)
batch = 256
steps = (len(train_images) + batch - 1) // batch
schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.1, total_steps=args.epochs * steps)
seconds = []
for epoch in range(args.epochs):
    start = time.perf_counter()
    model.train()
    order = torch.randperm(len(train_images))
    for step in range(steps):
        indices = order[step * batch : (step + 1) * batch]
        loss = F.cross_entropy(model(augment(normalize(train_images[indices]))), train_labels[indices])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    model.eval()
    correct = 0
    with torch.no_grad():
        for first in range(0, len(test_images), 1000):
            logits = model(normalize(test_images[first : first + 1000]))
            correct += (logits.argmax(1) == test_labels[first : first + 1000]).sum().item()
    seconds.append(time.perf_counter() - start)
    print(f"epoch {epoch + 1}: {seconds[-1]:.1f} s, test accuracy {correct / len(test_images):.4f}", flush=True)
print(f"median epoch {sorted(seconds)[len(seconds) // 2]:.1f} s, {sum(seconds) / 60:.1f} min in all")
