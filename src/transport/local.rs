//! An in-process transport: N threads, one rank each, with MPI's matching rules.
//!
//! Messages between a pair of ranks with the same tag are received in the order they were
//! sent (MPI's non-overtaking rule); a receive longer than its buffer is truncated and
//! reported, as MPI does. Sends are buffered, so they complete at once (unless made with
//! [`LocalComm::run_rendezvous`]: then those longer than a bound complete only once
//! received, as MPI's sends beyond its eager limit do). A receive that
//! waits longer than the hub's timeout fails instead of hanging the test. One difference:
//! a receive is matched when it is waited on or tested, not when it is posted, so code
//! with several receives in flight from one (source, tag) completes them in posting order
//! (which is also correct under MPI).
//!
//! [`LocalComm::run`] starts the threads and returns each rank's result:
//! ```
//! use mpiflow::transport::local::LocalComm;
//! use mpiflow::transport::Comm;
//! let ranks = LocalComm::run(3, |c| c.rank() * 10);
//! assert_eq!(ranks, vec![0, 10, 20]);
//! ```

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use super::comm::{check_peer, Comm, Completion, TransportError, ANY_SOURCE};
use super::segments::SharedSegments;
use super::tags::Tags;
use crate::tensor::AlignedBuf;

struct Message {
    src: usize,
    tag: i32,
    data: Vec<u8>,
    /// Set when the message is received, for a send that completes only then.
    taken: Option<Arc<AtomicBool>>,
}

impl Message {
    /// The message, taken by its receiver.
    fn received(self) -> Message {
        if let Some(t) = &self.taken {
            t.store(true, Ordering::Release);
        }
        self
    }
}

#[derive(Default)]
struct Mailbox {
    queue: Mutex<VecDeque<Message>>,
    arrived: Condvar,
}

/// What the ranks of one communicator share.
struct Hub {
    boxes: Vec<Mailbox>,
    timeout: Duration,
    /// Sub-communicators being created by `split`, by (split number, color).
    splits: Mutex<BTreeMap<(u64, u32), Arc<Hub>>>,
    /// Shared segments by allocation number: the buffers and their addresses.
    segments: Mutex<BTreeMap<u64, SharedAlloc>>,
    /// One-sided windows by allocation number ([`super::local_window`]).
    windows: Mutex<BTreeMap<u64, Arc<dyn std::any::Any + Send + Sync>>>,
    /// The node of each rank (all 0 unless made by [`LocalComm::run_on_nodes`]): ranks of
    /// different nodes share no segments, as MPI's nodes do not.
    nodes: Vec<usize>,
    /// Sends longer than this complete only once received (`usize::MAX`: all buffered).
    rendezvous: usize,
}

type SharedAlloc = Arc<(Vec<AlignedBuf>, Vec<usize>)>;

impl Hub {
    fn new(nodes: Vec<usize>, timeout: Duration) -> Arc<Hub> {
        Arc::new(Hub {
            boxes: nodes.iter().map(|_| Mailbox::default()).collect(),
            timeout,
            splits: Mutex::new(BTreeMap::new()),
            segments: Mutex::new(BTreeMap::new()),
            windows: Mutex::new(BTreeMap::new()),
            nodes,
            rendezvous: usize::MAX,
        })
    }
}

/// One rank of an in-process communicator.
pub struct LocalComm {
    rank: usize,
    hub: Arc<Hub>,
    splits_done: std::cell::Cell<u64>,
    segments_done: std::cell::Cell<u64>,
    windows_done: std::cell::Cell<u64>,
    links: super::links::Links,
}

/// A request of the in-process transport.
pub enum LocalRequest {
    /// Sends are buffered: complete when started.
    Sent,
    /// A send that completes once its message is received (see
    /// [`LocalComm::run_rendezvous`]).
    Held(Arc<AtomicBool>),
    Recv {
        buf: *mut u8,
        len: usize,
        src: usize,
        tag: i32,
    },
}

impl LocalComm {
    /// Communicators for `size` ranks, to be moved into one thread each.
    pub fn create(size: usize, timeout: Duration) -> Vec<LocalComm> {
        LocalComm::create_on_nodes(&vec![0; size], timeout)
    }

    /// Communicators for one rank per entry of `nodes`, each rank on the node its entry
    /// names (what a job across hosts looks like).
    pub fn create_on_nodes(nodes: &[usize], timeout: Duration) -> Vec<LocalComm> {
        LocalComm::of_hub(Hub::new(nodes.to_vec(), timeout))
    }

    /// A communicator per rank of `hub`.
    fn of_hub(hub: Arc<Hub>) -> Vec<LocalComm> {
        (0..hub.boxes.len())
            .map(|rank| LocalComm {
                rank,
                hub: hub.clone(),
                splits_done: 0.into(),
                segments_done: 0.into(),
                windows_done: 0.into(),
                links: Default::default(),
            })
            .collect()
    }

    /// Runs `f` on `size` threads, one rank each, and returns the results by rank.
    /// A panic in any rank is re-raised here.
    pub fn run<R: Send>(size: usize, f: impl Fn(LocalComm) -> R + Sync) -> Vec<R> {
        LocalComm::run_on_nodes(&vec![0; size], f)
    }

    /// As [`LocalComm::run`], one rank per entry of `nodes`, on the node it names.
    pub fn run_on_nodes<R: Send>(nodes: &[usize], f: impl Fn(LocalComm) -> R + Sync) -> Vec<R> {
        Self::run_comms(
            LocalComm::create_on_nodes(nodes, Duration::from_secs(30)),
            f,
        )
    }

    /// As [`LocalComm::run`], with receives and collectives that give up after `timeout`
    /// (tests of a rank that never comes).
    pub fn run_with_timeout<R: Send>(
        size: usize,
        timeout: Duration,
        f: impl Fn(LocalComm) -> R + Sync,
    ) -> Vec<R> {
        Self::run_comms(LocalComm::create(size, timeout), f)
    }

    /// As [`LocalComm::run`], with sends longer than `eager` bytes complete only once
    /// their message is received, as MPI's rendezvous sends do: code that waits on such a
    /// send while its receiver waits on something else deadlocks here as it would there.
    pub fn run_rendezvous<R: Send>(
        size: usize,
        eager: usize,
        f: impl Fn(LocalComm) -> R + Sync,
    ) -> Vec<R> {
        let mut hub = Hub::new(vec![0; size], Duration::from_secs(30));
        Arc::get_mut(&mut hub).expect("a new hub").rendezvous = eager;
        Self::run_comms(LocalComm::of_hub(hub), f)
    }

    fn run_comms<R: Send>(comms: Vec<LocalComm>, f: impl Fn(LocalComm) -> R + Sync) -> Vec<R> {
        std::thread::scope(|s| {
            let handles: Vec<_> = comms.into_iter().map(|c| s.spawn(|| f(c))).collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
                .collect()
        })
    }
}

impl LocalComm {
    /// Waits for a held send's message to be received, at most the hub's timeout.
    fn wait_taken(&self, taken: &AtomicBool) -> Result<Completion, TransportError> {
        let start = std::time::Instant::now();
        while !taken.load(Ordering::Acquire) {
            if start.elapsed() > self.hub.timeout {
                return Err(TransportError::Timeout {
                    rank: self.rank,
                    peer: ANY_SOURCE,
                    tag: 0,
                    secs: self.hub.timeout.as_secs(),
                });
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        Ok(Completion::new(0, false, self.rank))
    }
}

impl Comm for LocalComm {
    type Request = LocalRequest;

    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.hub.boxes.len()
    }

    /// The standard's minimum bound: in-process tests run every scheme as the most
    /// restrictive MPI library would.
    fn tags(&self) -> Tags {
        Tags::default()
    }

    fn links(&self) -> &super::links::Links {
        &self.links
    }

    unsafe fn isend(
        &self,
        buf: *const u8,
        len: usize,
        dst: usize,
        tag: i32,
    ) -> Result<LocalRequest, TransportError> {
        check_peer(self, dst)?;
        if dst == ANY_SOURCE {
            return Err(TransportError::BadPeer {
                rank: self.rank,
                peer: dst,
                size: self.size(),
            });
        }
        // SAFETY: the caller guarantees buf..buf+len is valid; it is copied right away.
        let data = unsafe { std::slice::from_raw_parts(buf, len) }.to_vec();
        let taken = (len > self.hub.rendezvous).then(|| Arc::new(AtomicBool::new(false)));
        let mb = &self.hub.boxes[dst];
        mb.queue.lock().expect("mailbox lock").push_back(Message {
            src: self.rank,
            tag,
            data,
            taken: taken.clone(),
        });
        mb.arrived.notify_all();
        Ok(taken.map_or(LocalRequest::Sent, LocalRequest::Held))
    }

    unsafe fn irecv(
        &self,
        buf: *mut u8,
        len: usize,
        src: usize,
        tag: i32,
    ) -> Result<LocalRequest, TransportError> {
        check_peer(self, src)?;
        Ok(LocalRequest::Recv { buf, len, src, tag })
    }

    type WindowSend = LocalRequest;

    unsafe fn isend_window_into(
        &self,
        buf: *const u8,
        len: usize,
        dst: usize,
        tag: i32,
        slot: *mut LocalRequest,
    ) -> Result<(), TransportError> {
        // SAFETY: the caller's contract, passed on; slot is valid for writes.
        unsafe { slot.write(self.isend(buf, len, dst, tag)?) };
        Ok(())
    }

    fn wait_window_sends(&self, sends: &mut Vec<LocalRequest>) -> Result<(), TransportError> {
        self.wait_all(sends)
    }

    fn wait(&self, req: LocalRequest) -> Result<Completion, TransportError> {
        let (buf, len, src, tag) = match req {
            LocalRequest::Sent => return Ok(Completion::new(0, false, self.rank)),
            LocalRequest::Held(taken) => return self.wait_taken(&taken),
            LocalRequest::Recv { buf, len, src, tag } => (buf, len, src, tag),
        };
        let mb = &self.hub.boxes[self.rank];
        let mut q = mb.queue.lock().expect("mailbox lock");
        loop {
            let found = q
                .iter()
                .position(|m| m.tag == tag && (src == ANY_SOURCE || m.src == src));
            if let Some(i) = found {
                let m = q.remove(i).expect("index from position").received();
                let count = m.data.len().min(len);
                // SAFETY: the caller of irecv guarantees buf..buf+len is valid and unaliased
                // until this wait returns; count <= len.
                unsafe { std::ptr::copy_nonoverlapping(m.data.as_ptr(), buf, count) };
                return Ok(Completion::new(count, m.data.len() > len, m.src));
            }
            let (guard, timeout) = mb
                .arrived
                .wait_timeout(q, self.hub.timeout)
                .expect("mailbox lock");
            q = guard;
            if timeout.timed_out() {
                return Err(TransportError::Timeout {
                    rank: self.rank,
                    peer: src,
                    tag,
                    secs: self.hub.timeout.as_secs(),
                });
            }
        }
    }

    fn try_receive_into(
        &self,
        src: usize,
        tag: i32,
        _within: Duration,
        buf: &mut Vec<u8>,
    ) -> Result<Option<usize>, TransportError> {
        check_peer(self, src)?;
        let mut q = self.hub.boxes[self.rank]
            .queue
            .lock()
            .expect("mailbox lock");
        let found = q
            .iter()
            .position(|m| m.tag == tag && (src == ANY_SOURCE || m.src == src));
        Ok(found.map(|i| {
            let m = q.remove(i).expect("index from position").received();
            *buf = m.data;
            m.src
        }))
    }

    fn test(&self, req: &mut LocalRequest) -> Result<Option<Completion>, TransportError> {
        match req {
            LocalRequest::Sent => Ok(Some(Completion::new(0, false, self.rank))),
            LocalRequest::Held(taken) => Ok(taken
                .load(Ordering::Acquire)
                .then(|| Completion::new(0, false, self.rank))),
            LocalRequest::Recv { src, tag, .. } => {
                let ready = self.hub.boxes[self.rank]
                    .queue
                    .lock()
                    .expect("mailbox lock")
                    .iter()
                    .any(|m| m.tag == *tag && (*src == ANY_SOURCE || m.src == *src));
                if ready {
                    let r = std::mem::replace(req, LocalRequest::Sent);
                    self.wait(r).map(Some)
                } else {
                    Ok(None)
                }
            }
        }
    }

    /// A posted receive here matches only when waited on; withdrawing it takes a message
    /// that is already there, as MPI's receive would have matched it on arrival.
    fn cancel_receive(&self, mut req: LocalRequest) -> Result<Option<Completion>, TransportError> {
        match req {
            LocalRequest::Sent | LocalRequest::Held(_) => Ok(None),
            LocalRequest::Recv { .. } => self.test(&mut req),
        }
    }

    fn shared_segments(&self, len: usize) -> Result<Option<SharedSegments>, TransportError> {
        if self.hub.nodes.iter().any(|n| *n != self.hub.nodes[0]) {
            return Ok(None);
        }
        // Threads share an address space: the first rank to arrive allocates for all.
        let seq = self.segments_done.get();
        self.segments_done.set(seq + 1);
        let alloc = self
            .hub
            .segments
            .lock()
            .expect("segments lock")
            .entry(seq)
            .or_insert_with(|| {
                let mut bufs: Vec<AlignedBuf> =
                    (0..self.size()).map(|_| AlignedBuf::zeroed(len)).collect();
                let addrs = bufs.iter_mut().map(|b| b.as_mut_ptr() as usize).collect();
                Arc::new((bufs, addrs))
            })
            .clone();
        let ptrs = alloc.1.iter().map(|&a| a as *mut u8).collect();
        // SAFETY: every rank gets the addresses of the same zero-filled, 64-byte aligned
        // buffers of `len` bytes, kept alive by the Arc the segments own.
        Ok(Some(unsafe {
            SharedSegments::new(ptrs, len, Box::new(alloc))
        }))
    }

    type Window<T: super::rma::RmaType> = super::local_window::LocalWindow<T>;

    fn window<T: super::rma::RmaType>(
        &self,
        len: usize,
    ) -> Result<Self::Window<T>, super::rma::AllocateError> {
        let seq = self.windows_done.get();
        self.windows_done.set(seq + 1);
        let (hub, me) = (&self.hub, (self.rank, self.size()));
        super::local_window::allocate(&hub.windows, seq, me, len, hub.timeout)
    }

    fn wait_limit(&self) -> Option<Duration> {
        Some(self.hub.timeout)
    }

    fn same_node(&self, peer: usize) -> bool {
        self.hub.nodes.get(peer) == Some(&self.hub.nodes[self.rank])
    }

    fn node_name(&self) -> Option<String> {
        Some(format!("in-process node {}", self.hub.nodes[self.rank]))
    }

    fn split_node(&self) -> Result<LocalComm, TransportError> {
        self.split(self.hub.nodes[self.rank] as u32, self.rank)
    }

    fn split(&self, color: u32, key: usize) -> Result<LocalComm, TransportError> {
        // Everyone learns everyone's (color, key) through rank 0's hub, the same way an
        // MPI library does it with an allgather.
        let seq = self.splits_done.get();
        self.splits_done.set(seq + 1);
        let mine: Vec<u8> = [u64::from(color), key as u64]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let mut all = vec![0u8; 16 * self.size()];
        super::collectives::allgather_bytes(self, &mine, &mut all)?;
        let entries: Vec<(u32, usize, usize)> = all
            .chunks(16)
            .enumerate()
            .map(|(r, c)| {
                let v = |i: usize| u64::from_le_bytes(c[i..i + 8].try_into().expect("8 bytes"));
                (v(0) as u32, v(8) as usize, r)
            })
            .collect();
        let mut group: Vec<(usize, usize)> = entries
            .iter()
            .filter(|e| e.0 == color)
            .map(|e| (e.1, e.2))
            .collect();
        group.sort_unstable();
        let new_rank = group
            .iter()
            .position(|g| g.1 == self.rank)
            .expect("self in group");
        let hub = self
            .hub
            .splits
            .lock()
            .expect("split lock")
            .entry((seq, color))
            .or_insert_with(|| {
                let nodes = group.iter().map(|g| self.hub.nodes[g.1]).collect();
                Hub::new(nodes, self.hub.timeout)
            })
            .clone();
        Ok(LocalComm {
            rank: new_rank,
            hub,
            splits_done: 0.into(),
            segments_done: 0.into(),
            windows_done: 0.into(),
            links: Default::default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::comm::{recv, send};
    use super::*;

    #[test]
    fn ordered_matching_truncation_and_timeouts() {
        let out = LocalComm::run(2, |c| {
            if c.rank() == 0 {
                send(&c, b"first", 1, 7).unwrap();
                send(&c, b"other-tag", 1, 8).unwrap();
                send(&c, b"second", 1, 7).unwrap();
                send(&c, b"too long for the buffer", 1, 9).unwrap();
                String::new()
            } else {
                let mut b = [0u8; 16];
                let n = recv(&c, &mut b, 0, 7).unwrap().count;
                let first = String::from_utf8_lossy(&b[..n]).into_owned();
                let n = recv(&c, &mut b, 0, 7).unwrap().count;
                let second = String::from_utf8_lossy(&b[..n]).into_owned();
                let t = recv(&c, &mut b[..4], ANY_SOURCE, 9).unwrap();
                assert!(t.truncated() && t.count == 4 && t.source == 0);
                format!("{first},{second}")
            }
        });
        assert_eq!(out[1], "first,second");
        let comms = LocalComm::create(2, Duration::from_millis(50));
        let mut b = [0u8; 1];
        assert!(matches!(
            recv(&comms[0], &mut b, 1, 0),
            Err(TransportError::Timeout { .. })
        ));
        assert!(matches!(
            send(&comms[0], &b, 5, 0),
            Err(TransportError::BadPeer { .. })
        ));
    }

    #[test]
    fn split_by_color() {
        let out = LocalComm::run(5, |c| {
            let sub = c.split((c.rank() % 2) as u32, 10 - c.rank()).unwrap();
            (sub.rank(), sub.size())
        });
        // Evens {0,2,4} ordered by key 10-rank: 4,2,0.
        assert_eq!(out, vec![(2, 3), (1, 2), (1, 3), (0, 2), (0, 3)]);
    }
}
