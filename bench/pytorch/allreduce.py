"""gloo all-reduce between 2 local processes, as `tandem bench allreduce` measures it:
python allreduce.py [--numel 11173962] [--iters 20] [--port 29517]"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, world, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    values = torch.ones(args.numel)
    for _ in range(3):
        dist.all_reduce(values)
    times = []
    for _ in range(args.iters):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(values)
        times.append(time.perf_counter() - start)
    median = sorted(times)[len(times) // 2]
    if rank == 0:
        print(f"median: {median * 1e3:.2f} ms")
        print(f"algbw: {args.numel * 4 / median / 1e9:.2f} GB/s")
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--numel", type=int, default=11173962)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--port", type=int, default=29517)
    mp.spawn(worker, args=(2, parser.parse_args()), nprocs=2)
