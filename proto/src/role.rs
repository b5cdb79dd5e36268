//! `tandem.v1.WorkerRole` by name: discovery keys (`.../workers/prefill/<id>`), log fields and the JSON
//! worker records name the role "prefill" or "decode". `Unspecified` is the proto default only: records,
//! keys and GetInfo answers with it are refused where they are read.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::v1::WorkerRole;

impl WorkerRole {
    /// "prefill", "decode" (or "unspecified").
    pub fn name(self) -> &'static str {
        match self {
            Self::Prefill => "prefill",
            Self::Decode => "decode",
            Self::Unspecified => "unspecified",
        }
    }

    /// The role named "prefill" or "decode"; None for anything else.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "prefill" => Some(Self::Prefill),
            "decode" => Some(Self::Decode),
            _ => None,
        }
    }
}

impl std::fmt::Display for WorkerRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl Serialize for WorkerRole {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for WorkerRole {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        Self::from_name(&name).ok_or_else(|| {
            serde::de::Error::custom(format!("worker role {name:?}: expected \"prefill\" or \"decode\""))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_go_by_their_names_and_unspecified_is_not_read() {
        for r in [WorkerRole::Prefill, WorkerRole::Decode] {
            assert_eq!(WorkerRole::from_name(r.name()), Some(r));
            let json = serde_json::to_string(&r).unwrap();
            assert_eq!(json, format!("\"{r}\""));
            assert_eq!(serde_json::from_str::<WorkerRole>(&json).unwrap(), r);
        }
        assert_eq!(WorkerRole::from_name("unspecified"), None);
        let err = serde_json::from_str::<WorkerRole>("\"unspecified\"").unwrap_err().to_string();
        assert!(err.contains("prefill") && err.contains("decode"), "{err}");
    }
}
