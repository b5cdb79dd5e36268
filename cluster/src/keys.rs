//! The discovery key layout: `/tandem/<cluster>/workers/<role>/<id>`.

use proto::v1::WorkerRole;

/// `/tandem/<cluster>/workers/`: the router watches this prefix.
pub fn workers_prefix(cluster: &str) -> String {
    format!("/tandem/{cluster}/workers/")
}

/// `/tandem/<cluster>/workers/<role>/`.
pub fn role_prefix(cluster: &str, role: WorkerRole) -> String {
    format!("{}{}/", workers_prefix(cluster), role.name())
}

/// The key one worker registers under.
pub fn worker_key(cluster: &str, role: WorkerRole, id: &str) -> String {
    format!("{}{id}", role_prefix(cluster, role))
}

/// Splits a key under `prefix` into (role, id); None for keys that do not follow the layout.
pub(crate) fn parse_key(prefix: &str, key: &str) -> Option<(WorkerRole, String)> {
    let rest = key.strip_prefix(prefix)?;
    let (role, id) = rest.split_once('/')?;
    if id.is_empty() || id.contains('/') {
        return None;
    }
    Some((WorkerRole::from_name(role)?, id.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_and_foreign_keys_are_rejected() {
        let k = worker_key("prod", WorkerRole::Decode, "d-1");
        assert_eq!(k, "/tandem/prod/workers/decode/d-1");
        let p = workers_prefix("prod");
        assert_eq!(parse_key(&p, &k), Some((WorkerRole::Decode, "d-1".into())));
        assert_eq!(parse_key(&p, "/tandem/prod/workers/other/x"), None);
        assert_eq!(parse_key(&p, "/tandem/prod/workers/prefill/a/b"), None);
        assert_eq!(parse_key(&p, "/tandem/dev/workers/prefill/a"), None);
    }
}
