//! `resnet18`, `resnet34`, `resnet50`: torchvision's ResNets (v1.5: a bottleneck strides in its
//! 3×3 convolution) with torchvision's variable names (`conv1.weight`, `bn1.running_mean`,
//! `layer1.0.conv1.weight`, `layer2.0.downsample.0.weight`, …, `fc.bias`), so a torchvision
//! `state_dict` saved as safetensors loads through `model.init_from` unchanged, and parameter
//! counts equal torchvision's for the same options.
//!
//! `small_stem = true` replaces the 7×7/2 convolution and the max-pool by one 3×3/1 convolution
//! (still named `conv1`), the usual stem for 32×32 images such as CIFAR-10.
//!
//! As a chain: the stem, one block per residual block, the head (pool and `fc`), so activation
//! checkpointing keeps one tensor per residual block.
//!
//! LoRA adapts any convolution (`conv1`, `layerL.B.convN`, `layerL.B.downsample.0`) and `fc`,
//! as peft adapts torchvision's `nn.Conv2d` and `nn.Linear`. The BatchNorm layers are part of the
//! frozen base: their weight and bias get no gradient, and `train.freeze_batchnorm_stats` says
//! whether their running statistics stay as loaded (eval mode, the default) or follow the batches
//! as under peft, which leaves the modules in training mode.
use anyhow::Result;
use serde::{Deserialize, Serialize};
use tch::nn::init::{FanInOut, NonLinearity, NormalOrUniform};
use tch::nn::{self, Init, Module};
use tch::Tensor;

use super::layers::{self, BatchNorm2d, Conv};
use super::lora::{adapted, adapter_for, conv_adapted, conv_adapter_for, Adapter, LoraOptions};
use super::preset::{run_chain, Built, Chain, Net, Preset};

/// `[model.resnet18]` (and `resnet34`, `resnet50`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ResNetOptions {
    pub num_classes: i64,
    pub in_channels: i64,
    /// Height and width of the input images (any size works; this one is checked against the
    /// data and used for synthetic data and estimates).
    pub image_size: i64,
    /// 3×3 stride-1 first convolution and no max-pool, for 32×32 inputs.
    pub small_stem: bool,
    /// Each residual block's last BatchNorm starts with γ = 0, so blocks start as identities.
    pub zero_init_residual: bool,
}

impl Default for ResNetOptions {
    fn default() -> Self {
        ResNetOptions {
            num_classes: 1000,
            in_channels: 3,
            image_size: 224,
            small_stem: false,
            zero_init_residual: false,
        }
    }
}

/// The three depths, one preset each.
pub struct ResNetPreset<const DEPTH: u32>;

impl<const DEPTH: u32> Preset for ResNetPreset<DEPTH> {
    type Options = ResNetOptions;
    const NAME: &'static str = match DEPTH {
        18 => "resnet18",
        34 => "resnet34",
        _ => "resnet50",
    };

    fn check(o: &ResNetOptions) -> Vec<(&'static str, String)> {
        let mut p = vec![];
        for (key, v, min) in [
            ("num_classes", o.num_classes, 2),
            ("in_channels", o.in_channels, 1),
            ("image_size", o.image_size, 8),
        ] {
            if v < min {
                p.push((key, format!("must be at least {min}, got {v}")));
            }
        }
        p
    }

    fn build(root: &nn::Path, o: &ResNetOptions) -> Result<Built> {
        let (bottleneck, layers) = match DEPTH {
            18 => (false, [2, 2, 2, 2]),
            34 => (false, [3, 4, 6, 3]),
            _ => (true, [3, 4, 6, 3]),
        };
        Ok(Built {
            input_shape: vec![o.in_channels, o.image_size, o.image_size],
            num_classes: o.num_classes,
            head: vec!["fc".into()],
            net: Box::new(ResNet::new(root, o, bottleneck, layers)),
        })
    }
}

/// torchvision's convolution initialisation: kaiming normal, fan-out, ReLU gain.
fn conv(p: nn::Path, cin: i64, cout: i64, k: i64, stride: i64, padding: i64) -> Conv {
    Conv::new(
        p,
        cin,
        cout,
        [k, k],
        nn::ConvConfigND::<[i64; 2]> {
            stride: [stride, stride],
            padding: [padding, padding],
            bias: false,
            ws_init: Init::Kaiming {
                dist: NormalOrUniform::Normal,
                fan: FanInOut::FanOut,
                non_linearity: NonLinearity::ReLU,
            },
            ..Default::default()
        },
    )
}

/// A BasicBlock (two 3×3 convolutions) or a Bottleneck (1×1, 3×3 with the stride, 1×1 ×4).
#[derive(Debug)]
struct Block {
    convs: Vec<(Conv, BatchNorm2d)>,
    downsample: Option<(Conv, BatchNorm2d)>,
    /// The adapters of `convs`, in their order, then of the downsampling convolution.
    lora: Vec<Option<Adapter>>,
}

impl Block {
    fn new(p: &nn::Path, inplanes: i64, planes: i64, stride: i64, bottleneck: bool, zero_init: bool) -> Self {
        let expansion = if bottleneck { 4 } else { 1 };
        // (in, out, kernel, stride, padding) of each convolution.
        let shapes: Vec<(i64, i64, i64, i64, i64)> = if bottleneck {
            vec![
                (inplanes, planes, 1, 1, 0),
                (planes, planes, 3, stride, 1),
                (planes, planes * 4, 1, 1, 0),
            ]
        } else {
            vec![(inplanes, planes, 3, stride, 1), (planes, planes, 3, 1, 1)]
        };
        let last = shapes.len();
        let convs = shapes
            .into_iter()
            .enumerate()
            .map(|(i, (cin, cout, k, s, pad))| {
                let n = i + 1;
                (
                    conv(p / format!("conv{n}"), cin, cout, k, s, pad),
                    BatchNorm2d::new(&(p / format!("bn{n}")), cout, zero_init && n == last),
                )
            })
            .collect();
        let downsample = (stride != 1 || inplanes != planes * expansion).then(|| {
            let d = p / "downsample";
            (
                conv(&d / "0", inplanes, planes * expansion, 1, stride, 0),
                BatchNorm2d::new(&(&d / "1"), planes * expansion, false),
            )
        });
        Block {
            convs,
            downsample,
            lora: vec![],
        }
    }

    /// The block's convolutions by name under it (`conv1`, …, `downsample.0`).
    fn conv_names(&self) -> Vec<String> {
        let mut v: Vec<String> = (1..=self.convs.len()).map(|n| format!("conv{n}")).collect();
        if self.downsample.is_some() {
            v.push("downsample.0".into());
        }
        v
    }

    fn adapt(&mut self, p: &nn::Path, o: &LoraOptions, made: &mut Vec<String>) {
        let convs = self.convs.iter().chain(&self.downsample).map(|(c, _)| c);
        self.lora = convs
            .zip(self.conv_names())
            .map(|(c, name)| {
                let path = name.split('.').fold(p.clone(), |q, part| q / part);
                conv_adapter_for(path, c, o, made)
            })
            .collect();
    }

    /// The adapter of convolution `i` (the downsampling one is last), if any.
    fn adapter(&self, i: usize) -> &Option<Adapter> {
        self.lora.get(i).unwrap_or(&None)
    }

    fn forward_t(&self, x: &Tensor, train: bool) -> Tensor {
        let last = self.convs.len() - 1;
        let mut h = x.shallow_clone();
        for (i, (c, bn)) in self.convs.iter().enumerate() {
            h = bn.forward_t(&conv_adapted(c, self.adapter(i), &h, train), train);
            if i < last {
                h = h.relu();
            }
        }
        let identity = match &self.downsample {
            Some((c, bn)) => bn.forward_t(&conv_adapted(c, self.adapter(last + 1), x, train), train),
            None => x.shallow_clone(),
        };
        (h + identity).relu()
    }
}

#[derive(Debug)]
pub struct ResNet {
    conv1: Conv,
    bn1: BatchNorm2d,
    max_pool: bool,
    blocks: Vec<Block>,
    /// The index in `blocks` of each layer's first residual block.
    first_of_layer: Vec<usize>,
    fc: nn::Linear,
    conv1_lora: Option<Adapter>,
    fc_lora: Option<Adapter>,
}

impl ResNet {
    fn new(root: &nn::Path, o: &ResNetOptions, bottleneck: bool, layers: [usize; 4]) -> Self {
        let conv1 = if o.small_stem {
            conv(root / "conv1", o.in_channels, 64, 3, 1, 1)
        } else {
            conv(root / "conv1", o.in_channels, 64, 7, 2, 3)
        };
        let bn1 = BatchNorm2d::new(&(root / "bn1"), 64, false);
        let expansion = if bottleneck { 4 } else { 1 };
        let mut inplanes = 64;
        let mut blocks = vec![];
        let mut first_of_layer = vec![];
        for (l, &n) in layers.iter().enumerate() {
            first_of_layer.push(blocks.len());
            let planes = 64 << l;
            let stride = if l == 0 { 1 } else { 2 };
            let lp = root / format!("layer{}", l + 1);
            for b in 0..n {
                let s = if b == 0 { stride } else { 1 };
                blocks.push(Block::new(
                    &(&lp / b),
                    inplanes,
                    planes,
                    s,
                    bottleneck,
                    o.zero_init_residual,
                ));
                inplanes = planes * expansion;
            }
        }
        let fc = layers::linear(root / "fc", 512 * expansion, o.num_classes);
        ResNet {
            conv1,
            bn1,
            max_pool: !o.small_stem,
            blocks,
            first_of_layer,
            fc,
            conv1_lora: None,
            fc_lora: None,
        }
    }

    /// Each residual block's name prefix (`layer1.0`, …).
    fn block_names(&self) -> Vec<String> {
        let mut v = vec![];
        for (l, &first) in self.first_of_layer.iter().enumerate() {
            let next = self.first_of_layer.get(l + 1).copied().unwrap_or(self.blocks.len());
            v.extend((0..next - first).map(|b| format!("layer{}.{b}", l + 1)));
        }
        v
    }
}

impl Chain for ResNet {
    fn blocks(&self) -> usize {
        self.blocks.len() + 2
    }

    fn block(&self, i: usize, state: &[Tensor], train: bool) -> Vec<Tensor> {
        let x = &state[0];
        let out = if i == 0 {
            let h = conv_adapted(&self.conv1, &self.conv1_lora, x, train);
            let h = self.bn1.forward_t(&h, train).relu();
            if self.max_pool {
                h.max_pool2d([3, 3], [2, 2], [1, 1], [1, 1], false)
            } else {
                h
            }
        } else if i == self.blocks.len() + 1 {
            let pooled = x.adaptive_avg_pool2d([1, 1]).flatten(1, -1);
            adapted(&self.fc_lora, self.fc.forward(&pooled), &pooled, train)
        } else {
            self.blocks[i - 1].forward_t(x, train)
        };
        vec![out]
    }

    /// The stem: `conv1`, `bn1`; residual block `layerL.B`: its place in the chain; the head:
    /// `fc`.
    fn block_of(&self, var: &str) -> Option<usize> {
        let mut parts = var.split('.');
        match parts.next()? {
            "conv1" | "bn1" => Some(0),
            "fc" => Some(self.blocks.len() + 1),
            layer => {
                let l: usize = layer.strip_prefix("layer")?.parse().ok()?;
                let b: usize = parts.next()?.parse().ok()?;
                let i = self.first_of_layer.get(l.checked_sub(1)?)? + b;
                let next = self.first_of_layer.get(l).copied().unwrap_or(self.blocks.len());
                (i < next).then_some(i + 1)
            }
        }
    }
}

impl Net for ResNet {
    fn keep_frozen_norm_stats(&self, on: bool) {
        self.bn1.keep_stats_when_frozen(on);
        for b in &self.blocks {
            for (_, bn) in b.convs.iter().chain(&b.downsample) {
                bn.keep_stats_when_frozen(on);
            }
        }
    }

    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        run_chain(self, xs, train)
    }

    fn chain(&self) -> Option<&dyn Chain> {
        Some(self)
    }

    fn adapt(&mut self, root: &nn::Path, o: &LoraOptions) -> Vec<String> {
        let mut made = vec![];
        self.conv1_lora = conv_adapter_for(root / "conv1", &self.conv1, o, &mut made);
        let names = self.block_names();
        for (block, name) in self.blocks.iter_mut().zip(names) {
            let path = name.split('.').fold(root.clone(), |q, part| q / part);
            block.adapt(&path, o, &mut made);
        }
        let [out, inputs] = self.fc.ws.size()[..] else {
            unreachable!("a linear layer's weight is [out, in]")
        };
        self.fc_lora = adapter_for(root / "fc", inputs, out, o, &mut made);
        made
    }

    fn adaptable(&self) -> Vec<String> {
        let mut v = vec!["conv1".to_owned()];
        for (block, name) in self.blocks.iter().zip(self.block_names()) {
            v.extend(block.conv_names().iter().map(|c| format!("{name}.{c}")));
        }
        v.push("fc".into());
        v
    }

    fn adaptable_kind(&self) -> &'static str {
        "convolutions and linear layers"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// resnet50's adaptable layers are torchvision's 53 convolutions and fc; every adapter
    /// mirrors its convolution's kernel and stride, and adapters whose B is zero change nothing.
    #[test]
    fn every_convolution_and_fc_take_an_adapter_shaped_as_peft_s() {
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let o = ResNetOptions {
            image_size: 32,
            num_classes: 4,
            ..Default::default()
        };
        let mut net = ResNetPreset::<50>::build(&vs.root(), &o).unwrap().net;
        let x = Tensor::rand([2, 3, 32, 32], tch::kind::FLOAT_CPU);
        let before = tch::no_grad(|| net.forward_t(&x, false));
        let lora = LoraOptions {
            rank: 2,
            targets: vec!["*".into()],
            ..Default::default()
        };
        let made = net.adapt(&vs.root(), &lora);
        assert_eq!(made, net.adaptable());
        assert_eq!(made.len(), 54);
        assert_eq!(made[..3], ["conv1", "layer1.0.conv1", "layer1.0.conv2"]);
        assert!(made.contains(&"layer4.0.downsample.0".to_owned()));
        let vars = vs.variables();
        let shape = |n: &str| vars[n].size();
        assert_eq!(shape("conv1.lora_A.weight"), [2, 3, 7, 7]);
        assert_eq!(shape("layer4.2.conv3.lora_A.weight"), [2, 512, 1, 1]);
        assert_eq!(shape("layer4.2.conv3.lora_B.weight"), [2048, 2, 1, 1]);
        assert_eq!(shape("layer2.0.conv2.lora_A.weight"), [2, 128, 3, 3]);
        assert_eq!(shape("fc.lora_B.weight"), [4, 2]);
        let chain = net.chain().unwrap();
        assert_eq!(
            chain.block_of("layer4.2.conv3.lora_A.weight"),
            chain.block_of("layer4.2.conv3.weight")
        );
        let after = tch::no_grad(|| net.forward_t(&x, false));
        assert!(before.equal(&after), "B starts at zero");
    }
}
