//! The timeline (`mpiflow train --timeline FILE`): every rank's phases as spans (compute,
//! each allreduce, push and pull with its bytes and peer, waits, checkpoints), merged by
//! the chief at the end into one Chrome trace-event JSON file (Perfetto,
//! chrome://tracing): one process track per rank, named by its task.
//!
//! Recording is off until [`enable`]; then the training loops' spans go to this process's
//! recorder ([`span`], or [`super::phases::Clock::since`], which records as it charges).
//! Off, a span costs one relaxed atomic load. Clocks are aligned to the chief's by
//! [`align`] (the best of several round trips, as NTP does) when recording starts;
//! [`gather_trace`] collects every rank's events at the chief, who writes the file.

use std::fmt::Write as _;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use super::phases::Phase;
use crate::transport::comm::{self, Comm, TransportError};

/// What a span moved, and with whom, when it moved something.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Detail {
    pub bytes: Option<u64>,
    /// The peer (`ps:0`, `3 replicas`): shared, a span costs no allocation.
    pub peer: Option<Arc<str>>,
    pub step: Option<u64>,
}

impl Detail {
    /// A span of step `step`.
    pub fn at(step: u64) -> Detail {
        Detail {
            step: Some(step),
            ..Detail::default()
        }
    }

    /// A span of step `step` that moved `bytes` with `peer`.
    pub fn moved(step: u64, bytes: usize, peer: &Arc<str>) -> Detail {
        Detail {
            bytes: Some(bytes as u64),
            peer: Some(peer.clone()),
            step: Some(step),
        }
    }
}

/// A phase's category name.
pub fn category(phase: Phase) -> &'static str {
    match phase {
        Phase::Compute => "compute",
        Phase::Comm => "comm",
        Phase::Wait => "wait",
    }
}

/// A span as recorded: what, when, and what it moved.
struct Raw {
    name: &'static str,
    cat: &'static str,
    start: Instant,
    end: Instant,
    detail: Detail,
}

struct Recorder {
    /// `Instant`s count from here...
    epoch: Instant,
    /// ...which is this many microseconds after the trace's start on the chief's clock.
    epoch_us: f64,
    spans: Vec<Raw>,
}

static ON: AtomicBool = AtomicBool::new(false);
static RECORDER: Mutex<Option<Recorder>> = Mutex::new(None);

fn unix_us() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1e6)
}

/// How this process's clock maps to the trace's: `offset_us`, the chief's wall clock minus
/// this process's; `base_us`, the chief's wall clock at the trace's start.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Alignment {
    pub offset_us: f64,
    pub base_us: f64,
}

impl Alignment {
    /// A process alone: its own clock, the trace starting now.
    pub fn alone() -> Alignment {
        Alignment {
            offset_us: 0.0,
            base_us: unix_us(),
        }
    }
}

/// Starts recording this process's spans on the trace's clock.
pub fn enable(align: Alignment) {
    let epoch = Instant::now();
    let epoch_us = unix_us() + align.offset_us - align.base_us;
    let mut r = RECORDER.lock().unwrap_or_else(|p| p.into_inner());
    *r = Some(Recorder {
        epoch,
        epoch_us,
        spans: Vec::with_capacity(1 << 16),
    });
    ON.store(true, Ordering::Release);
}

/// Whether spans are being recorded.
#[inline]
pub fn enabled() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Records a span from `start` to `end` (nothing unless [`enable`]d).
#[inline]
pub fn span(name: &'static str, cat: &'static str, start: Instant, end: Instant, detail: Detail) {
    if enabled() {
        record(Raw {
            name,
            cat,
            start,
            end,
            detail,
        });
    }
}

#[cold]
fn record(raw: Raw) {
    let mut r = RECORDER.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(r) = r.as_mut() {
        r.spans.push(raw);
    }
}

/// Stops recording; this process's spans as trace events of process `rank` named `task`
/// (JSON objects, each followed by a comma and a newline).
pub fn take_events(rank: usize, task: &str) -> String {
    ON.store(false, Ordering::Release);
    let Some(r) = RECORDER.lock().unwrap_or_else(|p| p.into_inner()).take() else {
        return String::new();
    };
    let name = serde_json::to_string(&format!("{task} (rank {rank})")).expect("json");
    let mut out = String::with_capacity(r.spans.len() * 128);
    let _ = writeln!(
        out,
        r#"{{"name":"process_name","ph":"M","pid":{rank},"tid":0,"args":{{"name":{name}}}}},"#
    );
    let _ = writeln!(
        out,
        r#"{{"name":"process_sort_index","ph":"M","pid":{rank},"tid":0,"args":{{"sort_index":{rank}}}}},"#
    );
    let us = |t: Instant| r.epoch_us + t.saturating_duration_since(r.epoch).as_secs_f64() * 1e6;
    for s in &r.spans {
        let (ts, end) = (us(s.start), us(s.end));
        let _ = write!(
            out,
            r#"{{"name":"{}","cat":"{}","ph":"X","pid":{rank},"tid":0,"ts":{ts:.3},"dur":{:.3},"args":{{"#,
            s.name,
            s.cat,
            (end - ts).max(0.0)
        );
        let mut sep = "";
        if let Some(step) = s.detail.step {
            let _ = write!(out, r#""step":{step}"#);
            sep = ",";
        }
        if let Some(b) = s.detail.bytes {
            let _ = write!(out, r#"{sep}"bytes":{b}"#);
            sep = ",";
        }
        if let Some(p) = &s.detail.peer {
            let p = serde_json::to_string(&**p).expect("json");
            let _ = write!(out, r#"{sep}"peer":{p}"#);
        }
        out.push_str("}},\n");
    }
    out
}

/// The tag of the timeline's messages (one of the callers' tags: nothing else travels
/// when the timeline is aligned or gathered).
const TAG: i32 = 1000;

/// Collective over `c`: this rank's clock against `root`'s, from the shortest of several
/// round trips (its error is at most half that round trip), and the trace's start (the
/// root's clock when it began).
pub fn align<C: Comm>(c: &C, root: usize) -> Result<Alignment, TransportError> {
    const TRIPS: usize = 8;
    if c.rank() == root {
        let base = unix_us();
        for peer in (0..c.size()).filter(|p| *p != root) {
            for _ in 0..TRIPS {
                let mut ping = [0u8; 1];
                comm::recv(c, &mut ping, peer, TAG)?;
                let mut pong = [0u8; 16];
                pong[..8].copy_from_slice(&unix_us().to_le_bytes());
                pong[8..].copy_from_slice(&base.to_le_bytes());
                comm::send(c, &pong, peer, TAG)?;
            }
        }
        return Ok(Alignment {
            offset_us: 0.0,
            base_us: base,
        });
    }
    let mut best = (f64::INFINITY, Alignment::alone());
    for _ in 0..TRIPS {
        let t0 = unix_us();
        comm::send(c, &[1u8], root, TAG)?;
        let mut pong = [0u8; 16];
        comm::recv(c, &mut pong, root, TAG)?;
        let t1 = unix_us();
        let f = |i: usize| f64::from_le_bytes(pong[i..i + 8].try_into().expect("8 bytes"));
        if t1 - t0 < best.0 {
            let offset_us = f(0) - (t0 + t1) / 2.0;
            best = (
                t1 - t0,
                Alignment {
                    offset_us,
                    base_us: f(8),
                },
            );
        }
    }
    Ok(best.1)
}

/// Collective over `c`: stops recording and gathers every rank's events at `root`, which
/// gets the whole trace (Chrome trace-event JSON, ranks in order); the others `None`.
pub fn gather_trace<C: Comm>(
    c: &C,
    root: usize,
    task: &str,
) -> Result<Option<String>, TimelineError> {
    gather_events(c, root, take_events(c.rank(), task))
}

/// [`gather_trace`] of events already taken ([`take_events`]).
pub fn gather_events<C: Comm>(
    c: &C,
    root: usize,
    mut mine: String,
) -> Result<Option<String>, TimelineError> {
    if c.rank() != root {
        comm::send(c, &(mine.len() as u64).to_le_bytes(), root, TAG)?;
        comm::send(c, mine.as_bytes(), root, TAG)?;
        return Ok(None);
    }
    let mut chunks = Vec::with_capacity(c.size());
    for peer in 0..c.size() {
        if peer == root {
            chunks.push(std::mem::take(&mut mine));
            continue;
        }
        let mut len = [0u8; 8];
        comm::recv(c, &mut len, peer, TAG)?;
        let mut buf = vec![0u8; u64::from_le_bytes(len) as usize];
        comm::recv(c, &mut buf, peer, TAG)?;
        chunks.push(String::from_utf8(buf).map_err(|_| TimelineError::Parse { rank: peer })?);
    }
    Ok(Some(trace_of(&chunks)))
}

/// Stops recording; this process's spans alone as a whole trace (a process with no
/// peers).
pub fn local_trace(task: &str) -> String {
    trace_of(&[take_events(0, task)])
}

/// Ranks' events ([`take_events`]) as one Chrome trace-event JSON document.
fn trace_of(chunks: &[String]) -> String {
    let mut trace = String::with_capacity(chunks.iter().map(String::len).sum::<usize>() + 64);
    trace.push_str("{\"traceEvents\":[\n");
    for c in chunks {
        trace.push_str(c);
    }
    // JSON has no trailing comma: the last event's goes.
    if trace.ends_with(",\n") {
        trace.truncate(trace.len() - 2);
    }
    trace.push_str("\n],\"displayTimeUnit\":\"ms\"}\n");
    trace
}

/// Errors of gathering and writing the timeline.
#[derive(Debug, thiserror::Error)]
pub enum TimelineError {
    #[error("timeline: {0}")]
    Transport(#[from] TransportError),
    #[error("timeline: rank {rank}'s events are not UTF-8")]
    Parse { rank: usize },
    #[error("timeline {path}: cannot write it: {source}")]
    Write {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("timeline {path}: {why}")]
    Read {
        path: std::path::PathBuf,
        why: String,
    },
}

/// A span read back from a trace file.
#[derive(Debug, Clone, PartialEq)]
pub struct SpanRead {
    pub name: String,
    pub cat: String,
    pub start_us: f64,
    pub dur_us: f64,
    pub step: Option<u64>,
}

/// One process's track of a trace: its name and spans.
#[derive(Debug, Clone, PartialEq)]
pub struct Track {
    pub pid: u64,
    pub name: String,
    pub spans: Vec<SpanRead>,
}

#[derive(serde::Deserialize)]
struct TraceFile {
    #[serde(rename = "traceEvents")]
    events: Vec<RawEvent>,
}

#[derive(serde::Deserialize)]
struct RawEvent {
    name: String,
    #[serde(default)]
    cat: String,
    ph: String,
    #[serde(default)]
    pid: u64,
    #[serde(default)]
    ts: f64,
    #[serde(default)]
    dur: f64,
    #[serde(default)]
    args: RawArgs,
}

#[derive(serde::Deserialize, Default)]
struct RawArgs {
    step: Option<u64>,
    name: Option<String>,
}

/// Reads a trace-event file as [`write()`] writes it (any Chrome trace of complete events,
/// `"ph":"X"`, and `process_name` metadata; other events are skipped): its tracks in
/// process order.
pub fn read(path: &Path) -> Result<Vec<Track>, TimelineError> {
    let text = std::fs::read_to_string(path).map_err(|e| TimelineError::Read {
        path: path.to_path_buf(),
        why: format!("cannot read it: {e}"),
    })?;
    parse(path, &text)
}

/// The largest start or end (µs, either sign) of a span read back: far beyond any run
/// (1e300 µs), and a window between two such ends still has a finite width to draw.
const TIME_LIMIT_US: f64 = 1e300;

/// The tracks of trace-event text `text` (of the file `path`, named in errors), as
/// [`read`] gives them. A span must lie in time: its start and end within ±1e300 µs, its
/// duration not negative (the picture's axis is drawn from them).
pub fn parse(path: &Path, text: &str) -> Result<Vec<Track>, TimelineError> {
    let err = |why: String| TimelineError::Read {
        path: path.to_path_buf(),
        why,
    };
    let trace: TraceFile =
        serde_json::from_str(text).map_err(|e| err(format!("not a trace-event file ({e})")))?;
    let mut tracks: std::collections::BTreeMap<u64, Track> = std::collections::BTreeMap::new();
    let within = |t: f64| t.abs() <= TIME_LIMIT_US;
    for (i, e) in trace.events.into_iter().enumerate() {
        if e.ph == "X" && !(e.dur >= 0.0 && within(e.ts) && within(e.ts + e.dur)) {
            return Err(err(format!(
                "event {i} ({:?}): ts {:?} and dur {:?} are not a span in time (within ±1e300 us, dur not negative)",
                e.name, e.ts, e.dur
            )));
        }
        let track = tracks.entry(e.pid).or_insert_with(|| Track {
            pid: e.pid,
            name: format!("process {}", e.pid),
            spans: Vec::new(),
        });
        match e.ph.as_str() {
            "M" if e.name == "process_name" => {
                if let Some(n) = e.args.name {
                    track.name = n;
                }
            }
            "X" => track.spans.push(SpanRead {
                name: e.name,
                cat: e.cat,
                start_us: e.ts,
                dur_us: e.dur,
                step: e.args.step,
            }),
            _ => {}
        }
    }
    Ok(tracks.into_values().collect())
}

/// Writes `trace` to `path` (atomically: a temporary file renamed).
pub fn write(path: &Path, trace: &str) -> Result<(), TimelineError> {
    let err = |source| TimelineError::Write {
        path: path.to_path_buf(),
        source,
    };
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, trace).map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}

/// Checks that `path` can be written before a run starts: creates it (empty) or fails.
pub fn check_writable(path: &Path) -> Result<(), TimelineError> {
    std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(path)
        .map(drop)
        .map_err(|source| TimelineError::Write {
            path: path.to_path_buf(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::local::LocalComm;

    #[test]
    fn spans_are_recorded_only_when_enabled_and_gathered_into_one_trace() {
        let t = Instant::now();
        span("before", "compute", t, t, Detail::default());
        // The recorder is the process's: record here, then gather what each rank took.
        // (Other tests of this process may add spans while it is on: look for ours.)
        enable(Alignment::alone());
        let a = Instant::now();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let peer: Arc<str> = "ps:0".into();
        span(
            "push",
            "comm",
            a,
            Instant::now(),
            Detail::moved(7, 4096, &peer),
        );
        let ours = take_events(0, "worker:0");
        assert!(!enabled());
        let traces = LocalComm::run(3, |c| {
            let align = align(&c, 1).unwrap();
            assert!(align.offset_us.abs() < 1e5, "one clock: {align:?}");
            let mine = match c.rank() {
                0 => ours.clone(),
                r => format!(
                    "{{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":{r},\"args\":{{\"name\":\"worker:{r} (rank {r})\"}}}},\n"
                ),
            };
            gather_events(&c, 1, mine).unwrap()
        });
        assert!(traces[0].is_none() && traces[2].is_none());
        let json: serde_json::Value = serde_json::from_str(traces[1].as_ref().unwrap()).unwrap();
        let events = json["traceEvents"].as_array().unwrap();
        let push: Vec<_> = events.iter().filter(|e| e["name"] == "push").collect();
        assert_eq!(push.len(), 1, "{events:?}");
        assert!(
            events.iter().all(|e| e["name"] != "before"),
            "not recorded when off"
        );
        let push = push[0];
        assert_eq!(
            (push["ph"].as_str(), push["pid"].as_u64()),
            (Some("X"), Some(0))
        );
        assert!(push["dur"].as_f64().unwrap() >= 2000.0, "{push}");
        assert!(
            push["ts"].as_f64().unwrap() >= 0.0,
            "after the trace's start: {push}"
        );
        assert_eq!(push["args"]["bytes"], 4096);
        assert_eq!(push["args"]["peer"], "ps:0");
        assert_eq!(push["args"]["step"], 7);
        let names: Vec<&str> = events
            .iter()
            .filter(|e| e["name"] == "process_name")
            .map(|e| e["args"]["name"].as_str().unwrap())
            .collect();
        assert_eq!(
            names,
            [
                "worker:0 (rank 0)",
                "worker:1 (rank 1)",
                "worker:2 (rank 2)"
            ]
        );
        // What is written reads back as tracks.
        let path = std::env::temp_dir().join(format!("mpiflow-trace-{}.json", std::process::id()));
        write(&path, traces[1].as_ref().unwrap()).unwrap();
        let tracks = read(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(tracks.len(), 3);
        assert_eq!(tracks[2].name, "worker:2 (rank 2)");
        let push = tracks[0].spans.iter().find(|s| s.name == "push").unwrap();
        assert_eq!((push.cat.as_str(), push.step), ("comm", Some(7)));
        assert!(push.dur_us >= 2000.0);
        let bad = std::env::temp_dir().join(format!("mpiflow-trace-{}.bad", std::process::id()));
        std::fs::write(&bad, "[1,2]").unwrap();
        let e = read(&bad).unwrap_err().to_string();
        std::fs::remove_file(&bad).unwrap();
        assert!(e.contains("not a trace-event file"), "{e}");
    }

    #[test]
    fn spans_that_do_not_lie_in_time_are_refused() {
        // A negative duration made the picture's window end before it began (a panic in
        // the axis); with ends far apart (1e308 either way) the drawing did not end.
        let span = |ts: &str, dur: &str| {
            format!(
                r#"{{"traceEvents":[{{"name":"a","ph":"X","pid":0,"ts":{ts},"dur":{dur},"args":{{"step":1}}}}]}}"#
            )
        };
        let p = Path::new("t.json");
        assert_eq!(parse(p, &span("5", "0")).unwrap()[0].spans.len(), 1);
        for (ts, dur) in [("10", "-20"), ("1e308", "1e308"), ("-1.7e308", "0")] {
            let e = parse(p, &span(ts, dur)).unwrap_err().to_string();
            assert!(
                e.starts_with("timeline t.json: event 0 (\"a\"): ts ")
                    && e.ends_with("are not a span in time (within ±1e300 us, dur not negative)"),
                "{e}"
            );
        }
    }
}
