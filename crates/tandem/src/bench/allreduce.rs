//! `tandem bench allreduce`: all-reduce time and bandwidth between local processes.
//!
//! The command serves a store, re-runs this binary `--nproc` times as workers (same arguments,
//! plus the worker's rank in an environment variable), and waits for them. Each worker joins
//! the process group, checks one all-reduce against the exact answer, then times `--iters`
//! all-reduces of `--numel` f32 after a barrier each. The buffer is a shared buffer, as DDP's
//! gradient buckets are: in shared memory between local processes unless
//! `--no-shared-memory` sends the data through the ring. Rank 0 prints the median over
//! iterations of the slowest rank's time, and the bandwidths:
//!
//! ```text
//! median: 12.3 ms
//! algbw: 3.63 GB/s      (bytes of the buffer / time)
//! busbw: 3.63 GB/s      (algbw * 2(n-1)/n: what each link carries)
//! ```

use std::net::SocketAddr;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use tandem_dist::{
    JobToken, ProcessGroup, ProcessGroupOptions, ReduceOp, StoreServer, DEFAULT_SEGMENT_BYTES,
    JOB_TOKEN_ENV,
};

/// Set in worker processes: "rank,store_port".
const WORKER_ENV: &str = "TANDEM_BENCH_ALLREDUCE_WORKER";
/// The gradient of ResNet-18 on CIFAR-10, in f32 elements.
const RESNET18_NUMEL: usize = 11_173_962;
/// Bound on joining the group and on each all-reduce.
const TIMEOUT: Duration = Duration::from_secs(120);

/// Settings of `tandem bench allreduce`.
#[derive(Args)]
pub struct AllreduceArgs {
    /// Number of local worker processes.
    #[arg(long, default_value_t = 2)]
    nproc: usize,
    /// f32 elements per all-reduce (default: ResNet-18's gradient).
    #[arg(long, default_value_t = RESNET18_NUMEL)]
    numel: usize,
    /// Timed all-reduces.
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Untimed all-reduces before timing.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Bytes per ring message.
    #[arg(long, default_value_t = DEFAULT_SEGMENT_BYTES)]
    segment_bytes: usize,
    /// Link the workers over loopback TCP instead of Unix sockets.
    #[arg(long)]
    tcp: bool,
    /// All-reduce through the ring even when the workers could share memory.
    #[arg(long)]
    no_shared_memory: bool,
    /// Time the exact sum of `--global-batch-size` (a max all-reduce of the blocks' largest
    /// values, then an i64 all-reduce through the ring) instead of the f32 all-reduce.
    #[arg(long)]
    exact: bool,
}

/// Runs the benchmark: as the parent, or as a worker when started by the parent.
pub fn run(args: AllreduceArgs) -> anyhow::Result<()> {
    if args.nproc == 0 || args.iters == 0 {
        bail!("--nproc and --iters must be at least 1");
    }
    match std::env::var(WORKER_ENV) {
        Ok(spec) => run_worker(&args, &spec),
        Err(_) => run_parent(&args),
    }
}

/// Serves the store, starts the workers and waits for all of them.
fn run_parent(args: &AllreduceArgs) -> anyhow::Result<()> {
    let token = JobToken::generate()?;
    let server = StoreServer::bind(SocketAddr::from(([127, 0, 0, 1], 0)), token.clone())?;
    let port = server.local_addr().port();
    let executable = std::env::current_exe().context("find the tandem executable")?;
    let mut workers = Vec::with_capacity(args.nproc);
    for rank in 0..args.nproc {
        let worker = Command::new(&executable)
            .args(std::env::args_os().skip(1))
            .env(WORKER_ENV, format!("{rank},{port}"))
            .env(JOB_TOKEN_ENV, token.expose_secret())
            .spawn()
            .with_context(|| format!("start worker {rank}"))?;
        workers.push(Worker(worker));
    }
    let limit = TIMEOUT * (2 + args.warmup + args.iters) as u32;
    let deadline = Instant::now() + limit;
    for (rank, worker) in workers.iter_mut().enumerate() {
        loop {
            if let Some(status) = worker
                .0
                .try_wait()
                .with_context(|| format!("wait for worker {rank}"))?
            {
                if !status.success() {
                    bail!("worker {rank} failed ({status})");
                }
                break;
            }
            if Instant::now() > deadline {
                bail!("worker {rank} did not finish within {limit:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    Ok(())
}

/// A worker process, killed if the parent gives up on it.
struct Worker(Child);

impl Drop for Worker {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// One rank: join, check, time, report.
fn run_worker(args: &AllreduceArgs, spec: &str) -> anyhow::Result<()> {
    let (rank, port) = spec
        .split_once(',')
        .with_context(|| format!("{WORKER_ENV}={spec:?} is not \"rank,port\""))?;
    let rank: usize = rank
        .parse()
        .with_context(|| format!("rank in {WORKER_ENV}={spec:?}"))?;
    let port: u16 = port
        .parse()
        .with_context(|| format!("port in {WORKER_ENV}={spec:?}"))?;
    let token = JobToken::from_env()?.with_context(|| format!("{JOB_TOKEN_ENV} is not set"))?;
    let mut options = ProcessGroupOptions::new(rank, args.nproc, "127.0.0.1", port, token);
    options.host_store = false;
    options.timeout = TIMEOUT;
    options.advertise_host = Some("127.0.0.1".into());
    options.segment_bytes = args.segment_bytes;
    options.unix_sockets = !args.tcp;
    options.shared_memory = !args.no_shared_memory;
    let mut group = ProcessGroup::connect(options)?;
    if args.exact {
        return time_exact_sum(args, &mut group, rank);
    }

    let template = rank_values(args.numel, rank);
    // The buffer DDP would use for its gradient buckets.
    let mut buffer = group.shared_buffer::<f32>(args.numel)?;
    buffer.copy_from_slice(&template);
    group.all_reduce_shared(&mut buffer, ReduceOp::Sum)?;
    check_sum(&buffer, args.nproc)?;

    for _ in 0..args.warmup {
        group.all_reduce_shared(&mut buffer, ReduceOp::Sum)?;
    }
    let mut seconds = Vec::with_capacity(args.iters);
    for _ in 0..args.iters {
        buffer.copy_from_slice(&template);
        group.barrier()?;
        let started = Instant::now();
        group.all_reduce_shared(&mut buffer, ReduceOp::Sum)?;
        seconds.push(started.elapsed().as_secs_f64());
    }
    check_sum(&buffer, args.nproc)?;
    // An iteration lasts as long as its slowest rank.
    group.all_reduce_f64(&mut seconds, ReduceOp::Max)?;
    if rank == 0 {
        let transport = match buffer.is_shared() {
            true => "shared memory",
            false => group.ring_transport(),
        };
        report(args, transport, &mut seconds);
        if let Some(refusal) = group.shared_memory_refusal() {
            say!("shared memory refused: {refusal}");
        }
    }
    Ok(())
}

/// Times [`ProcessGroup::exact_sum`] of one term per rank, as `--global-batch-size` with one
/// shard per process sums its gradients.
fn time_exact_sum(
    args: &AllreduceArgs,
    group: &mut ProcessGroup,
    rank: usize,
) -> anyhow::Result<()> {
    let template = rank_values(args.numel, rank);
    let mut buffers = group.exact_sum_buffers(args.numel)?;
    let mut sum = vec![0.0f32; args.numel];
    group.exact_sum(&mut buffers, &[&template], args.nproc, &mut sum)?;
    check_sum(&sum, args.nproc)?;
    for _ in 0..args.warmup {
        group.exact_sum(&mut buffers, &[&template], args.nproc, &mut sum)?;
    }
    let mut seconds = Vec::with_capacity(args.iters);
    for _ in 0..args.iters {
        group.barrier()?;
        let started = Instant::now();
        group.exact_sum(&mut buffers, &[&template], args.nproc, &mut sum)?;
        seconds.push(started.elapsed().as_secs_f64());
    }
    check_sum(&sum, args.nproc)?;
    group.all_reduce_f64(&mut seconds, ReduceOp::Max)?;
    if rank == 0 {
        let transport = match group.shared_memory_refusal() {
            None if args.nproc > 1 && !args.no_shared_memory => "shared memory, exact sum",
            _ => "the ring, exact sum",
        };
        report(args, transport, &mut seconds);
    }
    Ok(())
}

/// Rank `rank`'s values: element i is (i mod 1024) * (rank + 1).
fn rank_values(numel: usize, rank: usize) -> Vec<f32> {
    (0..numel)
        .map(|i| ((i % 1024) as f32) * (rank + 1) as f32)
        .collect()
}

/// Every rank fills element i with (i mod 1024) * (rank + 1), so the sum is exact in f32.
fn check_sum(buffer: &[f32], nproc: usize) -> anyhow::Result<()> {
    let ranks_factor = (nproc * (nproc + 1) / 2) as f32;
    for (i, value) in buffer.iter().enumerate() {
        let expected = (i % 1024) as f32 * ranks_factor;
        if *value != expected {
            bail!("all-reduce gave {value} at element {i}, expected {expected}");
        }
    }
    Ok(())
}

fn report(args: &AllreduceArgs, transport: &str, seconds: &mut [f64]) {
    seconds.sort_by(f64::total_cmp);
    let median = median_of_sorted(seconds);
    let bytes = (args.numel * std::mem::size_of::<f32>()) as f64;
    let algbw = bytes / median / 1e9;
    let busbw = algbw * 2.0 * (args.nproc - 1) as f64 / args.nproc as f64;
    say!(
        "allreduce: {} processes over {transport}, {} f32 ({:.1} MB), {} iterations, {} B segments",
        args.nproc,
        args.numel,
        bytes / 1e6,
        args.iters,
        args.segment_bytes
    );
    say!(
        "min: {:.2} ms",
        seconds.first().copied().unwrap_or_default() * 1e3
    );
    say!("median: {:.2} ms", median * 1e3);
    say!("algbw: {algbw:.2} GB/s");
    say!("busbw: {busbw:.2} GB/s");
}

/// The middle value of sorted numbers (the mean of the two middle ones for an even count).
fn median_of_sorted(sorted: &[f64]) -> f64 {
    let middle = sorted.len() / 2;
    match (sorted.len() % 2, sorted.get(middle)) {
        (_, None) => 0.0,
        (1, Some(value)) => *value,
        (_, Some(value)) => (sorted.get(middle - 1).copied().unwrap_or(*value) + value) / 2.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_even_and_empty() {
        assert_eq!(median_of_sorted(&[1.0, 2.0, 10.0]), 2.0);
        assert_eq!(median_of_sorted(&[1.0, 2.0, 4.0, 10.0]), 3.0);
        assert_eq!(median_of_sorted(&[]), 0.0);
    }

    #[test]
    fn check_sum_accepts_the_exact_sum_and_names_the_first_wrong_element() {
        let nproc = 3;
        let mut buffer: Vec<f32> = (0..2048).map(|i| (i % 1024) as f32 * 6.0).collect();
        assert!(check_sum(&buffer, nproc).is_ok());
        buffer[1030] += 1.0;
        let error = check_sum(&buffer, nproc).expect_err("wrong element");
        assert_eq!(
            error.to_string(),
            "all-reduce gave 37 at element 1030, expected 36"
        );
    }
}
