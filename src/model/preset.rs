//! What a preset is and what it builds: the trait every preset file implements, the network it
//! returns and the optional chain of blocks. The registry (`model`) lists the presets; nothing
//! here depends on which presets exist.
use anyhow::Result;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use tch::{nn, Tensor};

use super::lora::LoraOptions;
use crate::optim::Hyper;

/// Variables whose name starts with this are architecture weights (DARTS α): trained by
/// their own optimizer on held-out data, never by the weight optimizer.
pub const ARCH_PREFIX: &str = "arch.";

pub trait Net: std::fmt::Debug {
    /// Logits `[batch, num_classes]` for inputs `[batch, ..input_shape]`.
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor;
    /// The architecture the current α selects, for presets that search one.
    fn genotype(&self) -> Option<Genotype> {
        None
    }
    /// The model as a sequence of blocks, for activation checkpointing; None if it is not one.
    fn chain(&self) -> Option<&dyn Chain> {
        None
    }
    /// Adds low-rank adapters (under `root`, the preset's own root) to the linear layers (and
    /// convolutions) `o` targets, and returns their names; none where the preset has no such
    /// layers.
    fn adapt(&mut self, _root: &nn::Path, _o: &LoraOptions) -> Vec<String> {
        vec![]
    }
    /// The names of the layers `adapt` can adapt.
    fn adaptable(&self) -> Vec<String> {
        vec![]
    }
    /// What `adaptable` lists, for a message: "linear layers", or "linear layers and
    /// convolutions".
    fn adaptable_kind(&self) -> &'static str {
        "linear layers"
    }
    /// `train.freeze_batchnorm_stats`: whether the model's BatchNorm layers whose parameters
    /// are all frozen run in eval mode; a model without such layers ignores it.
    fn keep_frozen_norm_stats(&self, _on: bool) {}
    /// A language model's output projection `[vocab, hidden]`. Where there is one, `forward_t`
    /// (and the chain's last block) returns the final hidden states `[batch, seq, hidden]`, not
    /// logits: the next-token loss applies the projection chunk by chunk so that the whole
    /// `[batch, seq, vocab]` logits never exist. None: `forward_t` returns logits.
    fn output_head(&self) -> Option<Tensor> {
        None
    }
    /// A decoder's forward over `ids` `[batch, new]` that follow the positions `cache` holds:
    /// their keys and values are read from it and the new ones appended. The final hidden states
    /// `[batch, new, hidden]`. None: the preset keeps no cache, and generation runs the whole
    /// sequence for each new token.
    fn decode(&self, ids: &Tensor, cache: &mut KvCache) -> Option<Tensor> {
        let blocks = self.chain()?.blocks();
        let start = cache.len();
        let mut x = ids.shallow_clone();
        for i in 0..blocks {
            x = self.decode_block(i, &x, start, cache)?;
        }
        Some(x)
    }
    /// Block `i` of the chain in `decode`, block by block so that parameters streamed by block
    /// can be brought in around it: `x` is the previous block's output (the ids for block 0),
    /// `start` the positions the cache held when this forward began. None: no cache.
    fn decode_block(&self, _i: usize, _x: &Tensor, _start: i64, _cache: &mut KvCache) -> Option<Tensor> {
        None
    }
}

/// The keys and values a decoder has computed for the positions it has seen, one pair
/// `[batch, kv_heads, positions, head_dim]` per layer, so that generation runs only each new
/// token.
#[derive(Debug, Default)]
pub struct KvCache {
    pub layers: Vec<(Tensor, Tensor)>,
}

impl KvCache {
    /// The positions held.
    pub fn len(&self) -> i64 {
        self.layers.first().map_or(0, |(k, _)| k.size()[2])
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A model as a sequence of blocks: block 0 takes `[input]`, each block takes the previous
/// block's outputs, the last returns `[logits]`. A block may pass a tensor through unchanged
/// (the same tensor, not a copy). `forward_t` of such a model is `run_chain`, so plain and
/// checkpointed runs build the same graph and their gradients agree bit for bit.
pub trait Chain {
    fn blocks(&self) -> usize;
    fn block(&self, i: usize, state: &[Tensor], train: bool) -> Vec<Tensor>;
    /// The one block that uses the variable (parameter or buffer) of this VarStore name, for
    /// streaming parameters block by block (`memory.parameters = "host"`). None: the variable
    /// is used outside one block (or the chain does not say), and parameters cannot stream.
    fn block_of(&self, _var: &str) -> Option<usize> {
        None
    }

    /// The layer id `train.layer_decay` gives the variable, as timm's `param_groups_layer_decay`
    /// does for the model: by default the block that uses it.
    fn layer_of(&self, var: &str) -> Option<usize> {
        self.block_of(var)
    }

    /// A variable no block uses that is read after the last one (a decoder's output projection,
    /// which the loss applies): it stays on the device while the blocks' parameters stream.
    fn resident(&self, _var: &str) -> bool {
        false
    }

    /// The first block that reads a resident variable: a host update of it must be done before
    /// that block runs. By default none does, and the loss reads it after the last block.
    fn resident_from(&self, _var: &str) -> usize {
        self.blocks().saturating_sub(1)
    }
}

/// Every variable of `vs` by the block that uses it (`Chain::block_of`), or the name of one
/// that belongs to no block and is not `Chain::resident` (those are left out).
pub fn block_vars(c: &dyn Chain, vs: &nn::VarStore) -> Result<Vec<Vec<(String, Tensor)>>, String> {
    let mut blocks: Vec<Vec<(String, Tensor)>> = (0..c.blocks()).map(|_| vec![]).collect();
    let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, t) in vars {
        match c.block_of(&name).filter(|&i| i < blocks.len()) {
            Some(i) => blocks[i].push((name, t)),
            None if c.resident(&name) => {}
            None => return Err(name),
        }
    }
    Ok(blocks)
}

pub fn run_chain(c: &dyn Chain, x: &Tensor, train: bool) -> Tensor {
    let mut state = vec![x.shallow_clone()];
    for i in 0..c.blocks() {
        state = c.block(i, &state, train);
    }
    state.pop().expect("the last block returns the logits")
}

/// A built preset and the shapes it expects.
#[derive(Debug)]
pub struct Built {
    pub net: Box<dyn Net>,
    /// Shape of one sample, without the batch dimension.
    pub input_shape: Vec<i64>,
    pub num_classes: i64,
    /// The head's variables by name prefix (`heads.head` is `heads.head.weight` and
    /// `heads.head.bias`): what a checkpoint for another class count leaves to the build. LoRA's
    /// adapters join it (a base checkpoint lacks them), each adapter its own prefix.
    pub head: Vec<String>,
}

/// A second optimizer step some presets take before each weight step, on held-out data, for
/// the variables under `ARCH_PREFIX` (DARTS's architecture step).
#[derive(Debug, Clone, Copy)]
pub struct ExtraStep {
    pub lr: f64,
    pub hyper: Hyper,
}

/// A preset: its name, its options (the `[model.<name>]` table; left-out keys take the
/// defaults), their checks, how it is built, and any extra step it needs. Adding one is its own
/// file and one line in `PRESETS`.
pub trait Preset: Sync {
    type Options: Serialize + DeserializeOwned + Default;
    const NAME: &'static str;
    /// Problems with the options, as (option name, message).
    fn check(o: &Self::Options) -> Vec<(&'static str, String)>;
    fn build(root: &nn::Path, o: &Self::Options) -> Result<Built>;
    fn extra_step(_o: &Self::Options) -> Option<ExtraStep> {
        None
    }
}

/// The architecture a search preset (DARTS) selects: per node, the two strongest incoming edges
/// as (operation, input index).
///
/// Input index `j`: 0 and 1 are the cell inputs `s0` and `s1`, `2 + i` is intermediate node `i`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Genotype {
    pub normal: Vec<Vec<(String, usize)>>,
    pub reduce: Vec<Vec<(String, usize)>>,
}
