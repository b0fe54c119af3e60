//! The ps checkpoint: one file per ps task (`shard-ps{k}.bin`, each shard's parameters
//! and optimizer state by `var@offset`) and the chief's manifest over them, committed
//! atomically. Both ps transports write and read it.

use std::path::Path;

use serde_json::json;

use super::placement::Shard;
use super::PsError;
use crate::train::checkpoint::state::Variables;
use crate::train::checkpoint::{self, Arrays};
use crate::train::events::Event;
use crate::train::optim::{Optimizer, Slots};

/// The newest valid checkpoint of `dir` (created if missing), refused if it belongs to a
/// model with other variables than `vars`, and a warning for each newer one that did not
/// verify. Any mode's checkpoint will do (see [`checkpoint::state`]).
pub fn newest(
    dir: Option<&Path>,
    vars: &Variables,
) -> Result<(Option<checkpoint::Found>, Vec<String>), PsError> {
    let Some(dir) = dir else {
        return Ok((None, Vec::new()));
    };
    checkpoint::prepare_dir(dir)?;
    let (found, warnings) = checkpoint::latest(dir);
    if let Some(f) = &found {
        checkpoint::state::check_model(f, vars)?;
    }
    Ok((found, warnings))
}

/// The chief's last act of a checkpoint: the manifest over every ps's shard file (name,
/// bytes, checksum) and the model's description (`meta`, from
/// [`checkpoint::state::model_meta`]), committed atomically (the newest `keep` kept: [`checkpoint::retain`]); the event that
/// says so.
pub fn commit(
    dir: &Path,
    step: u64,
    files: &[(String, u64, u64)],
    meta: serde_json::Value,
    keep: usize,
) -> Result<Event, PsError> {
    let path = checkpoint::commit(dir, step, files, meta)?;
    checkpoint::retain(dir, keep);
    Ok(Event::Checkpoint { path, step })
}

/// The variables `shards` (every shard of every variable) cut: name and elements, in
/// creation order.
pub fn variables(shards: &[Shard]) -> Vec<(String, usize)> {
    let mut vars: Vec<(String, usize)> = Vec::new();
    for s in shards {
        if vars.len() <= s.var_index {
            vars.resize(s.var_index + 1, (String::new(), 0));
        }
        let v = &mut vars[s.var_index];
        v.0.clone_from(&s.var);
        v.1 = v.1.max(s.offset + s.len);
    }
    vars
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

/// The file name of ps `k`'s shard of pipeline stage `stage`'s variables (`None`: of the
/// whole model, [`file()`]).
pub fn file_of(k: usize, stage: Option<usize>) -> String {
    match stage {
        Some(s) => format!("shard-stage{s}-ps{k}.bin"),
        None => file(k),
    }
}

/// One ps's restored state: parameters and optimizer state per shard, and the step.
pub type Contents = (Vec<Vec<f32>>, Vec<Slots>, u64);

/// Reads the shards `mine` of checkpoint `dir` for the variables `all` cut (every shard
/// of every variable): whichever mode and placement wrote it; an error (never a partial
/// result) if anything is missing or mis-sized. `part`: the variables are some of the
/// checkpoint's (a pipeline stage's), read by name.
pub fn read(
    dir: &Path,
    mine: &[Shard],
    all: &[Shard],
    opt: &Optimizer,
    part: bool,
) -> Result<Contents, PsError> {
    let vars = variables(all);
    let state = match part {
        true => checkpoint::State::open_part(dir, &vars, None)?,
        false => checkpoint::State::open(dir, &vars)?,
    };
    let (params, slots) = mine
        .iter()
        .map(|s| state.slice(s.var_index, s.offset, s.len, opt))
        .unzip();
    Ok((params, slots, state.step))
}
