//! The caching allocator's configuration string. PyTorch reads PYTORCH_CUDA_ALLOC_CONF (which
//! wins in 2.11) or PYTORCH_ALLOC_CONF once, at first allocator use, so it is set before any
//! CUDA work and to the same value under both names.
use serde::{Deserialize, Serialize};

use crate::spec::schema::Allocator;

pub const CUDA_VAR: &str = "PYTORCH_CUDA_ALLOC_CONF";
pub const GENERIC_VAR: &str = "PYTORCH_ALLOC_CONF";

#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct EnvSettings {
    #[serde(rename = "PYTORCH_CUDA_ALLOC_CONF")]
    pub cuda_alloc_conf: Option<String>,
    #[serde(rename = "PYTORCH_ALLOC_CONF")]
    pub alloc_conf: Option<String>,
}

impl EnvSettings {
    pub fn from_env() -> Self {
        let get = |k| std::env::var(k).ok().filter(|v: &String| !v.is_empty());
        EnvSettings {
            cuda_alloc_conf: get(CUDA_VAR),
            alloc_conf: get(GENERIC_VAR),
        }
    }

    /// The string PyTorch will actually use.
    pub fn effective(&self) -> Option<&str> {
        self.cuda_alloc_conf.as_deref().or(self.alloc_conf.as_deref())
    }
}

/// Key/value pairs the spec asks for, in PyTorch's spelling.
pub fn from_spec(a: &Allocator, fraction: Option<f64>) -> Vec<(String, String)> {
    let mut out = vec![];
    if let Some(v) = a.expandable_segments {
        out.push(("expandable_segments".into(), if v { "True" } else { "False" }.into()));
    }
    if let Some(v) = a.max_split_size_mb {
        out.push(("max_split_size_mb".into(), v.to_string()));
    }
    if let Some(v) = a.garbage_collection_threshold {
        out.push(("garbage_collection_threshold".into(), v.to_string()));
    }
    if let Some(v) = a.roundup_power2_divisions {
        out.push(("roundup_power2_divisions".into(), v.to_string()));
    }
    if let Some(f) = fraction {
        // Every digit: a fraction made from memory.limit, rounded, could let the cap pass it.
        out.push(("per_process_memory_fraction".into(), format!("{f}")));
    }
    out
}

fn parse_pairs(s: &str) -> Vec<(String, String)> {
    s.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| match p.split_once(':') {
            Some((k, v)) => (k.trim().to_owned(), v.trim().to_owned()),
            None => (p.trim().to_owned(), String::new()),
        })
        .collect()
}

/// A key the environment already set to a different value than the spec.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Conflict {
    pub key: String,
    pub environment: String,
    pub spec: String,
}

/// Merges the spec's pairs into an existing string: keys only the environment sets are kept,
/// keys the spec sets win, and each disagreement is returned so it can be reported.
pub fn merge(existing: Option<&str>, ours: &[(String, String)]) -> (String, Vec<Conflict>) {
    let mut pairs = existing.map(parse_pairs).unwrap_or_default();
    let mut conflicts = vec![];
    for (k, v) in ours {
        match pairs.iter_mut().find(|(ek, _)| ek == k) {
            Some((_, ev)) => {
                if !ev.eq_ignore_ascii_case(v) {
                    conflicts.push(Conflict {
                        key: k.clone(),
                        environment: ev.clone(),
                        spec: v.clone(),
                    });
                }
                *ev = v.clone();
            }
            None => pairs.push((k.clone(), v.clone())),
        }
    }
    let s = pairs
        .iter()
        .map(|(k, v)| if v.is_empty() { k.clone() } else { format!("{k}:{v}") })
        .collect::<Vec<_>>()
        .join(",");
    (s, conflicts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_pytorch_spelling() {
        let a = Allocator {
            expandable_segments: Some(true),
            max_split_size_mb: Some(128),
            garbage_collection_threshold: Some(0.6),
            roundup_power2_divisions: Some(4),
        };
        let (s, c) = merge(None, &from_spec(&a, Some(0.25)));
        assert_eq!(
            s,
            "expandable_segments:True,max_split_size_mb:128,garbage_collection_threshold:0.6,\
             roundup_power2_divisions:4,per_process_memory_fraction:0.25"
        );
        assert!(c.is_empty());
        // A limit that is no round share of the card keeps every digit, so the cap stays at
        // or under it.
        let third = from_spec(&Allocator::default(), Some(1.0 / 3.0));
        assert_eq!(third[0].1, "0.3333333333333333");
        assert_eq!(third[0].1.parse::<f64>().unwrap(), 1.0 / 3.0);
    }

    #[test]
    fn environment_keys_are_kept_and_conflicts_reported() {
        let ours = vec![("max_split_size_mb".to_string(), "256".to_string())];
        let (s, c) = merge(Some("expandable_segments:True,max_split_size_mb:128"), &ours);
        assert_eq!(s, "expandable_segments:True,max_split_size_mb:256");
        assert_eq!(
            c,
            vec![Conflict {
                key: "max_split_size_mb".into(),
                environment: "128".into(),
                spec: "256".into()
            }]
        );
    }

    #[test]
    fn same_value_is_not_a_conflict() {
        let ours = vec![("expandable_segments".to_string(), "True".to_string())];
        let (_, c) = merge(Some("expandable_segments:true"), &ours);
        assert!(c.is_empty());
    }
}
