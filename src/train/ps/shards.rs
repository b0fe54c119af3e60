//! The ps checkpoint: one file per ps task (`shard-ps{k}.bin`, each shard's parameters
//! and optimizer state by `var@offset`) and the chief's manifest over them, committed
//! atomically. Both ps transports write and read it.

use std::path::Path;

use serde_json::json;

use super::placement::Shard;
use super::PsError;
use crate::train::checkpoint::{self, Arrays};
use crate::train::optim::Slots;

/// The newest valid checkpoint of `dir` (created if missing), refused if another number
/// of ps tasks wrote it, and a warning for each newer one that did not verify.
pub fn newest(
    dir: Option<&Path>,
    num_ps: usize,
) -> Result<(Option<checkpoint::Found>, Vec<String>), PsError> {
    let Some(dir) = dir else {
        return Ok((None, Vec::new()));
    };
    std::fs::create_dir_all(dir)
        .map_err(|e| PsError::Setup(format!("checkpoint dir {}: {e}", dir.display())))?;
    let (found, warnings) = checkpoint::latest(dir);
    if let Some(f) = &found {
        let n = f.meta["num_ps"].as_u64().unwrap_or(0) as usize;
        if n != num_ps {
            return Err(PsError::Setup(format!(
                "checkpoint {} was written by {n} ps tasks, this job has {num_ps}",
                f.path.display()
            )));
        }
    }
    Ok((found, warnings))
}

/// The chief's last act of a checkpoint: the manifest over every ps's shard file (name,
/// bytes, checksum), committed atomically, and the log line.
pub fn commit(
    dir: &Path,
    step: u64,
    files: &[(String, u64, u64)],
    num_ps: usize,
    log: &mut dyn FnMut(&str),
) -> Result<(), PsError> {
    let path = checkpoint::commit(dir, step, files, json!({"num_ps": num_ps}))?;
    log(&format!("# checkpoint {} written", path.display()));
    Ok(())
}

/// ps `k`'s checkpoint file contents: each shard's parameters and optimizer state.
pub fn arrays(k: usize, shards: &[Shard], params: &[&[f32]], slots: &[Slots], step: u64) -> Arrays {
    let mut arrays = Vec::new();
    for ((s, p), sl) in shards.iter().zip(params).zip(slots) {
        let key = format!("{}@{}", s.var, s.offset);
        arrays.push((format!("{key}/param"), p.to_vec()));
        arrays.push((format!("{key}/m"), sl.m.clone()));
        arrays.push((format!("{key}/v"), sl.v.clone()));
    }
    Arrays {
        step,
        meta: json!({"ps": k, "t": slots.first().map_or(0, |s| s.t)}),
        arrays,
    }
}

/// The file name of ps `k`'s shard in a checkpoint.
pub fn file(k: usize) -> String {
    format!("shard-ps{k}.bin")
}

/// One ps's restored state: parameters and optimizer state per shard, and the step.
pub type Contents = (Vec<Vec<f32>>, Vec<Slots>, u64);

/// Reads ps `k`'s shard from checkpoint `dir`; an error (never a partial result) if
/// anything is missing or mis-sized.
pub fn read(dir: &Path, k: usize, shards: &[Shard]) -> Result<Contents, String> {
    let a = checkpoint::read_file(&dir.join(file(k)), None).map_err(|e| e.to_string())?;
    let t = a.meta["t"].as_u64().unwrap_or(a.step);
    let mut params = Vec::new();
    let mut slots = Vec::new();
    for s in shards {
        let key = format!("{}@{}", s.var, s.offset);
        let get = |suffix: &str| {
            a.get(&format!("{key}/{suffix}"))
                .map(<[f32]>::to_vec)
                .ok_or(format!(
                    "checkpoint {} has no {key}/{suffix} (written with another placement?)",
                    dir.display()
                ))
        };
        let p = get("param")?;
        if p.len() != s.len {
            return Err(format!(
                "checkpoint {}: {key} has {} elements, expected {}",
                dir.display(),
                p.len(),
                s.len
            ));
        }
        params.push(p);
        slots.push(Slots {
            m: get("m")?,
            v: get("v")?,
            t,
        });
    }
    Ok((params, slots, a.step))
}
