//! etcd discovery. Workers write their record under a lease kept alive every TTL/3; the router lists the
//! prefix and then watches it from the listed revision.
//!
//! Failure behaviour (the part peers get wrong):
//! - etcd unreachable: the router keeps serving with its last view and re-lists when etcd answers again;
//!   workers keep retrying with backoff.
//! - lease lost (expired during an outage, or etcd restarted empty): the worker grants a new lease and
//!   writes its record again. It never gives up.
//! - a worker that dies stops its keep-alive; etcd deletes its key when the lease TTL runs out, and the
//!   router's watch sees the DELETE.
//! - etcd with authentication: every (re)connection starts with Authenticate, and an expired token is
//!   renewed on the call that finds it expired. Start-up ([`EtcdDiscovery::check`]) fails on refused
//!   credentials or a failed TLS handshake; later failures are logged with their cause and retried.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use etcd_client::{Client, ConnectOptions, EventType, GetOptions, PutOptions, WatchOptions};
use futures::future::BoxFuture;
use tokio::sync::{oneshot, watch};
use tracing::{debug, info, warn};

use crate::discovery::Stop;
use crate::etcd_failure::{Phase, Target, is_closed};
use crate::etcd_security::Credentials;
use crate::keys::{parse_key, worker_key, workers_prefix};
use crate::{ClusterView, Discovery, DiscoveryError, EtcdSecurity, Registration, RegistrationState, WorkerRecord};

/// Timing knobs of the etcd backend.
#[derive(Debug, Clone)]
pub struct EtcdOptions {
    /// Lease TTL: a dead worker disappears at most this long after its last keep-alive.
    pub lease_ttl: Duration,
    /// Timeout of each etcd request.
    pub request_timeout: Duration,
    /// Longest wait between retries while etcd is unreachable.
    pub max_backoff: Duration,
}

impl Default for EtcdOptions {
    fn default() -> Self {
        Self {
            lease_ttl: Duration::from_secs(10),
            request_timeout: Duration::from_secs(3),
            max_backoff: Duration::from_secs(2),
        }
    }
}

/// HTTP/2 keep-alive ping period: twice a default etcd's minimum (`--grpc-keepalive-min-time` 5 s).
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);

pub struct EtcdDiscovery {
    client: Client,
    credentials: Option<Arc<Credentials>>,
    target: Target,
    /// Times the router's watch lost etcd (each logged as "etcd watch failed" with the cause).
    watch_failures: Arc<std::sync::atomic::AtomicU64>,
    endpoints: String,
    cluster: String,
    options: EtcdOptions,
    view: OnceLock<watch::Receiver<Arc<ClusterView>>>,
}

impl EtcdDiscovery {
    /// Builds a plaintext client without credentials. Connections are made lazily, so this succeeds while
    /// etcd is down.
    pub async fn new(endpoints: Vec<String>, cluster: String, options: EtcdOptions) -> Result<Self, DiscoveryError> {
        Self::connect(endpoints, cluster, options, EtcdSecurity::default()).await
    }

    /// Builds the client with TLS and credentials as `security` says, reading its files (the password
    /// too) now. Connections, and authentication, are made lazily: this succeeds while etcd is down.
    pub async fn connect(
        endpoints: Vec<String>,
        cluster: String,
        options: EtcdOptions,
        security: EtcdSecurity,
    ) -> Result<Self, DiscoveryError> {
        if endpoints.is_empty() {
            return Err(DiscoveryError::Config("etcd discovery needs at least one endpoint".into()));
        }
        if cluster.is_empty() || cluster.contains('/') {
            return Err(DiscoveryError::Config(format!(
                "cluster name {cluster:?} must be non-empty and contain no '/'"
            )));
        }
        let loaded = security.load(&endpoints)?;
        let joined = endpoints.join(",");
        let target = Target { endpoints: joined.clone(), tls: security.ca.is_some() };
        // A default etcd (grpc-go) allows one HTTP/2 ping per --grpc-keepalive-min-time (5 s) and none
        // on a connection without streams; more and it answers GOAWAY "too_many_pings", dropping every
        // watch and keep-alive on the connection. Ping at twice that minimum, only while streams are
        // open (the watch and the lease keep-alive always are).
        let mut connect_options = ConnectOptions::new()
            .with_timeout(options.request_timeout)
            .with_connect_timeout(options.request_timeout)
            .with_keep_alive(KEEPALIVE_INTERVAL, options.request_timeout)
            .with_keep_alive_while_idle(false)
            // Simple tokens expire (5 min unused by default) and vanish when etcd restarts: renew on demand.
            .with_auto_token_refresh(true);
        if let Some(tls) = loaded.tls {
            connect_options = connect_options.with_tls(tls);
        }
        // Client::connect only builds a lazily connecting channel; it does not reach etcd. The user is not
        // given here (connect would authenticate at once): every attempt logs in first (`login`).
        let client = Client::connect(&endpoints, Some(connect_options))
            .await
            .map_err(|source| DiscoveryError::Etcd { endpoints: joined.clone(), source })?;
        Ok(Self {
            client,
            credentials: loaded.credentials.map(Arc::new),
            target,
            watch_failures: Default::default(),
            endpoints: joined,
            cluster,
            options,
            view: OnceLock::new(),
        })
    }

    /// How often the watch lost its connection to etcd so far.
    pub fn watch_failures(&self) -> u64 {
        self.watch_failures.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn cluster(&self) -> &str {
        &self.cluster
    }

    /// One request now (log in, then count the cluster's workers): an error when etcd refuses the
    /// credentials or the TLS handshake fails, which retrying cannot fix. An etcd that does not answer
    /// is only logged: the background tasks keep trying.
    pub async fn check(&self) -> Result<(), DiscoveryError> {
        let limit = self.options.request_timeout * 2;
        let mut attempt = self.check_once(limit).await;
        // A connection closed at first contact says TLS disagrees, unless etcd was only restarting: once more.
        if matches!(&attempt, Ok(Err(e)) if is_closed(e)) {
            tokio::time::sleep(Duration::from_millis(200)).await;
            attempt = self.check_once(limit).await;
        }
        let err = match attempt {
            Ok(Ok(workers)) => {
                info!(endpoints = %self.endpoints, workers, "etcd reached");
                return Ok(());
            }
            Ok(Err(e)) => self.target.classify_in(Phase::Start, e),
            Err(_) => DiscoveryError::EtcdUnreachable {
                endpoints: self.endpoints.clone(),
                detail: format!("no answer within {limit:?}"),
            },
        };
        if err.is_configuration() {
            return Err(err);
        }
        warn!(error = %err, "etcd not reachable at start; retrying in the background");
        Ok(())
    }

    /// Logs in and counts the cluster's workers, on a fresh connection.
    async fn check_once(
        &self,
        limit: Duration,
    ) -> Result<Result<i64, etcd_client::Error>, tokio::time::error::Elapsed> {
        let mut client = self.client.clone();
        let prefix = workers_prefix(&self.cluster);
        tokio::time::timeout(limit, async {
            login(&mut client, &self.credentials).await?;
            let resp = client.get(prefix.as_bytes(), Some(GetOptions::new().with_prefix().with_count_only())).await?;
            Ok(resp.count())
        })
        .await
    }
}

/// Authenticates when credentials are configured. etcd-client keeps the token (and the credentials, to
/// renew it) in state shared by every clone of the client.
async fn login(client: &mut Client, credentials: &Option<Arc<Credentials>>) -> Result<(), etcd_client::Error> {
    match credentials {
        Some(c) => client.update_user(Some(c.pair())).await,
        None => Ok(()),
    }
}

impl Discovery for EtcdDiscovery {
    fn watch(&self) -> watch::Receiver<Arc<ClusterView>> {
        self.view
            .get_or_init(|| {
                let (tx, rx) = watch::channel(Arc::new(ClusterView::default()));
                let watcher = Watcher {
                    client: self.client.clone(),
                    credentials: self.credentials.clone(),
                    target: self.target.clone(),
                    prefix: workers_prefix(&self.cluster),
                    max_backoff: self.options.max_backoff,
                    failures: self.watch_failures.clone(),
                    tx,
                };
                tokio::spawn(watcher.run());
                rx
            })
            .clone()
    }

    fn register(&self, record: WorkerRecord) -> BoxFuture<'_, Result<Registration, DiscoveryError>> {
        Box::pin(async move {
            if record.id.is_empty() || record.id.contains('/') {
                return Err(DiscoveryError::InvalidRecord(format!(
                    "worker id {:?} must be non-empty, no '/'",
                    record.id
                )));
            }
            if record.role == proto::v1::WorkerRole::Unspecified {
                return Err(DiscoveryError::InvalidRecord(format!(
                    "worker {}: role must be prefill or decode",
                    record.id
                )));
            }
            let key = worker_key(&self.cluster, record.role, &record.id);
            let value = serde_json::to_vec(&record).map_err(|e| DiscoveryError::InvalidRecord(e.to_string()))?;
            let (state_tx, state_rx) = watch::channel(RegistrationState::Registering);
            let (stop_tx, stop_rx) = oneshot::channel();
            let keeper = Keeper {
                client: self.client.clone(),
                credentials: self.credentials.clone(),
                target: self.target.clone(),
                key: key.clone(),
                value,
                ttl: self.options.lease_ttl,
                max_backoff: self.options.max_backoff,
                state: state_tx,
            };
            let task = tokio::spawn(keeper.run(stop_rx));
            Ok(Registration::new(key, state_rx, stop_tx, task))
        })
    }

    fn kind(&self) -> crate::DiscoveryKind {
        crate::DiscoveryKind::Etcd
    }
}

/// Keeps one worker registered.
struct Keeper {
    client: Client,
    credentials: Option<Arc<Credentials>>,
    target: Target,
    key: String,
    value: Vec<u8>,
    ttl: Duration,
    max_backoff: Duration,
    state: watch::Sender<RegistrationState>,
}

enum KeepAliveEnd {
    Stopped(Stop),
    Lost(String),
}

impl Keeper {
    async fn run(mut self, mut stop: oneshot::Receiver<Stop>) {
        let mut backoff = Duration::from_millis(100);
        loop {
            let attempt = tokio::select! {
                s = &mut stop => return self.finish(None, s.unwrap_or(Stop::Deregister)).await,
                r = self.grant_and_put() => r,
            };
            let lease = match attempt {
                Ok(lease) => lease,
                Err(e) => {
                    let e = self.target.classify(e);
                    warn!(key = %self.key, error = %e, "registration failed; retrying");
                    self.state.send_replace(RegistrationState::Retrying { error: e.to_string() });
                    tokio::select! {
                        s = &mut stop => return self.finish(None, s.unwrap_or(Stop::Deregister)).await,
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(self.max_backoff);
                    continue;
                }
            };
            backoff = Duration::from_millis(100);
            info!(key = %self.key, lease, "registered");
            self.state.send_replace(RegistrationState::Registered { lease });
            match self.keep_alive(lease, &mut stop).await {
                KeepAliveEnd::Stopped(s) => return self.finish(Some(lease), s).await,
                KeepAliveEnd::Lost(why) => {
                    warn!(key = %self.key, lease, reason = %why, "lease keep-alive interrupted; registering again");
                    self.state.send_replace(RegistrationState::Retrying { error: why });
                    // A best-effort revoke of the old lease, in case it is still alive somewhere.
                    let mut c = self.client.clone();
                    tokio::spawn(async move {
                        let _ = tokio::time::timeout(Duration::from_secs(1), c.lease_revoke(lease)).await;
                    });
                }
            }
        }
    }

    async fn grant_and_put(&mut self) -> Result<i64, etcd_client::Error> {
        login(&mut self.client, &self.credentials).await?;
        let ttl = self.ttl.as_secs().max(1) as i64;
        let lease = self.client.lease_grant(ttl, None).await?.id();
        let opts = PutOptions::new().with_lease(lease);
        self.client.put(self.key.as_bytes(), self.value.clone(), Some(opts)).await?;
        Ok(lease)
    }

    async fn keep_alive(&mut self, lease: i64, stop: &mut oneshot::Receiver<Stop>) -> KeepAliveEnd {
        let (mut keeper, mut responses) = match self.client.lease_keep_alive(lease).await {
            Ok(k) => k,
            Err(e) => return KeepAliveEnd::Lost(self.target.classify(e).to_string()),
        };
        let interval = (self.ttl / 3).max(Duration::from_millis(200));
        loop {
            tokio::select! {
                s = &mut *stop => return KeepAliveEnd::Stopped(s.unwrap_or(Stop::Deregister)),
                _ = tokio::time::sleep(interval) => {}
            }
            if let Err(e) = keeper.keep_alive().await {
                return KeepAliveEnd::Lost(self.target.classify(e).to_string());
            }
            match tokio::time::timeout(interval, responses.message()).await {
                Ok(Ok(Some(r))) if r.ttl() > 0 => debug!(key = %self.key, ttl = r.ttl(), "lease kept alive"),
                Ok(Ok(Some(_))) => return KeepAliveEnd::Lost("lease expired".into()),
                Ok(Ok(None)) => return KeepAliveEnd::Lost("keep-alive stream closed".into()),
                Ok(Err(e)) => return KeepAliveEnd::Lost(self.target.classify(e).to_string()),
                Err(_) => return KeepAliveEnd::Lost("keep-alive response timed out".into()),
            }
        }
    }

    async fn finish(&mut self, lease: Option<i64>, stop: Stop) {
        match (stop, lease) {
            (Stop::Deregister, Some(lease)) => {
                match tokio::time::timeout(Duration::from_secs(3), self.client.lease_revoke(lease)).await {
                    Ok(Ok(_)) => info!(key = %self.key, "deregistered"),
                    _ => warn!(key = %self.key, "could not revoke the lease; the entry expires with its TTL"),
                }
            }
            (Stop::Deregister, None) => {
                // The put may have landed before we were stopped: delete the key outright.
                let _ =
                    tokio::time::timeout(Duration::from_secs(1), self.client.delete(self.key.as_bytes(), None)).await;
            }
            (Stop::Abandon, _) => info!(key = %self.key, "registration abandoned; it expires with its lease"),
        }
    }
}

/// Keeps the router's view in step with the prefix.
struct Watcher {
    client: Client,
    credentials: Option<Arc<Credentials>>,
    target: Target,
    prefix: String,
    max_backoff: Duration,
    failures: Arc<std::sync::atomic::AtomicU64>,
    tx: watch::Sender<Arc<ClusterView>>,
}

impl Watcher {
    async fn run(mut self) {
        let mut backoff = Duration::from_millis(100);
        loop {
            if self.tx.is_closed() {
                return;
            }
            match self.list_then_watch().await {
                Ok(()) => backoff = Duration::from_millis(100),
                Err(e) => {
                    self.failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let n = self.tx.borrow().len();
                    let e = self.target.classify(e);
                    warn!(error = %e, workers = n, "etcd watch failed; serving with the last view");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(self.max_backoff);
                }
            }
        }
    }

    /// Lists the prefix (replacing the whole view, so deletions during an outage are seen), then
    /// applies watch events until the stream ends.
    async fn list_then_watch(&mut self) -> Result<(), etcd_client::Error> {
        login(&mut self.client, &self.credentials).await?;
        let resp = self.client.get(self.prefix.as_bytes(), Some(GetOptions::new().with_prefix())).await?;
        let revision = resp.header().map(|h| h.revision()).unwrap_or(0);
        let mut view = ClusterView::default();
        for kv in resp.kvs() {
            if let Some(r) = self.record(kv.key(), kv.value()) {
                view.workers.insert((r.role, r.id.clone()), r);
            }
        }
        self.publish(view.clone());
        let opts = WatchOptions::new().with_prefix().with_start_revision(revision + 1);
        let mut stream = self.client.watch(self.prefix.as_bytes(), Some(opts)).await?;
        while let Some(resp) = stream.message().await? {
            if resp.canceled() {
                warn!(reason = resp.cancel_reason(), "etcd watch canceled; listing again");
                return Ok(());
            }
            for ev in resp.events() {
                let Some(kv) = ev.kv() else { continue };
                let Ok(key) = std::str::from_utf8(kv.key()) else { continue };
                let Some((role, id)) = parse_key(&self.prefix, key) else { continue };
                match ev.event_type() {
                    EventType::Put => {
                        if let Some(r) = self.record(kv.key(), kv.value()) {
                            view.workers.insert((role, id), r);
                        }
                    }
                    EventType::Delete => {
                        view.workers.remove(&(role, id));
                    }
                }
            }
            self.publish(view.clone());
        }
        Ok(())
    }

    fn record(&self, key: &[u8], value: &[u8]) -> Option<WorkerRecord> {
        let key = std::str::from_utf8(key).ok()?;
        let (role, id) = parse_key(&self.prefix, key)?;
        match serde_json::from_slice::<WorkerRecord>(value) {
            Ok(r) if r.role == role && r.id == id => Some(r),
            Ok(r) => {
                warn!(key, record_role = %r.role, record_id = %r.id, "worker record does not match its key; ignored");
                None
            }
            Err(e) => {
                warn!(key, error = %e, "unreadable worker record; ignored");
                None
            }
        }
    }

    fn publish(&self, view: ClusterView) {
        self.tx.send_if_modified(|cur| {
            if **cur == view {
                return false;
            }
            info!(workers = view.len(), "cluster view updated");
            *cur = Arc::new(view);
            true
        });
    }
}
