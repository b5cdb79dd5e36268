//! Which requests the decode worker takes.
//!
//! Reservation policy: a request reserves blocks for its prefilled tokens plus two positions (the first
//! token the prefill worker samples and an MTP draft), and grows one block at a time as it decodes. It is
//! admitted only while, after its reservation, at least `growth_watermark_blocks` free blocks remain for
//! every request holding blocks, so running requests can keep growing; otherwise the reservation fails
//! with RESOURCE_EXHAUSTED (retryable: the router tries another decode worker or answers 429). When blocks
//! still run out mid-decode, the newest request is preempted and handed back for re-prefill.

use engine::cache::{BLOCK_SIZE, PoolStats};

#[derive(Debug, Clone, Copy)]
pub struct Policy {
    pub max_num_seqs: usize,
    pub growth_watermark_blocks: usize,
    pub max_model_len: usize,
}

/// Tokens to reserve for a request whose prefill covers `prefilled` tokens.
pub fn initial_tokens(prefilled: usize) -> usize {
    prefilled + 2
}

impl Policy {
    /// Ok, or why the request cannot be admitted now (a retryable condition).
    pub fn admit(&self, pool: &PoolStats, holding: usize, prefilled: usize) -> Result<(), String> {
        if holding >= self.max_num_seqs {
            return Err(format!("{holding} requests running or transferring (--max-num-seqs {})", self.max_num_seqs));
        }
        let need = initial_tokens(prefilled).div_ceil(BLOCK_SIZE);
        let keep = (holding + 1) * self.growth_watermark_blocks;
        if pool.free_blocks < need + keep {
            return Err(format!(
                "not enough cache blocks: {need} needed plus {keep} kept for growth, {} free of {}",
                pool.free_blocks, pool.total_blocks
            ));
        }
        Ok(())
    }

    /// Checks the lengths of a request (non-retryable errors).
    pub fn check_lengths(&self, prefilled: usize, remaining_output: usize) -> Result<(), String> {
        let total = prefilled + remaining_output;
        if total > self.max_model_len {
            return Err(format!(
                "{prefilled} prompt tokens + {remaining_output} output tokens = {total} exceed the maximum context length {}",
                self.max_model_len
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(free: usize) -> PoolStats {
        PoolStats { total_blocks: 100, free_blocks: free, used_blocks: 100 - free, requests: 0 }
    }

    #[test]
    fn admission_keeps_a_watermark_per_request() {
        let p = Policy { max_num_seqs: 8, growth_watermark_blocks: 1, max_model_len: 10_000 };
        // 130 tokens + 2 -> 3 blocks; 2 holders + this one keep 3.
        assert!(p.admit(&stats(6), 2, 130).is_ok());
        assert!(p.admit(&stats(5), 2, 130).unwrap_err().contains("not enough cache blocks"));
        assert!(p.admit(&stats(100), 8, 1).unwrap_err().contains("max-num-seqs"));
    }

    #[test]
    fn lengths_are_checked_against_the_context() {
        let p = Policy { max_num_seqs: 8, growth_watermark_blocks: 1, max_model_len: 100 };
        assert!(p.check_lengths(60, 40).is_ok());
        assert!(p.check_lengths(60, 41).unwrap_err().contains("101 exceed the maximum context length 100"));
    }
}
