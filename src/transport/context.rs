//! The MPI context: initialisation, the world communicator, and agreement on errors.
//!
//! An error found on one rank must reach every rank, or the others wait forever in the next
//! collective. [`Context::agree`] is the one place that does this: every rank contributes
//! its local `Result`, and every rank gets back the same verdict, naming the first rank
//! that failed (Horovod's "errors reach every rank as a response", without its globals).

use std::fmt::Display;

use mpi::datatype::PartitionMut;
use mpi::environment::Universe;
use mpi::raw::{AsRaw, FromRaw};
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

/// Errors from starting MPI.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InitError {
    #[error("MPI is already initialised in this process")]
    AlreadyInitialised,
    #[error("MPI is not initialised in this process (or already finalised)")]
    NotInitialised,
    #[error("{0}")]
    Tags(#[from] super::tags::TagError),
    #[error("setting MPI_COMM_WORLD's error handler failed: {0}")]
    ErrorHandler(String),
    /// The communicator a program handed in ([`Context::adopt_communicator`]) cannot be
    /// this context's (the message names the rank in `MPI_COMM_WORLD`).
    #[error("the communicator given on {0}")]
    Communicator(String),
}

/// An error raised on one rank (or on all alike) and agreed by all.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {message}", rank.map_or("all ranks".to_string(), |r| format!("rank {r}")))]
pub struct RankError {
    /// The lowest failing rank; `None` (shown as `all ranks`) when every rank failed with
    /// the same message.
    pub rank: Option<usize>,
    pub message: String,
}

/// The initialised MPI library and the job's communicator (`MPI_COMM_WORLD`, or a
/// duplicate of the one a program gave: [`Context::adopt_communicator`]).
pub struct Context {
    // Field order matters: the communicator handle is dropped before the universe,
    // whose drop calls `MPI_Finalize`.
    world: SimpleCommunicator,
    /// `None` where another part of the program initialised MPI ([`Context::adopt`]): it
    /// finalises it.
    _universe: Option<Universe>,
    /// Each rank's index among the ranks of its machine, and their number.
    machine_locals: Vec<(usize, usize)>,
    /// What starting found about hosts that are one machine (see [`Context::warnings`]).
    warnings: Vec<String>,
}

impl Context {
    /// Initialises MPI (`MPI_Init`).
    pub fn init() -> Result<Context, InitError> {
        let universe = mpi::initialize().ok_or(InitError::AlreadyInitialised)?;
        Context::started(universe.world(), Some(universe))
    }

    /// Whether MPI is initialised already (by this program or another part of it): what
    /// is to be set before `MPI_Init` reads it must be set before then.
    pub fn mpi_started() -> bool {
        mpi::environment::is_initialized()
    }

    /// Initialises MPI asking for `MPI_THREAD_MULTIPLE`; the flag says whether the library
    /// granted it (needed to use communicators from a second thread).
    pub fn init_threaded() -> Result<(Context, bool), InitError> {
        let (universe, level) = mpi::initialize_with_threading(mpi::Threading::Multiple)
            .ok_or(InitError::AlreadyInitialised)?;
        Ok((
            Context::started(universe.world(), Some(universe))?,
            level == mpi::Threading::Multiple,
        ))
    }

    /// The context of an MPI library another part of the program initialised (mpi4py, a C
    /// caller): its `MPI_COMM_WORLD`, and MPI left to that part to finalise. The flag says
    /// whether it provides `MPI_THREAD_MULTIPLE`.
    pub fn adopt() -> Result<(Context, bool), InitError> {
        let multiple = Context::initialised_elsewhere()?;
        let world = SimpleCommunicator::world();
        Ok((Context::started(world, None)?, multiple))
    }

    /// Checks that another part of the program initialised MPI (and has not finalised
    /// it); whether the library provides `MPI_THREAD_MULTIPLE`.
    fn initialised_elsewhere() -> Result<bool, InitError> {
        if !mpi::environment::is_initialized() || mpi::environment::is_finalized() {
            return Err(InitError::NotInitialised);
        }
        Ok(mpi::environment::threading_support() == mpi::Threading::Multiple)
    }

    /// The context of a communicator another part of the program made (mpi4py's
    /// `comm.py2f()`), given by its Fortran handle: the one form of a communicator every
    /// MPI library and language binding shares. Its ranks are this context's job (a
    /// duplicate of it carries mpiflow's traffic apart from the program's); MPI is left to
    /// that part to finalise. The flag says whether the library provides
    /// `MPI_THREAD_MULTIPLE`.
    pub fn adopt_communicator(fortran: i32) -> Result<(Context, bool), InitError> {
        let multiple = Context::initialised_elsewhere()?;
        let rank = SimpleCommunicator::world().rank();
        let bad = |what: String| InitError::Communicator(format!("rank {rank}: {what}"));
        // SAFETY: MPI is initialised; MPI_Comm_f2c takes any integer (an unknown handle
        // converts to MPI_COMM_NULL in Open MPI, checked below).
        let raw = unsafe { mpi::ffi::RSMPI_Comm_f2c(fortran) };
        // SAFETY: reading the constant handle of the initialised library.
        if raw == unsafe { mpi::ffi::RSMPI_COMM_NULL } {
            return Err(bad(format!(
                "Fortran handle {fortran} is MPI_COMM_NULL or no communicator"
            )));
        }
        let mut inter = 0;
        // SAFETY: `raw` is a communicator handle (not null, checked above); `inter` is
        // written by the call.
        let rc = unsafe { mpi::ffi::MPI_Comm_test_inter(raw, &mut inter) };
        if rc != 0 {
            return Err(bad(super::mpi::error_string(rc)));
        }
        if inter != 0 {
            return Err(bad(
                "an intercommunicator (mpiflow's job is one group of ranks)".into(),
            ));
        }
        let mut dup = raw;
        // SAFETY: `raw` is an intracommunicator of the initialised library; `dup` receives
        // a new communicator that the context owns (freed when it drops, before MPI is
        // finalised by the part that initialised it).
        let rc = unsafe { mpi::ffi::MPI_Comm_dup(raw, &mut dup) };
        if rc != 0 {
            return Err(bad(format!(
                "MPI_Comm_dup: {}",
                super::mpi::error_string(rc)
            )));
        }
        // SAFETY: `dup` is a live intracommunicator of no one else's, neither
        // MPI_COMM_WORLD nor MPI_COMM_SELF (a duplicate).
        let job = unsafe { SimpleCommunicator::from_raw(dup) };
        Ok((Context::started(job, None)?, multiple))
    }

    /// The context of a started library: tags checked, ranks seated.
    fn started(
        world: SimpleCommunicator,
        universe: Option<Universe>,
    ) -> Result<Context, InitError> {
        let mut ctx = Context {
            world,
            _universe: universe,
            machine_locals: Vec::new(),
            warnings: Vec::new(),
        };
        // First: errors of mpiflow's own receives that MPI raises on the world (MPICH)
        // return to the call, as on mpiflow's communicators (super::mpi::errors).
        super::mpi::errors::return_receive_errors(ctx.world.as_raw())
            .map_err(|rc| InitError::ErrorHandler(super::mpi::error_string(rc)))?;
        ctx.check_tags()?;
        ctx.seat();
        Ok(ctx)
    }

    /// Learns which ranks share a machine, unbinds ranks that launchers of different hosts
    /// of one machine bound to the same CPUs, and makes MPI yield while waiting where such
    /// hosts together oversubscribe their machine ([`crate::topology::colocated`]); mpiflow's
    /// own waits spin before they yield where MPI's spin and every rank of the machine has a
    /// CPU of its own ([`super::comm::spin_while_waiting`]).
    /// Collective; every rank ends with the same verdicts.
    fn seat(&mut self) {
        use crate::topology::colocated::{self, Seat};
        let mine = serde_json::to_vec(&Seat::here(&self.host())).expect("a seat serialises");
        let seats: Vec<Seat> = self
            .all_gather_bytes(&mine)
            .iter()
            .enumerate()
            // A rank of another build: a machine of its own, so never unbound.
            .map(|(r, b)| {
                serde_json::from_slice(b).unwrap_or_else(|_| Seat {
                    machine: format!("rank {r}"),
                    host: format!("rank {r}"),
                    cpus: Vec::new(),
                    online: 0,
                })
            })
            .collect();
        self.machine_locals = colocated::machine_locals(&seats);
        if let Some(clash) = colocated::clash(&seats) {
            let unbound = if clash.ranks.contains(&self.rank()) {
                crate::topology::unbind().map(drop)
            } else {
                Ok(())
            };
            self.warnings.push(match self.agree(unbound) {
                Ok(()) => {
                    format!("{clash}; mpiflow unbound them (mpirun --bind-to none avoids this)")
                }
                Err(e) => format!("{clash}; unbinding failed on {e} (run mpirun --bind-to none)"),
            });
        }
        if let Some(crowd) = colocated::crowding(&seats) {
            let told = if crowd.ranks.contains(&self.rank()) {
                super::mpi::idle::yield_when_idle()
            } else {
                Ok(false)
            };
            // Said unless every rank yielded already.
            let changed = self.all_gather_bytes(&[u8::from(!matches!(told, Ok(false)))]);
            if changed.iter().any(|b| b.first() == Some(&1)) {
                self.warnings.push(match self.agree(told) {
                    Ok(_) => format!(
                        "{crowd}; mpiflow made MPI yield the CPU while waiting (mpirun --mca mpi_yield_when_idle 1 does from the start)"
                    ),
                    Err(e) => format!(
                        "{crowd}, so MPI spins while waiting ({e}): run fewer ranks, or tell MPI to yield"
                    ),
                });
            }
        }
        let own_cpu = colocated::cpu_each(&seats, self.rank());
        super::comm::set_cpu_each(own_cpu);
        super::comm::spin_while_waiting(own_cpu && !super::mpi::idle::yields());
        super::comm::mpi_yields_while_polling(super::mpi::idle::yields());
    }

    /// This rank's host name: `MPIFLOW_HOST`, a test-only setting for fake nodes that
    /// share one real host name (Slurm's multiple-slurmd mode), or else the processor name.
    pub fn host(&self) -> String {
        std::env::var("MPIFLOW_HOST").unwrap_or_else(|_| self.processor_name())
    }

    /// This rank's index among the ranks of its machine (by kernel, not host name: hosts
    /// that are containers of one machine count as one), and how many ranks that machine
    /// runs: what a pinning plan takes.
    pub fn machine_local(&self) -> (usize, usize) {
        self.machine_locals[self.rank()]
    }

    /// One-line warnings (without `mpiflow: warning: `) from starting, the same on every
    /// rank: launchers of different hosts of one machine bound ranks to the same CPUs
    /// (mpiflow unbound them), or such hosts oversubscribe their machine (mpiflow made MPI
    /// yield while waiting).
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// Refuses a tag bound no scheme fits (only `MPIFLOW_TAG_UB` can make one: MPI
    /// guarantees 32767). Every rank reads the same variable and library, so all agree.
    fn check_tags(&self) -> Result<(), InitError> {
        super::mpi::tag_scheme()?;
        Ok(())
    }

    pub fn world(&self) -> &SimpleCommunicator {
        &self.world
    }

    pub fn rank(&self) -> usize {
        self.world.rank() as usize
    }

    pub fn size(&self) -> usize {
        self.world.size() as usize
    }

    /// The name MPI gives this rank's host (`MPI_Get_processor_name`).
    pub fn processor_name(&self) -> String {
        mpi::environment::processor_name()
            .map(|s| s.trim_end_matches('\0').to_string())
            .unwrap_or_else(|_| "unknown-host".into())
    }

    /// Every rank's byte string, indexed by rank (`MPI_Allgather` of the lengths, then
    /// `MPI_Allgatherv`).
    pub fn all_gather_bytes(&self, mine: &[u8]) -> Vec<Vec<u8>> {
        let size = self.size();
        let len = i32::try_from(mine.len()).expect("gathered strings are small");
        let mut lens = vec![0i32; size];
        self.world.all_gather_into(&len, &mut lens[..]);
        let displs: Vec<i32> = lens
            .iter()
            .scan(0i32, |acc, l| {
                let d = *acc;
                *acc += l;
                Some(d)
            })
            .collect();
        let total: usize = lens.iter().map(|l| *l as usize).sum();
        let mut buf = vec![0u8; total];
        {
            let mut part = PartitionMut::new(&mut buf[..], &lens[..], &displs[..]);
            self.world.all_gather_varcount_into(mine, &mut part);
        }
        lens.iter()
            .zip(&displs)
            .map(|(l, d)| buf[*d as usize..(*d + *l) as usize].to_vec())
            .collect()
    }

    /// Every rank's string, indexed by rank.
    pub fn all_gather_strings(&self, mine: &str) -> Vec<String> {
        self.all_gather_bytes(mine.as_bytes())
            .into_iter()
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .collect()
    }

    /// Collective: every rank's message, by rank (`None` where a rank had none), if any
    /// rank had one; `None` at the cost of one gathered flag when no rank did.
    fn gather_if_any(&self, mine: Option<&str>) -> Option<Vec<Option<String>>> {
        let any = i32::from(mine.is_some());
        let mut flags = vec![0i32; self.size()];
        self.world.all_gather_into(&any, &mut flags[..]);
        if flags.iter().all(|f| *f == 0) {
            return None;
        }
        let messages = self.all_gather_strings(mine.unwrap_or(""));
        Some(
            flags
                .iter()
                .zip(messages)
                .map(|(f, m)| (*f != 0).then_some(m))
                .collect(),
        )
    }

    /// Collective: every rank's warning, if any; each distinct one once, with the ranks
    /// that gave it ([`by_message`]), on every rank (one of them prints them).
    pub fn gather_warnings(&self, mine: Option<&str>) -> Vec<String> {
        self.gather_if_any(mine)
            .map_or_else(Vec::new, |by_rank| by_message(&by_rank))
    }

    /// Collective: every rank passes its local result; all get `Ok` only if all succeeded,
    /// otherwise the same error, naming the lowest failing rank (unless every rank failed
    /// with the same message, which then needs no rank).
    pub fn agree<T, E: Display>(&self, local: Result<T, E>) -> Result<T, RankError> {
        let mine = local.as_ref().err().map(|e| e.to_string());
        let Some(messages) = self.gather_if_any(mine.as_deref()) else {
            return Ok(local.unwrap_or_else(|_| unreachable!("no rank failed")));
        };
        let rank = messages
            .iter()
            .position(Option::is_some)
            .expect("some rank failed");
        let message = messages[rank].clone().expect("a failed rank's message");
        let everywhere = messages.iter().all(|m| m.as_ref() == Some(&message));
        Err(RankError {
            rank: (!everywhere).then_some(rank),
            message,
        })
    }
}

/// Each distinct message of `by_rank` (indexed by rank; `None`: that rank had none) once,
/// in order of its first rank, led by the ranks that gave it: `all ranks: M`, `rank 3: M`,
/// `ranks 0-2,5: M`.
pub fn by_message(by_rank: &[Option<String>]) -> Vec<String> {
    let mut groups: Vec<(&str, Vec<usize>)> = Vec::new();
    for (rank, m) in by_rank
        .iter()
        .enumerate()
        .filter_map(|(r, m)| Some((r, m.as_ref()?)))
    {
        match groups.iter_mut().find(|(g, _)| *g == m.as_str()) {
            Some((_, ranks)) => ranks.push(rank),
            None => groups.push((m, vec![rank])),
        }
    }
    groups
        .into_iter()
        .map(|(m, ranks)| match ranks.len() {
            n if n == by_rank.len() && n > 1 => format!("all ranks: {m}"),
            1 => format!("rank {}: {m}", ranks[0]),
            _ => format!("ranks {}: {m}", crate::topology::cpu_list(&ranks)),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::by_message;

    #[test]
    fn warnings_are_grouped_by_message_with_their_ranks() {
        // "" for a rank without a message.
        let s = |v: &[&str]| {
            v.iter()
                .map(|m| (!m.is_empty()).then(|| m.to_string()))
                .collect::<Vec<_>>()
        };
        assert_eq!(by_message(&s(&["a", "a", "a"])), ["all ranks: a"]);
        assert_eq!(
            by_message(&s(&["a", "", "b", "a", "a", "", "a"])),
            ["ranks 0,3-4,6: a", "rank 2: b"]
        );
        assert!(by_message(&s(&["", ""])).is_empty());
        assert_eq!(by_message(&s(&["a"])), ["rank 0: a"]);
    }
}
