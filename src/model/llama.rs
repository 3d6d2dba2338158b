//! `llama`: the Llama family of decoder-only language models (Llama 2 and 3.x, SmolLM2,
//! TinyLlama) and Qwen2/2.5 (biased query, key and value projections), as Hugging Face's
//! `LlamaForCausalLM` and `Qwen2ForCausalLM` compute them, under their state-dict names
//! (`model.embed_tokens`, `model.layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj,
//! post_attention_layernorm, mlp.{gate,up,down}_proj}`, `model.norm`, `lm_head`), so their
//! checkpoints load without a mapping.
//!
//! RMSNorm computes in fp32 and casts back, as Hugging Face's does; rotary embeddings take
//! `rope_theta` and Llama 3's frequency scaling (transformers' `_compute_llama3_parameters`);
//! grouped-query attention is `scaled_dot_product_attention` with `is_causal` and `enable_gqa`,
//! which picks the fused kernels on GPUs; the MLP is SwiGLU.
//!
//! The output is the final normed hidden states `[batch, seq, hidden]` and `output_head` the
//! vocabulary projection (`lm_head`, or the embedding when tied), which the next-token loss
//! applies chunk by chunk. As a chain: the embedding, one block per decoder layer, the final
//! norm. The projection is used outside the chain (by the loss), so the model's variables do not
//! all belong to one block, and parameters cannot stream block by block.
use anyhow::Result;
use serde::{Deserialize, Serialize};
use tch::nn::{self, Init, Module};
use tch::{Kind, Tensor};

use super::lora::{adapted, adapter_for, Adapter, LoraOptions};
use super::preset::{run_chain, Built, Chain, KvCache, Net, Preset};

/// `[model.llama]`, with Hugging Face's `LlamaConfig` names; the defaults are a tiny model.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LlamaOptions {
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    /// Grouped-query attention: each key/value head serves `num_attention_heads / this` heads.
    pub num_key_value_heads: i64,
    /// Each head's width; left out, `hidden_size / num_attention_heads`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<i64>,
    pub max_position_embeddings: i64,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    /// Llama 3's frequency scaling; left out, plain rotary embeddings.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<RopeScaling>,
    /// The output projection is the embedding (no `lm_head.weight`).
    pub tie_word_embeddings: bool,
    /// Biases on the query, key, value and output projections (`LlamaConfig.attention_bias`).
    pub attention_bias: bool,
    /// Biases on the query, key and value projections only, as Qwen2 has them.
    pub qkv_bias: bool,
    /// The training window: the input is `[seq_len]` token ids.
    pub seq_len: i64,
}

impl Default for LlamaOptions {
    fn default() -> Self {
        LlamaOptions {
            vocab_size: 256,
            hidden_size: 64,
            intermediate_size: 172,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: None,
            max_position_embeddings: 512,
            rms_norm_eps: 1e-6,
            rope_theta: 10000.0,
            rope_scaling: None,
            tie_word_embeddings: false,
            attention_bias: false,
            qkv_bias: false,
            seq_len: 128,
        }
    }
}

impl LlamaOptions {
    pub fn head_dim(&self) -> i64 {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// Whether the query, key and value projections have biases.
    fn qkv_biased(&self) -> bool {
        self.attention_bias || self.qkv_bias
    }
}

/// `[model.llama.rope_scaling]`: Llama 3.1's `rope_scaling`; the defaults are Llama 3.1's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RopeScaling {
    pub rope_type: RopeType,
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: i64,
}

impl Default for RopeScaling {
    fn default() -> Self {
        RopeScaling {
            rope_type: RopeType::Llama3,
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        }
    }
}

/// The rotary scalings the preset computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RopeType {
    Llama3,
}

pub struct LlamaPreset;

impl Preset for LlamaPreset {
    type Options = LlamaOptions;
    const NAME: &'static str = "llama";

    fn check(o: &LlamaOptions) -> Vec<(&'static str, String)> {
        let mut p = vec![];
        for (key, v, min) in [
            ("vocab_size", o.vocab_size, 2),
            ("hidden_size", o.hidden_size, 1),
            ("intermediate_size", o.intermediate_size, 1),
            ("num_hidden_layers", o.num_hidden_layers, 1),
            ("num_attention_heads", o.num_attention_heads, 1),
            ("num_key_value_heads", o.num_key_value_heads, 1),
            ("max_position_embeddings", o.max_position_embeddings, 1),
            ("seq_len", o.seq_len, 1),
        ] {
            if v < min {
                p.push((key, format!("must be at least {min}, got {v}")));
            }
        }
        if !p.is_empty() {
            return p;
        }
        match o.head_dim {
            None if o.hidden_size % o.num_attention_heads != 0 => p.push((
                "hidden_size",
                format!(
                    "must be a multiple of num_attention_heads ({}) so the heads split it evenly, got {}; or set head_dim",
                    o.num_attention_heads, o.hidden_size
                ),
            )),
            Some(d) if d < 2 || d % 2 != 0 => p.push((
                "head_dim",
                format!("must be even and at least 2 (rotary embeddings turn pairs), got {d}"),
            )),
            None if o.head_dim() % 2 != 0 => p.push((
                "hidden_size",
                format!(
                    "gives heads of odd width {} (hidden_size / num_attention_heads), and rotary embeddings turn pairs; set head_dim",
                    o.head_dim()
                ),
            )),
            _ => {}
        }
        if o.num_attention_heads % o.num_key_value_heads != 0 {
            p.push((
                "num_key_value_heads",
                format!(
                    "must divide num_attention_heads ({}) so each key/value head serves as many query heads, got {}",
                    o.num_attention_heads, o.num_key_value_heads
                ),
            ));
        }
        if o.seq_len > o.max_position_embeddings {
            p.push((
                "seq_len",
                format!(
                    "{} is beyond the model's {} positions (max_position_embeddings); set seq_len to at most {}",
                    o.seq_len, o.max_position_embeddings, o.max_position_embeddings
                ),
            ));
        }
        if !(o.rms_norm_eps > 0.0 && o.rms_norm_eps < 1.0) {
            p.push(("rms_norm_eps", format!("must be in (0, 1), got {}", o.rms_norm_eps)));
        }
        if !(o.rope_theta > 1.0 && o.rope_theta.is_finite()) {
            p.push(("rope_theta", format!("must be a number above 1, got {}", o.rope_theta)));
        }
        if let Some(s) = &o.rope_scaling {
            p.extend(check_scaling(s));
        }
        p
    }

    fn build(root: &nn::Path, o: &LlamaOptions) -> Result<Built> {
        Ok(Built {
            input_shape: vec![o.seq_len],
            num_classes: o.vocab_size,
            // A checkpoint for another vocabulary fits neither the embedding nor the head: the
            // load refuses it rather than making either fresh.
            head: vec![],
            net: Box::new(Llama::new(root, o)),
        })
    }
}

fn check_scaling(s: &RopeScaling) -> Vec<(&'static str, String)> {
    let mut p = vec![];
    if !(s.factor >= 1.0 && s.factor.is_finite()) {
        p.push(("rope_scaling", format!("factor must be at least 1, got {}", s.factor)));
    }
    if !(s.low_freq_factor > 0.0 && s.high_freq_factor > s.low_freq_factor) {
        p.push((
            "rope_scaling",
            format!(
                "needs 0 < low_freq_factor < high_freq_factor, got {} and {}",
                s.low_freq_factor, s.high_freq_factor
            ),
        ));
    }
    if s.original_max_position_embeddings < 1 {
        p.push((
            "rope_scaling",
            format!(
                "original_max_position_embeddings must be at least 1, got {}",
                s.original_max_position_embeddings
            ),
        ));
    }
    p
}

/// The rotary embeddings' inverse frequencies `[head_dim / 2]` (fp32, on `device`), as
/// transformers computes them: the default's, then Llama 3's scaling. Each step is the same
/// float32 operation as Python's (a scalar over a tensor is its reciprocal times the scalar).
fn inv_freq(o: &LlamaOptions, device: tch::Device) -> Tensor {
    let dim = o.head_dim();
    let steps = Tensor::arange_start_step(0, dim, 2, (Kind::Int64, device)).to_kind(Kind::Float);
    let inv = Tensor::pow_scalar(o.rope_theta, &(steps / dim as f64)).reciprocal();
    let Some(s) = &o.rope_scaling else {
        return inv;
    };
    let old = s.original_max_position_embeddings as f64;
    let (low, high) = (s.low_freq_factor, s.high_freq_factor);
    let low_wavelen = old / low;
    let high_wavelen = old / high;
    let wavelen = inv.reciprocal() * (2.0 * std::f64::consts::PI);
    let scaled = (&inv / s.factor).where_self(&wavelen.gt(low_wavelen), &inv);
    let smooth = (wavelen.reciprocal() * old - low) / (high - low);
    let smoothed = (smooth.neg() + 1.0) * &scaled / s.factor + &smooth * &scaled;
    let medium = wavelen.lt(high_wavelen).logical_not() * wavelen.gt(low_wavelen).logical_not();
    smoothed.where_self(&medium, &scaled)
}

/// `LlamaRMSNorm`: the mean square in fp32, the input scaled in fp32, cast back, then weighted.
#[derive(Debug)]
struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    fn new(p: &nn::Path, d: i64, eps: f64) -> Self {
        RmsNorm {
            weight: p.var("weight", &[d], Init::Const(1.0)),
            eps,
        }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let h = x.to_kind(Kind::Float);
        let variance = h.square().mean_dim(-1, true, None::<Kind>);
        let h = h * (variance + self.eps).rsqrt();
        &self.weight * h.to_kind(x.kind())
    }
}

/// A linear layer as Hugging Face initialises it: weight normal(0, 0.02), bias zero.
fn linear(p: nn::Path, inputs: i64, outputs: i64, bias: bool) -> nn::Linear {
    nn::linear(
        p,
        inputs,
        outputs,
        nn::LinearConfig {
            ws_init: Init::Randn {
                mean: 0.0,
                stdev: INIT_STD,
            },
            bs_init: Some(Init::Const(0.0)),
            bias,
        },
    )
}

/// `LlamaConfig.initializer_range`'s default.
const INIT_STD: f64 = 0.02;

/// The projections LoRA can adapt, as (name under the layer, short name).
pub const PROJECTIONS: [(&str, &str); 7] = [
    ("self_attn.q_proj", "q"),
    ("self_attn.k_proj", "k"),
    ("self_attn.v_proj", "v"),
    ("self_attn.o_proj", "o"),
    ("mlp.gate_proj", "gate"),
    ("mlp.up_proj", "up"),
    ("mlp.down_proj", "down"),
];

/// One `LlamaDecoderLayer`: x + Attention(RMSNorm(x)), then + MLP(RMSNorm(·)).
#[derive(Debug)]
struct DecoderLayer {
    input_layernorm: RmsNorm,
    /// q, k, v, o, gate, up, down, in `PROJECTIONS`' order.
    proj: Vec<nn::Linear>,
    lora: Vec<Option<Adapter>>,
    post_attention_layernorm: RmsNorm,
    heads: i64,
    kv_heads: i64,
    head_dim: i64,
}

impl DecoderLayer {
    fn new(p: &nn::Path, o: &LlamaOptions) -> Self {
        let (d, hd, m) = (o.hidden_size, o.head_dim(), o.intermediate_size);
        let (q, kv) = (o.num_attention_heads * hd, o.num_key_value_heads * hd);
        let qkv = o.qkv_biased();
        let shapes = [
            (d, q, qkv),
            (d, kv, qkv),
            (d, kv, qkv),
            (q, d, o.attention_bias),
            (d, m, false),
            (d, m, false),
            (m, d, false),
        ];
        DecoderLayer {
            input_layernorm: RmsNorm::new(&(p / "input_layernorm"), d, o.rms_norm_eps),
            proj: PROJECTIONS
                .iter()
                .zip(shapes)
                .map(|((name, _), (i, out, bias))| linear(path(p, name), i, out, bias))
                .collect(),
            lora: (0..PROJECTIONS.len()).map(|_| None).collect(),
            post_attention_layernorm: RmsNorm::new(&(p / "post_attention_layernorm"), d, o.rms_norm_eps),
            heads: o.num_attention_heads,
            kv_heads: o.num_key_value_heads,
            head_dim: hd,
        }
    }

    /// Projection `i` of `x`, with its adapter.
    fn project(&self, i: usize, x: &Tensor, train: bool) -> Tensor {
        adapted(&self.lora[i], self.proj[i].forward(x), x, train)
    }

    fn adapt(&mut self, p: &nn::Path, o: &LoraOptions, made: &mut Vec<String>) {
        for (i, (name, _)) in PROJECTIONS.iter().enumerate() {
            let [out, inputs] = self.proj[i].ws.size()[..] else {
                unreachable!("a linear layer's weight is [out, in]")
            };
            self.lora[i] = adapter_for(path(p, name), inputs, out, o, made);
        }
    }

    /// Causal self-attention over `x`; with `cache`, `x` follows the positions whose keys and
    /// values it holds, and its own are appended to them.
    fn attention(&self, x: &Tensor, rope: &(Tensor, Tensor), train: bool, cache: Option<&mut Kv>) -> Tensor {
        let (n, l, _) = x.size3().expect("[batch, seq, hidden]");
        let heads = |t: Tensor, h: i64| t.view([n, l, h, self.head_dim]).transpose(1, 2);
        let q = rotate(&heads(self.project(0, x, train), self.heads), rope);
        let k = rotate(&heads(self.project(1, x, train), self.kv_heads), rope);
        let v = heads(self.project(2, x, train), self.kv_heads);
        let (k, v, start) = match cache {
            None => (k, v, 0),
            Some(slot) => {
                let (k, v, start) = match slot.take() {
                    Some((pk, pv)) => (Tensor::cat(&[&pk, &k], 2), Tensor::cat(&[&pv, &v], 2), pk.size()[2]),
                    None => (k, v, 0),
                };
                *slot = Some((k.shallow_clone(), v.shallow_clone()));
                (k, v, start)
            }
        };
        // A query at position start + i sees keys 0..=start + i: the plain causal mask when
        // nothing came before, none for a single new query, else an explicit one.
        let (mask, causal) = match (start, l) {
            (0, _) => (None, true),
            (_, 1) => (None, false),
            (s, l) => (Some(Tensor::ones([l, s + l], (Kind::Bool, x.device())).tril(s)), false),
        };
        let a = Tensor::scaled_dot_product_attention::<&Tensor>(
            &q,
            &k,
            &v,
            mask.as_ref(),
            0.0,
            causal,
            None,
            self.kv_heads != self.heads,
        );
        let a = a.transpose(1, 2).reshape([n, l, self.heads * self.head_dim]);
        self.project(3, &a, train)
    }

    fn forward_t(&self, x: &Tensor, rope: &(Tensor, Tensor), train: bool, cache: Option<&mut Kv>) -> Tensor {
        let h = x + self.attention(&self.input_layernorm.forward(x), rope, train, cache);
        let y = self.post_attention_layernorm.forward(&h);
        let gated = self.project(4, &y, train).silu() * self.project(5, &y, train);
        &h + self.project(6, &gated, train)
    }
}

/// One layer's keys and values so far, `[batch, kv_heads, positions, head_dim]` each.
type Kv = Option<(Tensor, Tensor)>;

/// `base/a/b` for the dotted name `a.b`.
fn path<'a>(base: &nn::Path<'a>, dotted: &str) -> nn::Path<'a> {
    dotted.split('.').fold(base.clone(), |q, part| q / part)
}

/// `x · cos + rotate_half(x) · sin`, rotate_half turning the two halves of the last dimension.
fn rotate(x: &Tensor, (cos, sin): &(Tensor, Tensor)) -> Tensor {
    let half = x.size()[3] / 2;
    let turned = Tensor::cat(&[x.narrow(3, half, half).neg(), x.narrow(3, 0, half)], 3);
    x * cos + turned * sin
}

#[derive(Debug)]
pub struct Llama {
    embed_tokens: Tensor,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    /// None: tied to the embedding.
    lm_head: Option<Tensor>,
    options: LlamaOptions,
    /// The rotary inverse frequencies, made on the device of the first input that needs them
    /// (a copy from the host before every layer would wait for the device). Not a variable:
    /// transformers does not save them either.
    inv_freq: std::cell::RefCell<Option<Tensor>>,
}

impl Llama {
    fn new(root: &nn::Path, o: &LlamaOptions) -> Self {
        let model = root / "model";
        let std = Init::Randn {
            mean: 0.0,
            stdev: INIT_STD,
        };
        let layers = &model / "layers";
        let embed = &model / "embed_tokens";
        let embed_tokens = embed.var("weight", &[o.vocab_size, o.hidden_size], std);
        super::rounded::round_built(&embed);
        Llama {
            embed_tokens,
            layers: (0..o.num_hidden_layers)
                .map(|i| {
                    let p = &layers / i;
                    let layer = DecoderLayer::new(&p, o);
                    super::rounded::round_built(&p);
                    layer
                })
                .collect(),
            norm: RmsNorm::new(&(&model / "norm"), o.hidden_size, o.rms_norm_eps),
            lm_head: (!o.tie_word_embeddings).then(|| {
                let head = root / "lm_head";
                let w = head.var("weight", &[o.vocab_size, o.hidden_size], std);
                super::rounded::round_built(&head);
                w
            }),
            options: o.clone(),
            inv_freq: Default::default(),
        }
    }

    /// cos and sin `[seq, head_dim]` of positions `start..start + seq`, in fp32 (outside
    /// autocast's reach: a product and a concatenation), then in the activations' type.
    fn rope(&self, x: &Tensor, start: i64) -> (Tensor, Tensor) {
        let (l, device) = (x.size()[1], x.device());
        let mut cached = self.inv_freq.borrow_mut();
        let inv = match cached.as_ref().filter(|t| t.device() == device) {
            Some(t) => t.shallow_clone(),
            None => cached
                .insert(tch::no_grad(|| inv_freq(&self.options, device)))
                .shallow_clone(),
        };
        let positions = Tensor::arange_start(start, start + l, (Kind::Float, device));
        let freqs = positions.unsqueeze(1) * inv.unsqueeze(0);
        let emb = Tensor::cat(&[&freqs, &freqs], -1);
        (emb.cos().to_kind(x.kind()), emb.sin().to_kind(x.kind()))
    }
}

impl Chain for Llama {
    fn blocks(&self) -> usize {
        self.layers.len() + 2
    }

    fn block(&self, i: usize, state: &[Tensor], train: bool) -> Vec<Tensor> {
        let x = &state[0];
        let out = if i == 0 {
            Tensor::embedding(&self.embed_tokens, x, -1, false, false)
        } else if i == self.layers.len() + 1 {
            self.norm.forward(x)
        } else {
            self.layers[i - 1].forward_t(x, &self.rope(x, 0), train, None)
        };
        vec![out]
    }

    /// The embedding: block 0 (unless tied: the head outside the chain uses it too); decoder
    /// layer `N`: block `N + 1`; the final norm: the last block; `lm_head`: none (the loss
    /// applies it after the chain).
    fn block_of(&self, var: &str) -> Option<usize> {
        if let Some(rest) = var.strip_prefix("model.layers.") {
            let n: usize = rest.split('.').next()?.parse().ok()?;
            return (n < self.layers.len()).then_some(n + 1);
        }
        match var {
            "model.embed_tokens.weight" if self.lm_head.is_some() => Some(0),
            "model.norm.weight" => Some(self.layers.len() + 1),
            _ => None,
        }
    }

    /// The output projection (the embedding, when tied): the loss reads it after the last block.
    fn resident(&self, var: &str) -> bool {
        var == "lm_head.weight" || (self.lm_head.is_none() && var == "model.embed_tokens.weight")
    }

    /// A tied embedding is read by the embedding lookup first.
    fn resident_from(&self, var: &str) -> usize {
        match var {
            "model.embed_tokens.weight" => 0,
            _ => self.blocks() - 1,
        }
    }

    /// The embedding at the bottom, the output projection at the top with the final norm.
    fn layer_of(&self, var: &str) -> Option<usize> {
        match var {
            "model.embed_tokens.weight" => Some(0),
            "lm_head.weight" => Some(self.layers.len() + 1),
            _ => self.block_of(var),
        }
    }
}

impl Net for Llama {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        run_chain(self, xs, train)
    }

    fn chain(&self) -> Option<&dyn Chain> {
        Some(self)
    }

    fn decode_block(&self, i: usize, x: &Tensor, start: i64, cache: &mut KvCache) -> Option<Tensor> {
        if i == 0 {
            return Some(Tensor::embedding(&self.embed_tokens, x, -1, false, false));
        }
        let Some(layer) = self.layers.get(i - 1) else {
            return Some(self.norm.forward(x));
        };
        let mut kv: Kv = cache
            .layers
            .get(i - 1)
            .map(|(k, v)| (k.shallow_clone(), v.shallow_clone()));
        let out = layer.forward_t(x, &self.rope(x, start), false, Some(&mut kv));
        let kv = kv.expect("attention leaves the keys and values it saw");
        match cache.layers.get_mut(i - 1) {
            Some(slot) => *slot = kv,
            None => cache.layers.push(kv),
        }
        Some(out)
    }

    fn output_head(&self) -> Option<Tensor> {
        Some(self.lm_head.as_ref().unwrap_or(&self.embed_tokens).shallow_clone())
    }

    /// The short names (`q`, `gate`, …) stand for their projections (`q_proj`, `gate_proj`, …).
    fn adapt(&mut self, root: &nn::Path, o: &LoraOptions) -> Vec<String> {
        let o = &LoraOptions {
            targets: o.targets.iter().map(|t| long_name(t)).collect(),
            ..o.clone()
        };
        let mut made = vec![];
        let layers = root / "model" / "layers";
        for (i, layer) in self.layers.iter_mut().enumerate() {
            layer.adapt(&(&layers / i), o, &mut made);
        }
        made
    }

    fn adaptable(&self) -> Vec<String> {
        (0..self.layers.len())
            .flat_map(|i| PROJECTIONS.map(|(n, _)| format!("model.layers.{i}.{n}")))
            .collect()
    }
}

/// A LoRA target's projection: `q` is `q_proj`, …; other targets as written.
fn long_name(target: &str) -> String {
    match PROJECTIONS.iter().find(|(_, short)| *short == target) {
        Some((name, _)) => name.rsplit('.').next().unwrap_or(name).to_owned(),
        None => target.to_owned(),
    }
}

/// Hugging Face's `config.json` for the options: `Qwen2ForCausalLM` where only the query, key
/// and value projections have biases, `LlamaForCausalLM` otherwise.
pub fn hf_config(o: &LlamaOptions) -> serde_json::Value {
    let qwen2 = o.qkv_bias && !o.attention_bias;
    let mut c = serde_json::json!({
        "architectures": [if qwen2 { "Qwen2ForCausalLM" } else { "LlamaForCausalLM" }],
        "model_type": if qwen2 { "qwen2" } else { "llama" },
        "vocab_size": o.vocab_size,
        "hidden_size": o.hidden_size,
        "intermediate_size": o.intermediate_size,
        "num_hidden_layers": o.num_hidden_layers,
        "num_attention_heads": o.num_attention_heads,
        "num_key_value_heads": o.num_key_value_heads,
        "head_dim": o.head_dim(),
        "max_position_embeddings": o.max_position_embeddings,
        "rms_norm_eps": o.rms_norm_eps,
        "rope_theta": o.rope_theta,
        "rope_scaling": o.rope_scaling,
        "tie_word_embeddings": o.tie_word_embeddings,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    });
    if !qwen2 {
        c["attention_bias"] = o.attention_bias.into();
        c["mlp_bias"] = false.into();
    } else {
        c["use_sliding_window"] = false.into();
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    fn built(o: &LlamaOptions) -> (nn::VarStore, Llama) {
        let vs = nn::VarStore::new(Device::Cpu);
        let net = Llama::new(&vs.root(), o);
        (vs, net)
    }

    /// Decoding through the key/value cache, a prompt of 5 tokens and then one token at a time,
    /// gives the hidden states the whole sequence's forward gives at each position (grouped-query
    /// attention with Llama 3 scaling, so the positions' rotations count); a chunk of 3 after a
    /// cached prefix takes the explicit mask and agrees too.
    #[test]
    fn decoding_through_the_cache_gives_the_full_forward() {
        let o = LlamaOptions {
            rope_scaling: Some(RopeScaling::default()),
            ..Default::default()
        };
        let (_vs, net) = built(&o);
        let ids = Tensor::from_slice(&[5i64, 17, 3, 99, 41, 7, 250, 12, 64]).unsqueeze(0);
        let full = tch::no_grad(|| net.forward_t(&ids, false));
        let close = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]);
        for chunks in [&[5i64, 1, 1, 1, 1][..], &[4, 3, 2]] {
            let mut cache = KvCache::default();
            let mut at = 0;
            for &c in chunks {
                let h = tch::no_grad(|| net.decode(&ids.narrow(1, at, c), &mut cache)).unwrap();
                let gap = close(&h, &full.narrow(1, at, c));
                assert!(gap < 1e-5, "chunks {chunks:?}: positions {at}..{}: {gap}", at + c);
                at += c;
            }
            assert_eq!(cache.len(), 9);
        }
    }

    /// Each decoder layer's variables are its block's, and only they get gradients from it; the
    /// output projection (and a tied embedding, which the head shares) belong to no block, so
    /// the model does not stream by block; every variable has a layer for layer decay.
    #[test]
    fn blocks_own_their_layers_and_the_head_stands_outside_the_chain() {
        for tied in [false, true] {
            let o = LlamaOptions {
                tie_word_embeddings: tied,
                seq_len: 8,
                ..Default::default()
            };
            let (vs, net) = built(&o);
            assert_eq!(net.blocks(), 4);
            for (name, _) in vs.variables() {
                let block = net.block_of(&name);
                let want = match name.as_str() {
                    "lm_head.weight" => None,
                    "model.embed_tokens.weight" => (!tied).then_some(0),
                    "model.norm.weight" => Some(3),
                    n if n.starts_with("model.layers.0.") => Some(1),
                    n if n.starts_with("model.layers.1.") => Some(2),
                    n => panic!("unexpected variable {n}"),
                };
                assert_eq!(block, want, "{name}");
                assert!(net.layer_of(&name).is_some(), "{name}");
            }
            // The output projection is resident: the blocks hold everything else.
            let blocks = crate::model::block_vars(&net, &vs).unwrap();
            let held: usize = blocks.iter().map(Vec::len).sum();
            assert_eq!(held, vs.variables().len() - 1, "all but the output projection");
            let head = if tied {
                "model.embed_tokens.weight"
            } else {
                "lm_head.weight"
            };
            assert!(net.resident(head));
            // A host update of it is done before the first block that reads it.
            assert_eq!(net.resident_from(head), if tied { 0 } else { 3 }, "tied {tied}");
            let ids = Tensor::randint(o.vocab_size, [2, 8], (Kind::Int64, Device::Cpu));
            let hidden = net.block(0, &[ids], true);
            let h = hidden[0].detach().set_requires_grad(true);
            net.block(1, &[h], true)[0].sum(Kind::Float).backward();
            for (name, t) in vs.variables() {
                assert_eq!(t.grad().defined(), name.starts_with("model.layers.0."), "{name}");
            }
            let out = net.forward_t(&Tensor::zeros([1, 8], (Kind::Int64, Device::Cpu)), false);
            assert_eq!(out.size(), [1, 8, o.hidden_size]);
            assert_eq!(net.output_head().unwrap().size(), [o.vocab_size, o.hidden_size]);
        }
    }

    #[test]
    fn lora_targets_name_projections_short_or_as_peft_does() {
        let o = LlamaOptions::default();
        for targets in [vec!["q", "down"], vec!["q_proj", "mlp.down_proj"]] {
            let (vs, mut net) = built(&o);
            let lora = LoraOptions {
                targets: targets.iter().map(|t| t.to_string()).collect(),
                ..Default::default()
            };
            let made = net.adapt(&vs.root(), &lora);
            assert_eq!(
                made,
                [
                    "model.layers.0.self_attn.q_proj",
                    "model.layers.0.mlp.down_proj",
                    "model.layers.1.self_attn.q_proj",
                    "model.layers.1.mlp.down_proj"
                ]
            );
            let names: Vec<String> = vs.variables().into_keys().collect();
            assert!(names.iter().any(|n| n == "model.layers.1.mlp.down_proj.lora_B.weight"));
        }
        let (_, net) = built(&o);
        let lora = LoraOptions::default();
        let e = crate::model::lora::no_target(&lora, "llama", &net.adaptable()).0;
        assert!(e.contains("its layers are self_attn.q_proj, self_attn.k_proj"), "{e}");
    }

    #[test]
    fn llama3_scaling_keeps_high_frequencies_divides_low_ones_and_blends_between() {
        let plain = LlamaOptions {
            hidden_size: 64,
            num_attention_heads: 1,
            ..Default::default()
        };
        let scaled = LlamaOptions {
            rope_scaling: Some(RopeScaling {
                original_max_position_embeddings: 64,
                ..Default::default()
            }),
            ..plain.clone()
        };
        let (a, b) = (inv_freq(&plain, Device::Cpu), inv_freq(&scaled, Device::Cpu));
        let v = |t: &Tensor, i: i64| t.double_value(&[i]);
        // Wavelength 2π/f: below 64/4 kept, above 64/1 divided by the factor (8).
        assert_eq!(v(&a, 0), v(&b, 0));
        let last = a.size()[0] - 1;
        assert!((v(&b, last) - v(&a, last) / 8.0).abs() < 1e-12);
        let between = (0..=last)
            .filter(|&i| {
                let w = 2.0 * std::f64::consts::PI / v(&a, i);
                (16.0..64.0).contains(&w)
            })
            .collect::<Vec<_>>();
        assert!(!between.is_empty());
        for i in between {
            assert!(v(&b, i) < v(&a, i) && v(&b, i) > v(&a, i) / 8.0, "{i}");
        }
    }
}
