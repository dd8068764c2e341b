"""Issue 4's time-to-accuracy recipe in PyTorch, well tuned (data in memory, augmentation on
whole batches): the seed-004 model, SGD (momentum 0.9, Nesterov, lr 0.1, weight decay 5e-4,
one-cycle with `pct_start` 0.3), batch 256 (the last partial batch kept, as `tandem train`),
pad-4 crop + flip, 15 epochs; prints each epoch's seconds and test accuracy.

CPU (as before): python time_to_accuracy.py DATA default|channels_last [--threads 2]
GPU:             python time_to_accuracy.py DATA --device cuda --channels-last [--seeds 0,1,2,3,4]

DATA is `cifar-10-batches-bin.tar.gz`, a `cifar-10-batches-bin` folder or a folder holding
one; every `data_batch_N.bin` present is the training set (an empty one adds nothing) and
`test_batch.bin` the test set. The augmentation is the tutorial's (and `tandem train`'s)
order: pixels to [0, 1], zero padding, crop, flip, then normalization. On a GPU the data go to
the GPU once as bytes and the augmentation runs there as tensor ops; a warm-up epoch on a
throwaway model comes first (`--warmup-epochs`), then each seed is timed from building its
model to its last test accuracy."""
import argparse
import pathlib
import sys
import tarfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from models import ResNetBase, memory_format

RECORD = 3073
BATCH = 256
TEST_BATCH = 1000

parser = argparse.ArgumentParser()
parser.add_argument("data", help="cifar-10-batches-bin.tar.gz or a folder with the binary batches")
parser.add_argument("layout", nargs="?", choices=["default", "channels_last"], default="default")
parser.add_argument("--channels-last", action="store_true", help="same as the layout channels_last")
parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
parser.add_argument("--epochs", type=int, default=15)
parser.add_argument("--threads", type=int, default=2, help="CPU threads")
parser.add_argument("--seeds", default="0", help="comma-separated seeds, each a full run")
parser.add_argument("--warmup-epochs", type=int, help="untimed epochs first (default: 1 on a GPU, 0 on the CPU)")
parser.add_argument("--pct-start", type=float, default=0.3, help="OneCycleLR's pct_start")
parser.add_argument("--train-images", type=int, help="train on the first N images only (quick checks)")
args = parser.parse_args()
try:
    seeds = [int(seed) for seed in args.seeds.split(",")]
except ValueError:
    parser.error(f"--seeds {args.seeds!r}: expected comma-separated integers")
if args.epochs < 1:
    parser.error("--epochs must be at least 1")
if args.device == "cuda" and not torch.cuda.is_available():
    sys.exit(
        f"time_to_accuracy.py: --device cuda, but PyTorch {torch.__version__} sees no CUDA GPU "
        f"(built for CUDA {torch.version.cuda})"
    )
on_gpu = args.device == "cuda"
device = torch.device(args.device)
torch.set_num_threads(args.threads)
if on_gpu:
    torch.backends.cudnn.benchmark = True
layout = memory_format("channels_last" if args.channels_last else args.layout)
warmup_epochs = args.warmup_epochs if args.warmup_epochs is not None else (1 if on_gpu else 0)


def batch_files(data):
    """(name, bytes) of every binary batch file in DATA, archive or folder."""
    path = pathlib.Path(data)
    if path.is_file():
        with tarfile.open(path) as tar:
            for member in tar.getmembers():
                if member.isfile() and member.name.endswith(".bin"):
                    yield pathlib.PurePath(member.name).name, tar.extractfile(member).read()
        return
    folder = path / "cifar-10-batches-bin" if (path / "cifar-10-batches-bin").is_dir() else path
    found = False
    for file in sorted(folder.glob("*.bin")):
        found = True
        yield file.name, file.read_bytes()
    if not found:
        sys.exit(f"time_to_accuracy.py: no CIFAR-10 .bin batches in {folder}")


def load(data):
    """(train images, train labels, test images, test labels), images uint8 [N, 3, 32, 32]."""
    splits = {"train": ([], []), "test": ([], [])}
    for name, raw in batch_files(data):
        split = "train" if name.startswith("data_batch_") else "test" if name == "test_batch.bin" else None
        if split is None or not raw:
            continue
        if len(raw) % RECORD:
            sys.exit(f"time_to_accuracy.py: {name}: {len(raw)} bytes is not a multiple of {RECORD}")
        records = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(-1, RECORD)
        splits[split][1].append(records[:, 0].long())
        splits[split][0].append(records[:, 1:].reshape(-1, 3, 32, 32))
    for split, (images, _) in splits.items():
        if not images or sum(len(part) for part in images) == 0:
            sys.exit(f"time_to_accuracy.py: no {split} images in {data}")
    return [torch.cat(part).to(device) for split in splits.values() for part in split]


load_start = time.perf_counter()
train_images, train_labels, test_images, test_labels = load(args.data)
if args.train_images is not None:
    if args.train_images < 1:
        parser.error("--train-images must be at least 1")
    train_images, train_labels = train_images[: args.train_images], train_labels[: args.train_images]
print(
    f"data: {len(train_images)} train, {len(test_images)} test images on {args.device} "
    f"({time.perf_counter() - load_start:.1f} s)",
    flush=True,
)
mean = torch.tensor([0.485, 0.456, 0.406], device=device).view(1, 3, 1, 1)
std = torch.tensor([0.229, 0.224, 0.225], device=device).view(1, 3, 1, 1)
offsets = torch.arange(32, device=device)


def normalize(images):
    return ((images - mean) / std).contiguous(memory_format=layout)


def augment(images):
    """Pad-4 random crop and horizontal flip of uint8 images, then normalization."""
    count = images.shape[0]
    padded = F.pad(images.float() / 255, (4, 4, 4, 4))
    rows = (torch.randint(0, 9, (count,), device=device)[:, None] + offsets)[:, None, :, None]
    padded = padded.gather(2, rows.expand(count, 3, 32, 40))
    columns = (torch.randint(0, 9, (count,), device=device)[:, None] + offsets)[:, None, None, :]
    cropped = padded.gather(3, columns.expand(count, 3, 32, 32))
    flip = (torch.rand(count, device=device) < 0.5)[:, None, None, None]
    return normalize(torch.where(flip, cropped.flip(3), cropped))


def test_accuracy(model):
    model.eval()
    correct = torch.zeros((), dtype=torch.long, device=device)
    with torch.no_grad():
        for first in range(0, len(test_images), TEST_BATCH):
            logits = model(normalize(test_images[first : first + TEST_BATCH].float() / 255))
            correct += (logits.argmax(1) == test_labels[first : first + TEST_BATCH]).sum()
    return correct.item() / len(test_images)


def run(seed, epochs, label, total_epochs=None):
    """One training run from a fresh model; returns (seconds, final test accuracy)."""
    torch.manual_seed(seed)
    start = time.perf_counter()
    model = nn.Sequential(ResNetBase(), nn.Linear(64, 10)).to(device=device, memory_format=layout)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    steps = (len(train_images) + BATCH - 1) // BATCH
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, 0.1, total_steps=(total_epochs or epochs) * steps, pct_start=args.pct_start
    )
    seconds = []
    for epoch in range(epochs):
        epoch_start = time.perf_counter()
        model.train()
        order = torch.randperm(len(train_images), device=device)
        for step in range(steps):
            indices = order[step * BATCH : (step + 1) * BATCH]
            loss = F.cross_entropy(model(augment(train_images[indices])), train_labels[indices])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
        accuracy = test_accuracy(model)  # .item() waits for the GPU
        seconds.append(time.perf_counter() - epoch_start)
        print(f"{label}epoch {epoch + 1}: {seconds[-1]:.1f} s, test accuracy {accuracy:.4f}", flush=True)
    total = time.perf_counter() - start
    median = sorted(seconds)[len(seconds) // 2]
    print(f"{label}median epoch {median:.1f} s, {total / 60:.1f} min in all", flush=True)
    return total, accuracy


if warmup_epochs > 0:
    seconds, _ = run(seed=12345, epochs=warmup_epochs, label="warm-up ", total_epochs=args.epochs)
    print(f"warm-up: {seconds:.1f} s", flush=True)
results = []
for seed in seeds:
    seconds, accuracy = run(seed, args.epochs, label=f"seed {seed} " if len(seeds) > 1 else "")
    results.append((seconds, accuracy))
    print(f"seed {seed}: {seconds:.2f} s for {args.epochs} epochs, test accuracy {accuracy:.4f}", flush=True)
times = [seconds for seconds, _ in results]
accuracies = [accuracy for _, accuracy in results]
print(
    f"summary: {len(results)} seeds, time mean {sum(times) / len(times):.2f} s "
    f"(min {min(times):.2f}, max {max(times):.2f}), test accuracy mean {sum(accuracies) / len(accuracies):.4f} "
    f"(min {min(accuracies):.4f}, max {max(accuracies):.4f})"
)
