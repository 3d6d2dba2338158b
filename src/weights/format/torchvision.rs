//! torchvision's names, which memtrain's vit and resnet presets use: each tensor fills the
//! variable of its own name.
use super::{Format, Target};

pub struct Torchvision;

impl Format for Torchvision {
    fn name(&self) -> &'static str {
        "torchvision"
    }

    fn claims(&self, _names: &[&str]) -> bool {
        true
    }

    fn map(&self, name: &str) -> Option<Target> {
        Some(Target::whole(name))
    }
}
