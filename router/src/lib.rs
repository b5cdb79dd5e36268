//! tandem's front door. A request arrives over HTTP (OpenAI-compatible) or gRPC (`tandem.v1.Generate`),
//! is templated and tokenized here, then runs on a prefill/decode pair of workers:
//!
//! ```text
//! client -> http/ | grpc.rs -> admission -> flow::select (policies/) -> flow::attempt:
//!     DecodeWorker.Decode (Reserved) -> PrefillWorker.Prefill(descriptor) -> tokens on the Decode stream
//!   -> flow::output (detokenize, stop strings) -> SSE / JSON / gRPC stream
//! ```
//!
//! Workers are found through `cluster` discovery (etcd or a static list), polled for load and health,
//! and guarded by circuit breakers. The router never links model code: it reads `config.json`,
//! `tokenizer.json` and `tokenizer_config.json` as plain files.
//!
//! Entry points: [`Args`] (clap flags, embeddable) and [`run`] (serve until Ctrl-C/SIGTERM), or
//! [`start`] / [`start_with_listeners`] for a [`RouterHandle`] in tests and benchmarks.

mod admission;
mod auth;
pub use auth::ApiKey;
pub mod config;
mod error;
mod flow;
mod grpc;
mod http;
mod metrics;
mod model;
pub mod policies;
mod request_id;
mod server;
mod workers;

pub use config::Args;
pub use error::ApiError;
pub use server::{RouterError, RouterHandle, run, start, start_with_listeners};
