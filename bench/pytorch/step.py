"""Training-step and eval images/s of PyTorch, as `tandem bench step` measures them:
python step.py resnet18|resnet-base default|channels_last [--threads 2] [--steps 5]"""
import argparse
import time

import torch

from models import training_setup

parser = argparse.ArgumentParser()
parser.add_argument("model", choices=["resnet18", "resnet-base"])
parser.add_argument("layout", choices=["default", "channels_last"])
parser.add_argument("--threads", type=int, default=2)
parser.add_argument("--steps", type=int, default=5)
args = parser.parse_args()
torch.set_num_threads(args.threads)
model, batch, train_step, images = training_setup(args.model, args.layout)


def rate(step):
    step()  # warm-up, as Tandem's bench
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    return batch * args.steps / (time.perf_counter() - start)


model.train()
train = rate(train_step)
model.eval()
with torch.no_grad():
    evaluation = rate(lambda: model(images))
print(f"train: {train:.1f} img/s")
print(f"eval: {evaluation:.1f} img/s")
