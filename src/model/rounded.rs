//! A frozen base kept in bf16 (`train.frozen_dtype`) that no file overwrites (no
//! `model.init_from`): its values are the fp32 draw's, rounded to bf16 as `store_frozen` rounds
//! them, so it is still drawn in fp32, but each weight is rounded as soon as its layer is built
//! instead of once the whole model is. A Llama-8B base is then drawn in its bf16 bytes plus one
//! layer in fp32, where an fp32 draw first needs 32 GB of host memory.
use std::cell::RefCell;
use std::collections::HashSet;

use tch::{nn, Kind};

thread_local! {
    static KEPT: RefCell<Option<HashSet<String>>> = const { RefCell::new(None) };
}

/// While it lives, [`round_built`] rounds the named variables built on this thread to bf16.
pub struct RoundAsDrawn(());

impl RoundAsDrawn {
    pub fn enter(kept: HashSet<String>) -> RoundAsDrawn {
        KEPT.with(|k| *k.borrow_mut() = Some(kept));
        RoundAsDrawn(())
    }
}

impl Drop for RoundAsDrawn {
    fn drop(&mut self) {
        KEPT.with(|k| *k.borrow_mut() = None);
    }
}

/// The variables under `p` that are kept in bf16, rounded now; nothing outside a
/// [`RoundAsDrawn`]. The llama and vit presets call it after each layer (and llama after its
/// embedding and its head), and `build` on the root for the rest: another preset's base is
/// drawn whole in fp32 first, and rounded then.
pub fn round_built(p: &nn::Path) {
    KEPT.with(|k| {
        let k = k.borrow();
        let Some(kept) = k.as_ref() else { return };
        let prefix: String = p.components().map(|c| format!("{c}.")).collect();
        for name in kept.iter().filter_map(|n| n.strip_prefix(prefix.as_str())) {
            // A path's names cannot hold its separator: walk down to the variable's own path.
            let mut parts: Vec<&str> = name.split('.').collect();
            let Some(last) = parts.pop() else { continue };
            let owner = parts.iter().fold(None::<nn::Path>, |q, c| {
                Some(match q {
                    None => p / *c,
                    Some(q) => &q / *c,
                })
            });
            let var = match &owner {
                Some(o) => o.get(last),
                None => p.get(last),
            };
            if let Some(v) = var.filter(|v| v.kind() == Kind::Float) {
                tch::no_grad(|| v.shallow_clone().set_data(&v.to_kind(Kind::BFloat16)));
            }
        }
    });
}
