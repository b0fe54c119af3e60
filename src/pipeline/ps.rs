//! Pipeline training with parameter servers (`train --mode ps --stages S`): the ps tasks
//! hold every stage's variables and apply the optimizer; each stage's tasks (one per
//! replica) pull their stage's variables, run the pipeline, and push their stage's
//! gradients.
//!
//! Each stage is a synchronous ps job of its own: its R tasks (replica 0's is its chief)
//! and the ps tasks share a communicator, the stage's variables are placed on the ps tasks
//! by the usual placement, and an update is applied when all R replicas' gradients for the
//! step arrived, weighted by their samples ([`crate::train::ps`]'s semantics, unchanged). A
//! ps task serves all S jobs from one thread (`crate::train::ps::server::serve_many`).
//! The replica tasks still agree on each step's word (the loss, a non-finite value, a stop
//! signal) among themselves, so every stage stops at the same step. Checkpoints: each ps
//! task writes one file per stage it holds variables of (`shard-stage<k>-ps<j>.bin`), in the
//! common format under one manifest, so any mode resumes from them.

use std::collections::BTreeMap;
use std::time::Duration;

use super::train::{PipelineConfig, PipelineError};
use crate::cluster::Layout;
use crate::train::ps::placement::DeviceSetter;
use crate::train::ps::protocol::{Setup, SyncReplicas};
use crate::train::ps::worker::{Client, PushNote};
use crate::train::ps::{PsError, Roles};
use crate::transport::Comm;

/// The ps tasks of pipeline training (`--mode ps`).
#[derive(Debug, Clone)]
pub struct StagePs {
    /// How each stage's variables are placed on the ps tasks.
    pub placement: DeviceSetter,
    /// How long a ps waits for a stage's task, and a task for a ps.
    pub peer_timeout: Duration,
}

/// Whether world rank `r` of `layout` is on stage `k`'s ps communicator: a ps task, or
/// stage `k` of some replica.
fn on_stage_job(layout: &Layout, r: usize, k: usize) -> bool {
    let task = &layout.ranks[r].task;
    task.job == "ps" || layout.spec.replica_stage(task).map(|(_, s)| s) == Some(k)
}

/// Stage `k`'s ps job: every rank makes the communicator (a collective), and those on it
/// get its roles (ps tasks in order, the stage's tasks by replica, replica 0's first).
pub(crate) fn stage_job<C: Comm>(
    comm: &C,
    layout: &Layout,
    k: usize,
) -> Result<(C, Option<Roles>), PipelineError> {
    let me = comm.rank();
    let on = on_stage_job(layout, me, k);
    let sub = comm.split(u32::from(!on), me)?;
    if !on {
        return Ok((sub, None));
    }
    // The communicator's ranks are its members in world order.
    let members: Vec<usize> = (0..layout.ranks.len())
        .filter(|r| on_stage_job(layout, *r, k))
        .collect();
    let mut ps: Vec<(usize, usize)> = Vec::new();
    let mut workers: Vec<(usize, usize)> = Vec::new();
    let mut tasks = BTreeMap::new();
    for (local, world) in members.iter().enumerate() {
        let task = &layout.ranks[*world].task;
        tasks.insert(local, (task.clone(), *world));
        match layout.spec.replica_stage(task) {
            Some((replica, _)) => workers.push((replica, local)),
            None => ps.push((task.index, local)),
        }
    }
    ps.sort_unstable();
    workers.sort_unstable();
    let roles = Roles::from_parts(
        ps.into_iter().map(|p| p.1).collect(),
        workers.into_iter().map(|w| w.1).collect(),
        tasks,
    );
    Ok((sub, Some(roles)))
}

impl From<PsError> for PipelineError {
    fn from(e: PsError) -> Self {
        match e {
            PsError::Stopped(s) => PipelineError::Stopped(s),
            PsError::Ended(message) => PipelineError::Ended(message),
            other => PipelineError::Ps(other.to_string()),
        }
    }
}

/// A stage task's connection to its stage's ps job, and the step's pull and push.
pub(crate) struct StageClient<'a, C: Comm> {
    client: Client<'a, C>,
    setup: Setup,
}

impl<'a, C: Comm> StageClient<'a, C> {
    /// Stage `stage`'s variables (`vars`) placed on the job's ps tasks by `ps`.
    pub(crate) fn new(
        comm: &'a C,
        roles: &'a Roles,
        ps: &StagePs,
        vars: &[(String, usize)],
        stage: usize,
        replicas: usize,
        cfg: &PipelineConfig,
    ) -> StageClient<'a, C> {
        let shards = ps.placement.place(vars, roles.ps.len());
        let client = Client::new(comm, roles, shards, ps.peer_timeout);
        let setup = Setup {
            shards: client.shards.clone(),
            optimizer: cfg.train.optimizer,
            sync: Some(SyncReplicas {
                replicas_to_aggregate: replicas,
            }),
            stage: Some(stage),
            tables: Vec::new(),
            sparse: None,
            seed: 0,
        };
        StageClient { client, setup }
    }

    /// The chief of the stage's job (replica 0's task): the ps tasks load this stage's
    /// variables of checkpoint `restore`, or take `init`.
    pub(crate) fn start(
        &self,
        restore: Option<&std::path::Path>,
        init: &[crate::tensor::Tensor],
    ) -> Result<(), PipelineError> {
        match restore {
            Some(path) => self.client.restore(&self.setup, path)?,
            None => self.client.init(&self.setup, &mut init.to_vec())?,
        }
        Ok(())
    }

    /// The stage's parameters once the ps tasks applied `step` updates, into `params`;
    /// returns their global step, and the stop signal a ps announces (one it was sent).
    pub(crate) fn pull(
        &self,
        step: u64,
        params: &mut Vec<crate::tensor::Tensor>,
    ) -> Result<(u64, Option<i32>), PipelineError> {
        let pulled = self.client.pull(step, false, params)?;
        Ok((pulled.step, pulled.stop))
    }

    /// Pushes the stage's mean gradients of `samples` samples for `step`.
    pub(crate) fn push(
        &self,
        step: u64,
        samples: usize,
        loss: f32,
        grads: &mut Vec<crate::tensor::Tensor>,
    ) -> Result<(), PipelineError> {
        let note = PushNote::default();
        Ok(self.client.push(step, samples, loss, grads, note)?)
    }

    /// The ps tasks write their shards of this stage into staging directory `dir`.
    pub(crate) fn save(&self, dir: &std::path::Path) -> Result<Vec<(String, u64, u64)>, String> {
        self.client.save(dir).map_err(|e| e.to_string())
    }

    /// Tells the ps tasks this task is done (`stop`: stopped by that signal).
    pub(crate) fn done(&self, stop: Option<i32>) -> Result<(), PipelineError> {
        Ok(self.client.done(stop)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::MappingOptions;
    use crate::transport::local::LocalComm;

    /// A stage's job names its tasks by their ranks in the whole job (the ones mpirun and
    /// `# ranks:` name), not by their ranks on the stage's communicator.
    #[test]
    fn a_stage_job_names_its_tasks_by_their_ranks_in_the_job() {
        let opts = MappingOptions {
            ps: 1,
            stages: Some(2),
            ..Default::default()
        };
        // ps:0, replica_0:0, replica_0:1, replica_1:0, replica_1:1.
        let layout = Layout::single_host(5, &opts).unwrap();
        let names = LocalComm::run(5, |comm| {
            let (sub, roles) = stage_job(&comm, &layout, 1).unwrap();
            roles.map(|r| {
                let all = (0..sub.size()).map(|local| r.task(local));
                all.collect::<Vec<_>>()
            })
        });
        let stage_1 = [
            "ps:0 (rank 0)",
            "replica_0:1 (rank 2)",
            "replica_1:1 (rank 4)",
        ];
        let on = Some(stage_1.map(String::from).to_vec());
        assert_eq!(names, [on.clone(), None, on.clone(), None, on]);
    }
}
