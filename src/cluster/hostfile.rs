//! MPI hostfiles (OpenMPI's `host slots=N max_slots=M` and MPICH's `host:N`) and the
//! rank-to-host mapping `mpirun` would make from them, so a layout can be previewed with
//! `mpiflow spec --hostfile H -np N` before any job starts.
//!
//! Mapping follows OpenMPI 4.1: `--map-by slot` (default) fills each host's slots in file
//! order; `--map-by node` deals ranks round-robin over hosts. A host without `slots=` gets
//! OpenMPI's default, the number of cores (the preview assumes the hosts are like this
//! one; pass `default_slots` to say otherwise). More ranks than slots is an error unless
//! oversubscription is allowed, in which case extra ranks go round-robin to hosts below
//! their `max_slots`. Lines naming the same host add their slots, as in OpenMPI.

use std::path::Path;

/// Errors from reading a hostfile or mapping ranks onto it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostfileError {
    #[error("hostfile {path}: cannot read: {why}")]
    Read { path: String, why: String },
    #[error("hostfile {path}:{line}: {why}")]
    Syntax {
        path: String,
        line: usize,
        why: String,
    },
    #[error("hostfile {path}: no hosts")]
    Empty { path: String },
    #[error("hostfile {path}: {np} ranks requested but only {slots} slots (add --oversubscribe or more slots)")]
    NotEnoughSlots {
        path: String,
        np: usize,
        slots: usize,
    },
    #[error("hostfile {path}: {np} ranks requested but the hosts' max_slots allow only {max}")]
    OverMaxSlots { path: String, np: usize, max: usize },
    #[error("-np must be at least 1")]
    ZeroRanks,
}

/// One host of a hostfile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostSlots {
    pub host: String,
    pub slots: usize,
    pub max_slots: Option<usize>,
}

/// How `mpirun` deals ranks to hosts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MapBy {
    /// Fill each host's slots before the next (OpenMPI's default).
    #[default]
    Slot,
    /// One rank per host in turn.
    Node,
}

impl crate::named::Named for MapBy {
    const NAMES: &'static [(Self, &'static str, &'static str)] = &[
        (
            MapBy::Slot,
            "slot",
            "Fill each host's slots before the next (OpenMPI's default)",
        ),
        (MapBy::Node, "node", "One rank per host in turn"),
    ];
}

/// A parsed hostfile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hostfile {
    pub path: String,
    pub hosts: Vec<HostSlots>,
}

impl Hostfile {
    pub fn read(path: &Path, default_slots: usize) -> Result<Hostfile, HostfileError> {
        let text = std::fs::read_to_string(path).map_err(|e| HostfileError::Read {
            path: path.display().to_string(),
            why: e.to_string(),
        })?;
        Self::parse(&path.display().to_string(), &text, default_slots)
    }

    /// Parses OpenMPI or MPICH syntax (the two may not be mixed on one line).
    pub fn parse(path: &str, text: &str, default_slots: usize) -> Result<Hostfile, HostfileError> {
        let mut hosts: Vec<HostSlots> = Vec::new();
        for (n, raw) in text.lines().enumerate() {
            let line = raw.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let err = |why: String| HostfileError::Syntax {
                path: path.to_string(),
                line: n + 1,
                why,
            };
            let entry = parse_line(line, default_slots).map_err(err)?;
            match hosts.iter_mut().find(|h| h.host == entry.host) {
                Some(h) => {
                    h.slots += entry.slots;
                    h.max_slots = match (h.max_slots, entry.max_slots) {
                        (Some(a), Some(b)) => Some(a + b),
                        _ => None,
                    };
                }
                None => hosts.push(entry),
            }
        }
        if hosts.is_empty() {
            return Err(HostfileError::Empty { path: path.into() });
        }
        Ok(Hostfile {
            path: path.into(),
            hosts,
        })
    }

    /// The host of each rank, as `mpirun -np np --map-by map_by` would place them.
    pub fn map(
        &self,
        np: usize,
        map_by: MapBy,
        oversubscribe: bool,
    ) -> Result<Vec<String>, HostfileError> {
        if np == 0 {
            return Err(HostfileError::ZeroRanks);
        }
        let slots: usize = self.hosts.iter().map(|h| h.slots).sum();
        if np > slots && !oversubscribe {
            return Err(HostfileError::NotEnoughSlots {
                path: self.path.clone(),
                np,
                slots,
            });
        }
        let mut count = vec![0usize; self.hosts.len()];
        let mut order = Vec::with_capacity(np);
        // Within the slots.
        match map_by {
            MapBy::Slot => {
                for (i, h) in self.hosts.iter().enumerate() {
                    let take = h.slots.min(np - order.len());
                    order.extend(std::iter::repeat_n(i, take));
                    count[i] += take;
                }
            }
            MapBy::Node => {
                while order.len() < np.min(slots) {
                    for (i, h) in self.hosts.iter().enumerate() {
                        if count[i] < h.slots && order.len() < np {
                            order.push(i);
                            count[i] += 1;
                        }
                    }
                }
            }
        }
        // Beyond them (oversubscribed): round-robin over hosts below max_slots.
        while order.len() < np {
            let before = order.len();
            for (i, h) in self.hosts.iter().enumerate() {
                if order.len() < np && h.max_slots.is_none_or(|m| count[i] < m) {
                    order.push(i);
                    count[i] += 1;
                }
            }
            if order.len() == before {
                return Err(HostfileError::OverMaxSlots {
                    path: self.path.clone(),
                    np,
                    max: before,
                });
            }
        }
        // mpirun numbers ranks host by host in mapping order for by-slot, and in dealing
        // order for by-node; both are the order in which we pushed.
        Ok(order
            .into_iter()
            .map(|i| self.hosts[i].host.clone())
            .collect())
    }
}

fn check_host(host: &str) -> Result<(), String> {
    if host.is_empty() {
        return Err("empty host name".into());
    }
    match host
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
    {
        Some(c) => Err(format!("invalid character {c:?} in host name {host:?}")),
        None => Ok(()),
    }
}

fn count(key: &str, v: &str) -> Result<usize, String> {
    match v.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("{key}={v:?} must be a positive integer")),
    }
}

fn parse_line(line: &str, default_slots: usize) -> Result<HostSlots, String> {
    let mut words = line.split_whitespace();
    let first = words.next().expect("line is not empty");
    let rest: Vec<&str> = words.collect();
    if let Some((host, n)) = first.split_once(':') {
        // MPICH: host:N, nothing else on the line.
        if !rest.is_empty() {
            return Err(format!(
                "MPICH syntax {first:?} cannot be followed by {:?}",
                rest.join(" ")
            ));
        }
        check_host(host)?;
        return Ok(HostSlots {
            host: host.into(),
            slots: count("slots", n).map_err(|_| {
                format!("{first:?}: the count after ':' must be a positive integer")
            })?,
            max_slots: None,
        });
    }
    check_host(first)?;
    let (mut slots, mut max_slots) = (None, None);
    for w in rest {
        let (k, v) = w
            .split_once('=')
            .ok_or_else(|| format!("expected key=value after the host name, got {w:?}"))?;
        let slot = match k {
            "slots" | "cpu" | "count" => &mut slots,
            "max_slots" | "max-slots" => &mut max_slots,
            _ => return Err(format!("unknown key {k:?} (expected slots or max_slots)")),
        };
        if slot.replace(count(k, v)?).is_some() {
            return Err(format!("{k} given twice"));
        }
    }
    let slots = slots.unwrap_or(default_slots.max(1));
    if let Some(m) = max_slots {
        if m < slots {
            return Err(format!("max_slots={m} is less than slots={slots}"));
        }
    }
    Ok(HostSlots {
        host: first.into(),
        slots,
        max_slots,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hf(text: &str) -> Hostfile {
        Hostfile::parse("h", text, 2).unwrap()
    }

    #[test]
    fn openmpi_syntax_with_comments() {
        let h = hf("# cluster\n\na slots=2 max_slots=4  # first\nb slots=3\nc\n a slots=1\n");
        assert_eq!(
            h.hosts,
            vec![
                HostSlots {
                    host: "a".into(),
                    slots: 3,
                    max_slots: None
                },
                HostSlots {
                    host: "b".into(),
                    slots: 3,
                    max_slots: None
                },
                HostSlots {
                    host: "c".into(),
                    slots: 2,
                    max_slots: None
                },
            ]
        );
    }

    #[test]
    fn mpich_syntax() {
        let h = hf("a:2\nb:1\nc\n");
        let slots: Vec<usize> = h.hosts.iter().map(|x| x.slots).collect();
        assert_eq!(slots, vec![2, 1, 2]);
    }

    #[test]
    fn map_by_slot_and_node() {
        let h = hf("a slots=2\nb slots=2\nc slots=1\n");
        assert_eq!(h.map(4, MapBy::Slot, false).unwrap(), ["a", "a", "b", "b"]);
        assert_eq!(
            h.map(5, MapBy::Node, false).unwrap(),
            ["a", "b", "c", "a", "b"]
        );
        assert_eq!(h.map(3, MapBy::Node, false).unwrap(), ["a", "b", "c"]);
        assert!(matches!(
            h.map(6, MapBy::Slot, false),
            Err(HostfileError::NotEnoughSlots {
                np: 6,
                slots: 5,
                ..
            })
        ));
        assert_eq!(
            h.map(7, MapBy::Slot, true).unwrap(),
            ["a", "a", "b", "b", "c", "a", "b"]
        );
        let capped = hf("a slots=1 max_slots=1\nb slots=1 max_slots=2\n");
        assert_eq!(capped.map(3, MapBy::Slot, true).unwrap(), ["a", "b", "b"]);
        assert!(matches!(
            capped.map(4, MapBy::Slot, true),
            Err(HostfileError::OverMaxSlots { .. })
        ));
        assert_eq!(h.map(0, MapBy::Slot, false), Err(HostfileError::ZeroRanks));
    }

    #[test]
    fn bad_hostfiles_name_the_line() {
        for (text, want) in [
            ("a slots=x\n", "h:1: slots=\"x\" must be a positive integer"),
            ("a\nb slots=0\n", "h:2: slots=\"0\""),
            (
                "a slots=4 max_slots=2\n",
                "max_slots=2 is less than slots=4",
            ),
            ("a foo=1\n", "unknown key \"foo\""),
            ("a slots=1 slots=2\n", "slots given twice"),
            ("a extra\n", "expected key=value"),
            ("a:2 slots=3\n", "MPICH syntax"),
            ("a:x\n", "after ':' must be a positive integer"),
            ("a:\n", "after ':'"),
            ("bad$host\n", "invalid character '$'"),
            ("# only comments\n\n", "no hosts"),
        ] {
            let e = Hostfile::parse("h", text, 1).unwrap_err().to_string();
            assert!(e.contains(want), "{text:?}: {e}");
        }
    }
}
