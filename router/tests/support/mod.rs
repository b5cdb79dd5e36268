//! Test support: worker doubles that speak the real tonic PrefillWorker/DecodeWorker protocol, a tiny
//! model directory, and a router started on free ports. Shared by the tests and the benchmark.
#![allow(dead_code)]

pub mod double;
pub mod harness;
