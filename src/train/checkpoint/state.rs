//! The training state a checkpoint holds, whichever mode wrote it: every variable's values
//! and optimizer state, whole.
//!
//! Every file of a checkpoint holds slices of variables, `var@offset/param`, `/m` and `/v`:
//! each ps task writes the slices it holds to its own file; the replica modes (allreduce
//! and local) write every variable whole (`@0`) to one file. The manifest names the model
//! and lists its variables (name and elements, in creation order). So any mode restores
//! from any mode's checkpoint (an allreduce job from a ps job's, a job with another number
//! of ps tasks or another placement), and a checkpoint of another model is refused with
//! one line naming both sides.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::{Arrays, CheckpointError, Found};
use crate::model::Replica;
use crate::train::events::Event;
use crate::train::optim::{Optimizer, Slots};

/// The one file of a replica mode's checkpoint.
pub const REPLICA_FILE: &str = "shard-replicas.bin";

/// A model's variables: name and elements, in creation order.
pub type Variables = [(String, usize)];

/// The manifest's description of the model a checkpoint belongs to.
pub fn model_meta(describe: &str, vars: &Variables) -> Value {
    json!({
        "model": describe,
        "variables": vars.iter().map(|(n, k)| json!([n, k])).collect::<Vec<_>>(),
    })
}

fn other_model(path: &Path, why: String) -> CheckpointError {
    CheckpointError::OtherModel {
        path: path.display().to_string(),
        why,
    }
}

/// Refuses checkpoint `found` unless it was written for a model with exactly `vars`
/// (checkpoints written before the manifest listed variables are checked when loaded).
pub fn check_model(found: &Found, vars: &Variables) -> Result<(), CheckpointError> {
    let Some(listed) = found.meta["variables"].as_array() else {
        return Ok(());
    };
    let theirs: Vec<(String, usize)> = listed
        .iter()
        .map(|v| {
            (
                v[0].as_str().unwrap_or("?").to_string(),
                v[1].as_u64().unwrap_or(0) as usize,
            )
        })
        .collect();
    let model = found.meta["model"].as_str().unwrap_or("a model");
    if theirs.len() != vars.len() {
        return Err(other_model(
            &found.path,
            format!(
                "it holds {} variables ({model}), this model has {}",
                theirs.len(),
                vars.len()
            ),
        ));
    }
    for (i, ((a, n), (b, m))) in theirs.iter().zip(vars).enumerate() {
        if a != b || n != m {
            return Err(other_model(
                &found.path,
                format!(
                    "its variable {i} is {a} ({n} elements), this model's is {b} ({m} elements)"
                ),
            ));
        }
    }
    Ok(())
}

/// One variable's values and optimizer state.
#[derive(Debug, Clone, PartialEq)]
pub struct VarState {
    pub param: Vec<f32>,
    /// Empty when the optimizer keeps no such state.
    pub m: Vec<f32>,
    pub v: Vec<f32>,
}

/// Every variable of a model, whole, as a checkpoint restores it.
#[derive(Debug, Clone, PartialEq)]
pub struct State {
    /// The global step the checkpoint was taken at.
    pub step: u64,
    /// Updates the optimizer had applied (Adam's bias correction).
    pub t: u64,
    /// In the order of the model's variables.
    pub vars: Vec<VarState>,
}

/// `var@offset/part`, or the older replica form `var/part` (offset 0).
fn parse_key(key: &str) -> Option<(&str, usize, &str)> {
    let (var, part) = key.rsplit_once('/')?;
    match var.rsplit_once('@') {
        Some((name, offset)) => Some((name, offset.parse().ok()?, part)),
        None => Some((var, 0, part)),
    }
}

impl State {
    /// Reads the checkpoint at `path` (every file it lists, verified, each read once) for
    /// a model with variables `vars`: an error, never a partial state, if it belongs to
    /// another model or any element is missing.
    pub fn open(path: &Path, vars: &Variables) -> Result<State, CheckpointError> {
        let (found, files) = super::open(path)?;
        State::from_files(&found, &files, vars)
    }

    /// The state of checkpoint `found`, whose files hold `files`, for variables `vars`.
    fn from_files(
        found: &Found,
        files: &[Arrays],
        vars: &Variables,
    ) -> Result<State, CheckpointError> {
        check_model(found, vars)?;
        let mut state = State::assemble(&found.path, files, vars)?;
        state.step = found.step;
        Ok(state)
    }

    /// [`State::open`] for some of the checkpoint's variables (a pipeline stage's): each
    /// of `vars` must be one of its variables, of the same size; the others are skipped.
    /// With `model`, the whole model's variables, the checkpoint must be of that model.
    pub fn open_part(
        path: &Path,
        vars: &Variables,
        model: Option<&Variables>,
    ) -> Result<State, CheckpointError> {
        let (found, files) = super::open(path)?;
        if let Some(all) = model {
            check_model(&found, all)?;
        }
        if let Some(listed) = found.meta["variables"].as_array() {
            for (name, n) in vars {
                let theirs = listed.iter().find(|v| v[0].as_str() == Some(name.as_str()));
                let size = theirs.and_then(|v| v[1].as_u64()).map(|m| m as usize);
                if size != Some(*n) {
                    let model = found.meta["model"].as_str().unwrap_or("a model");
                    return Err(other_model(
                        &found.path,
                        format!("it holds no variable {name} of {n} elements ({model})"),
                    ));
                }
            }
        }
        let mut state = State::assemble_from(&found.path, &files, vars, true)?;
        state.step = found.step;
        Ok(state)
    }

    /// The state `files` (each a checkpoint file's arrays) hold for variables `vars`;
    /// `path` names them in errors.
    pub fn assemble(
        path: &Path,
        files: &[Arrays],
        vars: &Variables,
    ) -> Result<State, CheckpointError> {
        State::assemble_from(path, files, vars, false)
    }

    /// [`State::assemble`]; with `subset`, arrays of other variables are skipped, not
    /// refused.
    fn assemble_from(
        path: &Path,
        files: &[Arrays],
        vars: &Variables,
        subset: bool,
    ) -> Result<State, CheckpointError> {
        let mut state = State {
            step: 0,
            t: 0,
            vars: vars
                .iter()
                .map(|(_, n)| VarState {
                    param: vec![0.0; *n],
                    m: Vec::new(),
                    v: Vec::new(),
                })
                .collect(),
        };
        let mut covered = vec![0usize; vars.len()];
        for a in files {
            state.step = state.step.max(a.step);
            state.t = state.t.max(a.meta["t"].as_u64().unwrap_or(a.step));
            for (key, values) in &a.arrays {
                if key.starts_with(super::TABLE_ARRAYS) {
                    continue; // an embedding table's rows: the ps tasks' own to restore
                }
                let (name, offset, part) = parse_key(key)
                    .ok_or_else(|| other_model(path, format!("it holds an array named {key:?}")))?;
                let Some(i) = vars.iter().position(|(n, _)| n == name) else {
                    if subset {
                        continue;
                    }
                    return Err(other_model(
                        path,
                        format!("it holds variable {name}, which this model does not have"),
                    ));
                };
                let n = vars[i].1;
                if offset + values.len() > n {
                    return Err(other_model(
                        path,
                        format!(
                            "its {name}[{offset}..{}] lies beyond this model's {n} elements",
                            offset + values.len()
                        ),
                    ));
                }
                let var = &mut state.vars[i];
                let target = match part {
                    "param" => {
                        covered[i] += values.len();
                        &mut var.param
                    }
                    "m" => &mut var.m,
                    "v" => &mut var.v,
                    _ => continue,
                };
                if target.len() < n {
                    target.resize(n, 0.0);
                }
                target[offset..offset + values.len()].copy_from_slice(values);
            }
        }
        for ((name, n), got) in vars.iter().zip(&covered) {
            if got != n {
                return Err(CheckpointError::Corrupt {
                    path: path.display().to_string(),
                    why: format!("it holds {got} of {name}'s {n} elements"),
                });
            }
        }
        Ok(state)
    }

    /// A replica's state: its parameters and their optimizer state at `step`.
    pub fn of_replica(model: &Replica<'_>, slots: &[Slots], step: u64) -> State {
        State::of_params(&model.params, slots, step)
    }

    /// The state of parameters `params` (all of a model's, or a part: a pipeline stage's)
    /// and their optimizer state at `step`.
    pub fn of_params(params: &[crate::tensor::Tensor], slots: &[Slots], step: u64) -> State {
        State {
            step,
            t: slots.first().map_or(0, |s| s.t),
            vars: params
                .iter()
                .zip(slots)
                .map(|(p, s)| VarState {
                    param: p.as_slice::<f32>().expect("f32").to_vec(),
                    m: s.m.clone(),
                    v: s.v.clone(),
                })
                .collect(),
        }
    }

    /// Sets a replica's parameters to this state's, and its optimizer state to what `opt`
    /// resumes from (see [`Optimizer::resume`]).
    pub fn apply_to(&self, model: &mut Replica<'_>, slots: &mut [Slots], opt: &Optimizer) {
        for ((p, s), v) in model.params.iter_mut().zip(slots).zip(&self.vars) {
            p.as_mut_slice::<f32>()
                .expect("f32")
                .copy_from_slice(&v.param);
            *s = opt.resume(v.param.len(), v.m.clone(), v.v.clone(), self.t);
        }
    }

    /// The replica modes' checkpoint file: every variable whole, at offset 0.
    pub fn arrays(&self, vars: &Variables) -> Arrays {
        let mut arrays = Vec::new();
        for ((name, _), v) in vars.iter().zip(&self.vars) {
            arrays.push((format!("{name}@0/param"), v.param.clone()));
            arrays.push((format!("{name}@0/m"), v.m.clone()));
            arrays.push((format!("{name}@0/v"), v.v.clone()));
        }
        Arrays {
            step: self.step,
            meta: json!({"t": self.t}),
            arrays,
        }
    }

    /// Writes this state as a checkpoint of a replica mode into `dir` (one file, the
    /// manifest naming `describe`'s model), atomically; returns its directory.
    pub fn write(
        &self,
        dir: &Path,
        describe: &str,
        vars: &Variables,
    ) -> Result<PathBuf, CheckpointError> {
        let written = super::begin(dir, self.step).and_then(|tmp| {
            let (bytes, sum) = super::write_file(&tmp.join(REPLICA_FILE), &self.arrays(vars))?;
            super::commit(
                dir,
                self.step,
                &[(REPLICA_FILE.into(), bytes, sum)],
                model_meta(describe, vars),
            )
        });
        written.map_err(|e| super::abandoned(dir, self.step, e))
    }

    /// Elements `offset..offset + len` of variable `var`: values, and the state `opt`
    /// resumes from (see [`Optimizer::resume`]).
    pub fn slice(
        &self,
        var: usize,
        offset: usize,
        len: usize,
        opt: &Optimizer,
    ) -> (Vec<f32>, Slots) {
        let v = &self.vars[var];
        let part = |x: &Vec<f32>| {
            x.get(offset..offset + len)
                .map_or_else(Vec::new, <[f32]>::to_vec)
        };
        (
            part(&v.param),
            opt.resume(len, part(&v.m), part(&v.v), self.t),
        )
    }
}

/// The newest valid checkpoint in `dir` (created if missing), loaded for a model of
/// `vars`, if there is one; `events` hears of each newer one that did not verify, and of
/// the one restored. Any mode's checkpoint will do.
pub fn restore(
    dir: &Path,
    vars: &Variables,
    events: &mut dyn FnMut(&Event),
) -> Result<Option<State>, CheckpointError> {
    super::prepare_dir(dir)?;
    // Each file is read once: the newest checkpoint that verifies is also the one loaded.
    let (opened, warnings) = super::latest_with(dir, super::open);
    for w in warnings {
        events(&Event::Warning(w));
    }
    let Some((found, files)) = opened else {
        return Ok(None);
    };
    let state = State::from_files(&found, &files, vars)?;
    events(&Event::Restored {
        path: found.path,
        step: found.step,
    });
    Ok(Some(state))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::checkpoint::{begin, commit, latest, write_file, Arrays};

    fn vars() -> Vec<(String, usize)> {
        vec![("w".into(), 4), ("b".into(), 2)]
    }

    /// Writes one checkpoint of `files` (name, arrays) into a fresh `dir`.
    /// A file's name and its arrays.
    type File<'a> = (&'a str, Vec<(String, Vec<f32>)>);

    fn write(dir: &Path, files: &[File<'_>], meta: Value) -> Found {
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir).unwrap();
        let tmp = begin(dir, 7).unwrap();
        let mut listed = Vec::new();
        for (name, arrays) in files {
            let a = Arrays {
                step: 7,
                meta: json!({"t": 7}),
                arrays: arrays.clone(),
            };
            let (b, c) = write_file(&tmp.join(name), &a).unwrap();
            listed.push((name.to_string(), b, c));
        }
        commit(dir, 7, &listed, meta).unwrap();
        latest(dir).0.unwrap()
    }

    #[test]
    fn slices_of_several_files_make_whole_variables_and_slice_again() {
        let dir = std::env::temp_dir().join(format!("mpiflow-state-{}", std::process::id()));
        // Two ps tasks: w cut in two, b whole on the second; Adam state alongside.
        let ps0 = vec![
            ("w@0/param".into(), vec![1.0, 2.0]),
            ("w@0/m".into(), vec![0.1, 0.2]),
            ("w@0/v".into(), vec![0.01, 0.02]),
        ];
        let ps1 = vec![
            ("w@2/param".into(), vec![3.0, 4.0]),
            ("w@2/m".into(), vec![0.3, 0.4]),
            ("w@2/v".into(), vec![0.03, 0.04]),
            ("b@0/param".into(), vec![5.0, 6.0]),
            ("b@0/m".into(), vec![0.5, 0.6]),
            ("b@0/v".into(), vec![0.05, 0.06]),
        ];
        let found = write(
            &dir,
            &[("shard-ps0.bin", ps0), ("shard-ps1.bin", ps1.clone())],
            model_meta("test", &vars()),
        );
        let s = State::open(&found.path, &vars()).unwrap();
        assert_eq!((s.step, s.t), (7, 7));
        assert_eq!(s.vars[0].param, [1.0, 2.0, 3.0, 4.0]);
        assert_eq!(s.vars[0].m, [0.1, 0.2, 0.3, 0.4]);
        assert_eq!(s.vars[1].v, [0.05, 0.06]);
        // Restored by one replica, or by three ps tasks cutting w otherwise.
        let adam = Optimizer::new(crate::train::optim::OptimizerKind::Adam, 0.1);
        let (p, slots) = s.slice(0, 1, 2, &adam);
        assert_eq!(p, [2.0, 3.0]);
        assert_eq!(slots.v, [0.02, 0.03]);
        assert_eq!(slots.t, 7);

        // Another model: refused by the manifest, naming both sides.
        let other = vec![("w".to_string(), 4), ("b".to_string(), 3)];
        let e = State::open(&found.path, &other).unwrap_err().to_string();
        assert!(
            e.contains("another model")
                && e.contains("its variable 1 is b (2 elements), this model's is b (3 elements)"),
            "{e}"
        );
        // A checkpoint that lacks part of a variable is an error, not zeros.
        let found = write(&dir, &[("shard-ps1.bin", ps1)], json!({}));
        let e = State::open(&found.path, &vars()).unwrap_err().to_string();
        assert!(e.contains("it holds 2 of w's 4 elements"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
