//! A batch of non-blocking one-sided operations inside an epoch ([`super::Epoch::batch`]):
//! gets, puts, accumulates and atomics started on buffers that outlive the batch, all
//! completed by the flush of every rank touched when it ends.

use std::cell::{Cell, RefCell};
use std::marker::PhantomData;
use std::os::raw::{c_int, c_void};

use mpi::ffi;

use super::*;

/// Operations started inside [`Epoch::batch`]; they complete when the batch ends.
pub struct Batch<'s, 'e: 's, 'w: 'e, T: RmaType> {
    pub(super) epoch: &'e Epoch<'w, T>,
    /// Ranks with an operation started (flushed when the batch ends): the first one,
    /// and any others.
    pub(super) first: Cell<Option<usize>>,
    pub(super) more: RefCell<Vec<usize>>,
    // Invariant in 's, as std::thread::Scope: buffers must live for the whole batch.
    pub(super) _scope: PhantomData<&'s mut &'s ()>,
    pub(super) _env: PhantomData<&'e mut &'e ()>,
}

impl<'s, T: RmaType> Batch<'s, '_, '_, T> {
    fn started(&self, target: usize) {
        if self.first.get().is_none_or(|f| f == target) {
            self.first.set(Some(target));
        } else {
            self.more.borrow_mut().push(target);
        }
    }

    /// Starts `MPI_Get` into `buf` (filled when the batch ends).
    pub fn get_into(&self, target: usize, offset: usize, buf: &'s mut [T]) -> Result<(), RmaError> {
        // SAFETY: buf stays borrowed for the whole batch, which flushes before it ends.
        unsafe {
            self.epoch
                .start(Op::Get, target, offset, buf.as_mut_ptr(), buf.len())
        }?;
        self.started(target);
        Ok(())
    }

    /// Starts `MPI_Put` from `buf`.
    pub fn put(&self, target: usize, offset: usize, buf: &'s [T]) -> Result<(), RmaError> {
        // SAFETY: buf stays borrowed (MPI only reads it) until the batch's flush.
        unsafe {
            self.epoch
                .start(Op::Put, target, offset, buf.as_ptr().cast_mut(), buf.len())
        }?;
        self.started(target);
        Ok(())
    }

    /// Starts `MPI_Accumulate` with `MPI_SUM` from `buf`.
    pub fn accumulate_sum(
        &self,
        target: usize,
        offset: usize,
        buf: &'s [T],
    ) -> Result<(), RmaError> {
        // SAFETY: buf stays borrowed (MPI only reads it) until the batch's flush.
        unsafe {
            self.epoch.start(
                Op::AccumulateSum,
                target,
                offset,
                buf.as_ptr().cast_mut(),
                buf.len(),
            )
        }?;
        self.started(target);
        Ok(())
    }
}

impl<'s, T: RmaType> Batch<'s, '_, '_, T> {
    /// Starts one `MPI_Get` of the `block` elements at each of `offsets` in `target`'s
    /// window into `into`, back to back (an indexed datatype at the target: one operation
    /// for scattered rows, not one per row).
    pub fn get_blocks_into(
        &self,
        target: usize,
        offsets: &[usize],
        block: usize,
        into: &'s mut [T],
    ) -> Result<(), RmaError> {
        let (win, buf, t) = (self.epoch.win.win, into.as_mut_ptr(), target as c_int);
        self.blocks(
            "MPI_Get",
            target,
            (offsets, block, into.len()),
            |len, dtype| {
                // SAFETY: `into` holds `len` elements and stays borrowed for the whole batch,
                // which flushes before it ends; `blocks` checked every block against the
                // target's window and made `dtype` over them.
                unsafe { ffi::MPI_Get(buf.cast(), len, T::datatype(), t, 0, 1, dtype, win) }
            },
        )
    }

    /// Starts one `MPI_Accumulate` with `MPI_SUM` of `from` into the `block` elements at
    /// each of `offsets` in `target`'s window (`from` holds them back to back; an indexed
    /// datatype at the target: one operation, and one lock of the target, for scattered
    /// rows). The offsets must not overlap.
    pub fn accumulate_blocks_sum(
        &self,
        target: usize,
        offsets: &[usize],
        block: usize,
        from: &'s [T],
    ) -> Result<(), RmaError> {
        let (win, buf, t) = (
            self.epoch.win.win,
            from.as_ptr().cast_mut(),
            target as c_int,
        );
        let dt = T::datatype();
        self.blocks(
            "MPI_Accumulate",
            target,
            (offsets, block, from.len()),
            |len, dtype| {
                // SAFETY: `from` holds `len` elements and stays borrowed (MPI only reads it)
                // until the batch's flush; `blocks` checked every block against the target's
                // window and made `dtype` over them.
                unsafe {
                    ffi::MPI_Accumulate(buf.cast(), len, dt, t, 0, 1, dtype, ffi::RSMPI_SUM, win)
                }
            },
        )
    }

    /// Runs `op` (an MPI call on `len` elements at the origin and one `dtype` at the
    /// target, returning its code) with `dtype` the hindexed-block type of the `block`
    /// elements at each of `offsets` in `target`'s window, each checked against it; `len`
    /// (the origin's elements) must be a block per offset.
    fn blocks(
        &self,
        call: &'static str,
        target: usize,
        (offsets, block, len): (&[usize], usize, usize),
        op: impl FnOnce(c_int, ffi::MPI_Datatype) -> c_int,
    ) -> Result<(), RmaError> {
        assert_eq!(len, offsets.len() * block, "a block per offset");
        if offsets.is_empty() || block == 0 {
            return Ok(());
        }
        let size = std::mem::size_of::<T>();
        let mut displs = Vec::with_capacity(offsets.len());
        for o in offsets {
            let (_, disp, _) = self.epoch.range(call, target, *o, block)?;
            displs.push(disp * size as ffi::MPI_Aint);
        }
        let too_many = || RmaError::OutOfRange {
            call,
            rank: self.epoch.win.rank,
            target,
            offset: 0,
            end: len,
            len,
        };
        let count = c_int::try_from(offsets.len()).map_err(|_| too_many())?;
        let len = c_int::try_from(len).map_err(|_| too_many())?;
        let block = c_int::try_from(block).map_err(|_| too_many())?;
        let rank = self.epoch.win.rank;
        // SAFETY: an out-parameter filled by MPI.
        let mut dtype: ffi::MPI_Datatype = unsafe { std::mem::zeroed() };
        // SAFETY: `displs` holds `count` displacements; `dtype` receives the new type.
        let rc = unsafe {
            ffi::MPI_Type_create_hindexed_block(
                count,
                block,
                displs.as_ptr(),
                T::datatype(),
                &mut dtype,
            )
        };
        check("MPI_Type_create_hindexed_block", rank, rc)?;
        // SAFETY: a type just created.
        let rc = unsafe { ffi::MPI_Type_commit(&mut dtype) };
        check("MPI_Type_commit", rank, rc)?;
        let rc = op(len, dtype);
        // Freeing a type an operation in flight uses is allowed: MPI keeps it until done.
        // SAFETY: the type is ours, committed above.
        let freed = unsafe { ffi::MPI_Type_free(&mut dtype) };
        check(call, rank, rc)?;
        check("MPI_Type_free", rank, freed)?;
        self.started(target);
        Ok(())
    }

    /// Starts `MPI_Compare_and_swap`: if the element at `offset` equals `compare`, it
    /// becomes `swap`; `old` receives the element before (when the batch ends).
    pub fn compare_and_swap_into(
        &self,
        target: usize,
        offset: usize,
        (compare, swap): (&'s T, &'s T),
        old: &'s mut T,
    ) -> Result<(), RmaError> {
        let (t, disp, _) = self
            .epoch
            .range("MPI_Compare_and_swap", target, offset, 1)?;
        // SAFETY: the three buffers hold one T each and stay borrowed for the whole batch,
        // which flushes before it ends; the displacement was checked against the target's
        // window.
        let rc = unsafe {
            ffi::MPI_Compare_and_swap(
                (swap as *const T).cast::<c_void>(),
                (compare as *const T).cast::<c_void>(),
                (old as *mut T).cast::<c_void>(),
                T::datatype(),
                t,
                disp,
                self.epoch.win.win,
            )
        };
        check("MPI_Compare_and_swap", self.epoch.win.rank, rc)?;
        self.started(target);
        Ok(())
    }
}
