//! Discovery errors.

#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("etcd at {endpoints}: {source}")]
    Etcd { endpoints: String, source: etcd_client::Error },
    #[error("invalid worker record: {0}")]
    InvalidRecord(String),
    #[error("invalid discovery configuration: {0}")]
    Config(String),
}
