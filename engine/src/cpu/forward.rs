//! One decoder layer over a batch, and the main-model and MTP forwards built from it (docs/model.md §2).

use rayon::prelude::*;

use super::attention::{self, Decompressed};
use super::cache_io;
use super::indexer;
use super::kernels::rms_norm;
use super::moe::ffn_forward;
use super::topk;
use super::weights::{Layer, Weights};
use crate::backend::{AttnForm, DeviceRows, LayerDone, LayerReady, SeqOutput};
use crate::cache::{HostCache, LayerIdx};
use crate::rope::Rope;
use crate::{ModelConfig, Precision};

/// A batch item's rows: positions `start .. start + n`, rows `row0 .. row0 + n` of the batch matrices.
pub use crate::backend::BatchItem as Item;

pub struct Ctx<'a> {
    pub cfg: &'a ModelConfig,
    pub prec: Precision,
    pub rope: &'a Rope,
    pub w: &'a Weights,
    /// Where each row's top-k selection goes when a diagnostic asked for them (`CpuBackend::record_selections`).
    pub selections: Option<&'a crate::backend::SelectionLog>,
}

/// Positions of every row of the batch, in row order.
pub fn positions(items: &[Item<'_>]) -> Vec<usize> {
    items.iter().flat_map(|it| it.start..it.start + it.n).collect()
}

/// One forward call over a batch: its items, the attention form and the cache they read and write.
pub struct Pass<'a> {
    pub items: &'a [Item<'a>],
    pub form: AttnForm,
    pub cache: HostCache<'a>,
}

/// Runs `layer` (cache layer `li`) over the batch, updating the residual stream `h` in place.
pub fn layer_forward(
    ctx: &Ctx<'_>,
    pass: &Pass<'_>,
    layer: &Layer,
    li: LayerIdx,
    h: &mut [f32],
    on_layer: LayerDone<'_>,
) {
    let (items, form, cache) = (pass.items, pass.form, &pass.cache);
    let cfg = ctx.cfg;
    let pos = positions(items);
    let rows = pos.len();
    let (hidden, rank, rd, idim) = (cfg.hidden_size, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_head_dim);
    let (heads, vd, qk, ih) = (cfg.num_attention_heads, cfg.v_head_dim, cfg.qk_head_dim(), cfg.index_n_heads);

    let x = rms_norm(h, &layer.attn_norm, cfg.rms_norm_eps);
    let pr = attention::project(&layer.attn, cfg, ctx.rope, &x, &pos);
    let (iq, keys) = indexer::project(&layer.indexer, cfg, ctx.prec, ctx.rope, &x, &pr.qr, &pos);

    // Caches first: attention reads every position (this batch's too) back from the cache, so prefill
    // sees exactly what decode will (the quantized-then-dequantized latent in FP8).
    for it in items {
        for i in 0..it.n {
            let r = it.row0 + i;
            cache_io::write_latent(
                cache,
                li,
                it.blocks,
                it.start + i,
                &pr.c[r * rank..(r + 1) * rank],
                &pr.k_pe[r * rd..(r + 1) * rd],
            );
            cache_io::write_index_key(cache, li, it.blocks, it.start + i, &keys[r * idim..(r + 1) * idim]);
        }
    }
    // The CPU writes synchronously: the layer is complete as it is announced.
    on_layer(li, LayerReady::complete());

    let scale = cfg.softmax_scale();
    let topk = cfg.index_topk;
    // Per item: its context's index keys, and (MHA form) its decompressed keys/values.
    let item_ctx: Vec<(Vec<f32>, Vec<f32>, Option<Decompressed>)> = items
        .par_iter()
        .map(|it| {
            let end = it.start + it.n;
            let (kv, ks) = cache_io::read_index_keys(cache, li, it.blocks, end);
            let dec = (form == AttnForm::Prefill).then(|| {
                let (c, kpe) = cache_io::read_latents(cache, li, it.blocks, 0..end);
                attention::decompress(&layer.attn, &c, kpe, end)
            });
            (kv, ks, dec)
        })
        .collect();
    let row_item: Vec<usize> = items.iter().enumerate().flat_map(|(k, it)| std::iter::repeat_n(k, it.n)).collect();
    let o: Vec<f32> = (0..rows)
        .into_par_iter()
        .flat_map_iter(|r| {
            let it = &items[row_item[r]];
            let (kv, ks, dec) = &item_ctx[row_item[r]];
            let p = pos[r];
            let q_i = &iq.q[r * ih * idim..(r + 1) * ih * idim];
            let w_i = &iq.w[r * ih..(r + 1) * ih];
            // Logical positions 0..=p are ranked (topk's rule); cache slots come from the block table after.
            let sel = if p < topk {
                (0..=p).collect()
            } else {
                topk::select(&indexer::scores(q_i, w_i, kv, ks, p + 1, idim), topk)
            };
            if let Some(log) = ctx.selections {
                log.push(li, r, sel.iter().map(|&s| s as u32).collect());
            }
            let q_row = &pr.q[r * heads * qk..(r + 1) * heads * qk];
            match dec {
                Some(d) => attention::mha_row(cfg, q_row, d, &sel, scale),
                None => {
                    let (c_sel, kpe_sel) = cache_io::read_latents(cache, li, it.blocks, sel.iter().copied());
                    attention::absorbed_row(&layer.attn, cfg, q_row, &c_sel, &kpe_sel, scale)
                }
            }
        })
        .collect();
    debug_assert_eq!(o.len(), rows * heads * vd);
    let attn_out = layer.attn.o.forward(&o, rows);
    for (a, b) in h.iter_mut().zip(&attn_out) {
        *a += b;
    }
    let x = rms_norm(h, &layer.ffn_norm, cfg.rms_norm_eps);
    let f = ffn_forward(&layer.ffn, cfg, &x, rows);
    for (a, b) in h.iter_mut().zip(&f) {
        *a += b;
    }
    debug_assert_eq!(h.len(), rows * hidden);
}

/// Final norm, then logits for the rows each item asks for; splits results per item.
pub fn finish(
    ctx: &Ctx<'_>,
    items: &[Item<'_>],
    h: &[f32],
    norm: &[f32],
    head: &super::linear::Linear,
) -> Vec<SeqOutput> {
    let cfg = ctx.cfg;
    let hidden = cfg.hidden_size;
    let normed = rms_norm(h, norm, cfg.rms_norm_eps);
    let want_rows: Vec<usize> = items.iter().flat_map(|it| it.logits_rows()).collect();
    let mut gathered = Vec::with_capacity(want_rows.len() * hidden);
    for &r in &want_rows {
        gathered.extend_from_slice(&normed[r * hidden..(r + 1) * hidden]);
    }
    let logits = head.forward(&gathered, want_rows.len());
    let vocab = head.out_features();
    let mut at = 0;
    items
        .iter()
        .map(|it| {
            let n_logits = it.logits_rows().len();
            let l = logits[at * vocab..(at + n_logits) * vocab].to_vec();
            at += n_logits;
            let h = normed[it.row0 * hidden..(it.row0 + it.n) * hidden].to_vec();
            SeqOutput { logits: DeviceRows::new(n_logits, vocab, l), hidden: DeviceRows::new(it.n, hidden, h) }
        })
        .collect()
}

/// Embedding rows of `tokens` (`table` is `[vocab, hidden]`).
pub fn embed(table: &[f32], tokens: impl Iterator<Item = u32>, hidden: usize) -> Vec<f32> {
    let mut h = Vec::new();
    for t in tokens {
        h.extend_from_slice(&table[t as usize * hidden..(t as usize + 1) * hidden]);
    }
    h
}
