//! The error a bad spec ends in. Apart from the schema so that `exit`, on the ground floor,
//! can tell it from other failures without depending on how specs are read.
use std::fmt;

/// A spec problem the user must fix; always exit code 2.
#[derive(Debug)]
pub struct SpecError {
    pub problems: Vec<String>,
}

impl fmt::Display for SpecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.problems.join("\n"))
    }
}

impl std::error::Error for SpecError {}
