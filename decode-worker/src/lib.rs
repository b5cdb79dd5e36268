//! The decode worker: block reservation, continuous batching of sparse decode steps, MTP speculative decoding, token streaming.
