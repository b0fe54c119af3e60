//! The channel supervising launchers tell each other their programs' outcomes on
//! ([`super::lifetime`]): each task's outcome in 8 bytes, to every other task, and before
//! it at most one note of the same size (a program that entered `MPI_Finalize`; only over
//! [`super::star::Star`], as a program under [`OverMpi`] cannot use MPI: its launcher
//! holds it).
//!
//! - [`OverMpi`]: the job's own MPI communicator, where the launcher initialised MPI (it
//!   learned the cluster that way).
//! - [`super::star::Star`]: a socket of the launchers' own on one host, where the
//!   launcher must leave MPI to its program (a program that initialises MPI itself).

use super::lifetime::SuperviseError;
use crate::transport::comm::Comm;

/// How a launcher hears from and tells the others.
pub trait Notices {
    /// This launcher's rank in the job.
    fn rank(&self) -> usize;

    /// The messages that arrived since the last call, with the rank each came from.
    fn take(&mut self) -> Result<Vec<(usize, Vec<u8>)>, SuperviseError>;

    /// Tells every other rank `message` (at most twice per launcher, see above).
    fn tell(&mut self, message: [u8; 8]) -> Result<(), SuperviseError>;

    /// Waits until what this launcher told has left it, before it exits.
    fn flush(&mut self) -> Result<(), SuperviseError>;
}

/// Outcomes over MPI: a receive posted from every other rank, a send to each.
pub struct OverMpi<'c, C: Comm> {
    comm: &'c C,
    tag: i32,
    /// Leaked (8 bytes per task, once per process): valid for any request still pending
    /// when an error returns early.
    inbox: &'static mut [[u8; 8]],
    outbox: &'static mut [u8; 8],
    receives: Vec<Option<C::Request>>,
    sends: Vec<C::Request>,
}

impl<'c, C: Comm> OverMpi<'c, C> {
    /// Posts a receive from every other rank of `comm` on `tag`.
    pub fn new(comm: &'c C, tag: i32) -> Result<Self, SuperviseError> {
        let (me, n) = (comm.rank(), comm.size());
        let inbox: &'static mut [[u8; 8]] = Box::leak(vec![[0u8; 8]; n].into_boxed_slice());
        let mut receives = Vec::with_capacity(n);
        for (peer, buf) in inbox.iter_mut().enumerate() {
            receives.push(if peer == me {
                None
            } else {
                // SAFETY: `inbox` lives for the rest of the process, and each entry is read
                // only after its request completed.
                Some(unsafe { comm.irecv(buf.as_mut_ptr(), 8, peer, tag)? })
            });
        }
        Ok(OverMpi {
            comm,
            tag,
            inbox,
            outbox: Box::leak(Box::new([0u8; 8])),
            receives,
            sends: Vec::new(),
        })
    }
}

impl<C: Comm> Notices for OverMpi<'_, C> {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn take(&mut self) -> Result<Vec<(usize, Vec<u8>)>, SuperviseError> {
        let mut got = Vec::new();
        for (peer, req) in self.receives.iter_mut().enumerate() {
            let Some(r) = req else { continue };
            if let Some(done) = self.comm.test(r)? {
                *req = None;
                got.push((peer, self.inbox[peer][..done.count].to_vec()));
            }
        }
        Ok(got)
    }

    fn tell(&mut self, message: [u8; 8]) -> Result<(), SuperviseError> {
        if !self.sends.is_empty() {
            return Err(SuperviseError::Channel {
                rank: self.comm.rank(),
                what: "over MPI a launcher tells its outcome only".into(),
            });
        }
        *self.outbox = message;
        let me = self.comm.rank();
        for peer in (0..self.comm.size()).filter(|&p| p != me) {
            // SAFETY: `outbox` lives for the rest of the process and is written only here,
            // once.
            let req = unsafe { self.comm.isend(self.outbox.as_ptr(), 8, peer, self.tag)? };
            self.sends.push(req);
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<(), SuperviseError> {
        Ok(self.comm.wait_all(&mut self.sends)?)
    }
}
