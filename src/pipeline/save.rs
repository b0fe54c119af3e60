//! What a pipeline keeps on disk: checkpoints in per-stage shards, and the final
//! parameters.
//!
//! A checkpoint of a pipeline is the common format ([`crate::train::checkpoint`]) with one
//! file per stage, `shard-stage<k>.bin`, holding that stage's variables whole (values and
//! optimizer state, `var@0/param`, `/m`, `/v`): replica 0's tasks write them, one each, and
//! the manifest lists every variable of the model. So a pipeline resumes from any mode's
//! checkpoint (and with another number of stages), and any mode from a pipeline's.
//!
//! Every replica task takes part in each step of writing and restoring (collectives on
//! the replica tasks' communicator), so all of them reach the same verdict: the
//! checkpoint written and its path, or the error that stops them all.

use std::ops::Range;
use std::path::{Path, PathBuf};

use super::link::{Direction, Link};
use super::stage::Stage;
use super::train::PipelineError;
use crate::model::{Model, Sequential};
use crate::train::checkpoint::state;
use crate::train::checkpoint::{self, Arrays, State};
use crate::train::events::Event;
use crate::train::optim::{Optimizer, Slots};
use crate::transport::{Collectives, Comm};

/// The file of stage `k` in a pipeline checkpoint.
pub fn stage_file(k: usize) -> String {
    format!("shard-stage{k}.bin")
}

/// Where this task stands in the replica tasks' communicator.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Writers {
    /// The group rank that begins and commits checkpoints (replica 0's stage 0).
    pub coordinator: usize,
    /// This task writes its stage's shard (it is in replica 0).
    pub writes: bool,
}

/// A checkpoint file: its name, bytes and checksum (as a manifest lists it).
type FileEntry = (String, u64, u64);

/// Where and by whom a pipeline's checkpoints are written.
pub(crate) struct Saver<'a, C: Comm> {
    /// Every replica task.
    pub group: &'a Collectives<C>,
    pub who: Writers,
    pub dir: &'a Path,
    pub model: &'a Sequential,
    /// Checkpoints kept, the newest (0: all).
    pub keep: usize,
}

/// The model's variables: name and elements, in order.
fn variables(model: &Sequential) -> Vec<(String, usize)> {
    model
        .parameters()
        .into_iter()
        .map(|p| {
            let n = p.numel();
            (p.name, n)
        })
        .collect()
}

/// Every task's result, agreed: the first error any task met (by group rank), or `Ok`.
pub(crate) fn agree<C: Comm>(
    group: &Collectives<C>,
    mine: Result<(), String>,
) -> Result<(), PipelineError> {
    let said = group.allgather_varlen(mine.err().unwrap_or_default().as_bytes())?;
    match said.iter().find(|s| !s.is_empty()) {
        Some(e) => Err(PipelineError::Config(
            String::from_utf8_lossy(e).into_owned(),
        )),
        None => Ok(()),
    }
}

/// Restores the newest valid checkpoint in `dir` (any mode's) into this stage: its
/// parameters and their optimizer state; returns its step (`None`: none there). The
/// coordinator picks the checkpoint, so every task restores the same one.
pub(crate) fn restore<C: Comm>(
    at: &Saver<'_, C>,
    st: &mut Stage<'_>,
    slots: &mut [Slots],
    opt: &Optimizer,
    events: &mut dyn FnMut(&Event),
) -> Result<Option<u64>, PipelineError> {
    let (group, who, model) = (at.group, at.who, at.model);
    let Some((path, _)) = newest(at, events)? else {
        agree(group, Ok(()))?;
        return Ok(None);
    };
    // This stage's variables alone, by name: the state assembled holds no other stage's.
    let all = variables(model);
    let vars: Vec<(String, usize)> = all[st.param_range()].to_vec();
    let opened = State::open_part(&path, &vars, Some(&all));
    agree(group, opened.as_ref().map(drop).map_err(|e| e.to_string()))?;
    let state = opened.expect("agreed");
    for ((p, s), v) in st.replica.params.iter_mut().zip(slots).zip(&state.vars) {
        p.as_mut_slice::<f32>()
            .expect("f32")
            .copy_from_slice(&v.param);
        *s = opt.resume(v.param.len(), v.m.clone(), v.v.clone(), state.t);
    }
    if st.is_last() && who.writes {
        events(&Event::Restored {
            path,
            step: state.step,
        });
    }
    Ok(Some(state.step))
}

/// This stage's variables at `step` as a checkpoint file's arrays.
fn shard(st: &Stage<'_>, slots: &[Slots], vars: &[(String, usize)], step: u64) -> Arrays {
    State::of_params(&st.replica.params, slots, step).arrays(&vars[st.param_range()])
}

/// Writes the checkpoint of `step` into `dir`: replica 0's stages one shard each, the
/// coordinator the manifest, atomically; every task returns its path, or the same error.
pub(crate) fn write<C: Comm>(
    at: &Saver<'_, C>,
    step: u64,
    st: &Stage<'_>,
    slots: &[Slots],
    events: &mut dyn FnMut(&Event),
) -> Result<PathBuf, PipelineError> {
    let vars = variables(at.model);
    write_with(at, step, st.is_last(), events, |staging| {
        let file = stage_file(st.index());
        let (bytes, sum) =
            checkpoint::write_file(&staging.join(&file), &shard(st, slots, &vars, step))
                .map_err(|e| e.to_string())?;
        Ok(vec![(file, bytes, sum)])
    })
}

/// A checkpoint of `step` into `at.dir` whose files replica 0's tasks write with `files`
/// (given the staging directory, returning each file's name, bytes and checksum): the
/// coordinator begins it and commits the manifest over every task's files; every task
/// returns its path, or the same error. `last`: this task is its replica's last stage
/// (replica 0's reports the checkpoint).
pub(crate) fn write_with<C: Comm>(
    at: &Saver<'_, C>,
    step: u64,
    last: bool,
    events: &mut dyn FnMut(&Event),
    files: impl FnOnce(&Path) -> Result<Vec<FileEntry>, String>,
) -> Result<PathBuf, PipelineError> {
    let (group, who, dir, model) = (at.group, at.who, at.dir, at.model);
    let coordinating = group.rank() == who.coordinator;
    let begun = match coordinating {
        true => checkpoint::begin(dir, step).map(drop),
        false => Ok(()),
    };
    let fail = |e: &dyn std::fmt::Display| checkpoint::abandoned(dir, step, e).to_string();
    agree(group, begun.map_err(|e| fail(&e)))?;
    let mut written = Vec::new();
    let mut status = Ok(());
    if who.writes {
        match files(&checkpoint::staging_dir(dir, step)) {
            Ok(f) => written = f,
            Err(e) => status = Err(fail(&e)),
        }
    }
    agree(group, status)?;
    let mine = serde_json::to_vec(&written).expect("names and numbers serialise");
    let listed = group.allgather_varlen(&mine)?;
    let mut committed = Ok(PathBuf::new());
    if coordinating {
        let parsed: Result<Vec<Vec<FileEntry>>, _> =
            listed.iter().map(|l| serde_json::from_slice(l)).collect();
        committed = match parsed {
            Ok(all) => {
                let files: Vec<FileEntry> = all.into_iter().flatten().collect();
                let meta = state::model_meta(&model.describe(), &variables(model));
                let committed = checkpoint::commit(dir, step, &files, meta);
                checkpoint::retain(dir, at.keep);
                committed.map_err(|e| fail(&e))
            }
            Err(e) => Err(fail(&e)),
        };
    }
    agree(group, committed.as_ref().map(drop).map_err(Clone::clone))?;
    let path = checkpoint::path_of(dir, step);
    if last && who.writes {
        events(&Event::Checkpoint {
            path: path.clone(),
            step,
        });
    }
    Ok(path)
}

/// The newest valid checkpoint in `at.dir` for the whole model and its step, as the
/// coordinator finds it (the others hear it, so every task takes the same one): `None` if
/// there is none.
pub(crate) fn newest<C: Comm>(
    at: &Saver<'_, C>,
    events: &mut dyn FnMut(&Event),
) -> Result<Option<(PathBuf, u64)>, PipelineError> {
    let (group, who, dir) = (at.group, at.who, at.dir);
    let mut picked: Result<Option<(String, u64)>, String> = Ok(None);
    if group.rank() == who.coordinator {
        picked = std::fs::create_dir_all(dir)
            .map_err(|e| format!("checkpoint {}: {e}", dir.display()))
            .and_then(|()| {
                let (found, warnings) = checkpoint::latest(dir);
                for w in warnings {
                    events(&Event::Warning(w));
                }
                // Another model's checkpoint is refused here, for every stage at once.
                let vars = variables(at.model);
                let checked = found.map(|f| {
                    state::check_model(&f, &vars).map(|()| (f.path.display().to_string(), f.step))
                });
                checked.transpose().map_err(|e| e.to_string())
            });
    }
    let mine = serde_json::to_vec(&picked).expect("strings and numbers serialise");
    let said = group.bcast_varlen(mine, who.coordinator)?;
    let said: Result<Option<(String, u64)>, String> = serde_json::from_slice(&said)
        .map_err(|e| PipelineError::Config(format!("the coordinator's checkpoint: {e}")))?;
    Ok(said
        .map_err(PipelineError::Config)?
        .map(|(path, step)| (PathBuf::from(path), step)))
}

/// Replica 0's stages send their parameters to its last stage, which writes the whole
/// model to `path` (`--save-params`).
pub(crate) fn save_params<C: Comm>(
    st: &Stage<'_>,
    link: &mut Link<'_, C>,
    model: &Sequential,
    path: &Path,
    step: u64,
) -> Result<(), PipelineError> {
    let last = st.stages() - 1;
    if !st.is_last() {
        for p in &st.replica.params {
            link.send(
                p.as_slice::<f32>().expect("f32"),
                last,
                Direction::Parameters,
            )?;
        }
        link.flush()?;
        return Ok(());
    }
    let specs = model.parameters();
    let mut arrays = Vec::with_capacity(specs.len());
    let mine: Range<usize> = st.param_range();
    for (k, layers) in st.partition().iter().enumerate() {
        for i in model.param_range(layers.clone()) {
            let values = if k == st.index() {
                st.replica.params[i - mine.start]
                    .as_slice::<f32>()
                    .expect("f32")
                    .to_vec()
            } else {
                let mut buf = vec![0.0; specs[i].numel()];
                link.receive(&mut buf, k, Direction::Parameters, i)?;
                buf
            };
            arrays.push((specs[i].name.clone(), values));
        }
    }
    checkpoint::write_params_file(
        path,
        &Arrays {
            step,
            meta: serde_json::json!({}),
            arrays,
        },
    )?;
    Ok(())
}
