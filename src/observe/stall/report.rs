//! The chief's view of one stall: every rank's answer, who waits and who has not arrived,
//! as one line.

use std::fmt;

use super::Doing;

/// One rank as the chief saw it.
#[derive(Debug, Clone, PartialEq)]
pub struct Seen {
    pub rank: usize,
    pub task: String,
    /// Its answer; `None`: it did not answer in time (stopped, stuck outside MPI, gone).
    pub doing: Option<Doing>,
}

/// A stall: the longest wait (its step, operation and length) and every rank's state.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    pub step: u64,
    pub op: String,
    pub secs: f64,
    pub ranks: Vec<Seen>,
}

impl Report {
    /// The report of `ranks`' answers, about the longest wait among them; `None` if no
    /// rank waits.
    pub fn of(ranks: Vec<Seen>) -> Option<Report> {
        let (step, op, secs) = ranks
            .iter()
            .filter_map(|s| match &s.doing {
                Some(Doing::Waiting { op, step, secs, .. }) => Some((*step, op.clone(), *secs)),
                _ => None,
            })
            .max_by(|a, b| a.2.total_cmp(&b.2))?;
        Some(Report {
            step,
            op,
            secs,
            ranks,
        })
    }

    /// Whether a rank is already past the report's step (waiting at a later step, or
    /// busy after one): the wait it is about has ended.
    pub fn passed(&self) -> bool {
        self.ranks.iter().any(|s| match &s.doing {
            Some(Doing::Waiting { step, .. }) => *step > self.step,
            Some(Doing::Busy { step, .. }) => step.is_some_and(|t| t > self.step),
            _ => false,
        })
    }

    /// The tasks that wait.
    pub fn waiting(&self) -> Vec<String> {
        self.ranks
            .iter()
            .filter(|s| matches!(s.doing, Some(Doing::Waiting { .. })))
            .map(|s| s.task.clone())
            .collect()
    }

    /// The tasks that have not arrived: working, or not answering.
    pub fn missing(&self) -> Vec<String> {
        self.ranks
            .iter()
            .filter(|s| matches!(s.doing, None | Some(Doing::Busy { .. })))
            .map(|s| s.task.clone())
            .collect()
    }
}

/// Whole seconds (a stall is reported in seconds).
fn secs(s: f64) -> String {
    format!("{:.0} s", s.floor())
}

impl fmt::Display for Report {
    /// `stall at step 812: worker:0, worker:1 waiting 61 s in allreduce of a..f, 6 tensors
    /// (1.2 MB); not arrived: worker:2 (busy 63 s since step 811), worker:3 (no answer)`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "stall at step {}:", self.step)?;
        // Waiting ranks grouped by what they wait in, the longest wait's group first.
        type Key<'a> = (&'a str, u64, Option<&'a str>, Option<&'a str>, u64);
        let mut groups: Vec<(Key<'_>, Vec<&str>, f64)> = Vec::new();
        for s in &self.ranks {
            if let Some(Doing::Waiting {
                op,
                step,
                what,
                peer,
                bytes,
                secs,
            }) = &s.doing
            {
                let key = (op.as_str(), *step, what.as_deref(), peer.as_deref(), *bytes);
                match groups.iter_mut().find(|g| g.0 == key) {
                    Some(g) => {
                        g.1.push(&s.task);
                        g.2 = g.2.max(*secs);
                    }
                    None => groups.push((key, vec![&s.task], *secs)),
                }
            }
        }
        groups.sort_by(|a, b| b.2.total_cmp(&a.2));
        for (i, ((op, step, what, peer, bytes), tasks, waited)) in groups.iter().enumerate() {
            let sep = if i == 0 { " " } else { "; " };
            write!(
                f,
                "{sep}{} waiting {} in {op}",
                tasks.join(", "),
                secs(*waited)
            )?;
            if *step != self.step {
                write!(f, " of step {step}")?;
            }
            if let Some(w) = what {
                write!(f, " of {w}")?;
            }
            match (peer, bytes) {
                (Some(p), 0) => write!(f, " (with {p})")?,
                (Some(p), b) => write!(f, " (with {p}, {})", super::super::bytes(*b))?,
                (None, 0) => {}
                (None, b) => write!(f, " ({})", super::super::bytes(*b))?,
            }
        }
        let missing: Vec<String> = self
            .ranks
            .iter()
            .filter_map(|s| match &s.doing {
                None => Some(format!("{} (no answer)", s.task)),
                Some(Doing::Busy {
                    step: Some(t),
                    secs: b,
                }) => Some(format!("{} (busy {} since step {t})", s.task, secs(*b))),
                Some(Doing::Busy {
                    step: None,
                    secs: b,
                }) => Some(format!("{} (busy {})", s.task, secs(*b))),
                _ => None,
            })
            .collect();
        match missing.is_empty() {
            true => write!(f, "; every rank waits"),
            false => write!(f, "; not arrived: {}", missing.join(", ")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waiting(op: &str, step: u64, secs: f64) -> Option<Doing> {
        Some(Doing::Waiting {
            op: op.into(),
            step,
            what: Some("a..f, 6 tensors".into()),
            peer: None,
            bytes: 1_200_000,
            secs,
        })
    }

    #[test]
    fn the_line_names_the_step_the_waits_and_who_has_not_arrived() {
        let seen = |rank: usize, doing| Seen {
            rank,
            task: format!("worker:{rank}"),
            doing,
        };
        let r = Report::of(vec![
            seen(0, waiting("allreduce", 812, 61.4)),
            seen(1, waiting("allreduce", 812, 60.2)),
            seen(
                2,
                Some(Doing::Busy {
                    step: Some(811),
                    secs: 63.9,
                }),
            ),
            seen(3, None),
            seen(4, Some(Doing::Idle { secs: 3.0 })),
        ])
        .unwrap();
        assert_eq!(
            r.to_string(),
            "stall at step 812: worker:0, worker:1 waiting 61 s in allreduce of a..f, 6 tensors \
             (1.2 MB); not arrived: worker:2 (busy 63 s since step 811), worker:3 (no answer)"
        );
        assert_eq!(r.waiting(), ["worker:0", "worker:1"]);
        assert_eq!(r.missing(), ["worker:2", "worker:3"]);
        assert_eq!((r.step, r.op.as_str(), r.secs), (812, "allreduce", 61.4));
        assert!(!r.passed());
        let mut later = r.clone();
        later.ranks[2].doing = Some(Doing::Busy {
            step: Some(813),
            secs: 0.1,
        });
        assert!(later.passed());
    }

    #[test]
    fn waits_of_other_operations_are_groups_of_their_own_and_no_wait_is_no_report() {
        let r = Report::of(vec![
            Seen {
                rank: 0,
                task: "ps:0".into(),
                doing: waiting("gather", 9, 70.0),
            },
            Seen {
                rank: 1,
                task: "worker:0".into(),
                doing: waiting("pull", 10, 69.0),
            },
        ])
        .unwrap();
        let line = r.to_string();
        assert!(line.starts_with("stall at step 9: ps:0 waiting 70 s in gather of a..f"));
        assert!(line.contains("; worker:0 waiting 69 s in pull of step 10 of a..f"));
        assert!(line.ends_with("; every rank waits"), "{line}");
        assert_eq!(
            Report::of(vec![Seen {
                rank: 0,
                task: "worker:0".into(),
                doing: Some(Doing::Idle { secs: 1.0 }),
            }]),
            None
        );
    }
}
