//! Discovery errors. The etcd variants name the cause of a failed request: credentials, TLS, or an etcd
//! that cannot be reached.

#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("etcd at {endpoints}: {source}")]
    Etcd { endpoints: String, source: etcd_client::Error },
    /// etcd refused the credentials (or their absence, or the user's permissions).
    #[error("etcd at {endpoints}: authentication failed: {detail}")]
    EtcdAuth { endpoints: String, detail: String },
    /// The TLS handshake with etcd failed, or one side speaks TLS and the other does not.
    #[error("etcd at {endpoints}: TLS failed: {detail}")]
    EtcdTls { endpoints: String, detail: String },
    /// Nothing answered: connection refused, timeout, no route, unknown host.
    #[error("etcd at {endpoints} is unreachable: {detail}")]
    EtcdUnreachable { endpoints: String, detail: String },
    #[error("invalid worker record: {0}")]
    InvalidRecord(String),
    #[error("invalid discovery configuration: {0}")]
    Config(String),
}

impl DiscoveryError {
    /// A configuration error etcd answered with (credentials, TLS): retrying cannot fix it.
    pub fn is_configuration(&self) -> bool {
        matches!(self, Self::EtcdAuth { .. } | Self::EtcdTls { .. } | Self::Config(_))
    }
}
