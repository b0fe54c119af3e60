//! Who is who in ps training: the ps ranks and the worker ranks (the chief first), from
//! the cluster layout.

use std::collections::BTreeMap;

use super::PsError;
use crate::cluster::{Layout, TaskId};

/// The ps and worker ranks of a layout, each in task order.
#[derive(Debug, Clone)]
pub struct Roles {
    /// Rank of `ps:k` at `k`.
    pub ps: Vec<usize>,
    /// Rank of worker `w` at `w`: the chief (`chief:0`, else `worker:0`) is worker 0.
    pub workers: Vec<usize>,
    /// Each rank's task and its rank in the whole job (which errors name).
    tasks: BTreeMap<usize, (TaskId, usize)>,
}

impl Roles {
    /// The roles of `layout`; an error without ranks (not under MPI) or without ps tasks.
    pub fn new(layout: &Layout) -> Result<Roles, PsError> {
        let mut ps: Vec<(usize, usize)> = Vec::new();
        let mut workers: Vec<(usize, usize)> = Vec::new();
        let mut tasks = BTreeMap::new();
        for r in &layout.ranks {
            let rank = r
                .rank
                .ok_or_else(|| PsError::Setup("ps mode needs ranks (run under mpirun)".into()))?;
            tasks.insert(rank, (r.task.clone(), rank));
            match r.task.job.as_str() {
                "ps" => ps.push((r.task.index, rank)),
                "chief" | "worker" => {
                    workers.push((layout.spec.worker_id(&r.task).expect("a worker"), rank))
                }
                _ => {}
            }
        }
        if ps.is_empty() {
            return Err(PsError::Setup(
                "ps mode needs at least one ps task (--ps N)".into(),
            ));
        }
        ps.sort_unstable();
        workers.sort_unstable();
        Ok(Roles {
            ps: ps.into_iter().map(|x| x.1).collect(),
            workers: workers.into_iter().map(|x| x.1).collect(),
            tasks,
        })
    }

    /// `worker:1`: the task of a rank (`rank 7` if it has none).
    pub fn task_name(&self, rank: usize) -> String {
        self.tasks
            .get(&rank)
            .map_or(format!("rank {rank}"), |t| t.0.to_string())
    }

    /// The roles of a communicator of some of a job's ranks: `ps` and `workers` (the
    /// chief first) by their ranks on it, `tasks` giving each of its ranks its task and
    /// its rank in the whole job (errors name that one: it is the one mpirun reports).
    pub fn from_parts(
        ps: Vec<usize>,
        workers: Vec<usize>,
        tasks: BTreeMap<usize, (TaskId, usize)>,
    ) -> Roles {
        Roles { ps, workers, tasks }
    }

    /// `worker:1 (rank 2)`: how errors and logs name a rank.
    pub fn task(&self, rank: usize) -> String {
        self.tasks
            .get(&rank)
            .map_or(format!("rank {rank}"), |(t, world)| {
                format!("{t} (rank {world})")
            })
    }

    /// The ranks of the evaluator tasks (side-car evaluation, `crate::train::sidecar`).
    pub fn evaluators(&self) -> Vec<usize> {
        let of = |(r, (t, _)): (&usize, &(TaskId, usize))| t.is_evaluator().then_some(*r);
        self.tasks.iter().filter_map(of).collect()
    }

    /// This rank's ps index, if it is a ps task.
    pub fn ps_index(&self, rank: usize) -> Option<usize> {
        self.ps.iter().position(|r| *r == rank)
    }

    /// This rank's worker index (0 is the chief), if it is a worker.
    pub fn worker_index(&self, rank: usize) -> Option<usize> {
        self.workers.iter().position(|r| *r == rank)
    }
}
