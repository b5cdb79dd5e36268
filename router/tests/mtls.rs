//! Mutual TLS between the router and the workers, with a CA and certificates made at test time: the router
//! serves through workers that require its certificate; a client without a certificate, with one from
//! another CA, or without TLS at all is refused, and each refusal says why; unreadable or mismatched files
//! stop the router at start. The workers' side is the accept loop the real workers run (`tls::incoming`).

mod support;

use std::path::Path;

use std::time::Duration;

use proto::v1::LoadRequest;
use proto::v1::prefill_worker_client::PrefillWorkerClient;
use serde_json::json;
use support::harness::{Cluster, MODEL, Options, REPLY, eventually, model_dir, router_args};
use tls::diagnose::{Cause, diagnose};
use tls::test_pki::{Leaf, TestPki};
use tonic::transport::Endpoint;

/// Every log line of this test binary (to check what was said, and that no secret was).
fn logs() -> &'static logging::Capture {
    logging::capture()
}

fn logged() -> String {
    logs().text()
}

fn tls_args(ca: Option<&Path>, leaf: Option<&Leaf>) -> tls::TlsArgs {
    tls::TlsArgs { ca: ca.map(Path::to_owned), cert: leaf.map(|l| l.cert.clone()), key: leaf.map(|l| l.key.clone()) }
}

/// A worker's TLS requiring client certificates signed by `pki`.
fn mutual(pki: &TestPki, worker: &Leaf) -> tls::ServerTls {
    tls_args(Some(&pki.ca()), Some(worker)).server().unwrap().expect("TLS on")
}

fn router_flags(ca: &Path, leaf: Option<&Leaf>) -> Vec<String> {
    let mut v = vec!["--tls-ca".to_string(), ca.display().to_string()];
    if let Some(l) = leaf {
        v.extend(["--tls-cert".into(), l.cert.display().to_string(), "--tls-key".into(), l.key.display().to_string()]);
    }
    v
}

/// GetLoad on a worker double, over TLS as `client` says or in plaintext.
async fn get_load(addr: &str, client: Option<&tls::ClientTls>) -> Result<(), tonic::Status> {
    let ep = match client {
        Some(c) => c.apply(Endpoint::from_shared(tls::ClientTls::uri(addr)).unwrap()).unwrap(),
        None => Endpoint::from_shared(format!("http://{addr}")).unwrap(),
    };
    let channel = ep.connect_timeout(Duration::from_secs(5)).connect_lazy();
    PrefillWorkerClient::new(channel).get_load(LoadRequest {}).await.map(|_| ())
}

/// What a refused call's error chain says.
fn why(status: &tonic::Status) -> tls::diagnose::Diagnosis {
    let source = std::error::Error::source(status).unwrap_or_else(|| panic!("no cause in {status:?}"));
    diagnose(source)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_serves_through_workers_that_require_its_certificate() {
    logs();
    let pki = TestPki::new("cluster");
    let worker = pki.leaf("worker", &["tandem-worker"]);
    let router = pki.leaf("router", &[]);
    // Workers are dialed at 127.0.0.1 but checked under the name their certificate carries, as in pods.
    let mut args = router_flags(&pki.ca(), Some(&router));
    args.extend(["--tls-server-name".into(), "tandem-worker".into()]);
    let c = Cluster::start(Options { worker_tls: Some(mutual(&pki, &worker)), args, ..Default::default() }).await;
    let (s, body) =
        c.post_json("/v1/completions", json!({"model": MODEL, "prompt": "Say hello", "max_tokens": 64})).await;
    assert_eq!(s, 200, "{body}");
    assert_eq!(body["choices"][0]["text"], REPLY);
    assert_eq!(c.prefill[0].log().prefills.len(), 1);
    c.shutdown().await;

    // Key material is in no log line, and in no Debug of the TLS configurations (tonic's own prints it).
    let printed = format!(
        "{:?} {:?}",
        mutual(&pki, &router),
        tls_args(Some(&pki.ca()), Some(&router)).client(Some("tandem-worker")).unwrap()
    );
    let key = std::fs::read_to_string(&router.key).unwrap();
    let logs = logged();
    for line in key.lines().filter(|l| !l.starts_with("-----")) {
        assert!(!logs.contains(line), "a key line reached the logs");
        assert!(!printed.contains(line), "a key line in {printed}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_without_a_ca_serve_tls_to_a_router_without_a_certificate() {
    logs();
    let pki = TestPki::new("cluster");
    let worker = pki.leaf("worker", &[]);
    let server_only = tls_args(None, Some(&worker)).server().unwrap().expect("TLS on");
    assert!(!server_only.requires_client_certificates());
    let args = router_flags(&pki.ca(), None);
    let c = Cluster::start(Options { worker_tls: Some(server_only), args, ..Default::default() }).await;
    let (s, body) =
        c.post_json("/v1/completions", json!({"model": MODEL, "prompt": "Say hello", "max_tokens": 64})).await;
    assert_eq!(s, 200, "{body}");
    assert_eq!(body["choices"][0]["text"], REPLY);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_without_a_certificate_or_with_one_from_another_ca_is_refused_and_told_why() {
    logs();
    let pki = TestPki::new("cluster");
    let worker = pki.leaf("worker", &[]);
    let c = Cluster::start(Options {
        worker_tls: Some(mutual(&pki, &worker)),
        args: router_flags(&pki.ca(), Some(&pki.leaf("router", &[]))),
        ..Default::default()
    })
    .await;
    let addr = c.prefill[0].grpc_address();
    let good = tls_args(Some(&pki.ca()), Some(&pki.leaf("client", &[]))).client(None).unwrap().unwrap();
    get_load(&addr, Some(&good)).await.expect("a certificate from the cluster's CA is accepted");

    // Verifies the worker, presents nothing.
    let anonymous = tls_args(Some(&pki.ca()), None).client(None).unwrap().unwrap();
    let err = get_load(&addr, Some(&anonymous)).await.unwrap_err();
    let d = why(&err);
    assert!(matches!(d.cause, Cause::Tls | Cause::Closed), "{d:?}");

    // Presents a certificate of another CA (and trusts the cluster's CA, so the worker is verified).
    let other = TestPki::new("other");
    let foreign = tls_args(Some(&pki.ca()), Some(&other.leaf("intruder", &[]))).client(None).unwrap().unwrap();
    let err = get_load(&addr, Some(&foreign)).await.unwrap_err();
    let d = why(&err);
    assert!(matches!(d.cause, Cause::Tls | Cause::Closed), "{d:?}");

    // A client that trusts another CA refuses the worker: its message names the flag to fix.
    let distrustful = tls_args(Some(&other.ca()), Some(&other.leaf("client", &[]))).client(None).unwrap().unwrap();
    let d = why(&get_load(&addr, Some(&distrustful)).await.unwrap_err());
    assert_eq!(d.cause, Cause::Tls, "{d:?}");
    assert!(d.to_string().contains("not signed by the CA") && d.to_string().contains("--tls-ca"), "{d}");

    // A router without a certificate: never ready, and its log points at the worker's refusal.
    let dir = model_dir();
    let p = [addr.clone()];
    let d = [c.decode[0].grpc_address()];
    let args = router_args(dir.path(), &p, &d, &router_flags(&pki.ca(), None));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let anonymous_router = router::start_with_listeners(args, l, None).await.unwrap();
    assert!(
        eventually(Duration::from_secs(5), || logged().contains(tls::diagnose::CLOSED_AFTER_HANDSHAKE)).await,
        "the router's GetInfo failure says the worker refused it"
    );
    anonymous_router.shutdown().await;

    // The worker says which client failed and why (one warning per client address a minute: the first).
    let logs = logged();
    assert!(
        logs.contains("TLS handshake failed (clients need a certificate signed by this worker's --tls-ca)"),
        "{logs}"
    );
    assert!(logs.contains("peer sent no certificates") || logs.contains("UnknownIssuer"), "{logs}");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plaintext_client_is_told_that_the_worker_requires_tls() {
    logs();
    let pki = TestPki::new("cluster");
    let worker = pki.leaf("worker", &[]);
    // A router without TLS flags: the workers never become healthy, and it says why.
    let c =
        Cluster::start(Options { worker_tls: Some(mutual(&pki, &worker)), wait_ready: false, ..Default::default() })
            .await;
    let err = get_load(&c.prefill[0].grpc_address(), None).await.unwrap_err();
    let d = why(&err);
    assert_eq!(d.cause, Cause::Tls, "{d:?}");
    let msg = d.to_string();
    assert!(msg.contains("this tandem port requires TLS") && msg.contains("--tls-ca"), "{msg}");

    assert!(
        eventually(Duration::from_secs(5), || logged().contains("this tandem port requires TLS")).await,
        "the router's GetInfo failure names the cause"
    );
    let ready = c.http.get(c.url("/ready")).send().await.unwrap().status();
    assert_eq!(ready, 503);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_router_against_a_plaintext_worker_names_the_mismatch() {
    logs();
    let pki = TestPki::new("cluster");
    let c = Cluster::start(Options {
        args: router_flags(&pki.ca(), Some(&pki.leaf("router", &[]))),
        wait_ready: false,
        ..Default::default()
    })
    .await;
    let client = tls_args(Some(&pki.ca()), None).client(None).unwrap().unwrap();
    let d = why(&get_load(&c.prefill[0].grpc_address(), Some(&client)).await.unwrap_err());
    assert_eq!(d.cause, Cause::Tls, "{d:?}");
    assert!(d.to_string().contains("TLS"), "{d}");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreadable_or_mismatched_files_stop_the_router_at_start_and_in_check_config() {
    let pki = TestPki::new("cluster");
    let a = pki.leaf("a", &[]);
    let b = pki.leaf("b", &[]);
    let dir = model_dir();
    let start = |extra: Vec<String>| {
        let args = router_args(dir.path(), &["127.0.0.1:1".into()], &["127.0.0.1:2".into()], &extra);
        async move {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            router::start_with_listeners(args, l, None).await.err().map(|e| e.to_string())
        }
    };
    let missing = pki.dir().join("missing.pem");
    let s = |p: &Path| p.display().to_string();
    let err = start(vec!["--tls-ca".into(), s(&missing)]).await.expect("refused");
    assert!(err.contains("--tls-ca") && err.contains("missing.pem") && err.contains("cannot read"), "{err}");
    let mismatched = ["--tls-ca", &s(&pki.ca()), "--tls-cert", &s(&a.cert), "--tls-key", &s(&b.key)];
    let err = start(mismatched.iter().map(|x| x.to_string()).collect()).await.expect("refused");
    assert!(err.contains("--tls-key") && err.contains("is not the key of the certificate"), "{err}");
    let err = start(vec!["--tls-ca".into(), s(&a.key)]).await.expect("refused");
    assert!(err.contains("--tls-ca") && err.contains("no PEM certificate"), "{err}");

    let mut check = router_args(dir.path(), &["p:1".into()], &["d:1".into()], &["--check-config".into()]);
    check.tls = tls_args(Some(&pki.ca()), Some(&a));
    check.tls.key = Some(b.key.clone());
    let err = router::run(check).await.unwrap_err().to_string();
    assert!(err.contains("is not the key of the certificate"), "{err}");
}
