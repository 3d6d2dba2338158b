//! A language model's run counts target tokens, not samples: a step's loss is the mean over the
//! group's counted targets (as a causal language model's loss with labels is), and its records
//! give tokens, tokens per second and perplexity.
use tch::{Kind, Tensor};

use crate::data::Dataset;
use crate::model::lm_loss::IGNORE;

/// The target tokens of `group` that count (not `IGNORE`), known before its step so that every
/// micro-batch's loss is divided by the group's count. A token file's count follows from the
/// group's size; targets of their own are gathered plainly (they need no augmentation).
pub fn counted(data: &Dataset, group: &[i64]) -> u64 {
    if let Some(n) = data.plain_target_count(group) {
        return n;
    }
    let (_, y) = data.batch(&Tensor::from_slice(group));
    y.ne(IGNORE).sum(Kind::Int64).int64_value(&[]).max(0) as u64
}

/// The counts a checkpoint written before tokens were counted would hold at epoch `epoch`
/// (0-based) after its first `done` groups: (the epoch's, the run's), the run having trained on
/// every window of each epoch before.
pub fn resumed_counts(data: &Dataset, groups: &[&[i64]], done: usize, epoch: i64) -> (u64, u64) {
    let sum = |gs: &[&[i64]]| -> u64 { gs.iter().map(|g| counted(data, g)).sum() };
    let this = sum(&groups[..done.min(groups.len())]);
    let before = match epoch {
        0 => 0,
        e => sum(groups) * e as u64,
    };
    (this, before + this)
}

/// The perplexity of a token-mean loss.
pub fn perplexity(loss: f64) -> f64 {
    loss.exp()
}

#[cfg(test)]
mod tests {
    use tch::{nn, Device, Kind, Reduction, Tensor};

    use super::super::forward::{Around, Batch, Forward, Micro, PrecisionStage};
    use super::super::tally::Count;
    use crate::host::Home;
    use crate::model::lm_loss::IGNORE;
    use crate::model::Net;
    use crate::spec::Precision;

    /// A language model in miniature: token embeddings as the hidden states, and an output
    /// projection of its own.
    #[derive(Debug)]
    struct TinyLm {
        emb: nn::Embedding,
        head: Tensor,
    }

    impl Net for TinyLm {
        fn forward_t(&self, xs: &Tensor, _train: bool) -> Tensor {
            xs.apply(&self.emb)
        }

        fn output_head(&self) -> Option<Tensor> {
            Some(self.head.shallow_clone())
        }
    }

    struct Nothing;

    impl Around for Nothing {
        fn block_coming(&mut self, _: usize) {}
        fn block_ready(&mut self, _: usize) {}
        fn settle(&mut self) {}
        fn after_block(&mut self, _: usize) {}
    }

    fn forward() -> Forward {
        Forward {
            device: Device::Cpu,
            precision: PrecisionStage {
                precision: Precision::Fp32,
            },
            recompute: false,
            activations: Home::Device,
        }
    }

    #[test]
    fn a_language_models_step_is_the_token_mean_of_the_plain_loss() {
        tch::manual_seed(5);
        let vs = nn::VarStore::new(Device::Cpu);
        let net = TinyLm {
            emb: nn::embedding(vs.root() / "emb", 13, 8, Default::default()),
            head: vs.root().randn("head", &[13, 8], 0.0, 0.3),
        };
        let x = Tensor::randint(13, [3, 6], (Kind::Int64, Device::Cpu));
        let y = x.roll([-1], [1]).index_fill(1, &Tensor::from_slice(&[5i64]), IGNORE);
        let tokens = y.ne(IGNORE).sum(Kind::Int64).int64_value(&[]) as f64;
        // The plain computation: whole logits, mean over the counted targets.
        let logits = net.forward_t(&x, true).matmul(&net.head.tr()).reshape([-1, 13]);
        let loss = logits.cross_entropy_loss::<Tensor>(&y.reshape([-1]), None, Reduction::Sum, IGNORE, 0.0);
        (&loss / tokens).backward();
        let want: Vec<Tensor> = vs.trainable_variables().iter().map(|v| v.grad().copy()).collect();
        vs.trainable_variables().iter().for_each(|v| {
            let _ = v.grad().zero_();
        });
        let micro = Micro {
            batch: Batch {
                x: x.shallow_clone(),
                y: y.shallow_clone(),
            },
            buffers: &[],
            loss_scale: None,
            stream: None,
            step: None,
        };
        let (got, _) = forward().forward_backward(&net, &micro, tokens, &mut Nothing);
        let rel = (got.double_value(&[]) - loss.double_value(&[])).abs() / loss.double_value(&[]);
        assert!(rel <= 1e-6, "loss sums differ by {rel:e}");
        for (v, w) in vs.trainable_variables().iter().zip(&want) {
            let err = (v.grad() - w).abs().max().double_value(&[]) / w.abs().max().double_value(&[]);
            assert!(err <= 1e-6, "gradients differ by {err:e}");
        }
        // Validation counts the targets.
        let (_, _, count) = tch::no_grad(|| forward().forward_loss(&net, None, &micro.batch, false));
        match count {
            Count::Counted(t) => assert_eq!(t.int64_value(&[]) as f64, tokens),
            Count::Known(_) => panic!("a language model's loss counts its tokens"),
        }
    }
}
