//! The prefill worker: batched (chunked) prefill with prefix caching, first-token and MTP-draft sampling, layer-by-layer cache shipping.
