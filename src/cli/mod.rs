//! Subcommands of the `tandem` binary.

pub mod bench;
pub mod compile_kernels;
pub mod gen_tiny;
pub mod generate;
pub mod up;
pub mod verify;
