//! `vit`: torchvision's `VisionTransformer` with its variable names (`conv_proj`, `class_token`,
//! `encoder.pos_embedding`, `encoder.layers.encoder_layer_N.{ln_1, self_attention, ln_2, mlp}`,
//! `encoder.ln`, `heads.head`) and initialisations. Self-attention is `nn.MultiheadAttention`'s
//! packed projections (`in_proj_weight`, `in_proj_bias`, `out_proj`) around
//! `scaled_dot_product_attention`, which picks the fused kernels on GPUs.
//!
//! As a chain: the embedding (patches, class token, position embedding, dropout), one block per
//! encoder layer, the head (final LayerNorm, class token, `heads.head`). Dropout inside a block
//! draws the same masks when the block is recomputed, because recomputation replays the
//! generator state the block first saw.
//!
//! The same network with CLIP's choices (`pre_norm`, `activation = "quick_gelu"`, `patch_bias =
//! false`, `layer_norm_eps = 1e-5`, `projection_dim`) is a CLIP vision tower: Hugging Face's
//! `CLIPVisionModel` and open_clip's `visual` differ from torchvision's ViT only there, and in
//! their names, which the checkpoint reader maps.
use anyhow::Result;
use serde::{Deserialize, Serialize};
use tch::nn::{self, Init, Module};
use tch::Tensor;

use super::layers::{self, LayerNorm};
use super::lora::{adapted, adapter_for, Adapter, LoraOptions};
use super::preset::{run_chain, Built, Chain, Net, Preset};

/// `[model.vit]`; the defaults are ViT-B/16.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct VitOptions {
    pub image_size: i64,
    pub patch_size: i64,
    pub in_channels: i64,
    pub layers: i64,
    pub heads: i64,
    pub hidden_dim: i64,
    pub mlp_dim: i64,
    pub dropout: f64,
    pub attention_dropout: f64,
    pub num_classes: i64,
    /// LayerNorm's epsilon everywhere: torchvision and timm 1e-6, Hugging Face ViT 1e-12, CLIP 1e-5.
    pub layer_norm_eps: f64,
    pub activation: Activation,
    /// A LayerNorm (`ln_pre`) on the embedded tokens before the first block, as CLIP has.
    pub pre_norm: bool,
    /// Whether the patch embedding (`conv_proj`) has a bias; CLIP's has none.
    pub patch_bias: bool,
    /// The width of a bias-free projection (`projection`) of the class token before the head, as
    /// CLIP's `visual_projection`; 0: none.
    pub projection_dim: i64,
}

/// The MLP's nonlinearity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// The exact (erf) GELU of torchvision, timm and Hugging Face ViT.
    Gelu,
    /// `x · sigmoid(1.702 x)`, OpenAI CLIP's approximation, which its weights were trained with.
    QuickGelu,
}

impl Activation {
    fn apply(self, x: &Tensor) -> Tensor {
        match self {
            Activation::Gelu => x.gelu("none"),
            // Hugging Face's QuickGELUActivation: input * sigmoid(1.702 * input).
            Activation::QuickGelu => x * (x * 1.702).sigmoid(),
        }
    }
}

impl Default for VitOptions {
    fn default() -> Self {
        VitOptions {
            image_size: 224,
            patch_size: 16,
            in_channels: 3,
            layers: 12,
            heads: 12,
            hidden_dim: 768,
            mlp_dim: 3072,
            dropout: 0.0,
            attention_dropout: 0.0,
            num_classes: 1000,
            layer_norm_eps: 1e-6,
            activation: Activation::Gelu,
            pre_norm: false,
            patch_bias: true,
            projection_dim: 0,
        }
    }
}

pub struct VitPreset;

impl Preset for VitPreset {
    type Options = VitOptions;
    const NAME: &'static str = "vit";

    fn check(o: &VitOptions) -> Vec<(&'static str, String)> {
        let mut p = vec![];
        for (key, v, min) in [
            ("image_size", o.image_size, 1),
            ("patch_size", o.patch_size, 1),
            ("in_channels", o.in_channels, 1),
            ("layers", o.layers, 1),
            ("heads", o.heads, 1),
            ("hidden_dim", o.hidden_dim, 1),
            ("mlp_dim", o.mlp_dim, 1),
            ("num_classes", o.num_classes, 2),
        ] {
            if v < min {
                p.push((key, format!("must be at least {min}, got {v}")));
            }
        }
        if o.patch_size >= 1 && o.image_size >= 1 && o.image_size % o.patch_size != 0 {
            p.push((
                "image_size",
                format!(
                    "must be a multiple of model.vit.patch_size ({}), got {}; a patch_size that divides it: {}",
                    o.patch_size,
                    o.image_size,
                    (1..=o.image_size)
                        .filter(|d| o.image_size % d == 0)
                        .map(|d| d.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        }
        if o.heads >= 1 && o.hidden_dim % o.heads != 0 {
            p.push((
                "hidden_dim",
                format!(
                    "must be a multiple of heads ({}) so the heads split it evenly, got {}",
                    o.heads, o.hidden_dim
                ),
            ));
        }
        if o.projection_dim < 0 {
            p.push((
                "projection_dim",
                format!("must be 0 (no projection) or more, got {}", o.projection_dim),
            ));
        }
        if !(o.layer_norm_eps > 0.0 && o.layer_norm_eps < 1.0) {
            p.push(("layer_norm_eps", format!("must be in (0, 1), got {}", o.layer_norm_eps)));
        }
        for (key, v) in [("dropout", o.dropout), ("attention_dropout", o.attention_dropout)] {
            if !(0.0..1.0).contains(&v) {
                p.push((key, format!("must be in [0, 1), got {v}")));
            }
        }
        p
    }

    fn build(root: &nn::Path, o: &VitOptions) -> Result<Built> {
        Ok(Built {
            input_shape: vec![o.in_channels, o.image_size, o.image_size],
            num_classes: o.num_classes,
            head: vec!["heads.head".into()],
            net: Box::new(Vit::new(root, o)),
        })
    }
}

/// One `EncoderBlock`: x + Dropout(Attention(LN(x))), then + MLP(LN(·)).
#[derive(Debug)]
struct EncoderBlock {
    ln_1: LayerNorm,
    in_proj_weight: Tensor,
    in_proj_bias: Tensor,
    out_proj: nn::Linear,
    ln_2: LayerNorm,
    mlp_0: nn::Linear,
    mlp_3: nn::Linear,
    heads: i64,
    dropout: f64,
    attention_dropout: f64,
    activation: Activation,
    lora: BlockAdapters,
}

/// A block's LoRA adapters: on the packed in-projection's query, key and value parts, the
/// attention's output projection and the MLP's two layers.
#[derive(Debug, Default)]
struct BlockAdapters {
    q: Option<Adapter>,
    k: Option<Adapter>,
    v: Option<Adapter>,
    out: Option<Adapter>,
    fc1: Option<Adapter>,
    fc2: Option<Adapter>,
}

/// The linear layers of a block that LoRA can adapt, as (name under the block, inputs, outputs).
fn block_layers(d: i64, mlp: i64) -> [(&'static str, i64, i64); 6] {
    [
        ("self_attention.in_proj_q", d, d),
        ("self_attention.in_proj_k", d, d),
        ("self_attention.in_proj_v", d, d),
        ("self_attention.out_proj", d, d),
        ("mlp.0", d, mlp),
        ("mlp.3", mlp, d),
    ]
}

impl EncoderBlock {
    fn new(p: &nn::Path, o: &VitOptions) -> Self {
        let d = o.hidden_dim;
        let sa = p / "self_attention";
        let bias = Init::Randn { mean: 0.0, stdev: 1e-6 };
        let mlp = p / "mlp";
        EncoderBlock {
            ln_1: LayerNorm::new(&(p / "ln_1"), d, o.layer_norm_eps),
            in_proj_weight: sa.var("in_proj_weight", &[3 * d, d], layers::xavier_uniform(d, 3 * d)),
            in_proj_bias: sa.var("in_proj_bias", &[3 * d], Init::Const(0.0)),
            out_proj: {
                let b = 1.0 / (d as f64).sqrt();
                layers::linear_init(
                    &sa / "out_proj",
                    d,
                    d,
                    Init::Uniform { lo: -b, up: b },
                    Init::Const(0.0),
                )
            },
            ln_2: LayerNorm::new(&(p / "ln_2"), d, o.layer_norm_eps),
            mlp_0: layers::linear_init(&mlp / "0", d, o.mlp_dim, layers::xavier_uniform(d, o.mlp_dim), bias),
            mlp_3: layers::linear_init(&mlp / "3", o.mlp_dim, d, layers::xavier_uniform(o.mlp_dim, d), bias),
            heads: o.heads,
            dropout: o.dropout,
            attention_dropout: o.attention_dropout,
            activation: o.activation,
            lora: BlockAdapters::default(),
        }
    }

    fn sizes(&self) -> (i64, i64) {
        (self.in_proj_weight.size()[1], self.mlp_0.ws.size()[0])
    }

    fn adapt(&mut self, p: &nn::Path, o: &LoraOptions, made: &mut Vec<String>) {
        let (d, m) = self.sizes();
        let mut made_one = |(name, i, out): (&str, i64, i64)| {
            let path = name.split('.').fold(p.clone(), |q, part| q / part);
            adapter_for(path, i, out, o, made)
        };
        let [q, k, v, out, fc1, fc2] = block_layers(d, m);
        self.lora = BlockAdapters {
            q: made_one(q),
            k: made_one(k),
            v: made_one(v),
            out: made_one(out),
            fc1: made_one(fc1),
            fc2: made_one(fc2),
        };
    }

    fn attention(&self, x: &Tensor, train: bool) -> Tensor {
        let (n, l, d) = x.size3().expect("[batch, tokens, hidden]");
        let h = self.heads;
        let qkv = x.linear(&self.in_proj_weight, Some(&self.in_proj_bias));
        let split = |t: &Tensor| t.view([n, l, h, d / h]).transpose(1, 2);
        let parts = qkv.chunk(3, -1);
        let l_ = &self.lora;
        let q = adapted(&l_.q, parts[0].shallow_clone(), x, train);
        let k = adapted(&l_.k, parts[1].shallow_clone(), x, train);
        let v = adapted(&l_.v, parts[2].shallow_clone(), x, train);
        let p = if train { self.attention_dropout } else { 0.0 };
        let a = Tensor::scaled_dot_product_attention::<Tensor>(
            &split(&q),
            &split(&k),
            &split(&v),
            None,
            p,
            false,
            None,
            false,
        );
        let a = a.transpose(1, 2).reshape([n, l, d]);
        adapted(&l_.out, self.out_proj.forward(&a), &a, train)
    }

    fn forward_t(&self, input: &Tensor, train: bool) -> Tensor {
        let x = self
            .attention(&self.ln_1.forward(input), train)
            .dropout(self.dropout, train)
            + input;
        let h = self.ln_2.forward(&x);
        let y = adapted(&self.lora.fc1, self.mlp_0.forward(&h), &h, train);
        let y = self.activation.apply(&y).dropout(self.dropout, train);
        let y = adapted(&self.lora.fc2, self.mlp_3.forward(&y), &y, train).dropout(self.dropout, train);
        x + y
    }
}

#[derive(Debug)]
pub struct Vit {
    conv_proj: nn::Conv2D,
    class_token: Tensor,
    pos_embedding: Tensor,
    ln_pre: Option<LayerNorm>,
    layers: Vec<EncoderBlock>,
    ln: LayerNorm,
    projection: Option<nn::Linear>,
    head: nn::Linear,
    dropout: f64,
    projection_lora: Option<Adapter>,
    head_lora: Option<Adapter>,
}

impl Vit {
    fn new(root: &nn::Path, o: &VitOptions) -> Self {
        let d = o.hidden_dim;
        let fan_in = o.in_channels * o.patch_size * o.patch_size;
        let conv_proj = nn::conv2d(
            root / "conv_proj",
            o.in_channels,
            d,
            o.patch_size,
            nn::ConvConfig {
                stride: o.patch_size,
                ws_init: Init::Randn {
                    mean: 0.0,
                    stdev: (1.0 / fan_in as f64).sqrt(),
                },
                bs_init: Init::Const(0.0),
                bias: o.patch_bias,
                ..Default::default()
            },
        );
        let side = o.image_size / o.patch_size;
        let seq = side * side + 1;
        let enc = root / "encoder";
        let layer_root = &enc / "layers";
        Vit {
            conv_proj,
            class_token: root.var("class_token", &[1, 1, d], Init::Const(0.0)),
            pos_embedding: enc.var("pos_embedding", &[1, seq, d], Init::Randn { mean: 0.0, stdev: 0.02 }),
            ln_pre: o
                .pre_norm
                .then(|| LayerNorm::new(&(root / "ln_pre"), d, o.layer_norm_eps)),
            layers: (0..o.layers)
                .map(|i| {
                    let p = &layer_root / format!("encoder_layer_{i}");
                    let block = EncoderBlock::new(&p, o);
                    super::rounded::round_built(&p);
                    block
                })
                .collect(),
            ln: LayerNorm::new(&(&enc / "ln"), d, o.layer_norm_eps),
            projection: (o.projection_dim > 0).then(|| projection(root / "projection", d, o.projection_dim)),
            head: layers::linear_init(
                root / "heads" / "head",
                if o.projection_dim > 0 { o.projection_dim } else { d },
                o.num_classes,
                Init::Const(0.0),
                Init::Const(0.0),
            ),
            dropout: o.dropout,
            projection_lora: None,
            head_lora: None,
        }
    }

    /// The layers after the blocks, as (name, inputs, outputs).
    fn top_layers(&self) -> Vec<(&'static str, i64, i64)> {
        let [out, inputs] = self.head.ws.size()[..] else {
            unreachable!("a linear layer's weight is [out, in]")
        };
        let mut v = vec![];
        if let Some(p) = &self.projection {
            let s = p.ws.size();
            v.push(("projection", s[1], s[0]));
        }
        v.push(("heads.head", inputs, out));
        v
    }
}

impl Chain for Vit {
    fn blocks(&self) -> usize {
        self.layers.len() + 2
    }

    fn block(&self, i: usize, state: &[Tensor], train: bool) -> Vec<Tensor> {
        let x = &state[0];
        let out = if i == 0 {
            let n = x.size()[0];
            let p = self.conv_proj.forward(x);
            let d = p.size()[1];
            let p = p.reshape([n, d, -1]).permute([0, 2, 1]);
            let cls = self.class_token.expand([n, -1, -1], false);
            let tokens = Tensor::cat(&[cls, p], 1) + &self.pos_embedding;
            let tokens = match &self.ln_pre {
                Some(ln) => ln.forward(&tokens),
                None => tokens,
            };
            tokens.dropout(self.dropout, train)
        } else if i == self.layers.len() + 1 {
            let mut pooled = self.ln.forward(x).select(1, 0);
            if let Some(proj) = &self.projection {
                pooled = adapted(&self.projection_lora, proj.forward(&pooled), &pooled, train);
            }
            adapted(&self.head_lora, self.head.forward(&pooled), &pooled, train)
        } else {
            self.layers[i - 1].forward_t(x, train)
        };
        vec![out]
    }

    /// timm's: the final norm is the last encoder block's layer, the head one above it.
    fn layer_of(&self, var: &str) -> Option<usize> {
        match var.starts_with("encoder.ln.") {
            true => Some(self.layers.len()),
            false => self.block_of(var),
        }
    }

    /// The embedding: `conv_proj`, `class_token`, `encoder.pos_embedding`, `ln_pre`; encoder
    /// layer `N`: block `N + 1`; the head: `encoder.ln`, `projection`, `heads`.
    fn block_of(&self, var: &str) -> Option<usize> {
        if let Some(rest) = var.strip_prefix("encoder.layers.encoder_layer_") {
            let n: usize = rest.split('.').next()?.parse().ok()?;
            return (n < self.layers.len()).then_some(n + 1);
        }
        let first = var.split('.').next()?;
        match first {
            "conv_proj" | "class_token" | "ln_pre" => Some(0),
            "projection" => Some(self.layers.len() + 1),
            "encoder" if var == "encoder.pos_embedding" => Some(0),
            "encoder" if var.starts_with("encoder.ln.") => Some(self.layers.len() + 1),
            "heads" => Some(self.layers.len() + 1),
            _ => None,
        }
    }
}

impl Net for Vit {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        run_chain(self, xs, train)
    }

    fn adapt(&mut self, root: &nn::Path, o: &LoraOptions) -> Vec<String> {
        let mut made = vec![];
        let layers = root / "encoder" / "layers";
        for (i, block) in self.layers.iter_mut().enumerate() {
            block.adapt(&(&layers / format!("encoder_layer_{i}")), o, &mut made);
        }
        for (name, inputs, outputs) in self.top_layers() {
            let path = name.split('.').fold(root.clone(), |q, part| q / part);
            let a = adapter_for(path, inputs, outputs, o, &mut made);
            match name {
                "projection" => self.projection_lora = a,
                _ => self.head_lora = a,
            }
        }
        made
    }

    fn adaptable(&self) -> Vec<String> {
        let mut v = vec![];
        for (i, block) in self.layers.iter().enumerate() {
            let (d, m) = block.sizes();
            v.extend(
                block_layers(d, m)
                    .iter()
                    .map(|(n, _, _)| format!("encoder.layers.encoder_layer_{i}.{n}")),
            );
        }
        v.extend(self.top_layers().iter().map(|(n, _, _)| n.to_string()));
        v
    }

    fn chain(&self) -> Option<&dyn Chain> {
        Some(self)
    }
}

/// CLIP's `visual_projection`: a bias-free linear layer, PyTorch's default initialisation.
fn projection(p: nn::Path, inputs: i64, outputs: i64) -> nn::Linear {
    let b = 1.0 / (inputs as f64).sqrt();
    nn::linear(
        p,
        inputs,
        outputs,
        nn::LinearConfig {
            ws_init: Init::Uniform { lo: -b, up: b },
            bs_init: None,
            bias: false,
        },
    )
}
