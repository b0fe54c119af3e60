//! `mpiflow bench pushpull --transport rma`: the one-sided ps's message pattern alone.

use super::*;
use crate::transport::mpi::MpiComm;
use crate::transport::rma::Window;

/// Benchmark support (`mpiflow bench pushpull --transport rma`): a model of `floats`
/// floats sliced evenly over the ps tasks' windows; each worker runs `warmup + rounds`
/// rounds of one push (`MPI_Accumulate` of its gradient into every slice) and one pull
/// (`MPI_Get` of every slice), as asynchronous SGD does. The ps ranks do nothing but wait
/// in a barrier. Workers return the mean seconds of a timed round; ps ranks `None`.
pub fn bench_pushpull(
    comm: &MpiComm,
    layout: &Layout,
    floats: usize,
    rounds: usize,
    warmup: usize,
) -> Result<Option<f64>, PsError> {
    let roles = Roles::new(layout)?;
    let me = comm.rank();
    let np = roles.ps.len();
    let slice = floats.div_ceil(np).max(1);
    let range = |k: usize| (k * slice).min(floats)..((k + 1) * slice).min(floats);
    let mine = roles
        .ps
        .iter()
        .position(|r| *r == me)
        .map_or(0, |k| range(k).len());
    let mut w = Window::<f32>::allocate(comm, mine).map_err(|e| PsError::Setup(e.to_string()))?;
    let mut secs = None;
    if roles.workers.contains(&me) {
        // Gradients that hold data (memory never written maps the zero page, which an
        // accumulate would read from cache at any size).
        let grads = vec![1f32; floats];
        let mut params = vec![0f32; floats];
        let ep = w.lock_all()?;
        let mut start = Instant::now();
        for i in 0..warmup + rounds {
            if i == warmup {
                start = Instant::now();
            }
            ep.batch(|b| -> Result<(), RmaError> {
                for (k, r) in roles.ps.iter().enumerate() {
                    b.accumulate_sum(*r, 0, &grads[range(k)])?;
                }
                Ok(())
            })??;
            ep.batch(|b| -> Result<(), RmaError> {
                for ((k, r), dst) in roles.ps.iter().enumerate().zip(params.chunks_mut(slice)) {
                    debug_assert_eq!(dst.len(), range(k).len());
                    b.get_into(*r, 0, dst)?;
                }
                Ok(())
            })??;
        }
        secs = Some(start.elapsed().as_secs_f64() / rounds.max(1) as f64);
    }
    mpi::traits::CommunicatorCollectives::barrier(comm.raw());
    w.free()?;
    Ok(secs)
}
