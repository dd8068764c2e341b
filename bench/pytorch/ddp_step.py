"""Aggregate training images/s of PyTorch DDP over gloo, 2 local processes x 1 thread, as
`tandem launch --standalone --nproc-per-node 2 -- bench step` measures it:
python ddp_step.py resnet18|resnet-base default|channels_last [--steps 4] [--port 29519]"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from models import training_setup


def worker(rank, world, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    _, batch, step, _ = training_setup(
        args.model, args.layout, torch.nn.parallel.DistributedDataParallel
    )
    step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    dist.barrier()
    seconds = time.perf_counter() - start
    if rank == 0:
        print(f"train: {world * batch * args.steps / seconds:.1f} img/s (aggregate)")
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("model", choices=["resnet18", "resnet-base"])
    parser.add_argument("layout", choices=["default", "channels_last"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--port", type=int, default=29519)
    mp.spawn(worker, args=(2, parser.parse_args()), nprocs=2)
