//! Feed-forward blocks: the dense MLP and the MoE with group-limited routing and a shared expert (docs/model.md §2.4).

use rayon::prelude::*;

use super::kernels::{matmul_t, sigmoid, silu, softmax};
use super::linear::Linear;
use super::weights::{Ffn, Mlp, Moe};
use crate::ModelConfig;
use crate::config::ScoringFunc;

/// `down(silu(gate(x)) * up(x))` over `rows` rows.
pub fn mlp_forward(m: &Mlp, x: &[f32], rows: usize) -> Vec<f32> {
    let mut g = m.gate.forward(x, rows);
    let u = m.up.forward(x, rows);
    for (a, b) in g.iter_mut().zip(&u) {
        *a = silu(*a) * b;
    }
    m.down.forward(&g, rows)
}

/// The routing order (docs/model.md §2.6): `v[a]` ranks before `v[b]` when larger (IEEE, -0.0 == +0.0, NaN last);
/// equal values rank the lower index first. A pure rule every backend's routing must follow.
pub fn ranks_before(v: &[f32], a: usize, b: usize) -> std::cmp::Ordering {
    use std::cmp::Ordering;
    let by_value = match (v[a].is_nan(), v[b].is_nan()) {
        // `+ 0.0` turns -0.0 into +0.0, so total_cmp agrees with IEEE comparison here.
        (false, false) => (v[b] + 0.0).total_cmp(&(v[a] + 0.0)),
        (true, false) => Ordering::Greater,
        (false, true) => Ordering::Less,
        (true, true) => Ordering::Equal,
    };
    by_value.then(a.cmp(&b))
}

/// Routing of one token: `(expert, weight)` sorted by expert id.
///
/// Scores come from the gate logits; `bias` (e_score_correction_bias) is added for choosing groups and
/// experts only; the weights use the unbiased scores. Equal group scores keep the lower group, equal expert
/// scores the lower expert ([`ranks_before`]).
pub fn route(logits: &[f32], bias: Option<&[f32]>, cfg: &ModelConfig) -> Vec<(usize, f32)> {
    let n = logits.len();
    let scores: Vec<f32> = match cfg.scoring_func {
        ScoringFunc::Sigmoid => logits.iter().map(|&l| sigmoid(l)).collect(),
        ScoringFunc::Softmax => {
            let mut s = logits.to_vec();
            softmax(&mut s);
            s
        }
    };
    let sel: Vec<f32> = match bias {
        Some(b) => scores.iter().zip(b).map(|(s, b)| s + b).collect(),
        None => scores.clone(),
    };
    let mut allowed = vec![true; n];
    if cfg.n_group > 1 {
        let per = n / cfg.n_group;
        let group_score: Vec<f32> = (0..cfg.n_group)
            .map(|g| {
                let v = &sel[g * per..(g + 1) * per];
                let mut order: Vec<usize> = (0..per).collect();
                order.sort_by(|&a, &b| ranks_before(v, a, b));
                if bias.is_some() { v[order[0]] + v[order[1]] } else { v[order[0]] }
            })
            .collect();
        let mut groups: Vec<usize> = (0..cfg.n_group).collect();
        groups.sort_by(|&a, &b| ranks_before(&group_score, a, b));
        allowed.fill(false);
        for &g in &groups[..cfg.topk_group] {
            allowed[g * per..(g + 1) * per].fill(true);
        }
    }
    let mut experts: Vec<usize> = (0..n).filter(|&e| allowed[e]).collect();
    experts.sort_by(|&a, &b| ranks_before(&sel, a, b));
    experts.truncate(cfg.num_experts_per_tok);
    experts.sort_unstable();
    let mut weights: Vec<f32> = experts.iter().map(|&e| scores[e]).collect();
    if cfg.norm_topk_prob {
        let sum: f32 = weights.iter().sum();
        if sum > 0.0 {
            for w in &mut weights {
                *w /= sum;
            }
        }
    }
    experts.into_iter().zip(weights).map(|(e, w)| (e, w * cfg.routed_scaling_factor)).collect()
}

/// `v` rounded to the nearest bf16 (ties to even), as the GPU's `cvt.rn.bf16.f32`; NaN stays NaN.
pub fn bf16_round(v: f32) -> f32 {
    half::bf16::from_f32(v).to_f32()
}

pub fn moe_forward(m: &Moe, cfg: &ModelConfig, x: &[f32], rows: usize) -> Vec<f32> {
    let hidden = cfg.hidden_size;
    let logits = matmul_t(x, rows, hidden, &m.gate, cfg.n_routed_experts);
    let routes: Vec<Vec<(usize, f32)>> = (0..rows)
        .map(|r| route(&logits[r * cfg.n_routed_experts..(r + 1) * cfg.n_routed_experts], m.bias.as_deref(), cfg))
        .collect();
    // Tokens per expert, then each expert runs once on its gathered rows.
    let mut assigned: Vec<Vec<usize>> = vec![Vec::new(); cfg.n_routed_experts];
    for (r, route) in routes.iter().enumerate() {
        for &(e, _) in route {
            assigned[e].push(r);
        }
    }
    let outputs: Vec<Option<Vec<f32>>> = assigned
        .par_iter()
        .enumerate()
        .map(|(e, rs)| {
            if rs.is_empty() {
                return None;
            }
            let mut xe = Vec::with_capacity(rs.len() * hidden);
            for &r in rs {
                xe.extend_from_slice(&x[r * hidden..(r + 1) * hidden]);
            }
            let mut out = mlp_forward(&m.experts[e], &xe, rs.len());
            // An FP8 model's routed experts give bf16 outputs (the GPU's grouped experts and the exchange
            // of expert parallelism keep them so).
            if matches!(m.experts[e].down, Linear::Fp8(_)) {
                for v in &mut out {
                    *v = bf16_round(*v);
                }
            }
            Some(out)
        })
        .collect();
    let shared = m.shared.as_ref().map(|s| mlp_forward(s, x, rows));
    // Each token sums its experts in ascending id order, then the (unscaled) shared expert.
    let mut cursor = vec![0usize; cfg.n_routed_experts];
    let mut y = vec![0f32; rows * hidden];
    for (r, route) in routes.iter().enumerate() {
        let yr = &mut y[r * hidden..(r + 1) * hidden];
        for &(e, w) in route {
            let i = cursor[e];
            cursor[e] += 1;
            let out = outputs[e].as_ref().expect("expert ran for its rows");
            for (a, b) in yr.iter_mut().zip(&out[i * hidden..(i + 1) * hidden]) {
                *a += b * w;
            }
        }
        if let Some(s) = &shared {
            for (a, b) in yr.iter_mut().zip(&s[r * hidden..(r + 1) * hidden]) {
                *a += b;
            }
        }
    }
    y
}

pub fn ffn_forward(f: &Ffn, cfg: &ModelConfig, x: &[f32], rows: usize) -> Vec<f32> {
    match f {
        Ffn::Dense(m) => mlp_forward(m, x, rows),
        Ffn::Moe(m) => moe_forward(m, cfg, x, rows),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::RngExt;

    fn cfg() -> ModelConfig {
        ModelConfig::from_json_str(
            r#"{"model_type":"deepseek_v32","vocab_size":16,"hidden_size":8,"intermediate_size":8,
            "moe_intermediate_size":8,"num_hidden_layers":2,"first_k_dense_replace":1,"num_attention_heads":1,
            "n_routed_experts":16,"num_experts_per_tok":4,"n_group":4,"topk_group":2,"routed_scaling_factor":2.5,
            "norm_topk_prob":true,"q_lora_rank":8,"kv_lora_rank":512,"qk_nope_head_dim":8,"qk_rope_head_dim":64,
            "v_head_dim":8,"index_n_heads":1,"index_head_dim":128,"index_topk":4,"max_position_embeddings":4096}"#,
        )
        .unwrap()
    }

    /// Enumerates every choice of groups and experts and keeps the best by the rules of docs/model.md §2.4.
    fn brute_force(logits: &[f32], bias: &[f32], c: &ModelConfig) -> Vec<(usize, f32)> {
        let s: Vec<f64> = logits.iter().map(|&l| 1.0 / (1.0 + (-l as f64).exp())).collect();
        let sel: Vec<f64> = s.iter().zip(bias).map(|(a, b)| a + *b as f64).collect();
        let per = 16 / 4;
        let gscore = |g: usize| {
            let mut v: Vec<f64> = sel[g * per..(g + 1) * per].to_vec();
            v.sort_by(|a, b| b.partial_cmp(a).unwrap());
            v[0] + v[1]
        };
        // Best pair of groups by score sum ordering = the two highest group scores.
        let mut gs: Vec<usize> = (0..4).collect();
        gs.sort_by(|&a, &b| gscore(b).partial_cmp(&gscore(a)).unwrap().then(a.cmp(&b)));
        let kept: Vec<usize> = gs[..2].iter().flat_map(|&g| g * per..(g + 1) * per).collect();
        let mut best: Option<(f64, Vec<usize>)> = None;
        // All 4-subsets of the 8 kept experts; the chosen set maximises the sum of selection scores.
        for mask in 0u32..256 {
            if mask.count_ones() != 4 {
                continue;
            }
            let set: Vec<usize> = (0..8).filter(|i| mask & (1 << i) != 0).map(|i| kept[i]).collect();
            let sum: f64 = set.iter().map(|&e| sel[e]).sum();
            if best.as_ref().is_none_or(|(b, _)| sum > *b) {
                best = Some((sum, set));
            }
        }
        let mut set = best.unwrap().1;
        set.sort();
        let tot: f64 = set.iter().map(|&e| s[e]).sum();
        set.into_iter().map(|e| (e, (s[e] / tot * c.routed_scaling_factor as f64) as f32)).collect()
    }

    #[test]
    fn routing_equals_brute_force_and_bias_only_selects() {
        let c = cfg();
        let (mut rng, seed) = crate::cpu::test_support::rng();
        for _ in 0..200 {
            let logits: Vec<f32> = (0..16).map(|_| rng.random::<f32>() * 6.0 - 3.0).collect();
            let bias: Vec<f32> = (0..16).map(|_| rng.random::<f32>() * 0.6 - 0.3).collect();
            let got = route(&logits, Some(&bias), &c);
            let want = brute_force(&logits, &bias, &c);
            assert_eq!(
                got.iter().map(|x| x.0).collect::<Vec<_>>(),
                want.iter().map(|x| x.0).collect::<Vec<_>>(),
                "seed {seed}"
            );
            for (a, b) in got.iter().zip(&want) {
                assert!((a.1 - b.1).abs() < 1e-5, "weights use unbiased scores (seed {seed})");
            }
            let sum: f32 = got.iter().map(|x| x.1).sum();
            assert!((sum - 2.5).abs() < 1e-4, "normalized then scaled by routed_scaling_factor");
        }
    }

    #[test]
    fn a_large_bias_changes_the_choice_but_not_the_weights_formula() {
        let c = cfg();
        let logits = vec![0.0f32; 16];
        let mut bias = vec![0.0f32; 16];
        bias[13] = 5.0;
        bias[14] = 5.0; // group 3 wins through bias alone
        let r = route(&logits, Some(&bias), &c);
        assert!(r.iter().any(|x| x.0 == 13) && r.iter().any(|x| x.0 == 14));
        // All scores equal sigmoid(0) = 0.5, so every weight is 2.5 / 4 regardless of bias.
        for (_, w) in r {
            assert!((w - 0.625).abs() < 1e-6);
        }
    }

    #[test]
    fn equal_group_scores_keep_the_lower_groups() {
        // Every score equal: groups 0 and 1 are kept, and within them experts 0..4.
        let c = cfg();
        let r = route(&[0.0; 16], Some(&[0.0; 16]), &c);
        assert_eq!(r.iter().map(|x| x.0).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
        // Groups 1 and 3 tie above groups 0 and 2: the lower (1) wins the first place, 3 the second.
        let mut logits = [0.0f32; 16];
        for e in [4, 5, 12, 13] {
            logits[e] = 2.0;
        }
        let r = route(&logits, Some(&[0.0; 16]), &c);
        assert_eq!(r.iter().map(|x| x.0).collect::<Vec<_>>(), vec![4, 5, 12, 13]);
        // Three groups tie for two places: the two lower ones.
        logits[9] = 2.0;
        logits[8] = 2.0;
        let r = route(&logits, Some(&[0.0; 16]), &c);
        assert_eq!(r.iter().map(|x| x.0).collect::<Vec<_>>(), vec![4, 5, 8, 9]);
    }

    #[test]
    fn equal_expert_scores_keep_the_lower_experts() {
        let c = cfg();
        // Groups 0 and 2 are kept (expert 0 and 8 lead them); experts 1, 2, 3, 9, 10, 11 tie below the leaders.
        let mut logits = [0.0f32; 16];
        logits[0] = 3.0;
        logits[8] = 3.0;
        for e in [1, 2, 3, 9, 10, 11] {
            logits[e] = 1.0;
        }
        let r = route(&logits, Some(&[0.0; 16]), &c);
        assert_eq!(r.iter().map(|x| x.0).collect::<Vec<_>>(), vec![0, 1, 2, 8]);
    }

    #[test]
    fn routing_order_treats_signed_zeros_as_equal_and_nan_as_last() {
        let v = [-0.0f32, 0.0, f32::NAN, -1.0];
        let mut order: Vec<usize> = (0..4).collect();
        order.sort_by(|&a, &b| ranks_before(&v, a, b));
        assert_eq!(order, vec![0, 1, 3, 2]);
        let v = [0.0f32, -0.0];
        let mut order: Vec<usize> = (0..2).collect();
        order.sort_by(|&a, &b| ranks_before(&v, a, b));
        assert_eq!(order, vec![0, 1]);
    }
}
