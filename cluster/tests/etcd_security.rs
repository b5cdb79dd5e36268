//! Discovery against a real etcd serving TLS (with client certificates) and with authentication on:
//! what works, and that each misconfiguration is named as what it is (credentials, TLS, unreachable),
//! at start-up and in the background, without the password ever reaching a log line or a `Debug`.

mod support {
    pub mod etcd;
}

use std::path::PathBuf;

use std::time::Duration;

use cluster::{
    Capacity, Discovery, DiscoveryError, EtcdDiscovery, EtcdOptions, EtcdSecurity, PasswordSource, RegistrationState,
    WorkerRecord,
};
use etcd_client::{Client, ConnectOptions, Permission};
use proto::v1::{ModelFingerprint, WorkerRole};
use support::etcd::{Etcd, ServerTls};
use tls::test_pki::TestPki;

const PASSWORD: &str = "pw-7f3a9c-never-logged";
const WRONG_PASSWORD: &str = "wrong-41d2e8-never-logged";
const ROOT_PASSWORD: &str = "root-pw-0b1e55";

/// Every log line of this test binary (to check what was said, and that no secret was).
fn logs() -> &'static logging::Capture {
    logging::capture()
}

fn logged() -> String {
    logs().text()
}

fn record(id: &str) -> WorkerRecord {
    WorkerRecord {
        id: id.into(),
        role: WorkerRole::Decode,
        grpc_address: "127.0.0.1:7002".into(),
        capacity: Capacity { max_num_seqs: 4, kv_blocks_total: 64, max_model_len: 1024 },
        fingerprint: Some(ModelFingerprint { model_name: "tiny".into(), ..Default::default() }),
    }
}

fn options() -> EtcdOptions {
    EtcdOptions {
        lease_ttl: Duration::from_secs(5),
        request_timeout: Duration::from_secs(1),
        max_backoff: Duration::from_millis(300),
    }
}

async fn connect(url: &str, cluster: &str, security: EtcdSecurity) -> Result<EtcdDiscovery, DiscoveryError> {
    EtcdDiscovery::connect(vec![url.to_owned()], cluster.into(), options(), security).await
}

/// Registers one worker through `worker` and waits until `router` sees it.
async fn registers_and_is_seen(worker: &EtcdDiscovery, router: &EtcdDiscovery, id: &str) {
    let mut view = router.watch();
    let mut reg = worker.register(record(id)).await.unwrap();
    assert!(reg.wait_registered(Duration::from_secs(5)).await, "{:?}", reg.state());
    let seen = tokio::time::timeout(Duration::from_secs(5), view.wait_for(|v| v.get(WorkerRole::Decode, id).is_some()));
    assert!(seen.await.is_ok_and(|r| r.is_ok()), "the router's watch never saw {id}");
}

fn password_file(dir: &std::path::Path, name: &str, password: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, format!("{password}\n")).unwrap();
    p
}

fn with_user(user: &str, file: PathBuf) -> EtcdSecurity {
    EtcdSecurity { user: Some(user.into()), password: Some(PasswordSource::File(file)), ..Default::default() }
}

/// Users `tandem` (read and write under /tandem/) and `reader` (read only), then authentication on.
async fn enable_auth(url: &str, options: Option<ConnectOptions>) {
    let mut c = Client::connect([url], options).await.unwrap();
    c.user_add("root", ROOT_PASSWORD, None).await.unwrap();
    c.user_grant_role("root", "root").await.unwrap();
    for (role, perm) in [
        ("tandem", Permission::read_write("/tandem/").with_prefix()),
        ("reader", Permission::read("/tandem/").with_prefix()),
    ] {
        c.role_add(role).await.unwrap();
        c.role_grant_permission(role, perm).await.unwrap();
        c.user_add(role, PASSWORD, None).await.unwrap();
        c.user_grant_role(role, role).await.unwrap();
    }
    c.auth_enable().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_work_and_wrong_or_missing_ones_are_named_as_authentication_failures() {
    logs();
    let Some(etcd) = Etcd::start() else { return };
    enable_auth(&etcd.client_url, None).await;
    let dir = tempfile::tempdir().unwrap();
    let good = with_user("tandem", password_file(dir.path(), "good", PASSWORD));

    let router = connect(&etcd.client_url, "auth", good.clone()).await.unwrap();
    let worker = connect(&etcd.client_url, "auth", good.clone()).await.unwrap();
    router.check().await.unwrap();
    registers_and_is_seen(&worker, &router, "d0").await;

    let wrong =
        connect(&etcd.client_url, "auth", with_user("tandem", password_file(dir.path(), "bad", WRONG_PASSWORD)));
    let err = wrong.await.unwrap().check().await.unwrap_err();
    assert!(matches!(err, DiscoveryError::EtcdAuth { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("authentication failed") && msg.contains("--etcd-user"), "{msg}");

    let none = connect(&etcd.client_url, "auth", EtcdSecurity::default()).await.unwrap();
    let err = none.check().await.unwrap_err();
    assert!(matches!(err, DiscoveryError::EtcdAuth { .. }), "{err:?}");
    assert!(err.to_string().contains("requires authentication"), "{err}");

    // Read access passes the start-up check; the registration's writes are refused, and its state says why.
    let reader = connect(&etcd.client_url, "auth", with_user("reader", dir.path().join("good"))).await.unwrap();
    reader.check().await.unwrap();
    let reg = reader.register(record("r0")).await.unwrap();
    let refused = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            if let RegistrationState::Retrying { error } = reg.state() {
                return error;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    let error = refused.await.expect("the registration never failed");
    assert!(error.contains("permission denied") && error.contains("read and write access"), "{error}");

    // Neither password in any log line (trace level, every crate) nor in what the configuration prints.
    let config = format!(
        "{good:?} {:?}",
        cluster::DiscoveryConfig::Etcd {
            endpoints: vec![etcd.client_url.clone()],
            cluster: "auth".into(),
            options: options(),
            security: good.clone(),
        }
    );
    let logs = logged();
    for secret in [PASSWORD, WRONG_PASSWORD] {
        assert!(!logs.contains(secret), "a password reached the logs");
        assert!(!config.contains(secret) && !msg.contains(secret) && !error.contains(secret));
    }
}

/// etcd forgets a simple token after --auth-token-ttl unused: the next call finds it invalid and must log
/// in again by itself (here the deregistration's lease revoke, long after the registration's login).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_token_is_renewed_on_the_call_that_finds_it_expired() {
    logs();
    let Some(etcd) = Etcd::start_args(&["--auth-token-ttl", "1"]) else { return };
    enable_auth(&etcd.client_url, None).await;
    let dir = tempfile::tempdir().unwrap();
    let good = with_user("tandem", password_file(dir.path(), "good", PASSWORD));
    let router = connect(&etcd.client_url, "ttl", good.clone()).await.unwrap();
    let worker = connect(&etcd.client_url, "ttl", good).await.unwrap();
    let mut view = router.watch();
    let mut reg = worker.register(record("d0")).await.unwrap();
    assert!(reg.wait_registered(Duration::from_secs(5)).await, "{:?}", reg.state());
    let seen = tokio::time::timeout(Duration::from_secs(5), view.wait_for(|v| v.len() == 1)).await;
    assert!(seen.is_ok_and(|r| r.is_ok()));
    // The keep-alive stream outlives the token; the router's watch too.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(matches!(reg.state(), RegistrationState::Registered { .. }), "{:?}", reg.state());
    reg.deregister().await;
    let gone = tokio::time::timeout(Duration::from_secs(5), view.wait_for(|v| v.is_empty())).await;
    assert!(gone.is_ok_and(|r| r.is_ok()), "deregistered with a renewed token");
    assert!(!logged().contains("could not revoke the lease"), "the revoke failed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_client_certificates_works_and_each_tls_mistake_is_named_at_start() {
    logs();
    let pki = TestPki::new("etcd");
    let server = pki.leaf("etcd-server", &[]);
    let client = pki.leaf("tandem", &[]);
    let tls = ServerTls { ca: pki.ca(), cert: server.cert, key: server.key, client_cert_auth: true };
    let Some(etcd) = Etcd::start_tls(tls) else { return };
    let good = EtcdSecurity {
        ca: Some(pki.ca()),
        cert: Some(client.cert.clone()),
        key: Some(client.key.clone()),
        ..Default::default()
    };

    let router = connect(&etcd.client_url, "tls", good.clone()).await.unwrap();
    let worker = connect(&etcd.client_url, "tls", good.clone()).await.unwrap();
    router.check().await.unwrap();
    registers_and_is_seen(&worker, &router, "d0").await;

    // No client certificate: etcd refuses the handshake.
    let no_cert = EtcdSecurity { ca: Some(pki.ca()), ..Default::default() };
    let r = connect(&etcd.client_url, "tls", no_cert).await.unwrap().check().await;
    let err = r.unwrap_err();
    assert!(matches!(err, DiscoveryError::EtcdTls { .. }), "{err:?}");

    // A client that trusts another CA refuses etcd's certificate.
    let other = TestPki::new("other");
    let other_client = other.leaf("tandem", &[]);
    let foreign = EtcdSecurity {
        ca: Some(other.ca()),
        cert: Some(other_client.cert),
        key: Some(other_client.key),
        ..Default::default()
    };
    let err = connect(&etcd.client_url, "tls", foreign).await.unwrap().check().await.unwrap_err();
    assert!(matches!(err, DiscoveryError::EtcdTls { .. }), "{err:?}");
    assert!(err.to_string().contains("not signed by the CA this side trusts"), "{err}");

    // Plaintext against etcd's TLS port.
    let plain_url = format!("http://127.0.0.1:{}", etcd.client_port());
    let err = connect(&plain_url, "tls", EtcdSecurity::default()).await.unwrap().check().await.unwrap_err();
    assert!(matches!(err, DiscoveryError::EtcdTls { .. }), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_to_a_plaintext_etcd_is_a_tls_failure_and_no_etcd_at_all_is_unreachable() {
    logs();
    let pki = TestPki::new("plain");
    let Some(etcd) = Etcd::start() else { return };
    let tls_url = format!("https://127.0.0.1:{}", etcd.client_port());
    let tls = EtcdSecurity { ca: Some(pki.ca()), ..Default::default() };
    let err = connect(&tls_url, "x", tls).await.unwrap().check().await.unwrap_err();
    assert!(matches!(err, DiscoveryError::EtcdTls { .. }), "{err:?}");
    assert!(err.to_string().contains("does it serve TLS"), "{err}");

    // Nothing listens there: start-up goes on (etcd may come later), the registration says why it waits.
    drop(etcd);
    let gone = connect(&format!("http://127.0.0.1:{}", free_port()), "x", EtcdSecurity::default()).await.unwrap();
    gone.check().await.unwrap();
    let reg = gone.register(record("d0")).await.unwrap();
    let waiting = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            if let RegistrationState::Retrying { error } = reg.state() {
                return error;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    let error = waiting.await.expect("no retry");
    assert!(error.contains("is unreachable") && error.contains("refused"), "{error}");
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}
