//! The official `openai` Python client against the router (completions and chat, streamed and not,
//! logprobs, stop, errors, API key). Needs TANDEM_PYTHON (scripts/test.sh sets it up); skips otherwise.

mod support;

use support::harness::{Cluster, MODEL, Options, REPLY};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_openai_python_client_works_unchanged() {
    let Some(python) = std::env::var_os("TANDEM_PYTHON") else {
        assert!(std::env::var_os("CI").is_none(), "TANDEM_PYTHON must be set under CI (scripts/test.sh sets it)");
        eprintln!("SKIP: TANDEM_PYTHON is not set (scripts/test.sh creates .venv with the openai client)");
        return;
    };
    let c = Cluster::start(Options { args: vec!["--api-key".into(), "k".into()], ..Default::default() }).await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_client.py");
    let base = c.base.clone();
    let out = tokio::process::Command::new(python).args([script, &base, MODEL, REPLY]).output().await.unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && stdout.trim() == "OK", "stdout: {stdout}\nstderr: {stderr}");
}
