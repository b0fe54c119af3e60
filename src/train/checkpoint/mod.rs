//! Checkpoints: written atomically, verified on load, never restored in part.
//!
//! Layout: `DIR/ckpt-<step>/` holds `manifest.json` and one `shard-ps<k>.bin` per parameter
//! server (each ps writes its own). A checkpoint is first written as `DIR/.ckpt-<step>.tmp/`
//! (every file fsynced), the manifest last, then the directory is renamed into place and
//! `DIR` fsynced: a crash leaves either the whole checkpoint or none.
//!
//! A shard file is `MFCKPT01 | u32 header length | JSON header | f32 arrays | u64 FNV-1a of
//! everything before`. The manifest records each shard's size and checksum. On load, the
//! newest checkpoint whose manifest and every shard verify is used; a corrupted or
//! incomplete one is reported and the previous one tried.
//!
//! What the files hold, and how every mode restores from any mode's checkpoint: `state`.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

pub(crate) mod state;
pub mod tables;

pub use state::State;

const MAGIC: &[u8; 8] = b"MFCKPT01";

/// Errors from writing or reading checkpoints.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CheckpointError {
    #[error("checkpoint {path}: {why}")]
    Io { path: String, why: String },
    #[error("checkpoint {path}: corrupted: {why}")]
    Corrupt { path: String, why: String },
    #[error("checkpoint {path} was written for another model: {why}")]
    OtherModel { path: String, why: String },
    /// A checkpoint directory that cannot hold checkpoints (a file there, no permission).
    #[error("checkpoint directory {path}: {why}")]
    Dir { path: String, why: String },
    /// A parameters file (`save_params`, `--save-params`) that cannot be written.
    #[error("parameters file {path}: {why}")]
    Params { path: String, why: String },
    /// Writing the checkpoint of `step` failed (a full or read-only disk): what it had
    /// written is removed, and `newest`, the newest valid checkpoint, stays as it was.
    #[error("checkpoint of step {step} not written ({why}); {}", match newest { Some(p) => format!("the newest checkpoint is still {p}"), None => "there is no earlier checkpoint".into() })]
    NotWritten {
        step: u64,
        why: String,
        newest: Option<String>,
    },
}

/// The error of a checkpoint of `step` in `dir` that failed with `e`: its staging
/// directory is removed (freeing what it took of a full disk), and the error names the
/// newest valid checkpoint, untouched.
pub fn abandoned(dir: &Path, step: u64, e: impl std::fmt::Display) -> CheckpointError {
    let _ = fs::remove_dir_all(staging_dir(dir, step));
    let newest = latest(dir).0.map(|f| f.path.display().to_string());
    CheckpointError::NotWritten {
        step,
        why: e.to_string(),
        newest,
    }
}

fn io(path: &Path, e: impl std::fmt::Display) -> CheckpointError {
    CheckpointError::Io {
        path: path.display().to_string(),
        why: e.to_string(),
    }
}

fn corrupt(path: &Path, why: impl Into<String>) -> CheckpointError {
    CheckpointError::Corrupt {
        path: path.display().to_string(),
        why: why.into(),
    }
}

/// The checksum of checkpoint files (64-bit FNV-1a).
pub fn checksum(bytes: &[u8]) -> u64 {
    crate::hash::fnv1a(bytes)
}

/// The first characters of the names of the arrays that hold an embedding table's rows in
/// a ps task's shard file (`table:NAME:ids`, `:values`, `:state`): no model variable;
/// whoever holds the rows restores them ([`tables`]).
pub const TABLE_ARRAYS: &str = "table:";

/// Named float arrays with a little metadata: what a shard file holds.
#[derive(Debug, Clone, PartialEq)]
pub struct Arrays {
    pub step: u64,
    pub meta: Value,
    pub arrays: Vec<(String, Vec<f32>)>,
}

impl Arrays {
    pub fn get(&self, name: &str) -> Option<&[f32]> {
        self.arrays
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
    }
}

/// Writes `a` to `path` (fsynced); returns (bytes, checksum).
pub fn write_file(path: &Path, a: &Arrays) -> Result<(u64, u64), CheckpointError> {
    let bytes = encode(a);
    let sum = u64::from_le_bytes(bytes[bytes.len() - 8..].try_into().expect("8 bytes"));
    let mut f = File::create(path).map_err(|e| io(path, e))?;
    f.write_all(&bytes).map_err(|e| io(path, e))?;
    f.sync_all().map_err(|e| io(path, e))?;
    Ok((bytes.len() as u64, sum))
}

#[cfg(test)]
thread_local! {
    /// How much longer than the write itself a checkpoint file written for this thread by
    /// a writer of its own takes: a slow file system, in tests.
    pub(crate) static SLOW_DISK: std::cell::Cell<std::time::Duration> =
        const { std::cell::Cell::new(std::time::Duration::ZERO) };
}

/// [`write_file`] on a thread of its own while this one calls `beat` every `every`: a
/// task that writes a large file (or to a slow file system) stays alive to its peers, which
/// count `beat`'s marks as a sign of life, not as silence.
pub fn write_file_beating<E>(
    path: &Path,
    a: &Arrays,
    every: std::time::Duration,
    mut beat: impl FnMut() -> Result<(), E>,
) -> Result<Result<(u64, u64), CheckpointError>, E> {
    #[cfg(test)]
    let slow = SLOW_DISK.get();
    std::thread::scope(|s| {
        let writer = s.spawn(|| {
            #[cfg(test)]
            std::thread::sleep(slow);
            write_file(path, a)
        });
        let mut last = std::time::Instant::now();
        while !writer.is_finished() {
            std::thread::sleep(every.min(std::time::Duration::from_millis(1)));
            if last.elapsed() >= every {
                beat()?;
                last = std::time::Instant::now();
            }
        }
        Ok(writer
            .join()
            .expect("writing a checkpoint file does not panic"))
    })
}

/// Why a directory cannot take new files: it could not be created, or a file could not be
/// written into it.
enum Unwritable {
    Create(std::io::Error),
    Write(std::io::Error),
}

/// Creates `dir` if missing and writes the file `probe` in it (removed at once): what
/// [`prepare_dir`] and [`prepare_params_file`] check before a run.
fn takes_files(dir: &Path, probe: &Path) -> Result<(), Unwritable> {
    fs::create_dir_all(dir).map_err(Unwritable::Create)?;
    File::create(probe).map_err(Unwritable::Write)?;
    let _ = fs::remove_file(probe);
    Ok(())
}

/// Makes `dir` ready to take checkpoints before a run starts, so that a directory that
/// cannot hold them fails the run at once, not at its first checkpoint: created if
/// missing, and a new file written into it (a probe, removed at once).
pub fn prepare_dir(dir: &Path) -> Result<(), CheckpointError> {
    let why = if dir.exists() && !dir.is_dir() {
        "is a file, not a directory".to_string()
    } else {
        match takes_files(dir, &dir.join(format!(".probe.{}", std::process::id()))) {
            Ok(()) => return Ok(()),
            Err(Unwritable::Create(e)) => format!("cannot create it: {e}"),
            Err(Unwritable::Write(e)) => format!("cannot write into it: {e}"),
        }
    };
    Err(CheckpointError::Dir {
        path: dir.display().to_string(),
        why,
    })
}

/// Checks, before a run, that a parameters file can be written at `path` (`--save-params`),
/// so that a run does not end with its result unwritable: `path` is no directory, and its
/// directory (created if missing) takes a new file (a probe, removed at once).
pub fn prepare_params_file(path: &Path) -> Result<(), CheckpointError> {
    let dir = directory_of(path);
    let why = if path.is_dir() {
        "is a directory".to_string()
    } else {
        match takes_files(&dir, &beside(path, "probe")) {
            Ok(()) => return Ok(()),
            Err(Unwritable::Create(e)) => {
                format!("cannot create its directory {}: {e}", dir.display())
            }
            Err(Unwritable::Write(e)) => format!("cannot write into {}: {e}", dir.display()),
        }
    };
    Err(CheckpointError::Params {
        path: path.display().to_string(),
        why,
    })
}

/// Writes a parameters file atomically: a temporary file beside `path`, fsynced, renamed
/// into place, its directory fsynced. A crash or a full disk leaves an earlier file at
/// `path` whole.
pub fn write_params_file(path: &Path, a: &Arrays) -> Result<(), CheckpointError> {
    let tmp = beside(path, "tmp");
    let dir = directory_of(path);
    let written = write_file(&tmp, a)
        .and_then(|_| fs::rename(&tmp, path).map_err(|e| io(path, e)))
        .and_then(|()| fsync_dir(&dir));
    written.map_err(|e| {
        let _ = fs::remove_file(&tmp);
        let why = match e {
            CheckpointError::Io { why, .. } => why,
            other => other.to_string(),
        };
        CheckpointError::Params {
            path: path.display().to_string(),
            why,
        }
    })
}

/// The directory a file at `path` goes into (`.` for a bare file name).
fn directory_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// A hidden file beside `path` for `what` (`.NAME.what.PID`): one per process, so that
/// ranks sharing a directory never write the same one.
fn beside(path: &Path, what: &str) -> PathBuf {
    let name = path
        .file_name()
        .map_or_else(|| "params".into(), |n| n.to_string_lossy().into_owned());
    directory_of(path).join(format!(".{name}.{what}.{}", std::process::id()))
}

/// The bytes of a checkpoint file holding `a` (what [`parse`] reads).
pub fn encode(a: &Arrays) -> Vec<u8> {
    let header = json!({
        "step": a.step,
        "meta": a.meta,
        "arrays": a.arrays.iter().map(|(n, v)| json!([n, v.len()])).collect::<Vec<_>>(),
    })
    .to_string();
    let mut bytes = Vec::with_capacity(
        16 + header.len() + a.arrays.iter().map(|x| 4 * x.1.len()).sum::<usize>(),
    );
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&(header.len() as u32).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    for (_, v) in &a.arrays {
        for x in v {
            bytes.extend_from_slice(&x.to_le_bytes());
        }
    }
    let sum = checksum(&bytes);
    bytes.extend_from_slice(&sum.to_le_bytes());
    bytes
}

/// Reads and verifies a shard file (`expect`: size and checksum from a manifest).
pub fn read_file(path: &Path, expect: Option<(u64, u64)>) -> Result<Arrays, CheckpointError> {
    let bytes = fs::read(path).map_err(|e| io(path, e))?;
    if let Some((size, _)) = expect {
        if bytes.len() as u64 != size {
            return Err(corrupt(
                path,
                format!("{} bytes, the manifest says {size}", bytes.len()),
            ));
        }
    }
    parse(path, &bytes, expect.map(|e| e.1))
}

/// Parses and verifies the bytes of a shard file (`path` names it in errors).
pub fn parse(
    path: &Path,
    bytes: &[u8],
    expect_checksum: Option<u64>,
) -> Result<Arrays, CheckpointError> {
    if bytes.len() < 20 || &bytes[..8] != MAGIC {
        return Err(corrupt(path, "not an mpiflow checkpoint file"));
    }
    let (body, tail) = bytes.split_at(bytes.len() - 8);
    let stored = u64::from_le_bytes(tail.try_into().expect("8 bytes"));
    let sum = checksum(body);
    if stored != sum || expect_checksum.is_some_and(|c| c != sum) {
        return Err(corrupt(path, "checksum mismatch"));
    }
    let hlen = u32::from_le_bytes(body[8..12].try_into().expect("4 bytes")) as usize;
    let header: Value = body
        .get(12..12 + hlen)
        .and_then(|h| serde_json::from_slice(h).ok())
        .ok_or_else(|| corrupt(path, "bad header"))?;
    let mut data = &body[12 + hlen..];
    let mut arrays = Vec::new();
    for entry in header["arrays"]
        .as_array()
        .ok_or_else(|| corrupt(path, "no arrays"))?
    {
        let name = entry[0].as_str().unwrap_or_default();
        // A length past the file (or past usize) is a truncated array, never a wrap.
        let len = entry[1]
            .as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .and_then(|n| n.checked_mul(4))
            .filter(|&n| n <= data.len())
            .ok_or_else(|| corrupt(path, format!("array {name} is truncated")))?;
        let (this, rest) = data.split_at(len);
        arrays.push((
            name.to_string(),
            this.chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4")))
                .collect(),
        ));
        data = rest;
    }
    if !data.is_empty() {
        return Err(corrupt(path, "trailing bytes"));
    }
    Ok(Arrays {
        step: header["step"].as_u64().unwrap_or(0),
        meta: header["meta"].clone(),
        arrays,
    })
}

/// Where the checkpoint of `step` lives once committed.
pub fn path_of(dir: &Path, step: u64) -> PathBuf {
    dir.join(format!("ckpt-{step}"))
}

/// The temporary directory a checkpoint of `step` is written into.
pub fn staging_dir(dir: &Path, step: u64) -> PathBuf {
    dir.join(format!(".ckpt-{step}.tmp"))
}

/// Creates an empty staging directory for `step`.
pub fn begin(dir: &Path, step: u64) -> Result<PathBuf, CheckpointError> {
    let tmp = staging_dir(dir, step);
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(|e| io(&tmp, e))?;
    }
    fs::create_dir_all(&tmp).map_err(|e| io(&tmp, e))?;
    Ok(tmp)
}

fn fsync_dir(dir: &Path) -> Result<(), CheckpointError> {
    File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(|e| io(dir, e))
}

/// Finishes a checkpoint: writes the manifest (files: name, bytes, checksum) and renames
/// the staging directory into place.
pub fn commit(
    dir: &Path,
    step: u64,
    files: &[(String, u64, u64)],
    meta: Value,
) -> Result<PathBuf, CheckpointError> {
    let tmp = staging_dir(dir, step);
    let manifest = json!({
        "step": step,
        "meta": meta,
        "files": files.iter().map(|(n, b, c)| json!({"file": n, "bytes": b, "checksum": format!("{c:016x}")})).collect::<Vec<_>>(),
    });
    let mpath = tmp.join("manifest.json");
    let mut f = File::create(&mpath).map_err(|e| io(&mpath, e))?;
    f.write_all(manifest.to_string().as_bytes())
        .and_then(|_| f.sync_all())
        .map_err(|e| io(&mpath, e))?;
    fsync_dir(&tmp)?;
    let fin = path_of(dir, step);
    if fin.exists() {
        fs::remove_dir_all(&fin).map_err(|e| io(&fin, e))?;
    }
    fs::rename(&tmp, &fin).map_err(|e| io(&fin, e))?;
    fsync_dir(dir)?;
    Ok(fin)
}

/// Removes all but the newest `keep` committed checkpoints in `dir` (0: keeps all), and
/// staging directories older than the newest checkpoint (a crash's leftovers). A failure
/// to remove one leaves it: the next commit tries again.
pub fn retain(dir: &Path, keep: usize) {
    let listed = listed(dir);
    let newest = listed.first().map(|(s, _)| *s);
    if keep > 0 {
        for (_, old) in listed.iter().skip(keep) {
            let _ = fs::remove_dir_all(old);
        }
    }
    let Some(newest) = newest else { return };
    for e in fs::read_dir(dir).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let step = name
            .strip_prefix(".ckpt-")
            .and_then(|s| s.strip_suffix(".tmp"))
            .and_then(|s| s.parse::<u64>().ok());
        if step.is_some_and(|s| s < newest) {
            let _ = fs::remove_dir_all(e.path());
        }
    }
}

/// A verified checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct Found {
    pub step: u64,
    pub path: PathBuf,
    pub meta: Value,
    /// File name, bytes, checksum.
    pub files: Vec<(String, u64, u64)>,
}

/// Checks a checkpoint directory: manifest and every file.
pub fn verify(path: &Path) -> Result<Found, CheckpointError> {
    open(path).map(|(found, _)| found)
}

/// Reads and checks a checkpoint directory: its manifest, and every file it lists, each
/// read once and returned in the manifest's order.
pub fn open(path: &Path) -> Result<(Found, Vec<Arrays>), CheckpointError> {
    let mpath = path.join("manifest.json");
    let text = fs::read_to_string(&mpath)
        .map_err(|_| corrupt(path, "no manifest (incomplete checkpoint)"))?;
    let m: Value =
        serde_json::from_str(&text).map_err(|_| corrupt(&mpath, "manifest is not JSON"))?;
    let mut files = Vec::new();
    let mut contents = Vec::new();
    for f in m["files"]
        .as_array()
        .ok_or_else(|| corrupt(&mpath, "manifest lists no files"))?
    {
        let name = f["file"].as_str().unwrap_or_default().to_string();
        // A file of this checkpoint, never a path out of it.
        let plain = Path::new(&name)
            .file_name()
            .is_some_and(|n| n == name.as_str());
        if !plain {
            return Err(corrupt(&mpath, format!("file {name:?} is not a file name")));
        }
        let bytes = f["bytes"].as_u64().unwrap_or(0);
        let sum = f["checksum"]
            .as_str()
            .and_then(|c| u64::from_str_radix(c, 16).ok())
            .unwrap_or(0);
        contents.push(read_file(&path.join(&name), Some((bytes, sum)))?);
        files.push((name, bytes, sum));
    }
    let found = Found {
        step: m["step"].as_u64().unwrap_or(0),
        path: path.to_path_buf(),
        meta: m["meta"].clone(),
        files,
    };
    Ok((found, contents))
}

/// The committed checkpoints in `dir` by their names (`ckpt-STEP`), newest first: each is
/// verified when read.
pub fn listed(dir: &Path) -> Vec<(u64, PathBuf)> {
    let mut steps: Vec<(u64, PathBuf)> = fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.strip_prefix("ckpt-")
                .and_then(|s| s.parse().ok())
                .map(|s| (s, e.path()))
        })
        .collect();
    steps.sort_by_key(|s| std::cmp::Reverse(s.0));
    steps
}

/// The newest checkpoint in `dir` that verifies, and a warning for each newer one skipped.
pub fn latest(dir: &Path) -> (Option<Found>, Vec<String>) {
    latest_with(dir, verify)
}

/// The newest checkpoint in `dir` that `check` (reading it: [`verify`] or [`open`])
/// accepts, as `check` returns it, and a warning for each newer one it refused.
pub fn latest_with<T>(
    dir: &Path,
    mut check: impl FnMut(&Path) -> Result<T, CheckpointError>,
) -> (Option<T>, Vec<String>) {
    let mut warnings = Vec::new();
    for (_, p) in listed(dir) {
        match check(&p) {
            Ok(f) => return (Some(f), warnings),
            Err(e) => warnings.push(format!("{e}; trying the previous checkpoint")),
        }
    }
    (None, warnings)
}

#[cfg(test)]
mod tests;
