//! One-sided windows as a transport's capability: memory each rank of a communicator
//! exposes to the others' gets, puts, accumulates and atomics, allocated by
//! [`super::Comm::window`]. MPI's windows ([`super::rma`]) and the in-process transport's
//! (`super::local_window`) implement it, so what is built on windows (the one-sided
//! parameter server) runs in `cargo test` as under `mpirun`.

use super::progress::Progress;
use super::rma::{self, RmaError, RmaType};

/// A window of `T` on every rank of a communicator.
pub trait RmaWindow<T: RmaType> {
    /// The window open for operations on every rank (a passive-target epoch).
    type Open<'w>: Access<T>
    where
        Self: 'w;

    /// Runs `f` with this rank's window memory, outside any epoch.
    ///
    /// # Safety
    /// No rank may access this rank's window meanwhile: the caller's protocol must
    /// guarantee it (for example: initialise, then a barrier before any rank opens it).
    unsafe fn with_local_mut<R>(&mut self, f: impl FnOnce(&mut [T]) -> R) -> R;

    /// Opens the window for operations.
    fn open(&mut self) -> Result<Self::Open<'_>, RmaError>;

    /// Frees the window: a collective over its communicator, so every rank must reach it.
    fn free(self) -> Result<(), RmaError>
    where
        Self: Sized;
}

/// One-sided operations on an open window, each complete at its target when it returns
/// (offsets and lengths in elements of `T`; accumulates and atomics are element-wise
/// atomic, as MPI's).
pub trait Access<T: RmaType> {
    /// Reads `buf.len()` elements of rank `target`'s window at `offset`.
    fn get_into(&self, target: usize, offset: usize, buf: &mut [T]) -> Result<(), RmaError>;

    /// Several gets, `(target, offset, into)`, started together.
    fn gets<'b>(
        &self,
        ops: impl IntoIterator<Item = (usize, usize, &'b mut [T])>,
    ) -> Result<(), RmaError>;

    /// Several accumulates (`MPI_SUM`), `(target, offset, values)`, started together.
    fn accumulates<'b>(
        &self,
        ops: impl IntoIterator<Item = (usize, usize, &'b [T])>,
    ) -> Result<(), RmaError>;

    /// Writes `buf` into rank `target`'s window at `offset`.
    fn put(&self, target: usize, offset: usize, buf: &[T]) -> Result<(), RmaError>;

    /// Adds `value` to one element; returns the element before.
    fn fetch_and_add(&self, target: usize, offset: usize, value: T) -> Result<T, RmaError>;

    /// Reads `out.len()` elements, each atomically with respect to the accumulates and
    /// atomics landing meanwhile (a few in one operation: a snapshot of words, or of
    /// parameters others add into).
    fn read_atomic(&self, target: usize, offset: usize, out: &mut [T]) -> Result<(), RmaError>;

    /// Replaces one element by `value` if it equals `compare`; returns the element before.
    fn compare_and_swap(
        &self,
        target: usize,
        offset: usize,
        compare: T,
        value: T,
    ) -> Result<T, RmaError>;

    /// Several gathers started together, `(target, offsets, block, into)`: `into` gets the
    /// `block` elements at each of `offsets` in `target`'s window, back to back (one
    /// operation each where the transport has indexed datatypes).
    fn gathers<'b>(
        &self,
        ops: impl IntoIterator<Item = (usize, &'b [usize], usize, &'b mut [T])>,
    ) -> Result<(), RmaError> {
        for (target, offsets, block, into) in ops {
            for (o, row) in offsets.iter().zip(into.chunks_exact_mut(block.max(1))) {
                self.get_into(target, *o, row)?;
            }
        }
        Ok(())
    }

    /// Several scattered accumulates (`MPI_SUM`) started together, `(target, offsets,
    /// block, values)`: `values` holds a block for each of `offsets` back to back, added
    /// to the `block` elements there (one operation each where the transport has indexed
    /// datatypes). A call's offsets must not overlap.
    fn accumulate_blocks<'b>(
        &self,
        ops: impl IntoIterator<Item = (usize, &'b [usize], usize, &'b [T])>,
    ) -> Result<(), RmaError> {
        self.accumulates(
            ops.into_iter()
                .flat_map(|(target, offsets, block, values)| {
                    let rows = values.chunks_exact(block.max(1));
                    offsets
                        .iter()
                        .zip(rows)
                        .map(move |(o, row)| (target, *o, row))
                }),
        )
    }

    /// Several compare-and-swaps started together: `ops[i]` (a target and an offset)
    /// becomes `swap[i]` where it equals `compare[i]`; `old[i]` receives it before. Each
    /// is atomic; they complete in no particular order.
    fn compare_and_swaps(
        &self,
        ops: &[(usize, usize)],
        compare: &[T],
        swap: &[T],
        old: &mut [T],
    ) -> Result<(), RmaError> {
        for (i, (target, offset)) in ops.iter().enumerate() {
            old[i] = self.compare_and_swap(*target, *offset, compare[i], swap[i])?;
        }
        Ok(())
    }

    /// Several puts, `(target, offset, values)`, started together.
    fn puts<'b>(
        &self,
        ops: impl IntoIterator<Item = (usize, usize, &'b [T])>,
    ) -> Result<(), RmaError> {
        for (target, offset, values) in ops {
            self.put(target, offset, values)?;
        }
        Ok(())
    }

    /// Runs `f` with this rank's window memory, between the memory model's syncs.
    ///
    /// # Safety
    /// No rank may have an operation on this rank's window in flight, or start one, until
    /// `f` returns: the caller's protocol must guarantee it.
    unsafe fn with_local<R>(&mut self, f: impl FnOnce(&mut [T]) -> R) -> Result<R, RmaError>;

    /// Runs `f` with the first `len` elements of this rank's window memory, read-only.
    ///
    /// # Safety
    /// No rank may write those elements until `f` returns.
    unsafe fn with_local_prefix<R>(
        &self,
        len: usize,
        f: impl FnOnce(&[T]) -> R,
    ) -> Result<R, RmaError>;

    /// Lets operations other ranks aim at this one progress while it polls (MPI's
    /// progress engine, where one-sided operations are emulated over messages).
    fn poke(&self) -> Result<(), RmaError> {
        Ok(())
    }
}

impl<T: RmaType> RmaWindow<T> for rma::Window<T> {
    type Open<'w> = Opened<'w, T>;

    unsafe fn with_local_mut<R>(&mut self, f: impl FnOnce(&mut [T]) -> R) -> R {
        // SAFETY: the caller guarantees no rank accesses this window meanwhile.
        f(unsafe { self.local_mut() })
    }

    fn open(&mut self) -> Result<Opened<'_, T>, RmaError> {
        let epoch = self.lock_all()?;
        let progress = Progress::new(epoch.rank())?;
        Ok(Opened { epoch, progress })
    }

    fn free(self) -> Result<(), RmaError> {
        rma::Window::free(self)
    }
}

/// An MPI window open on every rank: its epoch, and the progress engine this rank runs
/// while it polls.
pub struct Opened<'w, T: RmaType> {
    epoch: rma::Epoch<'w, T>,
    progress: Progress,
}

impl<T: RmaType> Access<T> for Opened<'_, T> {
    fn get_into(&self, target: usize, offset: usize, buf: &mut [T]) -> Result<(), RmaError> {
        self.epoch.get_into(target, offset, buf)
    }

    fn gets<'b>(
        &self,
        ops: impl IntoIterator<Item = (usize, usize, &'b mut [T])>,
    ) -> Result<(), RmaError> {
        self.epoch.batch(|b| -> Result<(), RmaError> {
            for (target, offset, into) in ops {
                b.get_into(target, offset, into)?;
            }
            Ok(())
        })?
    }

    fn accumulates<'b>(
        &self,
        ops: impl IntoIterator<Item = (usize, usize, &'b [T])>,
    ) -> Result<(), RmaError> {
        self.epoch.batch(|b| -> Result<(), RmaError> {
            for (target, offset, values) in ops {
                b.accumulate_sum(target, offset, values)?;
            }
            Ok(())
        })?
    }

    fn put(&self, target: usize, offset: usize, buf: &[T]) -> Result<(), RmaError> {
        self.epoch.put(target, offset, buf)
    }

    fn compare_and_swaps(
        &self,
        ops: &[(usize, usize)],
        compare: &[T],
        swap: &[T],
        old: &mut [T],
    ) -> Result<(), RmaError> {
        assert!(compare.len() == ops.len() && swap.len() == ops.len() && old.len() == ops.len());
        self.epoch.batch(|b| -> Result<(), RmaError> {
            for (((target, offset), cs), o) in ops.iter().zip(compare.iter().zip(swap)).zip(old) {
                b.compare_and_swap_into(*target, *offset, cs, o)?;
            }
            Ok(())
        })?
    }

    fn gathers<'b>(
        &self,
        ops: impl IntoIterator<Item = (usize, &'b [usize], usize, &'b mut [T])>,
    ) -> Result<(), RmaError> {
        self.epoch.batch(|b| -> Result<(), RmaError> {
            for (target, offsets, block, into) in ops {
                b.get_blocks_into(target, offsets, block, into)?;
            }
            Ok(())
        })?
    }

    fn accumulate_blocks<'b>(
        &self,
        ops: impl IntoIterator<Item = (usize, &'b [usize], usize, &'b [T])>,
    ) -> Result<(), RmaError> {
        self.epoch.batch(|b| -> Result<(), RmaError> {
            for (target, offsets, block, values) in ops {
                b.accumulate_blocks_sum(target, offsets, block, values)?;
            }
            Ok(())
        })?
    }

    fn puts<'b>(
        &self,
        ops: impl IntoIterator<Item = (usize, usize, &'b [T])>,
    ) -> Result<(), RmaError> {
        self.epoch.batch(|b| -> Result<(), RmaError> {
            for (target, offset, values) in ops {
                b.put(target, offset, values)?;
            }
            Ok(())
        })?
    }

    fn fetch_and_add(&self, target: usize, offset: usize, value: T) -> Result<T, RmaError> {
        self.epoch.fetch_and_add(target, offset, value)
    }

    fn read_atomic(&self, target: usize, offset: usize, out: &mut [T]) -> Result<(), RmaError> {
        self.epoch.read_atomic(target, offset, out)
    }

    fn compare_and_swap(
        &self,
        target: usize,
        offset: usize,
        compare: T,
        value: T,
    ) -> Result<T, RmaError> {
        self.epoch.compare_and_swap(target, offset, compare, value)
    }

    unsafe fn with_local<R>(&mut self, f: impl FnOnce(&mut [T]) -> R) -> Result<R, RmaError> {
        // SAFETY: the caller's guarantee is `rma::Epoch::with_local`'s.
        unsafe { self.epoch.with_local(f) }
    }

    unsafe fn with_local_prefix<R>(
        &self,
        len: usize,
        f: impl FnOnce(&[T]) -> R,
    ) -> Result<R, RmaError> {
        // SAFETY: the caller's guarantee is `rma::Epoch::with_local_prefix`'s.
        unsafe { self.epoch.with_local_prefix(len, f) }
    }

    fn poke(&self) -> Result<(), RmaError> {
        Ok(self.progress.poke()?)
    }
}

impl From<super::progress::ProgressError> for RmaError {
    fn from(e: super::progress::ProgressError) -> RmaError {
        RmaError::Mpi {
            call: e.call,
            rank: e.rank,
            message: e.message,
        }
    }
}
