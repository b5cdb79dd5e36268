//! Shared pieces of the cross-process tests.
#![allow(dead_code)]

#[path = "../../cluster/tests/support/etcd.rs"]
pub mod etcd;

pub mod cluster;
