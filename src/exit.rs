//! Exit codes and the typed errors that choose them.
use std::fmt;

pub const OK: i32 = 0;
/// Anything unexpected: I/O failure, libtorch error that is not an OOM, a bug.
pub const FAILURE: i32 = 1;
/// Bad command line or bad spec: nothing ran.
pub const USAGE: i32 = 2;
/// An out-of-memory the OOM policy could not recover from.
pub const OOM: i32 = 3;
/// Stopped by Ctrl-C or SIGTERM after saving a checkpoint.
pub const INTERRUPTED: i32 = 130;

/// A usage problem found after parsing (e.g. a bad `--set`, a run directory conflict).
#[derive(Debug)]
pub struct UsageError(pub String);

impl fmt::Display for UsageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}
impl std::error::Error for UsageError {}

/// The run ended on an OOM its policy could not absorb.
#[derive(Debug)]
pub struct OomExit(pub String);

impl fmt::Display for OomExit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}
impl std::error::Error for OomExit {}

/// The run was interrupted and stopped cleanly.
#[derive(Debug)]
pub struct Interrupted(pub String);

impl fmt::Display for Interrupted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}
impl std::error::Error for Interrupted {}

pub fn code_for(e: &anyhow::Error) -> i32 {
    if e.downcast_ref::<crate::spec::SpecError>().is_some() || e.downcast_ref::<UsageError>().is_some() {
        USAGE
    } else if e.downcast_ref::<OomExit>().is_some() {
        OOM
    } else if e.downcast_ref::<Interrupted>().is_some() {
        INTERRUPTED
    } else {
        FAILURE
    }
}
