//! Which rank steps each parameter when optimizer state is sharded (ZeRO stage 1).

/// Which rank steps each parameter when optimizer state is sharded across data-parallel ranks.
#[derive(Debug, Clone, PartialEq)]
pub struct Shard {
    pub rank: usize,
    /// `owners[i]`: the rank that holds parameter `i`'s state and computes its update.
    pub owners: Vec<usize>,
}

impl Shard {
    /// Balances state bytes: parameters largest first, each to the rank holding least so far
    /// (the lowest such rank on ties), as PyTorch's ZeroRedundancyOptimizer partitions. Every
    /// rank computes the same assignment from the same sizes.
    pub fn balanced(numels: &[i64], ranks: usize, rank: usize) -> Shard {
        let mut order: Vec<usize> = (0..numels.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(numels[i]));
        let mut load = vec![0i64; ranks.max(1)];
        let mut owners = vec![0; numels.len()];
        for i in order {
            let r = (0..load.len())
                .min_by_key(|&r| (load[r], r))
                .expect("at least one rank");
            owners[i] = r;
            load[r] += numels[i];
        }
        Shard { rank, owners }
    }

    fn owns(&self, i: usize) -> bool {
        self.owners[i] == self.rank
    }
}

/// Whether this process steps parameter `i`: always, unless the state is sharded.
pub(super) fn steps_param(shard: Option<&Shard>, i: usize) -> bool {
    shard.is_none_or(|s| s.owns(i))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_balance_state_largest_first_and_cover_every_parameter() {
        let s = Shard::balanced(&[100, 10, 60, 50, 1], 2, 1);
        // 100 -> 0; 60 -> 1; 50 -> 1 (60 < 100); 10 -> 0 (100 < 110); 1 -> 1 (110 = 110: lower rank 0)
        assert_eq!(s.owners, vec![0, 0, 1, 1, 0]);
        assert_eq!(Shard::balanced(&[5, 5, 5], 3, 0).owners, vec![0, 1, 2]);
        assert_eq!(Shard::balanced(&[5, 5], 1, 0).owners, vec![0, 0]);
    }
}
