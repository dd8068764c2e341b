"""Training-step and eval images/s of PyTorch, as `tandem bench step` measures them.

CPU (as before): python step.py resnet18|resnet-base [default|channels_last] [--threads 2] [--steps 5]
GPU:             python step.py resnet18|resnet-base --device cuda [--batch N] [--channels-last]
                     [--cuda-graph | --compile [MODE]] [--amp bf16] [--mode train|eval|both]
                     [--deterministic] [--optimizer adam|sgd|sgd-momentum] [--steps 50] [--warmup 10]

Prints `train: X img/s` and `eval: X img/s` (the mean over the timed steps after the warm-up
steps), and on a GPU also `peak memory: N MB` (PyTorch's allocator). On a GPU,
`cudnn.benchmark = True` and PyTorch's default precision (TF32 convolutions); the timing uses
CUDA events around the timed steps. `--cuda-graph` captures the whole training step (forward,
backward and optimizer) with `torch.cuda.graph` after warm-up steps on a side stream, and the
eval forward likewise; `--compile` is `torch.compile(model, mode=MODE)` (default
`reduce-overhead`); `--amp bf16` is autocast to bfloat16 (float32 master weights)."""
import argparse
import contextlib
import sys
import time

import torch
import torch.nn.functional as F

from models import build, memory_format

CUDA_ONLY_FLAGS = ["cuda_graph", "compile", "amp", "deterministic"]

parser = argparse.ArgumentParser()
parser.add_argument("model", choices=["resnet18", "resnet-base"])
parser.add_argument("layout", nargs="?", choices=["default", "channels_last"], default="default")
parser.add_argument("--channels-last", action="store_true", help="same as the layout channels_last")
parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
parser.add_argument("--batch", type=int, help="default: 128 for resnet18, 256 for resnet-base")
parser.add_argument("--threads", type=int, default=2, help="CPU threads")
parser.add_argument("--steps", type=int, help="timed steps (default: 5 on the CPU, 50 on a GPU)")
parser.add_argument("--warmup", type=int, help="untimed steps first (default: 1 on the CPU, 10 on a GPU)")
parser.add_argument("--mode", choices=["train", "eval", "both"], default="both")
parser.add_argument(
    "--optimizer",
    choices=["adam", "sgd", "sgd-momentum"],
    help="default: adam (lr 0.01) for resnet18, sgd (lr 1e-3) for resnet-base, as tandem bench step",
)
parser.add_argument("--cuda-graph", action="store_true", help="capture the whole step as a CUDA graph")
parser.add_argument(
    "--compile",
    nargs="?",
    const="reduce-overhead",
    choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
)
parser.add_argument("--amp", choices=["bf16"], help="autocast to bfloat16")
parser.add_argument("--deterministic", action="store_true", help="torch.backends.cudnn.deterministic")
args = parser.parse_args()

if args.device != "cuda":
    for flag in CUDA_ONLY_FLAGS:
        if getattr(args, flag):
            parser.error(f"--{flag.replace('_', '-')} needs --device cuda")
if args.cuda_graph and args.compile:
    parser.error("--cuda-graph and --compile exclude each other (reduce-overhead already uses CUDA graphs)")
if args.device == "cuda" and not torch.cuda.is_available():
    sys.exit(
        f"step.py: --device cuda, but PyTorch {torch.__version__} sees no CUDA GPU "
        f"(built for CUDA {torch.version.cuda})"
    )
for name in ["batch", "steps", "warmup"]:
    value = getattr(args, name)
    if value is not None and value < (0 if name == "warmup" else 1):
        parser.error(f"--{name} must be at least {0 if name == 'warmup' else 1}")

on_gpu = args.device == "cuda"
layout = "channels_last" if args.channels_last else args.layout
steps = args.steps or (50 if on_gpu else 5)
warmup = args.warmup if args.warmup is not None else (10 if on_gpu else 1)
if args.cuda_graph:
    warmup = max(warmup, 3)  # the side-stream warm-up before capture
torch.set_num_threads(args.threads)
if on_gpu:
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.deterministic = args.deterministic

device = torch.device(args.device)
fmt = memory_format(layout)
model, default_batch, _ = build(args.model)
batch = args.batch or default_batch
model = model.to(device=device, memory_format=fmt)
optimizer_kind = args.optimizer or ("adam" if args.model == "resnet18" else "sgd")
if optimizer_kind == "adam":
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, capturable=args.cuda_graph)
elif optimizer_kind == "sgd":
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
else:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
runnable = torch.compile(model, mode=args.compile) if args.compile else model
images = torch.randn(batch, 3, 32, 32, device=device).contiguous(memory_format=fmt)
labels = torch.randint(0, 10, (batch,), device=device)


def autocast():
    if not args.amp:
        return contextlib.nullcontext()
    # A graph must not keep autocast's cast cache across replays.
    return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=not args.cuda_graph)


def forward_backward_step():
    with autocast():
        loss = F.cross_entropy(runnable(images), labels)
    loss.backward()
    optimizer.step()


def train_step():
    optimizer.zero_grad(set_to_none=True)
    forward_backward_step()


def eval_step():
    with torch.no_grad(), autocast():
        runnable(images)


def captured(step, body):
    """Runs `step` `warmup` times on a side stream, then captures `body` as a CUDA graph
    (PyTorch's whole-network capture recipe); returns the replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)  # backward allocates the gradients in the graph's pool
    with torch.cuda.graph(graph):
        body()
    return graph.replay


def rate(step):
    """Images per second of `step`, the mean over `steps` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        step()
    if not on_gpu:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        return batch * steps / (time.perf_counter() - start)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    end.synchronize()
    return batch * steps / (start.elapsed_time(end) / 1000)


if on_gpu:
    setup = [args.model, f"batch {batch}", layout, optimizer_kind, args.amp or "default precision"]
    setup += ["cuda graph"] if args.cuda_graph else []
    setup += [f"compile {args.compile}"] if args.compile else []
    setup += ["cudnn deterministic"] if args.deterministic else []
    print(f"setup: {', '.join(setup)}; torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
if args.mode in ("train", "both"):
    model.train()
    if args.cuda_graph:
        train = rate(captured(train_step, forward_backward_step))
    else:
        train = rate(train_step)
    # Each figure as soon as it is measured: a variant stopped by a time limit keeps it.
    print(f"train: {train:.1f} img/s", flush=True)
if args.mode in ("eval", "both"):
    model.eval()
    evaluation = rate(captured(eval_step, eval_step) if args.cuda_graph else eval_step)
    print(f"eval: {evaluation:.1f} img/s", flush=True)
if on_gpu:
    # Device memory in use, as Tandem's `peak memory:` measures it (total - free: the CUDA
    # context, the libraries' handles and workspaces included), in MiB; the allocator's own
    # peak of tensors alone beside it.
    free, total = torch.cuda.mem_get_info()
    print(
        f"peak memory: {(total - free) / 2**20:.0f} MB"
        f" (tensors at most {torch.cuda.max_memory_allocated() / 2**20:.0f} MB)",
        flush=True,
    )
if args.compile:
    # reduce-overhead may give up CUDA graphs (a mutated input, say) without a word.
    from torch._dynamo.utils import counters

    print(f"note: torch.compile CUDA-graph skips: {counters['inductor']['cudagraph_skips']}", flush=True)
