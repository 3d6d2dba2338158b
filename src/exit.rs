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

/// A typed error that carries only its message; the type alone picks the exit code.
macro_rules! message_error {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug)]
        pub struct $name(pub String);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl std::error::Error for $name {}
    };
}

message_error!(
    /// A usage problem found after parsing (e.g. a bad `--set`, a run directory conflict).
    UsageError
);
message_error!(
    /// The run ended on an OOM its policy could not absorb.
    OomExit
);
message_error!(
    /// The run was interrupted and stopped cleanly.
    Interrupted
);

pub fn code_for(e: &anyhow::Error) -> i32 {
    if e.downcast_ref::<crate::spec::error::SpecError>().is_some() || e.downcast_ref::<UsageError>().is_some() {
        USAGE
    } else if e.downcast_ref::<OomExit>().is_some() {
        OOM
    } else if e.downcast_ref::<Interrupted>().is_some() {
        INTERRUPTED
    } else {
        FAILURE
    }
}
