//! `memtrain watch`: a live view of the GPUs, who holds their memory, and the memtrain jobs'
//! memory timelines and events. Model (a `Snapshot`, gathered) → view (ratatui widgets) → this
//! loop (keys and a one-second tick). Watching writes nothing anywhere.
mod model;
mod view;

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::backend::TestBackend;
use ratatui::Terminal;

pub use model::{Gatherer, JobView, Snapshot};

use crate::cli::WatchArgs;
use crate::exit::UsageError;

const TICK: Duration = Duration::from_secs(1);
/// `--once`'s width when stdout is not a terminal.
const ONCE_WIDTH: u16 = 140;

pub fn watch(args: &WatchArgs) -> Result<()> {
    let mut gatherer = Gatherer::new(&args.run_dirs)?;
    if args.once {
        let snap = gatherer.snapshot();
        if args.json {
            crate::outln!("{}", serde_json::to_string_pretty(&snap)?)?;
        } else {
            crate::out!("{}", frame_text(&snap, once_width()))?;
        }
        return Ok(());
    }
    if !std::io::stdout().is_terminal() {
        return Err(UsageError(
            "watch draws on a terminal and stdout is not one; use --once for a plain-text frame, or --once --json"
                .into(),
        )
        .into());
    }
    live(gatherer)
}

fn once_width() -> u16 {
    match std::io::stdout().is_terminal() {
        true => crossterm::terminal::size().map_or(ONCE_WIDTH, |(w, _)| w),
        false => ONCE_WIDTH,
    }
}

/// One frame drawn by the same widgets as the live view, as plain text.
pub fn frame_text(snap: &Snapshot, width: u16) -> String {
    let mut t = Terminal::new(TestBackend::new(width, view::height(snap))).expect("a test backend never fails");
    t.draw(|f| view::draw(f, snap, 0)).expect("a test backend never fails");
    view::plain(t.backend().buffer())
}

/// Leaves raw mode and the alternate screen however `live` ends; ratatui's panic hook does the
/// same on a panic.
struct Restore;

impl Drop for Restore {
    fn drop(&mut self) {
        ratatui::restore();
    }
}

fn live(mut gatherer: Gatherer) -> Result<()> {
    let mut terminal = ratatui::try_init().context("setting up the terminal")?;
    let _restore = Restore;
    let mut selected = 0usize;
    let mut snap = gatherer.snapshot();
    let mut next = Instant::now() + TICK;
    loop {
        selected = selected.min(snap.jobs.len().saturating_sub(1));
        terminal.draw(|f| view::draw(f, &snap, selected))?;
        let wait = next.saturating_duration_since(Instant::now());
        if event::poll(wait)? {
            if let Event::Key(k) = event::read()? {
                if k.kind != KeyEventKind::Press {
                    continue;
                }
                match k.code {
                    KeyCode::Char('q') | KeyCode::Esc => return Ok(()),
                    KeyCode::Char('c') if k.modifiers.contains(KeyModifiers::CONTROL) => return Ok(()),
                    KeyCode::Up | KeyCode::Left => selected = selected.saturating_sub(1),
                    KeyCode::Down | KeyCode::Right => selected += 1,
                    _ => {}
                }
            }
        }
        if Instant::now() >= next {
            snap = gatherer.snapshot();
            next = Instant::now() + TICK;
        }
    }
}
