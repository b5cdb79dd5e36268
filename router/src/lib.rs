//! The front door: OpenAI-compatible HTTP and gRPC, prefill/decode pair selection, discovery of workers.
