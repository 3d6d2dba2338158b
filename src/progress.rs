//! Progress while training: an indicatif bar per epoch on a terminal, plain periodic lines
//! when stderr is a pipe or file (CI, scripts), nothing with `-q` or `log.progress = "off"`.
use std::io::IsTerminal;
use std::time::Instant;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::spec::schema::Progress as Mode;

pub struct Progress {
    mode: Resolved,
    bar: Option<ProgressBar>,
    total: u64,
    last_time: Instant,
    quiet: bool,
}

#[derive(Clone, Copy, PartialEq)]
enum Resolved {
    Bars,
    Lines,
    Off,
}

impl Progress {
    pub fn new(mode: Mode, quiet: bool) -> Self {
        let mode = match (mode, quiet) {
            (_, true) | (Mode::Off, _) => Resolved::Off,
            (Mode::Bars, _) => Resolved::Bars,
            (Mode::Lines, _) => Resolved::Lines,
            (Mode::Auto, _) if std::io::stderr().is_terminal() => Resolved::Bars,
            (Mode::Auto, _) => Resolved::Lines,
        };
        Progress {
            mode,
            bar: None,
            total: 0,
            last_time: Instant::now(),
            quiet,
        }
    }

    pub fn start_epoch(&mut self, epoch: i64, epochs: i64, steps: u64, done: u64) {
        self.total = steps;
        self.last_time = Instant::now();
        if self.mode == Resolved::Bars {
            let bar = ProgressBar::with_draw_target(Some(steps), ProgressDrawTarget::stderr());
            bar.set_style(
                ProgressStyle::with_template("epoch {prefix} [{bar:30}] {pos}/{len} {msg} ({elapsed}<{eta})")
                    .expect("valid template")
                    .progress_chars("=> "),
            );
            bar.set_prefix(format!("{}/{}", epoch + 1, epochs));
            bar.set_position(done);
            self.bar = Some(bar);
        }
    }

    /// `msg` is built lazily: only when something will be shown.
    pub fn step(&mut self, done: u64, msg: impl FnOnce() -> String) {
        match self.mode {
            Resolved::Bars => {
                if let Some(b) = &self.bar {
                    b.set_position(done);
                    if done.is_multiple_of(5) || done == self.total {
                        b.set_message(msg());
                    }
                }
            }
            Resolved::Lines => {
                // A line every ten seconds at most: logs stay short, long epochs still show life.
                if self.last_time.elapsed().as_secs_f64() >= 10.0 && done < self.total {
                    self.last_time = Instant::now();
                    say(format_args!("  step {done}/{}  {}", self.total, msg()));
                }
            }
            Resolved::Off => {}
        }
    }

    pub fn finish_epoch(&mut self) {
        if let Some(b) = self.bar.take() {
            b.finish_and_clear();
        }
    }

    /// Prints a line without tearing the bar; silent under `-q`.
    pub fn println(&self, line: &str) {
        match &self.bar {
            _ if self.quiet => {}
            Some(b) => b.println(line),
            None => say(format_args!("{line}")),
        }
    }
}

/// A line on stderr that nobody may be reading: `memtrain run ... 2>&1 | head` closes the pipe,
/// and a run must not die of a progress line (eprintln! panics on a closed stream).
pub fn say(line: std::fmt::Arguments) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// A command's output on stdout. A reader that stopped reading (`memtrain check spec.toml |
/// head`) wanted no more, so a closed pipe ends nothing: the command finishes its work (`clean`
/// still ends what it set out to end) and exits as it would have. Any other failure to write (a
/// full disk behind `> file`) is an error, so no output is lost unnoticed.
pub fn out(text: std::fmt::Arguments) -> anyhow::Result<()> {
    use std::io::Write;
    let mut stdout = std::io::stdout();
    match stdout.write_fmt(text).and_then(|_| stdout.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(anyhow::Error::new(e).context("writing to standard output"))
        }
        _ => Ok(()),
    }
}

/// `println!` through [`out`]: `outln!("{x}")?`.
#[macro_export]
macro_rules! outln {
    () => { $crate::progress::out(format_args!("\n")) };
    ($($arg:tt)*) => { $crate::progress::out(format_args!("{}\n", format_args!($($arg)*))) };
}

/// `print!` through [`out`].
#[macro_export]
macro_rules! out {
    ($($arg:tt)*) => { $crate::progress::out(format_args!($($arg)*)) };
}
