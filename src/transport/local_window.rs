//! The in-process transport's one-sided windows ([`super::window`]): each rank's memory
//! behind a lock, so every operation is atomic as a whole (MPI promises element-wise
//! atomicity for accumulates and atomics; this gives more).

use std::any::Any;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::rma::{AllocateError, RmaError, RmaType};
use super::window::{Access, RmaWindow};

/// Every rank's memory of one window.
struct Shared<T> {
    mems: Vec<Mutex<Vec<T>>>,
    /// Ranks that have put their memory in.
    arrived: AtomicUsize,
}

/// One rank's handle on an in-process window.
pub struct LocalWindow<T: RmaType> {
    shared: Arc<Shared<T>>,
    rank: usize,
}

/// The window of allocation `entry` (shared by every rank through the hub's registry,
/// `registry`), with this rank's `len` elements in: returned once every rank of `size`
/// has put its memory in (a collective), or an error after `timeout`.
pub(super) fn allocate<T: RmaType>(
    registry: &Mutex<std::collections::BTreeMap<u64, Arc<dyn Any + Send + Sync>>>,
    entry: u64,
    (rank, size): (usize, usize),
    len: usize,
    timeout: Duration,
) -> Result<LocalWindow<T>, AllocateError> {
    let any = registry
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(entry)
        .or_insert_with(|| {
            Arc::new(Shared::<T> {
                mems: (0..size).map(|_| Mutex::new(Vec::new())).collect(),
                arrived: AtomicUsize::new(0),
            })
        })
        .clone();
    let other = || AllocateError::Other {
        rank,
        message: "ranks allocated windows of different element types in the same order".into(),
    };
    let shared: Arc<Shared<T>> = any.downcast().map_err(|_| other())?;
    *lock(&shared.mems[rank]) = vec![T::default(); len];
    shared.arrived.fetch_add(1, Ordering::AcqRel);
    let start = Instant::now();
    while shared.arrived.load(Ordering::Acquire) < size {
        if start.elapsed() > timeout {
            return Err(AllocateError::Other {
                rank,
                message: format!(
                    "not every rank allocated the window within {} s",
                    timeout.as_secs()
                ),
            });
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    Ok(LocalWindow { shared, rank })
}

/// A rank's memory, locked (a panic elsewhere while it was held leaves it usable).
fn lock<T>(m: &Mutex<Vec<T>>) -> MutexGuard<'_, Vec<T>> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<T: RmaType> LocalWindow<T> {
    /// Rank `target`'s memory, locked, with `offset..offset + count` checked against it.
    fn at(
        &self,
        call: &'static str,
        target: usize,
        offset: usize,
        count: usize,
    ) -> Result<MutexGuard<'_, Vec<T>>, RmaError> {
        let size = self.shared.mems.len();
        let mem = self.shared.mems.get(target).ok_or(RmaError::NoSuchRank {
            call,
            rank: self.rank,
            target,
            size,
        })?;
        let mem = lock(mem);
        let end = offset.saturating_add(count);
        if end > mem.len() {
            return Err(RmaError::OutOfRange {
                call,
                rank: self.rank,
                target,
                offset,
                end,
                len: mem.len(),
            });
        }
        Ok(mem)
    }
}

impl<T: RmaType> RmaWindow<T> for LocalWindow<T> {
    type Open<'w> = &'w LocalWindow<T>;

    unsafe fn with_local_mut<R>(&mut self, f: impl FnOnce(&mut [T]) -> R) -> R {
        f(&mut lock(&self.shared.mems[self.rank]))
    }

    fn open(&mut self) -> Result<&LocalWindow<T>, RmaError> {
        Ok(self)
    }

    fn free(self) -> Result<(), RmaError> {
        Ok(())
    }
}

impl<T: RmaType> Access<T> for &LocalWindow<T> {
    fn get_into(&self, target: usize, offset: usize, buf: &mut [T]) -> Result<(), RmaError> {
        let mem = self.at("get", target, offset, buf.len())?;
        buf.copy_from_slice(&mem[offset..offset + buf.len()]);
        Ok(())
    }

    fn gets<'b>(
        &self,
        ops: impl IntoIterator<Item = (usize, usize, &'b mut [T])>,
    ) -> Result<(), RmaError> {
        for (target, offset, into) in ops {
            self.get_into(target, offset, into)?;
        }
        Ok(())
    }

    fn accumulates<'b>(
        &self,
        ops: impl IntoIterator<Item = (usize, usize, &'b [T])>,
    ) -> Result<(), RmaError> {
        for (target, offset, values) in ops {
            let mut mem = self.at("accumulate", target, offset, values.len())?;
            for (m, v) in mem[offset..].iter_mut().zip(values) {
                *m = T::sum(*m, *v);
            }
        }
        Ok(())
    }

    fn put(&self, target: usize, offset: usize, buf: &[T]) -> Result<(), RmaError> {
        let mut mem = self.at("put", target, offset, buf.len())?;
        mem[offset..offset + buf.len()].copy_from_slice(buf);
        Ok(())
    }

    fn fetch_and_add(&self, target: usize, offset: usize, value: T) -> Result<T, RmaError> {
        let mut mem = self.at("fetch_and_add", target, offset, 1)?;
        let old = mem[offset];
        mem[offset] = T::sum(old, value);
        Ok(old)
    }

    fn read_atomic(&self, target: usize, offset: usize, out: &mut [T]) -> Result<(), RmaError> {
        self.get_into(target, offset, out)
    }

    fn compare_and_swap(
        &self,
        target: usize,
        offset: usize,
        compare: T,
        value: T,
    ) -> Result<T, RmaError> {
        let mut mem = self.at("compare_and_swap", target, offset, 1)?;
        let old = mem[offset];
        if old == compare {
            mem[offset] = value;
        }
        Ok(old)
    }

    unsafe fn with_local<R>(&mut self, f: impl FnOnce(&mut [T]) -> R) -> Result<R, RmaError> {
        Ok(f(&mut lock(&self.shared.mems[self.rank])))
    }

    unsafe fn with_local_prefix<R>(
        &self,
        len: usize,
        f: impl FnOnce(&[T]) -> R,
    ) -> Result<R, RmaError> {
        let mem = self.at("with_local_prefix", self.rank, 0, len)?;
        Ok(f(&mem[..len]))
    }
}
