//! `torchscript`: the user's own model, saved from Python with `torch.jit.script(model).save(p)`
//! (or `torch.jit.trace`), whose `forward` takes a batch `[N, ..input_shape]` and returns logits
//! `[N, num_classes]`.
//!
//! The module's parameters (trainable) and buffers (BatchNorm statistics, not trainable) enter
//! the VarStore under their `state_dict` names as tensors that share the module's storage, so
//! checkpoints, resume, `init_from`, the OOM rollback, CPU fallback (`set_data` moves the storage
//! the module reads) and the estimate all see the module's real state. tch's own
//! `TrainableCModule` registers parameters only and ignores the train flag; this loads through
//! the shim instead and sets train or eval mode before a forward that changes it.
//!
//! A scripted module is not a chain of blocks, so activation checkpointing does not apply.
use std::cell::Cell;
use std::path::PathBuf;

use anyhow::Result;
use serde::{Deserialize, Serialize};
use tch::{nn, Kind, Tensor};

use super::preset::{Built, Net, Preset};
use crate::exit::UsageError;
use crate::shim::{self, ScriptModule};

/// `[model.torchscript]`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TorchScriptOptions {
    /// The saved module (relative to the current directory).
    pub path: PathBuf,
    /// Shape of one sample, without the batch dimension.
    pub input_shape: Vec<i64>,
    pub num_classes: i64,
}

pub struct TorchScriptPreset;

/// Batch size of the sample forward that checks the output shape before training.
const SAMPLE_BATCH: i64 = 2;

impl Preset for TorchScriptPreset {
    type Options = TorchScriptOptions;
    const NAME: &'static str = "torchscript";

    fn check(o: &TorchScriptOptions) -> Vec<(&'static str, String)> {
        let mut p = vec![];
        if o.path.as_os_str().is_empty() {
            p.push((
                "path",
                "is required: the file torch.jit.script(model).save(path) wrote".to_owned(),
            ));
        } else if !o.path.is_file() {
            p.push((
                "path",
                format!(
                    "names {}, which is not a file (paths are relative to the current directory)",
                    o.path.display()
                ),
            ));
        }
        if o.input_shape.is_empty() {
            p.push((
                "input_shape",
                "is required: the shape of one sample without the batch dimension, e.g. [3, 32, 32]".to_owned(),
            ));
        } else if let Some(d) = o.input_shape.iter().find(|&&d| d < 1) {
            p.push(("input_shape", format!("entries must be at least 1, got {d}")));
        }
        if o.num_classes < 2 {
            p.push((
                "num_classes",
                format!(
                    "is required and must be at least 2 (the width of forward's logits), got {}",
                    o.num_classes
                ),
            ));
        }
        p
    }

    fn build(root: &nn::Path, o: &TorchScriptOptions) -> Result<Built> {
        let net = TorchScript::load(root, o)?;
        net.check_output(root.device(), &o.input_shape, o.num_classes)?;
        Ok(Built {
            input_shape: o.input_shape.clone(),
            num_classes: o.num_classes,
            head: vec![],
            net: Box::new(net),
        })
    }
}

#[derive(Debug)]
pub struct TorchScript {
    module: ScriptModule,
    /// The mode last set on the module (None: not yet set by us).
    train: Cell<Option<bool>>,
}

impl TorchScript {
    fn load(root: &nn::Path, o: &TorchScriptOptions) -> Result<Self> {
        let module = ScriptModule::load(&o.path, root.device()).map_err(|e| {
            UsageError(format!(
                "model.torchscript.path: {} is not a TorchScript module ({}); save one with torch.jit.script(model).save(path) or torch.jit.trace(model, example).save(path)",
                o.path.display(),
                shim::first_line(&e.to_string())
            ))
        })?;
        for (name, t, trainable) in module
            .named_parameters()?
            .into_iter()
            .map(|(n, t)| {
                let g = t.requires_grad();
                (n, t, g)
            })
            .chain(module.named_buffers()?.into_iter().map(|(n, t)| (n, t, false)))
        {
            // tch's Path forbids dots in a variable name; walk the dotted name instead.
            let mut parts: Vec<&str> = name.split('.').collect();
            let leaf = parts.pop().expect("split yields one part at least");
            let sub;
            let path = match parts.split_first() {
                None => root,
                Some((first, rest)) => {
                    sub = rest.iter().fold(root.sub(*first), |p, s| p.sub(*s));
                    &sub
                }
            };
            let _ = path.add(leaf, t, trainable);
        }
        Ok(TorchScript {
            module,
            train: Cell::new(None),
        })
    }

    fn set_mode(&self, train: bool) {
        if self.train.get() != Some(train) {
            if let Err(e) = self.module.set_train(train) {
                // Inside the OOM guard a panic is how a libtorch error leaves the step.
                panic!("{e}");
            }
            self.train.set(Some(train));
        }
    }

    /// Runs forward in eval mode on a small zero batch and insists on `[N, num_classes]`
    /// floating-point logits, so a mismatch is an error before training starts.
    fn check_output(&self, device: tch::Device, input_shape: &[i64], num_classes: i64) -> Result<()> {
        let mut shape = vec![SAMPLE_BATCH];
        shape.extend_from_slice(input_shape);
        let x = Tensor::zeros(&shape, (Kind::Float, device));
        self.module.set_train(false)?;
        self.train.set(Some(false));
        let out = tch::no_grad(|| self.module.forward(&x)).map_err(|e| {
            let why = shim::first_line(&e.to_string()).to_owned();
            // A forward that ran but returned something else needs another forward, not another
            // input shape.
            let fix = match why.contains("forward returned") {
                true => "make forward return one tensor of logits (for a tuple, script a wrapper that returns its first element)",
                false => "set input_shape to the shape of one sample that forward accepts",
            };
            UsageError(format!(
                "model.torchscript: forward failed on a sample batch of shape {shape:?} (model.torchscript.input_shape = {input_shape:?}): {why}; {fix}"
            ))
        })?;
        let want = vec![SAMPLE_BATCH, num_classes];
        if out.size() != want || !out.is_floating_point() {
            return Err(UsageError(format!(
                "model.torchscript: forward returned {:?} {:?} on a sample batch of shape {shape:?}; memtrain needs floating-point logits {want:?} ([N, num_classes] with model.torchscript.num_classes = {num_classes}). Set num_classes to forward's output width, or make forward return logits",
                out.kind(),
                out.size()
            ))
            .into());
        }
        Ok(())
    }
}

impl Net for TorchScript {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        self.set_mode(train);
        match self.module.forward(xs) {
            Ok(t) => t,
            // Inside the OOM guard: a panic carries the libtorch message (an OOM among them).
            Err(e) => panic!("{e}"),
        }
    }
}
