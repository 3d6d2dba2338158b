//! `memtrain generate RUN_DIR --prompt TEXT`: a language-model run's weights (its best
//! checkpoint, or `--checkpoint`) continue a prompt, greedily or by sampling at a temperature,
//! one token at a time through the decoder's key/value cache, on the run's device and under its
//! memory cap: so a user can look at what a fine-tune learned. The prompt is tokenized with the
//! run's `data.tokenizer` (or `--tokenizer`); `--prompt-ids` gives token ids instead. An OOM
//! ends with exit 3; bad input with exit 2, before anything is computed.

use anyhow::{Context, Result};
use tch::{Kind, Tensor};

use crate::cli::GenerateArgs;
use crate::eval::Loaded;
use crate::exit::{OomExit, UsageError};
use crate::model::{self, KvCache};
use crate::oom::{self, StepError};
use crate::run::streamed_decode;

/// What the tokens are read and written with: a tokenizer, or none (ids in, ids out).
struct Words {
    tokenizer: Option<tokenizers::Tokenizer>,
}

impl Words {
    fn open(args: &GenerateArgs, spec: &crate::spec::Spec) -> Result<Words> {
        let path = args.tokenizer.as_deref().or(spec.data.tokenizer.as_deref());
        let tokenizer = match path {
            Some(p) => Some(
                tokenizers::Tokenizer::from_file(p)
                    .map_err(|e| UsageError(format!("the tokenizer {} does not read: {e}", p.display())))?,
            ),
            None => None,
        };
        Ok(Words { tokenizer })
    }

    /// The prompt's token ids: `--prompt-ids`, or `--prompt` through the tokenizer.
    fn prompt(&self, args: &GenerateArgs) -> Result<Vec<i64>> {
        if let Some(ids) = &args.prompt_ids {
            return parse_ids(ids);
        }
        let text = args.prompt.as_deref().unwrap_or_default();
        let Some(t) = &self.tokenizer else {
            return Err(UsageError(
                "--prompt needs a tokenizer, and the run has no data.tokenizer: name one with --tokenizer FILE, or give token ids with --prompt-ids".into(),
            )
            .into());
        };
        let enc = t
            .encode(text, true)
            .map_err(|e| anyhow::anyhow!("tokenizing the prompt: {e}"))?;
        Ok(enc.get_ids().iter().map(|&i| i as i64).collect())
    }

    /// The end-of-text id: `data.eos_id`, else the tokenizer's by a well-known name.
    fn eos(&self, spec: &crate::spec::Spec) -> Option<i64> {
        spec.data
            .eos_id
            .or_else(|| crate::data::eos_by_name(self.tokenizer.as_ref()?).map(i64::from))
    }

    fn text(&self, ids: &[i64]) -> String {
        match &self.tokenizer {
            Some(t) => {
                let ids: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
                t.decode(&ids, true)
                    .unwrap_or_else(|e| format!("(the tokenizer cannot decode these ids: {e})"))
            }
            None => ids.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(" "),
        }
    }
}

fn parse_ids(text: &str) -> Result<Vec<i64>> {
    let ids: Result<Vec<i64>, _> = text
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
        .map(str::parse::<i64>)
        .collect();
    match ids {
        Ok(ids) if !ids.is_empty() => Ok(ids),
        _ => Err(UsageError(format!(
            "--prompt-ids takes token ids separated by commas or spaces, e.g. \"1, 15, 27\"; got \"{text}\""
        ))
        .into()),
    }
}

/// How the next token is chosen.
#[derive(Debug, Clone, Copy)]
struct Sampler {
    /// 0: greedy (the largest logit).
    temperature: f64,
    /// 0: every token may be drawn.
    top_k: i64,
}

impl Sampler {
    fn next(&self, logits: &Tensor) -> i64 {
        let logits = logits.to_kind(Kind::Float);
        if self.temperature <= 0.0 {
            return logits.argmax(-1, false).int64_value(&[]);
        }
        let mut scaled = logits / self.temperature;
        if self.top_k > 0 && self.top_k < scaled.size()[0] {
            let (kth, _) = scaled.topk(self.top_k, -1, true, true);
            let floor = kth.get(self.top_k - 1);
            scaled = scaled.where_self(&scaled.ge_tensor(&floor), &Tensor::from(f64::NEG_INFINITY));
        }
        scaled.softmax(-1, Kind::Float).multinomial(1, false).int64_value(&[0])
    }
}

pub fn generate(args: &GenerateArgs) -> Result<()> {
    crate::shim::cpu_alloc_install().context("installing the counting CPU allocator")?;
    let run_dir = &args.run_dir;
    let resolved = crate::eval::resolved_spec(run_dir)?;
    let weights = crate::checkpoint::weights_file(run_dir, args.checkpoint.as_deref())?;
    let spec = crate::eval::load_spec(&resolved, None)?;
    let words = Words::open(args, &spec)?;
    let prompt = words.prompt(args)?;
    let place = crate::eval::place(&spec, run_dir)?;
    let model = Loaded::open(&spec, &weights, place)?;
    let (built, net) = (&model.built, model.built.net.as_ref());
    if net.output_head().is_none() {
        return Err(UsageError(format!(
            "generate continues text with a language model, and this run's model ({}) is a classifier: score it with memtrain eval",
            spec.model.preset
        ))
        .into());
    }
    if let Some(&bad) = prompt.iter().find(|&&i| i < 0 || i >= built.num_classes) {
        return Err(UsageError(format!(
            "the prompt has token id {bad}, beyond the model's vocabulary of {}",
            built.num_classes
        ))
        .into());
    }
    tch::manual_seed(args.seed);
    let sampler = Sampler {
        temperature: args.temperature,
        top_k: args.top_k,
    };
    let eos = (!args.ignore_eos).then(|| words.eos(&spec)).flatten();
    let device = place.tch();
    let new = oom::guarded(|| tch::no_grad(|| continued(&model, &prompt, device, sampler, args.max_new_tokens, eos)))
        .map_err(|e| match e {
        StepError::Oom { message, .. } => anyhow::Error::from(OomExit(format!(
            "generate: out of memory on {device:?} under the run's cap: {message}"
        ))),
        other => anyhow::anyhow!("generate: {other:?}"),
    })?;
    crate::outln!("{}{}", words.text(&prompt), joined(&words, &prompt, &new))?;
    Ok(())
}

/// The generated part as text: the whole sequence decoded minus the prompt decoded, so that a
/// tokenizer that joins pieces (spaces, byte fallback) prints them as it would together.
fn joined(words: &Words, prompt: &[i64], new: &[i64]) -> String {
    if words.tokenizer.is_none() {
        return format!(" | {}", words.text(new));
    }
    let all: Vec<i64> = prompt.iter().chain(new).copied().collect();
    match words.text(&all).strip_prefix(&words.text(prompt)) {
        Some(rest) => rest.to_owned(),
        None => format!(" {}", words.text(new)),
    }
}

/// The final hidden states of `pending`, the ids after those `cache` holds; a model that keeps
/// no cache runs the whole sequence `seq` again.
fn hidden(model: &Loaded, pending: &Tensor, seq: &[i64], cache: &mut KvCache) -> Tensor {
    let net = model.built.net.as_ref();
    let device = pending.device();
    // Streamed: one autocast region per block, as training's streamed forward has.
    let autocast = || model.precision.autocast(device);
    let decoded = match &model.stream {
        Some(s) => streamed_decode(net, s, pending, cache, &autocast),
        None => {
            let _autocast = autocast();
            net.decode(pending, cache)
        }
    };
    decoded.unwrap_or_else(|| model.forward(&Tensor::from_slice(seq).to_device(device).unsqueeze(0)))
}

/// The next token's logits from the last hidden state, through the output projection in the
/// dtype training's loss computes it in.
fn logits(model: &Loaded, last: &Tensor) -> Tensor {
    model::lm_loss::logits_in(model.built.net.as_ref(), last, model.precision.precision.autocast())
}

/// Up to `max_new` tokens after `prompt`, stopping at `eos` (left out): through the decoder's cache
/// where it keeps one, else the whole sequence each time.
fn continued(
    model: &Loaded,
    prompt: &[i64],
    device: tch::Device,
    sampler: Sampler,
    max_new: i64,
    eos: Option<i64>,
) -> Vec<i64> {
    let mut cache = KvCache::default();
    let mut seq: Vec<i64> = prompt.to_vec();
    let mut out = vec![];
    let mut pending = Tensor::from_slice(prompt).to_device(device).unsqueeze(0);
    for _ in 0..max_new {
        let hidden = hidden(model, &pending, &seq, &mut cache);
        let last = hidden.select(1, hidden.size()[1] - 1).squeeze_dim(0);
        let next = sampler.next(&logits(model, &last));
        if Some(next) == eos {
            // The stop, not part of the text.
            break;
        }
        out.push(next);
        seq.push(next);
        pending = Tensor::from_slice(&[next]).to_device(device).unsqueeze(0);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_ids_read_with_commas_or_spaces_and_refuse_anything_else() {
        assert_eq!(parse_ids("1, 15 27").unwrap(), vec![1, 15, 27]);
        assert!(parse_ids("").is_err());
        let e = parse_ids("1, x").unwrap_err().to_string();
        assert!(e.contains("--prompt-ids takes token ids"), "{e}");
    }

    #[test]
    fn greedy_takes_the_largest_logit_and_top_1_sampling_agrees() {
        let logits = Tensor::from_slice(&[0.1f32, 2.0, -1.0, 1.9]);
        let greedy = Sampler {
            temperature: 0.0,
            top_k: 0,
        };
        assert_eq!(greedy.next(&logits), 1);
        let top1 = Sampler {
            temperature: 1.5,
            top_k: 1,
        };
        for _ in 0..5 {
            assert_eq!(top1.next(&logits), 1);
        }
    }
}
