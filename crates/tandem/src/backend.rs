//! `--backend auto|nccl|ring` of `train` and `bench step` in jobs of several processes: what
//! carries the gradients between the ranks, announced with the reason after the `device:`
//! line.
//!
//! - `ring`: Tandem's process group (shared memory on one host, sockets across hosts); for CPU
//!   ranks, and for GPU ranks that share a GPU (NCCL refuses two ranks on one GPU).
//! - `nccl`: NCCL, for GPU ranks that each have their own GPU.
//! - `auto`: `nccl` when every rank has its own GPU and every rank found libnccl, else `ring`.
//!
//! Every rank publishes where it computes ([`RankDevice`]) through the job's store and decides
//! with [`decide`] on the same table, so every rank reaches the same choice. With `nccl` the
//! trainer joins an NCCL communicator on each rank's GPU (`tandem_cuda::NcclGroup`) and
//! averages the gradients there; **that path has not run on a GPU** (see the tandem-cuda
//! README).

use std::collections::BTreeMap;
use std::fmt;

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use tandem_cuda::device::VisibleDevices;
use tandem_cuda::{Device, Library, Probe};

use crate::device::Announce;
use crate::exit::SettingsError;
use crate::train::ddp::Ddp;

/// The store name under which each rank publishes its [`RankDevice`].
const RECORD_NAME: &str = "backend/device";

/// What `--backend` asked for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendRequest {
    /// nccl when every rank has its own GPU and NCCL loads, else ring.
    #[default]
    Auto,
    /// NCCL between GPU ranks, each on its own GPU.
    Nccl,
    /// Tandem's process group: shared memory on one host, sockets across hosts.
    Ring,
}

impl fmt::Display for BackendRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BackendRequest::Auto => "auto",
            BackendRequest::Nccl => "nccl",
            BackendRequest::Ring => "ring",
        })
    }
}

/// What carries the gradients.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// NCCL.
    Nccl,
    /// Tandem's process group.
    Ring,
}

/// The backend and why, as the `backend:` line shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackendChoice {
    /// The backend.
    pub backend: Backend,
    /// Why, in words.
    pub reason: String,
}

impl fmt::Display for BackendChoice {
    /// `ring (reason)` or `nccl (reason)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self.backend {
            Backend::Nccl => "nccl",
            Backend::Ring => "ring",
        };
        write!(f, "{name} ({})", self.reason)
    }
}

/// Where one rank computes, as it tells the others.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankDevice {
    /// The host's name, for messages.
    pub host: String,
    /// What tells hosts apart: the host name and its boot id (as NCCL tells them apart).
    pub host_id: String,
    /// The GPU, or `None` on the CPU.
    pub gpu: Option<RankGpu>,
    /// Whether this rank found libnccl.
    pub nccl: NcclStatus,
}

/// A rank's GPU.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankGpu {
    /// The ordinal among the rank's visible GPUs (`cuda:N`).
    pub ordinal: usize,
    /// The GPU it is on the host: the `CUDA_VISIBLE_DEVICES` entry the ordinal maps to (a
    /// number or a UUID), else the ordinal. Two ranks of one host with the same value share
    /// a GPU even when their ordinals differ, and the reverse.
    pub physical: String,
}

/// Whether a rank found libnccl.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum NcclStatus {
    /// The probe found it.
    Found,
    /// The probe's message naming what was searched.
    Missing(String),
    /// A CPU rank does not look for it.
    NotProbed,
}

impl RankDevice {
    /// This process's record for `device`: the probe is asked about NCCL only on a GPU.
    pub fn local(device: &Device) -> RankDevice {
        let (gpu, nccl) = match device {
            Device::Cpu { .. } => (None, NcclStatus::NotProbed),
            Device::Cuda { ordinal, .. } => {
                let physical = physical_gpu(*ordinal, &VisibleDevices::from_env());
                let nccl = match Probe::process().get(Library::Nccl) {
                    Ok(_) => NcclStatus::Found,
                    Err(missing) => NcclStatus::Missing(missing.to_string()),
                };
                let gpu = RankGpu {
                    ordinal: *ordinal,
                    physical,
                };
                (Some(gpu), nccl)
            }
        };
        let host = crate::train::run_lock::host_name();
        let boot_id =
            std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
        RankDevice {
            host_id: format!("{host}/{}", boot_id.trim()),
            host,
            gpu,
            nccl,
        }
    }
}

/// The host's name of GPU `ordinal` under `CUDA_VISIBLE_DEVICES` as `visible` reads it.
pub fn physical_gpu(ordinal: usize, visible: &VisibleDevices) -> String {
    use tandem_cuda::device::VisibleDevice;
    match visible {
        VisibleDevices::Listed(devices) => match devices.get(ordinal) {
            Some(VisibleDevice::Index(index)) => index.to_string(),
            Some(VisibleDevice::Uuid(uuid)) => uuid.clone(),
            None => ordinal.to_string(),
        },
        VisibleDevices::All => ordinal.to_string(),
    }
}

/// Why NCCL cannot carry this job.
enum Obstacle {
    /// Every rank is on the CPU.
    CpuRanks,
    /// Anything else, in words.
    Other(String),
}

/// Decides the backend from every rank's record, in rank order. `ring` is always possible;
/// `nccl` needs every rank on a GPU of its own and libnccl on every rank: `auto` falls back
/// to `ring` saying why, an explicit `nccl` is an error saying why.
pub fn decide(request: BackendRequest, ranks: &[RankDevice]) -> anyhow::Result<BackendChoice> {
    let ring = |reason: String| BackendChoice {
        backend: Backend::Ring,
        reason,
    };
    if request == BackendRequest::Ring {
        return Ok(ring("requested".into()));
    }
    match (request, nccl_obstacle(ranks)) {
        (BackendRequest::Nccl, None) => Ok(BackendChoice {
            backend: Backend::Nccl,
            reason: "requested".into(),
        }),
        (_, None) => Ok(BackendChoice {
            backend: Backend::Nccl,
            reason: format!(
                "auto: each of the {} rank(s) has its own GPU and found libnccl",
                ranks.len()
            ),
        }),
        (BackendRequest::Nccl, Some(Obstacle::CpuRanks)) => bail!(
            "--backend nccl: every rank is on the CPU, and NCCL needs a GPU for each rank \
             (use --backend ring or auto)"
        ),
        (BackendRequest::Nccl, Some(Obstacle::Other(why))) => {
            bail!("--backend nccl: {why} (use --backend ring or auto)")
        }
        (_, Some(Obstacle::CpuRanks)) => Ok(ring("cpu ranks".into())),
        (_, Some(Obstacle::Other(why))) => Ok(ring(format!("auto: {why}"))),
    }
}

/// The first reason, if any, why NCCL cannot carry a job of these ranks.
fn nccl_obstacle(ranks: &[RankDevice]) -> Option<Obstacle> {
    let cpu_ranks: Vec<usize> = (0..ranks.len())
        .filter(|&rank| ranks[rank].gpu.is_none())
        .collect();
    if cpu_ranks.len() == ranks.len() {
        return Some(Obstacle::CpuRanks);
    }
    if !cpu_ranks.is_empty() {
        let verb = if cpu_ranks.len() == 1 { "is" } else { "are" };
        return Some(Obstacle::Other(format!(
            "{} {verb} on the CPU, and NCCL needs a GPU for each rank",
            list_ranks(&cpu_ranks)
        )));
    }
    if let Some(shared) = shared_gpu(ranks) {
        return Some(Obstacle::Other(shared));
    }
    let missing: Vec<(usize, &str)> = ranks
        .iter()
        .enumerate()
        .filter_map(|(rank, record)| match &record.nccl {
            NcclStatus::Found => None,
            NcclStatus::Missing(message) => Some((rank, message.as_str())),
            NcclStatus::NotProbed => Some((rank, "libnccl was not looked for")),
        })
        .collect();
    match missing.as_slice() {
        [] => None,
        [(_, message), ..] if missing.len() == ranks.len() => {
            Some(Obstacle::Other(message.to_string()))
        }
        [(rank, message), ..] => Some(Obstacle::Other(format!("on rank {rank}, {message}"))),
    }
}

/// "ranks 0 and 1 share GPU 0; NCCL refuses two ranks on one GPU", for the first GPU that
/// several ranks share.
fn shared_gpu(ranks: &[RankDevice]) -> Option<String> {
    let mut by_gpu: BTreeMap<(&str, &str), Vec<usize>> = BTreeMap::new();
    for (rank, record) in ranks.iter().enumerate() {
        if let Some(gpu) = &record.gpu {
            by_gpu
                .entry((record.host_id.as_str(), gpu.physical.as_str()))
                .or_default()
                .push(rank);
        }
    }
    let several_hosts = ranks
        .iter()
        .any(|record| record.host_id != ranks[0].host_id);
    let ((_, physical), sharing) = by_gpu
        .into_iter()
        .filter(|(_, sharing)| sharing.len() > 1)
        .min_by_key(|(_, sharing)| sharing[0])?;
    let on_host = match several_hosts {
        true => format!(" of host {}", ranks[sharing[0]].host),
        false => String::new(),
    };
    Some(format!(
        "{} share GPU {physical}{on_host}; NCCL refuses two ranks on one GPU",
        list_ranks(&sharing)
    ))
}

/// "rank 1", "ranks 0 and 1", "ranks 0, 2 and 4".
fn list_ranks(ranks: &[usize]) -> String {
    match ranks {
        [one] => format!("rank {one}"),
        [init @ .., last] => {
            let init: Vec<String> = init.iter().map(usize::to_string).collect();
            format!("ranks {} and {last}", init.join(", "))
        }
        [] => "no rank".into(),
    }
}

/// Chooses the backend of this job and prints `backend: ...`: with `ddp` (a job of several
/// processes) from every rank's record gathered through the store; without it only an
/// explicit `--backend nccl` is checked (against this process's device), as a job of one
/// process has no gradients to exchange (the answer is then `None`: nothing to carry).
pub fn choose(
    request: BackendRequest,
    device: &Device,
    ddp: Option<&Ddp>,
    announce: Announce,
) -> anyhow::Result<Option<Backend>> {
    let local = RankDevice::local(device);
    let ranks = match ddp {
        Some(ddp) => gather(ddp, &local)?,
        None if request == BackendRequest::Nccl => vec![local],
        None => return Ok(None),
    };
    // The same ranks ask the same way after a restart: a refusal is final.
    let choice = decide(request, &ranks).map_err(SettingsError::from_error)?;
    match announce {
        Announce::Stdout => say!("backend: {choice}"),
        Announce::Stderr => tell!("backend: {choice}"),
    }
    Ok(ddp.map(|_| choice.backend))
}

/// Every rank's record, in rank order.
fn gather(ddp: &Ddp, local: &RankDevice) -> anyhow::Result<Vec<RankDevice>> {
    let record = serde_json::to_vec(local).context("cannot encode this rank's device")?;
    ddp.gather_records(RECORD_NAME, record)?
        .iter()
        .enumerate()
        .map(|(rank, bytes)| {
            serde_json::from_slice(bytes).with_context(|| {
                format!(
                    "rank {rank}'s device record in the store is not valid: {}",
                    String::from_utf8_lossy(bytes)
                )
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_cuda::device::VisibleDevice;

    fn cpu(host: &str) -> RankDevice {
        RankDevice {
            host: host.into(),
            host_id: format!("{host}/boot"),
            gpu: None,
            nccl: NcclStatus::NotProbed,
        }
    }

    fn gpu(host: &str, ordinal: usize, physical: &str) -> RankDevice {
        RankDevice {
            gpu: Some(RankGpu {
                ordinal,
                physical: physical.into(),
            }),
            nccl: NcclStatus::Found,
            ..cpu(host)
        }
    }

    fn line(request: BackendRequest, ranks: &[RankDevice]) -> String {
        match decide(request, ranks) {
            Ok(choice) => format!("backend: {choice}"),
            Err(error) => format!("error: {error}"),
        }
    }

    /// The lines of the auto, nccl and ring requests.
    fn lines(ranks: &[RankDevice]) -> [String; 3] {
        [
            BackendRequest::Auto,
            BackendRequest::Nccl,
            BackendRequest::Ring,
        ]
        .map(|request| line(request, ranks))
    }

    #[test]
    fn cpu_ranks_take_the_ring() {
        let ranks = [cpu("a"), cpu("a")];
        assert_eq!(
            lines(&ranks),
            [
                "backend: ring (cpu ranks)",
                "error: --backend nccl: every rank is on the CPU, and NCCL needs a GPU for each \
                 rank (use --backend ring or auto)",
                "backend: ring (requested)",
            ]
        );
        // A job of one process on the CPU (an explicit nccl is checked against it alone).
        assert!(line(BackendRequest::Nccl, &[cpu("a")]).contains("every rank is on the CPU"));
    }

    #[test]
    fn ranks_sharing_a_gpu_take_the_ring_and_say_why() {
        let ranks = [gpu("a", 0, "0"), gpu("a", 0, "0")];
        assert_eq!(
            lines(&ranks),
            [
                "backend: ring (auto: ranks 0 and 1 share GPU 0; NCCL refuses two ranks on one GPU)",
                "error: --backend nccl: ranks 0 and 1 share GPU 0; NCCL refuses two ranks on one \
                 GPU (use --backend ring or auto)",
                "backend: ring (requested)",
            ]
        );
        // Three ranks on two GPUs: rank r on GPU r mod 2.
        let ranks = [gpu("a", 0, "0"), gpu("a", 1, "1"), gpu("a", 0, "0")];
        assert_eq!(
            line(BackendRequest::Auto, &ranks),
            "backend: ring (auto: ranks 0 and 2 share GPU 0; NCCL refuses two ranks on one GPU)"
        );
    }

    #[test]
    fn the_physical_gpu_decides_not_the_ordinal() {
        // Each rank sees one GPU as cuda:0 (CUDA_VISIBLE_DEVICES=0 and =1): distinct GPUs.
        let ranks = [gpu("a", 0, "0"), gpu("a", 0, "1")];
        assert_eq!(
            line(BackendRequest::Auto, &ranks),
            "backend: nccl (auto: each of the 2 rank(s) has its own GPU and found libnccl)"
        );
        // The same ordinal on two hosts: distinct GPUs.
        let ranks = [gpu("a", 0, "0"), gpu("b", 0, "0")];
        assert_eq!(
            decide(BackendRequest::Auto, &ranks).unwrap().backend,
            Backend::Nccl
        );
        // Two hosts, two ranks on host b's GPU 1: the host is named.
        let ranks = [
            gpu("a", 0, "0"),
            gpu("b", 0, "1"),
            gpu("b", 1, "GPU-1234"),
            gpu("b", 0, "1"),
        ];
        assert_eq!(
            line(BackendRequest::Auto, &ranks),
            "backend: ring (auto: ranks 1 and 3 share GPU 1 of host b; NCCL refuses two ranks \
             on one GPU)"
        );
    }

    #[test]
    fn a_missing_libnccl_falls_back_with_the_probes_message_or_is_an_error() {
        let missing = "libnccl not found: searched only the folders [\"/empty\"] for libnccl.so \
                       and 3 other names; dlopen said: /empty/libnccl.so: No such file";
        let mut ranks = [gpu("a", 0, "0"), gpu("a", 1, "1")];
        for record in &mut ranks {
            record.nccl = NcclStatus::Missing(missing.into());
        }
        assert_eq!(
            line(BackendRequest::Auto, &ranks),
            format!("backend: ring (auto: {missing})")
        );
        assert_eq!(
            line(BackendRequest::Nccl, &ranks),
            format!("error: --backend nccl: {missing} (use --backend ring or auto)")
        );
        // Only rank 1 lacks it: the rank is named.
        ranks[0].nccl = NcclStatus::Found;
        assert_eq!(
            line(BackendRequest::Auto, &ranks),
            format!("backend: ring (auto: on rank 1, {missing})")
        );
    }

    #[test]
    fn a_cpu_rank_among_gpu_ranks_is_named() {
        let ranks = [gpu("a", 0, "0"), cpu("a"), gpu("a", 1, "1"), cpu("a")];
        assert_eq!(
            line(BackendRequest::Auto, &ranks),
            "backend: ring (auto: ranks 1 and 3 are on the CPU, and NCCL needs a GPU for each \
             rank)"
        );
        assert!(line(BackendRequest::Nccl, &ranks[..2])
            .starts_with("error: --backend nccl: rank 1 is on the CPU"));
    }

    #[test]
    fn nccl_is_chosen_where_every_rank_has_its_own_gpu_and_libnccl() {
        let ranks = [gpu("a", 0, "0"), gpu("a", 1, "1")];
        for request in [BackendRequest::Auto, BackendRequest::Nccl] {
            assert_eq!(decide(request, &ranks).unwrap().backend, Backend::Nccl);
        }
        assert_eq!(
            line(BackendRequest::Nccl, &ranks),
            "backend: nccl (requested)"
        );
        // One GPU rank alone (world size 1 under launch): NCCL runs on it.
        assert_eq!(
            line(BackendRequest::Nccl, &ranks[..1]),
            "backend: nccl (requested)"
        );
        assert_eq!(
            line(BackendRequest::Auto, &ranks[..1]),
            "backend: nccl (auto: each of the 1 rank(s) has its own GPU and found libnccl)"
        );
        assert_eq!(
            decide(BackendRequest::Ring, &ranks).unwrap().backend,
            Backend::Ring
        );
    }

    #[test]
    fn the_physical_gpu_follows_cuda_visible_devices() {
        let listed = VisibleDevices::Listed(vec![
            VisibleDevice::Index(3),
            VisibleDevice::Uuid("GPU-abc".into()),
        ]);
        assert_eq!(physical_gpu(0, &listed), "3");
        assert_eq!(physical_gpu(1, &listed), "GPU-abc");
        assert_eq!(physical_gpu(1, &VisibleDevices::All), "1");
    }

    #[test]
    fn a_cpu_process_publishes_a_record_without_probing() {
        let record = RankDevice::local(&Device::Cpu {
            reason: "requested".into(),
        });
        assert_eq!(record.gpu, None);
        assert_eq!(record.nccl, NcclStatus::NotProbed);
        assert!(record.host_id.starts_with(&record.host));
        let bytes = serde_json::to_vec(&record).unwrap();
        assert_eq!(
            serde_json::from_slice::<RankDevice>(&bytes).unwrap(),
            record
        );
    }

    #[test]
    fn ranks_gather_their_records_through_the_process_group_and_agree() {
        use crate::train::ddp::WorkerPlacement;
        use std::time::Duration;
        let port = tandem_testdata::free_port();
        let records = [gpu("a", 0, "0"), gpu("a", 1, "0"), cpu("b")];
        let lines: Vec<String> = std::thread::scope(|scope| {
            let ranks: Vec<_> = (0..records.len())
                .map(|rank| {
                    let records = &records;
                    scope.spawn(move || {
                        let placement = WorkerPlacement {
                            rank,
                            world_size: records.len(),
                            local_world_size: records.len(),
                            master_addr: "127.0.0.1".into(),
                            master_port: port,
                            store_hosted: false,
                            key_prefix: "round0/pg".into(),
                            round_prefix: "round0/pg".into(),
                            worker_id: rank,
                            membership_epoch: 0,
                            store_replicas: Vec::new(),
                        };
                        let token = tandem_dist::JobToken::new("backend-test-token").unwrap();
                        let ddp = Ddp::join(&placement, token, Duration::from_secs(20), 8, 64, 64)
                            .unwrap();
                        let gathered = gather(&ddp, &records[rank]).unwrap();
                        assert_eq!(gathered, records.to_vec(), "rank {rank}");
                        line(BackendRequest::Auto, &gathered)
                    })
                })
                .collect();
            ranks.into_iter().map(|rank| rank.join().unwrap()).collect()
        });
        for line in &lines {
            assert_eq!(
                line,
                "backend: ring (auto: rank 2 is on the CPU, and NCCL needs a GPU for each rank)"
            );
        }
    }

    #[test]
    fn rank_lists_read_as_words() {
        assert_eq!(list_ranks(&[1]), "rank 1");
        assert_eq!(list_ranks(&[0, 1]), "ranks 0 and 1");
        assert_eq!(list_ranks(&[0, 2, 4]), "ranks 0, 2 and 4");
    }
}
