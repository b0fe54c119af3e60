//! The chief's progress: at each logged step a live line (step of total, loss, samples/s,
//! ETA) redrawn in place on a terminal, or, when output goes to a file or a pipe (a batch
//! job's log), the plain log line with the ETA added. Other lines (notes, checkpoints,
//! warnings) clear the live line, print, and redraw it below. [`Ticker`]: the same for a
//! loop without steps (a benchmark), on stderr.

use std::fmt::Write;

/// How progress shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    /// One line redrawn in place (`\r`, erase to the end of the line).
    Live,
    /// A plain line per logged step.
    Lines,
}

/// One logged step, as progress shows it.
#[derive(Debug, Clone, Copy)]
pub struct Tick<'a> {
    pub step: u64,
    pub loss: f32,
    pub steps_per_sec: f64,
    pub samples_per_sec: f64,
    /// The step's plain log line (what [`Style::Lines`] prints, before the ETA).
    pub line: &'a str,
}

/// The progress of one run towards `total` steps.
#[derive(Debug, Clone)]
pub struct Progress {
    total: u64,
    style: Style,
    /// The live line on screen, if any.
    live: Option<String>,
}

/// Erases the terminal line the cursor is on and returns to its start.
const ERASE: &str = "\r\x1b[2K";

impl Progress {
    pub fn new(total: u64, style: Style) -> Progress {
        Progress {
            total,
            style,
            live: None,
        }
    }

    /// The text to write for a logged step.
    pub fn step(&mut self, t: &Tick<'_>) -> String {
        let left = self.total.saturating_sub(t.step);
        let eta = eta(left as f64 / t.steps_per_sec);
        match self.style {
            Style::Lines => format!("{} eta {eta}\n", t.line),
            Style::Live => {
                let pct = 100.0 * t.step as f64 / self.total.max(1) as f64;
                let live = format!(
                    "step {}/{} {pct:.0}% loss {:.4} {:.0} samples/s eta {eta}",
                    t.step, self.total, t.loss, t.samples_per_sec
                );
                self.live = Some(live.clone());
                format!("{ERASE}{live}")
            }
        }
    }

    /// The text to write for any other line (`line` without its newline).
    pub fn line(&self, line: &str) -> String {
        match &self.live {
            None => format!("{line}\n"),
            Some(live) => format!("{ERASE}{line}\n{live}"),
        }
    }

    /// The text that ends the live line when the run ends (so what follows starts on a
    /// line of its own).
    pub fn finish(&mut self) -> String {
        match self.live.take() {
            Some(_) => "\n".to_string(),
            None => String::new(),
        }
    }
}

/// Progress of a long loop without steps of its own (a benchmark's rounds and sizes):
/// nothing for its first 2 s, then its state at most every 0.5 s live, or every 10 s as
/// plain lines; a live line is erased at the end.
#[derive(Debug, Clone)]
pub struct Ticker {
    style: Style,
    start: std::time::Instant,
    last: Option<std::time::Instant>,
}

impl Ticker {
    pub fn new(style: Style) -> Ticker {
        Ticker {
            style,
            start: std::time::Instant::now(),
            last: None,
        }
    }

    /// The text to write now for the state `what` describes, if it is due.
    pub fn tick(&mut self, what: impl FnOnce() -> String) -> Option<String> {
        let every = match self.style {
            Style::Live => std::time::Duration::from_millis(500),
            Style::Lines => std::time::Duration::from_secs(10),
        };
        let due = match self.last {
            None => self.start.elapsed() >= std::time::Duration::from_secs(2),
            Some(t) => t.elapsed() >= every,
        };
        if !due {
            return None;
        }
        self.last = Some(std::time::Instant::now());
        let at = eta(self.start.elapsed().as_secs_f64());
        Some(match self.style {
            Style::Live => format!("{ERASE}{} ({at})", what()),
            Style::Lines => format!("{} ({at})\n", what()),
        })
    }

    /// The text that ends the progress (erases a live line), if any.
    pub fn finish(&mut self) -> Option<String> {
        match (self.style, self.last) {
            (Style::Live, Some(_)) => Some(ERASE.to_string()),
            _ => None,
        }
    }
}

/// Seconds as `m:ss` or `h:mm:ss`; `?` if not known (no rate yet).
pub fn eta(secs: f64) -> String {
    if !secs.is_finite() || secs < 0.0 {
        return "?".into();
    }
    let s = secs.round() as u64;
    let mut out = String::new();
    if s >= 3600 {
        let _ = write!(out, "{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60);
    } else {
        let _ = write!(out, "{}:{:02}", s / 60, s % 60);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tick(step: u64, line: &str) -> Tick<'_> {
        Tick {
            step,
            loss: 0.5,
            steps_per_sec: 100.0,
            samples_per_sec: 6400.0,
            line,
        }
    }

    #[test]
    fn lines_add_the_eta_and_live_redraws_one_line_in_place() {
        let mut p = Progress::new(1000, Style::Lines);
        assert_eq!(p.step(&tick(250, "step 250 x")), "step 250 x eta 0:08\n");
        assert_eq!(p.line("# note"), "# note\n");
        assert_eq!(p.finish(), "");

        let mut p = Progress::new(1000, Style::Live);
        assert_eq!(p.line("# before"), "# before\n");
        let live = "step 250/1000 25% loss 0.5000 6400 samples/s eta 0:08";
        assert_eq!(p.step(&tick(250, "")), format!("\r\x1b[2K{live}"));
        // A note goes above the live line, which is drawn again.
        assert_eq!(p.line("# ckpt"), format!("\r\x1b[2K# ckpt\n{live}"));
        assert_eq!(p.finish(), "\n");
        assert_eq!(p.line("accuracy"), "accuracy\n");
    }

    #[test]
    fn a_ticker_waits_two_seconds_then_shows_and_erases_its_line() {
        let mut t = Ticker::new(Style::Live);
        assert_eq!(t.tick(|| "x".into()), None, "not in the first 2 s");
        assert_eq!(t.finish(), None, "nothing shown, nothing to erase");
        t.start -= std::time::Duration::from_secs(3);
        assert_eq!(
            t.tick(|| "size 8".into()).unwrap(),
            "\r\x1b[2Ksize 8 (0:03)"
        );
        assert_eq!(t.tick(|| "size 16".into()), None, "at most every 0.5 s");
        assert_eq!(t.finish().unwrap(), "\r\x1b[2K");
        let mut t = Ticker::new(Style::Lines);
        t.start -= std::time::Duration::from_secs(3);
        assert_eq!(t.tick(|| "size 8".into()).unwrap(), "size 8 (0:03)\n");
        assert_eq!(t.finish(), None);
    }

    #[test]
    fn etas_read_as_clock_times() {
        assert_eq!(eta(0.4), "0:00");
        assert_eq!(eta(75.0), "1:15");
        assert_eq!(eta(3600.0 * 2.0 + 61.0), "2:01:01");
        assert_eq!(eta(f64::INFINITY), "?");
        assert_eq!(eta(f64::NAN), "?");
    }
}
