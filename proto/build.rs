//! Generates the tandem.v1 Rust code. `protoc` comes from $PROTOC (set by .cargo/config.toml to
//! scripts/protoc) or, when unset, from the protoc-bin-vendored crate, so no system package is needed.

#[path = "src/redact_list.rs"]
mod redact;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos =
        ["tandem/v1/common.proto", "tandem/v1/transfer.proto", "tandem/v1/worker.proto", "tandem/v1/generate.proto"];
    for p in &protos {
        println!("cargo:rerun-if-changed={p}");
    }
    if std::env::var_os("PROTOC").is_none() {
        let protoc = protoc_bin_vendored::protoc_bin_path()?;
        // SAFETY: build scripts are single-threaded here; nothing else reads the environment concurrently.
        unsafe { std::env::set_var("PROTOC", protoc) };
    }
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // Discovery stores fingerprints in its JSON worker records (roles: src/role.rs).
        .type_attribute("tandem.v1.ModelFingerprint", "#[derive(serde::Serialize, serde::Deserialize)]")
        // Records written by workers from before the field read as protocol 0 (= 1, unversioned).
        .field_attribute("tandem.v1.ModelFingerprint.kv_transfer_protocol", "#[serde(default)]")
        // Messages that carry a transfer token get a Debug that leaves it out (src/redact.rs).
        .skip_debug(redact::TOKEN_CARRIERS.iter().map(|m| format!(".tandem.v1.{m}")))
        .compile_protos(&protos, &["."])?;
    Ok(())
}
