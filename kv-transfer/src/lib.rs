//! Ships a request's MLA latent and indexer caches from a prefill worker into the blocks a decode worker reserved, over UCX, TCP or in-process.
