//! A measured run against the model: a metrics file of `mpiflow train --metrics` across
//! hosts, read into the cluster it ran on, the step it measured and the part of the step
//! its workers spent alone.

use super::cost::{Cluster, HostTasks, Links};
use super::predict::{comm, Mode};
use super::workload::Workload;
use crate::bench::median;
use crate::observe::metrics::Record;

/// Errors of [`Run::from_records`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RunError {
    #[error("no logged step with every rank's times (train with --metrics and --log-every below --steps)")]
    NoSteps,
    #[error("task {0}: neither a worker, the chief nor a ps task")]
    Task(String),
    #[error("a run needs 1 or more hosts")]
    NoHosts,
}

/// A measured run.
#[derive(Debug, Clone, PartialEq)]
pub struct Run {
    pub mode: Mode,
    /// Workers and ps tasks per host.
    pub hosts: Vec<HostTasks>,
    /// Seconds per step: the median over logged windows after the first.
    pub step: f64,
    /// Seconds per step the slowest worker spent outside communication (compute and the
    /// rest: a synchronous step waits for it), the median over the same windows.
    pub alone: f64,
    /// The windows the medians are of.
    pub windows: usize,
}

impl Run {
    /// Reads the records of a run over `hosts` hosts started with `mpirun --map-by node`
    /// (rank r on host r mod hosts; the metrics do not hold hosts). A run with ps tasks
    /// is a synchronous ps run, otherwise an allreduce run.
    pub fn from_records(records: &[Record], hosts: usize) -> Result<Run, RunError> {
        if hosts == 0 {
            return Err(RunError::NoHosts);
        }
        let windows: Vec<_> = records
            .iter()
            .filter_map(|r| match r {
                Record::Step {
                    steps_per_sec,
                    ranks,
                    ..
                } if !ranks.is_empty() && *steps_per_sec > 0.0 => Some((steps_per_sec, ranks)),
                _ => None,
            })
            .collect();
        let (first, _) = windows.split_first().ok_or(RunError::NoSteps)?;
        let mut placed = vec![HostTasks { workers: 0, ps: 0 }; hosts];
        for r in first.1 {
            let host = &mut placed[r.rank % hosts];
            match r.task.split(':').next() {
                Some("ps") => host.ps += 1,
                Some("worker" | "chief") => host.workers += 1,
                _ => return Err(RunError::Task(r.task.clone())),
            }
        }
        let mode = if placed.iter().any(|h| h.ps > 0) {
            Mode::Ps
        } else {
            Mode::Allreduce
        };
        // The first window holds the start (warming up, the first evaluation's wait).
        let used = if windows.len() > 1 {
            &windows[1..]
        } else {
            &windows[..]
        };
        let step = median(&mut used.iter().map(|(s, _)| 1.0 / **s).collect::<Vec<_>>());
        let alone = median(
            &mut used
                .iter()
                .map(|(_, ranks)| {
                    ranks
                        .iter()
                        .filter(|r| !r.task.starts_with("ps:") && r.times.steps > 0)
                        .map(|r| (r.times.compute + r.times.other) / r.times.steps as f64)
                        .fold(0.0, f64::max)
                })
                .collect::<Vec<_>>(),
        );
        Ok(Run {
            mode,
            hosts: placed,
            step,
            alone,
            windows: used.len(),
        })
    }

    /// The cluster it ran on, with these links.
    pub fn cluster(&self, links: Links) -> Cluster {
        Cluster {
            hosts: self.hosts.clone(),
            links,
        }
    }

    /// The step the model predicts for this run: its workers' time alone, as measured,
    /// and the communication of its mode on its cluster for `w`'s parameters.
    pub fn predicted(&self, w: &Workload, links: Links) -> f64 {
        self.alone + comm(&self.cluster(links), w, self.mode)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observe::phases::{RankTimes, Times};

    fn window(step: u64, steps_per_sec: f64, tasks: &[(&str, f64, f64)]) -> Record {
        Record::Step {
            step,
            wall_s: step as f64,
            loss: Some(0.5),
            steps_per_sec,
            samples_per_sec: steps_per_sec * 64.0,
            ranks: tasks
                .iter()
                .enumerate()
                .map(|(rank, (task, compute, comm))| RankTimes {
                    rank,
                    task: task.to_string(),
                    times: Times {
                        compute: *compute,
                        comm: *comm,
                        wait: 0.0,
                        other: 0.1,
                        steps: 100,
                    },
                })
                .collect(),
        }
    }

    #[test]
    fn a_ps_run_over_three_hosts_is_read_into_its_placement_and_medians() {
        let tasks = |c: f64| {
            [
                ("ps:0", 0.2, 2.0),
                ("worker:0", c, 2.0),
                ("worker:1", c, 2.0),
            ]
        };
        let records = vec![
            window(100, 10.0, &tasks(5.0)), // the start: left out
            window(200, 30.0, &tasks(0.7)),
            window(300, 32.0, &tasks(0.9)),
            window(400, 20.0, &tasks(0.8)),
            Record::Eval {
                step: 400,
                wall_s: 9.0,
                accuracy: 0.8,
                correct: 8,
                total: 10,
            },
        ];
        let run = Run::from_records(&records, 3).unwrap();
        assert_eq!(run.mode, Mode::Ps);
        assert_eq!(run.windows, 3);
        let (ps, w) = (
            HostTasks { workers: 0, ps: 1 },
            HostTasks { workers: 1, ps: 0 },
        );
        assert_eq!(run.hosts, vec![ps, w, w]);
        assert!((run.step - 1.0 / 30.0).abs() < 1e-12, "{run:?}");
        assert!((run.alone - (0.8 + 0.1) / 100.0).abs() < 1e-12, "{run:?}");
        // Two hosts of two replicas each.
        let ar = [("worker:0", 1.0, 1.0), ("worker:1", 1.0, 1.0)];
        let mut four = ar.to_vec();
        four.extend([("worker:2", 1.0, 1.0), ("worker:3", 1.0, 1.0)]);
        let run = Run::from_records(&[window(100, 50.0, &four)], 2).unwrap();
        assert_eq!(run.mode, Mode::Allreduce);
        assert_eq!(run.hosts, vec![HostTasks { workers: 2, ps: 0 }; 2]);
        assert_eq!(run.windows, 1);
    }

    #[test]
    fn runs_without_rank_times_or_with_strange_tasks_are_refused() {
        assert_eq!(Run::from_records(&[], 2), Err(RunError::NoSteps));
        let odd = window(100, 10.0, &[("evaluator:0", 1.0, 1.0)]);
        assert_eq!(
            Run::from_records(std::slice::from_ref(&odd), 2),
            Err(RunError::Task("evaluator:0".into()))
        );
        assert_eq!(Run::from_records(&[odd], 0), Err(RunError::NoHosts));
    }
}
