//! Progress of long work, shared by the commands that do it (`prefetch`,
//! `export`, `verify`, and `import` once its path is rewritten): on a
//! terminal an `indicatif` bar (bytes done of the total, the rate, the ETA
//! and what is being worked on); otherwise plain lines, one when a phase
//! starts and one when it ends, and between them one every
//! [`PLAIN_INTERVAL`] while it runs, so that a log shows long work moving.

use std::io::Write as _;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::server::admin::status_page::bytes;

/// The bar: spinner, elapsed time, bar, bytes of total, the message (what
/// is being worked on), rate and ETA.
pub const BAR_TEMPLATE: &str = "{spinner:.green} [{elapsed_precise}] [{bar:32.cyan/blue}] {bytes}/{total_bytes} {msg} {binary_bytes_per_sec} ETA {eta}";

/// Longest time between two plain lines while a phase runs.
pub const PLAIN_INTERVAL: Duration = Duration::from_secs(10);

/// An `indicatif` bar drawn on stdout with [`BAR_TEMPLATE`].
pub fn bar() -> ProgressBar {
    let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stdout());
    let style = ProgressStyle::with_template(BAR_TEMPLATE)
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
    bar.set_style(style);
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

/// One command's progress through its phases.
pub struct Progress {
    /// `verify`: the prefix of plain lines.
    command: &'static str,
    shown: Shown,
    phase: Option<Phase>,
}

enum Shown {
    Bar(ProgressBar),
    Plain { last: Instant },
}

struct Phase {
    what: String,
    started: Instant,
    total: u64,
    done: u64,
    item: String,
}

impl Progress {
    /// A bar on a terminal, plain lines otherwise.
    pub fn new(command: &'static str, terminal: bool) -> Progress {
        let shown = if terminal { Shown::Bar(bar()) } else { Shown::Plain { last: Instant::now() } };
        Progress { command, shown, phase: None }
    }

    /// Starts a phase of `total` bytes (`what`, e.g. `hashing 12 blobs
    /// (140.0 MiB)`), ending the one before.
    pub fn phase(&mut self, what: impl Into<String>, total: u64) {
        self.end_phase();
        let what = what.into();
        match &mut self.shown {
            Shown::Bar(bar) => {
                bar.set_length(total);
                bar.set_position(0);
                bar.reset_elapsed();
                bar.set_message(what.clone());
            }
            Shown::Plain { last } => {
                println!("{}: {what}", self.command);
                let _ = std::io::stdout().flush();
                *last = Instant::now();
            }
        }
        self.phase = Some(Phase { what, started: Instant::now(), total, done: 0, item: String::new() });
    }

    /// What is being worked on now (a blob's digest), shown on the bar.
    pub fn item(&mut self, item: impl Into<String>) {
        let Some(phase) = &mut self.phase else { return };
        phase.item = item.into();
        if let Shown::Bar(bar) = &self.shown {
            bar.set_message(phase.item.clone());
        }
    }

    /// `n` more bytes done.
    pub fn advance(&mut self, n: u64) {
        let Some(phase) = &mut self.phase else { return };
        phase.done += n;
        match &mut self.shown {
            Shown::Bar(bar) => {
                bar.set_length(phase.total.max(phase.done));
                bar.set_position(phase.done);
            }
            Shown::Plain { last } if last.elapsed() >= PLAIN_INTERVAL => {
                *last = Instant::now();
                println!(
                    "{}: {} / {} {}/s, at {}",
                    self.command,
                    bytes(phase.done),
                    bytes(phase.total.max(phase.done)),
                    bytes(rate(phase.done, phase.started)),
                    phase.item
                );
                let _ = std::io::stdout().flush();
            }
            Shown::Plain { .. } => {}
        }
    }

    /// Ends the phase running, if any: a line with what it did.
    fn end_phase(&mut self) {
        let Some(phase) = self.phase.take() else { return };
        if let Shown::Plain { .. } = self.shown {
            let secs = phase.started.elapsed().as_secs_f64();
            println!(
                "{}: {} done: {} in {secs:.1} s ({}/s)",
                self.command,
                phase.what,
                bytes(phase.done),
                bytes(rate(phase.done, phase.started))
            );
            let _ = std::io::stdout().flush();
        }
    }

    /// Ends the last phase and clears the bar, before the command's result.
    pub fn finish(&mut self) {
        self.end_phase();
        if let Shown::Bar(bar) = &self.shown {
            bar.finish_and_clear();
        }
    }
}

fn rate(done: u64, since: Instant) -> u64 {
    (done as f64 / since.elapsed().as_secs_f64().max(0.001)) as u64
}
