//! Ring collectives as plans: a plan lists the messages a rank sends to its right neighbour
//! and receives from its left one, segment by segment, and what to do with each arrival.
//! One thread sends while the calling thread receives, so a full socket buffer can never
//! deadlock the ring, and a segment is forwarded as soon as it has arrived (pipelining).

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Instant;

use crate::element::{chunk_range, combine_slices, Element, ReduceOp};
use crate::error::{DistError, Result};
use crate::link::{Header, PeerLink};

/// What to do with a segment that arrives from the left neighbour.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Arrival {
    /// Combine it into the local segment.
    Reduce,
    /// Combine it, then finish the reduction (divide once for `Mean`): the chunk is complete.
    ReduceAndFinish,
    /// Replace the local segment with it.
    Overwrite,
}

/// One message to send: a segment, once the receive it depends on (if any) is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Send {
    pub segment: usize,
    pub after_receive: Option<usize>,
}

/// One message to receive, once the send it must not overtake (if any) is done: the
/// receiver writes into the segment while reading the socket, so the sender must be
/// finished with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Receive {
    pub segment: usize,
    pub arrival: Arrival,
    pub after_send: Option<usize>,
}

/// Everything one rank does in one collective.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Consecutive element ranges covering the buffer.
    pub segments: Vec<Range<usize>>,
    pub sends: Vec<Send>,
    pub receives: Vec<Receive>,
}

/// Builds plans chunk by chunk: the buffer is cut into chunks and each chunk into segments
/// of at most `segment_elements`.
struct PlanBuilder {
    plan: Plan,
    chunk_segments: Vec<Range<usize>>,
    last_receive: Vec<Option<usize>>,
    last_send: Vec<Option<usize>>,
}

impl PlanBuilder {
    fn new(chunks: impl Iterator<Item = Range<usize>>, segment_elements: usize) -> PlanBuilder {
        let segment_elements = segment_elements.max(1);
        let mut segments = Vec::new();
        let mut chunk_segments = Vec::new();
        for chunk in chunks {
            let first = segments.len();
            let mut start = chunk.start;
            while start < chunk.end {
                let end = (start + segment_elements).min(chunk.end);
                segments.push(start..end);
                start = end;
            }
            chunk_segments.push(first..segments.len());
        }
        let last_receive = vec![None; segments.len()];
        let last_send = vec![None; segments.len()];
        PlanBuilder {
            plan: Plan {
                segments,
                ..Plan::default()
            },
            chunk_segments,
            last_receive,
            last_send,
        }
    }

    fn send_chunk(&mut self, chunk: usize) {
        for segment in self.chunk_segments.get(chunk).cloned().unwrap_or_default() {
            let step = self.plan.sends.len();
            self.plan.sends.push(Send {
                segment,
                after_receive: order(segment, step, &mut self.last_send, &self.last_receive),
            });
        }
    }

    fn receive_chunk(&mut self, chunk: usize, arrival: Arrival) {
        for segment in self.chunk_segments.get(chunk).cloned().unwrap_or_default() {
            let step = self.plan.receives.len();
            self.plan.receives.push(Receive {
                segment,
                arrival,
                after_send: order(segment, step, &mut self.last_receive, &self.last_send),
            });
        }
    }

    /// Reduce-scatter: after `world_size - 1` steps rank `rank` holds chunk `rank` complete.
    /// Chunk `c` starts at rank `c + 1` and travels right, each rank adding its own values,
    /// so every chunk is summed in one fixed rank order.
    fn reduce_scatter_steps(&mut self, rank: usize, world_size: usize) {
        for step in 0..world_size.saturating_sub(1) {
            self.send_chunk(ring_index(rank, world_size, -1 - step as isize));
            let arrival = if step + 2 == world_size {
                Arrival::ReduceAndFinish
            } else {
                Arrival::Reduce
            };
            self.receive_chunk(ring_index(rank, world_size, -2 - step as isize), arrival);
        }
    }

    /// All-gather: rank `rank` starts with chunk `rank` and passes each chunk on to the right.
    fn all_gather_steps(&mut self, rank: usize, world_size: usize) {
        for step in 0..world_size.saturating_sub(1) {
            self.send_chunk(ring_index(rank, world_size, -(step as isize)));
            self.receive_chunk(
                ring_index(rank, world_size, -1 - step as isize),
                Arrival::Overwrite,
            );
        }
    }
}

/// Orders step `step` of one direction on `segment`: records it as that direction's last
/// step there (in `mine`) and returns the other direction's last step there (in `theirs`),
/// which it must wait for.
fn order(
    segment: usize,
    step: usize,
    mine: &mut [Option<usize>],
    theirs: &[Option<usize>],
) -> Option<usize> {
    if let Some(last) = mine.get_mut(segment) {
        *last = Some(step);
    }
    theirs.get(segment).copied().flatten()
}

/// `(rank + offset) mod world_size`.
fn ring_index(rank: usize, world_size: usize, offset: isize) -> usize {
    let world_size = world_size.max(1) as isize;
    (rank as isize + offset).rem_euclid(world_size) as usize
}

/// Where one rank stands in the ring and how finely it cuts buffers: what every plan of
/// its collectives depends on besides the buffer's length.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Planner {
    /// This rank.
    pub rank: usize,
    /// The ranks in the ring.
    pub world_size: usize,
    /// The most elements one message carries.
    pub segment_elements: usize,
}

impl Planner {
    /// The all-reduce plan: reduce-scatter then all-gather over `len` elements.
    pub(crate) fn all_reduce(&self, len: usize) -> Plan {
        let mut builder = self.reduce_scattered(len);
        builder.all_gather_steps(self.rank, self.world_size);
        builder.plan
    }

    /// The reduce-scatter plan: afterwards chunk `rank` of the buffer is complete on rank
    /// `rank`.
    pub(crate) fn reduce_scatter(&self, len: usize) -> Plan {
        self.reduce_scattered(len).plan
    }

    /// A builder over `len` elements cut into `world_size` chunks, with the reduce-scatter
    /// steps planned.
    fn reduce_scattered(&self, len: usize) -> PlanBuilder {
        let chunks = (0..self.world_size).map(|chunk| chunk_range(len, self.world_size, chunk));
        let mut builder = PlanBuilder::new(chunks, self.segment_elements);
        builder.reduce_scatter_steps(self.rank, self.world_size);
        builder
    }

    /// The all-gather plan over a buffer of `world_size` chunks of `part_len` elements each.
    pub(crate) fn all_gather(&self, part_len: usize) -> Plan {
        let chunks = (0..self.world_size).map(|chunk| chunk * part_len..(chunk + 1) * part_len);
        let mut builder = PlanBuilder::new(chunks, self.segment_elements);
        builder.all_gather_steps(self.rank, self.world_size);
        builder.plan
    }

    /// The broadcast plan: the buffer of `len` elements travels from `root` around the ring,
    /// stopping before it gets back to `root`.
    pub(crate) fn broadcast(&self, root: usize, len: usize) -> Plan {
        let mut builder = PlanBuilder::new(std::iter::once(0..len), self.segment_elements);
        let distance = ring_index(self.rank, self.world_size, -(root as isize));
        if self.world_size > 1 {
            if distance != 0 {
                builder.receive_chunk(0, Arrival::Overwrite);
            }
            if distance + 1 != self.world_size {
                builder.send_chunk(0);
            }
        }
        builder.plan
    }
}

/// The neighbours and settings one plan runs with.
pub(crate) struct Ring<'a> {
    pub left: &'a PeerLink,
    pub right: &'a PeerLink,
    pub world_size: usize,
    pub deadline: Instant,
    /// The operation's name in errors, e.g. "all_reduce #3".
    pub op: &'a str,
    /// Called once with the first failure, before the sockets are closed; returns the error
    /// to report (it may swap in a root cause another rank published).
    pub on_failure: &'a (dyn Fn(DistError) -> DistError + Sync),
}

/// Counts finished receives and sends, so each thread knows when the other is done with a
/// segment.
struct Progress {
    counts: Mutex<Counts>,
    changed: Condvar,
    failed: AtomicBool,
}

/// How many receives and sends of the plan have finished.
#[derive(Default)]
struct Counts {
    received: usize,
    sent: usize,
}

impl Progress {
    /// Blocks until `done(counts)` holds; `late` is the error when the deadline passes first.
    fn wait_until(
        &self,
        deadline: Instant,
        done: impl Fn(&Counts) -> bool,
        late: impl Fn() -> DistError,
    ) -> Result<()> {
        let mut counts = self
            .counts
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        while !done(&counts) {
            if self.failed.load(Ordering::SeqCst) {
                return Err(DistError::InvalidArgument(
                    "cancelled by the other ring thread".into(),
                ));
            }
            let Some(left) = crate::store::remaining(deadline) else {
                return Err(late());
            };
            counts = match self.changed.wait_timeout(counts, left) {
                Ok((guard, _)) => guard,
                Err(poisoned) => poisoned.into_inner().0,
            };
        }
        Ok(())
    }

    fn count(&self, update: impl Fn(&mut Counts)) {
        let mut counts = self
            .counts
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        update(&mut counts);
        self.changed.notify_all();
    }
}

/// The first error of either thread, after `on_failure` has seen it.
struct FirstFailure<'a> {
    error: Mutex<Option<DistError>>,
    ring: &'a Ring<'a>,
    progress: &'a Progress,
}

impl FirstFailure<'_> {
    fn record(&self, error: DistError) {
        let mut first = self
            .error
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if first.is_some() {
            return;
        }
        self.progress.failed.store(true, Ordering::SeqCst);
        self.progress.changed.notify_all();
        *first = Some((self.ring.on_failure)(error));
        drop(first);
        self.ring.left.shut_down();
        self.ring.right.shut_down();
    }
}

/// Runs `plan` over `buffer`. `kind` and `sequence` go into every header.
pub(crate) fn run_plan<T: Element>(
    ring: &Ring<'_>,
    buffer: &mut [T],
    plan: &Plan,
    op: ReduceOp,
    kind: u32,
    sequence: u64,
) -> Result<()> {
    if plan.sends.is_empty() && plan.receives.is_empty() {
        return Ok(());
    }
    let segments = split_segments(buffer, &plan.segments)?;
    let progress = Progress {
        counts: Mutex::new(Counts::default()),
        changed: Condvar::new(),
        failed: AtomicBool::new(false),
    };
    let failure = FirstFailure {
        error: Mutex::new(None),
        ring,
        progress: &progress,
    };
    let header = |segment: usize| Header {
        sequence,
        kind,
        bytes: (plan.segments.get(segment).map_or(0, Range::len) * std::mem::size_of::<T>()) as u64,
    };
    let transfer = Transfer {
        ring,
        plan,
        segments: &segments,
        progress: &progress,
        header: &header,
    };
    std::thread::scope(|scope| {
        scope.spawn(|| {
            if let Err(error) = transfer.send_all() {
                failure.record(error);
            }
        });
        if let Err(error) = transfer.receive_all(op) {
            failure.record(error);
        }
    });
    match failure
        .error
        .into_inner()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
    {
        Some(error) => Err(error),
        None => Ok(()),
    }
}

/// Cuts the buffer into the plan's segments, each behind a lock shared by the two threads.
fn split_segments<'b, T>(
    buffer: &'b mut [T],
    ranges: &[Range<usize>],
) -> Result<Vec<Mutex<&'b mut [T]>>> {
    let mut rest = buffer;
    let mut segments = Vec::with_capacity(ranges.len());
    for range in ranges {
        let Some((segment, tail)) = std::mem::take(&mut rest).split_at_mut_checked(range.len())
        else {
            return Err(DistError::InvalidArgument(format!(
                "segment {range:?} lies outside the buffer"
            )));
        };
        segments.push(Mutex::new(segment));
        rest = tail;
    }
    Ok(segments)
}

/// One plan's run over a buffer cut into segments: what its sending and its receiving
/// thread share.
struct Transfer<'a, 'b, T> {
    ring: &'a Ring<'a>,
    plan: &'a Plan,
    segments: &'a [Mutex<&'b mut [T]>],
    progress: &'a Progress,
    header: &'a (dyn Fn(usize) -> Header + Sync),
}

impl<T: Element> Transfer<'_, '_, T> {
    /// The sending thread's part: the plan's sends in order, each after the receive it waits
    /// for.
    fn send_all(&self) -> Result<()> {
        for send in &self.plan.sends {
            if let Some(receive) = send.after_receive {
                self.progress.wait_until(
                    self.ring.deadline,
                    |counts| counts.received > receive,
                    || late_error(self.ring.left, self.ring.op),
                )?;
            }
            let segment = lock_segment(self.segments, send.segment)?;
            self.ring.right.send(
                (self.header)(send.segment),
                bytemuck::cast_slice(&segment[..]),
                self.ring.deadline,
                self.ring.op,
            )?;
            drop(segment);
            self.progress.count(|counts| counts.sent += 1);
        }
        Ok(())
    }

    /// The receiving thread's part: the plan's receives in order, each combined with `op`
    /// or copied as the plan says, after the send it waits for.
    fn receive_all(&self, op: ReduceOp) -> Result<()> {
        let longest = self
            .plan
            .receives
            .iter()
            .filter_map(|receive| self.plan.segments.get(receive.segment))
            .map(Range::len)
            .max();
        let mut incoming = vec![T::zeroed(); longest.unwrap_or(0)];
        for receive in &self.plan.receives {
            let expected = (self.header)(receive.segment);
            if let Some(send) = receive.after_send {
                let late = || {
                    self.ring
                        .right
                        .error("did not take data before the deadline", self.ring.op)
                };
                self.progress
                    .wait_until(self.ring.deadline, |counts| counts.sent > send, late)?;
            }
            let mut segment = lock_segment(self.segments, receive.segment)?;
            if receive.arrival == Arrival::Overwrite {
                self.ring.left.receive(
                    expected,
                    bytemuck::cast_slice_mut(&mut segment[..]),
                    self.ring.deadline,
                    self.ring.op,
                )?;
            } else {
                let incoming = incoming.get_mut(..segment.len()).unwrap_or_default();
                self.ring.left.receive(
                    expected,
                    bytemuck::cast_slice_mut(incoming),
                    self.ring.deadline,
                    self.ring.op,
                )?;
                combine_slices(op, &mut segment[..], incoming);
                if receive.arrival == Arrival::ReduceAndFinish && op == ReduceOp::Mean {
                    for value in segment.iter_mut() {
                        *value = value.divide(self.ring.world_size);
                    }
                }
            }
            drop(segment);
            self.progress.count(|counts| counts.received += 1);
        }
        Ok(())
    }
}

fn late_error(peer: &PeerLink, op: &str) -> DistError {
    peer.error("sent nothing before the deadline", op)
}

fn lock_segment<'s, 'b, T>(
    segments: &'s [Mutex<&'b mut [T]>],
    index: usize,
) -> Result<std::sync::MutexGuard<'s, &'b mut [T]>> {
    let segment = segments.get(index).ok_or_else(|| {
        DistError::InvalidArgument(format!("plan refers to missing segment {index}"))
    })?;
    Ok(segment
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn planner(rank: usize, world_size: usize, segment_elements: usize) -> Planner {
        Planner {
            rank,
            world_size,
            segment_elements,
        }
    }

    fn simulate_all_reduce(
        world_size: usize,
        len: usize,
        segment_elements: usize,
        op: ReduceOp,
    ) -> Vec<Vec<f64>> {
        let buffers: Vec<Vec<f64>> = (0..world_size)
            .map(|rank| (0..len).map(|i| (rank * 1000 + i) as f64).collect())
            .collect();
        let plans: Vec<Plan> = (0..world_size)
            .map(|rank| planner(rank, world_size, segment_elements).all_reduce(len))
            .collect();
        simulate(buffers, &plans, op)
    }

    /// Runs every rank's plan step by step with in-memory queues (each thread of each rank
    /// as far as its dependencies allow), to check plans without sockets. Panics if the
    /// ranks deadlock or a message arrives with the wrong length.
    fn simulate(mut buffers: Vec<Vec<f64>>, plans: &[Plan], op: ReduceOp) -> Vec<Vec<f64>> {
        let world_size = plans.len();
        let mut queues: Vec<std::collections::VecDeque<Vec<f64>>> =
            vec![Default::default(); world_size];
        let mut next_send = vec![0usize; world_size];
        let mut next_receive = vec![0usize; world_size];
        loop {
            let mut moved = false;
            for rank in 0..world_size {
                let plan = &plans[rank];
                while let Some(send) = plan.sends.get(next_send[rank]) {
                    if send
                        .after_receive
                        .is_some_and(|needed| next_receive[rank] <= needed)
                    {
                        break;
                    }
                    let data = buffers[rank][plan.segments[send.segment].clone()].to_vec();
                    queues[(rank + 1) % world_size].push_back(data);
                    next_send[rank] += 1;
                    moved = true;
                }
                while let Some(receive) = plan.receives.get(next_receive[rank]) {
                    if receive
                        .after_send
                        .is_some_and(|needed| next_send[rank] <= needed)
                    {
                        break;
                    }
                    let Some(data) = queues[rank].pop_front() else {
                        break;
                    };
                    let segment = &mut buffers[rank][plan.segments[receive.segment].clone()];
                    assert_eq!(segment.len(), data.len());
                    for (local, arrived) in segment.iter_mut().zip(&data) {
                        *local = match receive.arrival {
                            Arrival::Overwrite => *arrived,
                            _ => f64::combine(op, *arrived, *local),
                        };
                    }
                    if receive.arrival == Arrival::ReduceAndFinish && op == ReduceOp::Mean {
                        segment
                            .iter_mut()
                            .for_each(|value| *value = value.divide(world_size));
                    }
                    next_receive[rank] += 1;
                    moved = true;
                }
            }
            if !moved {
                break;
            }
        }
        for rank in 0..world_size {
            assert_eq!(
                next_send[rank],
                plans[rank].sends.len(),
                "rank {rank} did not finish sending"
            );
            assert_eq!(
                next_receive[rank],
                plans[rank].receives.len(),
                "rank {rank} did not finish receiving"
            );
        }
        buffers
    }

    #[test]
    fn simulated_all_reduce_plans_sum_every_element() {
        for world_size in 1..=5usize {
            for len in [0, 1, world_size.saturating_sub(1), 7, 31] {
                for segment_elements in [1, 3, 1000] {
                    let buffers =
                        simulate_all_reduce(world_size, len, segment_elements, ReduceOp::Sum);
                    let expected: Vec<f64> = (0..len)
                        .map(|i| (0..world_size).map(|rank| (rank * 1000 + i) as f64).sum())
                        .collect();
                    for buffer in &buffers {
                        assert_eq!(
                            buffer, &expected,
                            "world {world_size} len {len} segment {segment_elements}"
                        );
                    }
                }
            }
        }
    }

    /// A small deterministic generator for the randomized plan checks.
    fn next_random(state: &mut u64) -> u64 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    }

    #[test]
    fn randomized_plans_of_every_collective_give_the_reference() {
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        for _ in 0..300 {
            let world_size = 1 + (next_random(&mut state) % 6) as usize;
            let len = (next_random(&mut state) % 60) as usize;
            let segment_elements = 1 + (next_random(&mut state) % 9) as usize;
            let root = (next_random(&mut state) % world_size as u64) as usize;
            let case = format!("world {world_size} len {len} segment {segment_elements}");
            let input = |rank: usize| -> Vec<f64> {
                (0..len)
                    .map(|i| ((rank * 37 + i * 11) % 50) as f64)
                    .collect()
            };
            let column =
                |i: usize| (0..world_size).map(move |rank| ((rank * 37 + i * 11) % 50) as f64);

            // Reduce-scatter with Max: rank r holds its chunk's maxima.
            let plans: Vec<Plan> = (0..world_size)
                .map(|rank| planner(rank, world_size, segment_elements).reduce_scatter(len))
                .collect();
            let outputs = simulate((0..world_size).map(input).collect(), &plans, ReduceOp::Max);
            for (rank, output) in outputs.iter().enumerate() {
                for i in chunk_range(len, world_size, rank) {
                    let expected = column(i).fold(f64::MIN, f64::max);
                    assert_eq!(
                        output[i], expected,
                        "reduce_scatter {case} rank {rank} [{i}]"
                    );
                }
            }

            // All-gather: every rank ends with all parts in rank order.
            let part = len.min(7);
            let plans: Vec<Plan> = (0..world_size)
                .map(|rank| planner(rank, world_size, segment_elements).all_gather(part))
                .collect();
            let gathered = |rank: usize| -> Vec<f64> {
                (0..world_size * part)
                    .map(|i| {
                        if i / part.max(1) == rank {
                            (rank * 100 + i) as f64
                        } else {
                            -1.0
                        }
                    })
                    .collect()
            };
            let outputs = simulate(
                (0..world_size).map(gathered).collect(),
                &plans,
                ReduceOp::Sum,
            );
            let expected: Vec<f64> = (0..world_size * part)
                .map(|i| ((i / part.max(1)) * 100 + i) as f64)
                .collect();
            for output in &outputs {
                assert_eq!(output, &expected, "all_gather {case}");
            }

            // Broadcast from a random root.
            let plans: Vec<Plan> = (0..world_size)
                .map(|rank| planner(rank, world_size, segment_elements).broadcast(root, len))
                .collect();
            let outputs = simulate((0..world_size).map(input).collect(), &plans, ReduceOp::Sum);
            for output in &outputs {
                assert_eq!(output, &input(root), "broadcast {case} root {root}");
            }

            // All-reduce with Mean.
            let outputs = simulate_all_reduce(world_size, len, segment_elements, ReduceOp::Mean);
            let expected: Vec<f64> = (0..len)
                .map(|i| {
                    (0..world_size)
                        .map(|rank| (rank * 1000 + i) as f64)
                        .sum::<f64>()
                        / world_size as f64
                })
                .collect();
            for output in &outputs {
                assert_eq!(output, &expected, "all_reduce {case}");
            }
        }
    }

    #[test]
    fn each_rank_sends_two_world_minus_one_over_world_of_the_data() {
        let (world_size, len) = (4, 1000);
        let plan = planner(1, world_size, 64).all_reduce(len);
        let sent: usize = plan
            .sends
            .iter()
            .map(|send| plan.segments[send.segment].len())
            .sum();
        assert_eq!(sent, 2 * (world_size - 1) * len / world_size);
    }

    #[test]
    fn broadcast_plan_stops_before_the_root() {
        let last = planner(1, 3, 4).broadcast(2, 10);
        assert!(last.sends.is_empty());
        assert_eq!(last.receives.len(), 3);
        let root = planner(2, 3, 4).broadcast(2, 10);
        assert!(root.receives.is_empty());
        assert_eq!(
            root.sends
                .iter()
                .map(|send| send.after_receive)
                .collect::<Vec<_>>(),
            vec![None; 3]
        );
        let middle = planner(0, 3, 4).broadcast(2, 10);
        assert_eq!(
            middle
                .sends
                .iter()
                .map(|send| send.after_receive)
                .collect::<Vec<_>>(),
            vec![Some(0), Some(1), Some(2)]
        );
    }
}
