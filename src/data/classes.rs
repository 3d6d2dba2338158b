//! The data's classes: how many there are (probed cheaply before the model is built, so a
//! classifier's `num_classes` can follow the data) and their names, which a run writes as
//! `classes.json` and `eval` reads back to map another folder's classes by name.
//!
//! An imagefolder's classes are its directory names, in sorted order (label 0 is the first). The
//! other file sources have class indices only: their classes are `0..max label + 1`, named by
//! their indices ("0", "1", ...). Synthetic data follows the model and has no classes of its own.
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use super::source::reader;
pub use super::source::DataClasses;
use crate::spec::schema::{Data, DataSource};

/// The name of the class-to-index mapping in a run directory.
pub const CLASSES_FILE: &str = "classes.json";

/// The classes of the configured data (its training and validation files), read cheaply:
/// directory names, or the label arrays alone where the file allows. None where the data
/// follows the model (synthetic data), or has no path to read.
pub fn probe(data: &Data) -> Result<Option<DataClasses>> {
    let Some(path) = data.path.as_deref() else {
        return Ok(None);
    };
    reader(data.source).classes(data, path)
}

/// The class-to-index mapping a run writes as `classes.json`: `classes[i]` is class i's name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassNames {
    pub classes: Vec<String>,
}

impl ClassNames {
    /// The names a run records: an imagefolder's directory names, else the indices of the
    /// model's `num_classes` outputs.
    pub fn of_run(data: &Data, num_classes: i64) -> Result<ClassNames> {
        let classes = match data.source {
            DataSource::Imagefolder => match probe(data)? {
                Some(DataClasses::Named(n)) => n,
                _ => indices(num_classes),
            },
            _ => indices(num_classes),
        };
        Ok(ClassNames { classes })
    }

    /// The index of class `name`.
    pub fn index_of(&self, name: &str) -> Option<i64> {
        self.classes.iter().position(|c| c == name).map(|i| i as i64)
    }

    pub fn write(&self, run_dir: &Path) -> Result<()> {
        crate::atomic::write_json(&run_dir.join(CLASSES_FILE), self)
    }

    /// `classes.json` of a run directory.
    pub fn read(run_dir: &Path) -> Result<ClassNames> {
        let path = run_dir.join(CLASSES_FILE);
        let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        let names: ClassNames = serde_json::from_str(&text).with_context(|| {
            format!(
                "{}: not a class list; expected {{\"classes\": [\"name of class 0\", ...]}}",
                path.display()
            )
        })?;
        let mut seen = std::collections::HashSet::new();
        if let Some(dup) = names.classes.iter().find(|c| !seen.insert(c.as_str())) {
            bail!("{}: names class \"{dup}\" twice", path.display());
        }
        Ok(names)
    }
}

fn indices(n: i64) -> Vec<String> {
    (0..n.max(0)).map(|i| i.to_string()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn class_names_round_trip_through_classes_json() {
        let dir = tempfile::tempdir().unwrap();
        let names = ClassNames {
            classes: vec!["cat".into(), "dog".into()],
        };
        names.write(dir.path()).unwrap();
        let back = ClassNames::read(dir.path()).unwrap();
        assert_eq!(back, names);
        assert_eq!(back.index_of("dog"), Some(1));
        assert_eq!(back.index_of("cow"), None);
        std::fs::write(dir.path().join(CLASSES_FILE), r#"{"classes": ["a", "a"]}"#).unwrap();
        let e = format!("{:#}", ClassNames::read(dir.path()).unwrap_err());
        assert!(e.contains("\"a\" twice"), "{e}");
    }

    #[test]
    fn other_sources_name_classes_by_index() {
        let data = Data {
            source: DataSource::Npz,
            ..Data::default()
        };
        assert_eq!(ClassNames::of_run(&data, 3).unwrap().classes, ["0", "1", "2"]);
        assert_eq!(super::super::source::label_range([3, 0, 7]), Some(8));
        assert_eq!(super::super::source::label_range([]), None);
        assert_eq!(DataClasses::Range(5).describe(), "labels 0 to 4, so 5 class(es)");
    }
}
