//! The `tandem` binary's single-process subcommands: gen-tiny, verify, generate.

// The golden files' reader, shared with the engine's golden tests.
#[path = "../engine/tests/support/golden.rs"]
mod golden;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn tandem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tandem")).args(args).output().expect("tandem runs")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn all_output(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn gen_tiny(dir: &Path, seed: u64) {
    let o = tandem(&["gen-tiny", dir.to_str().unwrap(), "--seed", &seed.to_string()]);
    assert!(o.status.success(), "{}", all_output(&o));
}

fn golden() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden/hf-tiny-v32")
}

#[test]
fn gen_tiny_is_deterministic_and_complete() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    gen_tiny(a.path(), 5);
    gen_tiny(b.path(), 5);
    let mut files: Vec<String> =
        std::fs::read_dir(a.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    files.sort();
    for f in [
        "config.json",
        "generation_config.json",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model-00001-of-00003.safetensors",
    ] {
        assert!(files.contains(&f.to_string()), "{f} missing from {files:?}");
    }
    for f in &files {
        assert_eq!(std::fs::read(a.path().join(f)).unwrap(), std::fs::read(b.path().join(f)).unwrap(), "{f} differs");
    }
    let cfg: serde_json::Value = serde_json::from_slice(&std::fs::read(a.path().join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["model_type"], "deepseek_v32");
    assert_eq!(cfg["num_key_value_heads"], 4);
    assert_eq!(cfg["torch_dtype"], "bfloat16");
    assert_eq!(cfg["rope_scaling"]["type"], "yarn");
    let tok: serde_json::Value =
        serde_json::from_slice(&std::fs::read(a.path().join("tokenizer.json")).unwrap()).unwrap();
    let added = tok["added_tokens"].as_array().unwrap();
    assert_eq!(added[0]["id"], 0);
    assert_eq!(added[1]["id"], 1);
    assert!(tandem(&["verify", a.path().to_str().unwrap(), "--tensors"]).status.success());
}

#[test]
fn verify_checks_sizes_and_a_sha256_manifest() {
    let d = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(golden()).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), d.path().join(e.file_name())).unwrap();
    }
    let dir = d.path().to_str().unwrap();
    let o = tandem(&["verify", dir]);
    assert!(o.status.success(), "{}", all_output(&o));
    assert!(stdout(&o).contains("2 shards"));

    // A manifest in sha256sum format: matches, then a flipped byte is caught.
    use sha2::Digest;
    let mut manifest = String::new();
    for f in ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"] {
        let digest = sha2::Sha256::digest(std::fs::read(d.path().join(f)).unwrap());
        let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
        manifest.push_str(&format!("{hex}  {f}\n"));
    }
    let mpath = d.path().join("SHA256SUMS");
    std::fs::write(&mpath, &manifest).unwrap();
    let o = tandem(&["verify", dir, "--sha256", mpath.to_str().unwrap()]);
    assert!(o.status.success(), "{}", all_output(&o));
    assert!(stdout(&o).contains("2 files matched the manifest"));
    let shard = d.path().join("model-00002-of-00002.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&shard, &bytes).unwrap();
    let o = tandem(&["verify", dir, "--sha256", mpath.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(stdout(&o).contains("model-00002-of-00002.safetensors: sha256"), "{}", stdout(&o));

    // A truncated shard no longer matches its header.
    bytes.truncate(bytes.len() - 10);
    std::fs::write(&shard, &bytes).unwrap();
    let o = tandem(&["verify", dir]);
    assert!(!o.status.success());
    assert!(stdout(&o).contains("size does not match its header"), "{}", stdout(&o));

    // A shard listed in the index but missing.
    std::fs::remove_file(&shard).unwrap();
    let o = tandem(&["verify", dir]);
    assert!(!o.status.success());
    assert!(stdout(&o).contains("model-00002-of-00002.safetensors"), "{}", stdout(&o));
}

#[test]
fn generate_reproduces_the_golden_greedy_tokens_in_full_precision() {
    let case = golden::cases(&golden().join("golden.safetensors")).swap_remove(0);
    let (ids, want) = (case.ids, case.greedy);
    let ids_arg: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
    let o = tandem(&[
        "generate",
        "--model",
        golden().to_str().unwrap(),
        "--prompt-ids",
        &ids_arg.join(","),
        "--precision",
        "full",
        "--max-tokens",
        "16",
        "--ignore-eos",
        "--json",
    ]);
    assert!(o.status.success(), "{}", all_output(&o));
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    let got: Vec<u32> =
        v["generated_token_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
    assert_eq!(got, want);
    assert_eq!(v["prompt_token_ids"].as_array().unwrap().len(), ids.len());
}

#[test]
fn generate_with_the_tiny_tokenizer_and_chat_template() {
    let d = tempfile::tempdir().unwrap();
    gen_tiny(d.path(), 0);
    let model = d.path().to_str().unwrap();
    let o = tandem(&["generate", "--model", model, "--prompt", "Hello there", "--chat", "--max-tokens", "8", "--json"]);
    assert!(o.status.success(), "{}", all_output(&o));
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    let prompt = v["prompt_token_ids"].as_array().unwrap();
    assert_eq!(prompt[0], 0, "chat prompts start with BOS");
    assert!(prompt.iter().any(|t| t == 3), "<｜User｜> (id 3) is in the chat prompt");
    assert_eq!(*prompt.last().unwrap(), 4, "the generation prompt ends with <｜Assistant｜> (id 4)");
    assert!(v["generated_token_ids"].as_array().unwrap().len() <= 8);
    assert!(v["text"].is_string());

    // Each MTP draft is listed with its verdict; greedy verification accepts exactly the drafts that
    // equal the main model's token at their position.
    let args = ["generate", "--model", model, "--prompt", "abc", "--temperature", "0", "--max-tokens", "24"];
    let o = tandem(&[&args[..], &["--ignore-eos", "--json"]].concat());
    assert!(o.status.success(), "{}", all_output(&o));
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    let got: Vec<u32> =
        v["generated_token_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
    let steps = v["mtp"]["steps"].as_array().unwrap();
    assert_eq!(steps.len() as u64, v["mtp"]["drafts"].as_u64().unwrap());
    assert!(steps.len() >= 8, "the tiny model has an MTP layer: {}", v["mtp"]);
    let accepted = steps.iter().filter(|s| s["accepted"] == true).count() as u64;
    assert_eq!(accepted, v["mtp"]["accepted"].as_u64().unwrap());
    for s in steps {
        let p = s["position"].as_u64().unwrap() as usize;
        let draft = s["draft_token_id"].as_u64().unwrap() as u32;
        if let Some(&t) = got.get(p) {
            assert_eq!(s["accepted"] == true, draft == t, "draft {s} vs token {t} at output position {p}");
        }
    }
    // Seeded sampling is reproducible.
    let args = ["generate", "--model", model, "--prompt", "abc", "--temperature", "0.9", "--seed", "11", "--json"];
    assert_eq!(stdout(&tandem(&args)).split("\"seconds\"").next(), stdout(&tandem(&args)).split("\"seconds\"").next());
}

#[test]
fn bad_input_exits_non_zero_with_the_cause() {
    let d = tempfile::tempdir().unwrap();
    let o = tandem(&["verify", d.path().to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(
        all_output(&o).contains("neither model.safetensors.index.json nor model.safetensors"),
        "{}",
        all_output(&o)
    );
    let o = tandem(&["generate", "--model", golden().to_str().unwrap(), "--prompt-ids", "5000"]);
    assert!(!o.status.success());
    assert!(all_output(&o).contains("outside the vocabulary"), "{}", all_output(&o));
    let o = tandem(&["generate", "--model", golden().to_str().unwrap(), "--prompt", "hi"]);
    assert!(!o.status.success());
    assert!(all_output(&o).contains("no tokenizer.json"), "{}", all_output(&o));
    let o = tandem(&["generate", "--model", golden().to_str().unwrap(), "--prompt-ids", "5", "--temperature=-1"]);
    assert!(!o.status.success());
    assert!(all_output(&o).contains("temperature"), "{}", all_output(&o));
    std::fs::write(d.path().join("config.json"), r#"{"model_type": "llama"}"#).unwrap();
    let o = tandem(&["generate", "--model", d.path().to_str().unwrap(), "--prompt-ids", "5"]);
    assert!(!o.status.success());
    assert!(all_output(&o).contains("model_type"), "{}", all_output(&o));
}

#[test]
fn a_gpu_that_is_not_there_is_a_clear_error_and_bad_devices_are_refused() {
    let model = golden();
    let model = model.to_str().unwrap();
    // GPU 99 exists nowhere: every role refuses at start with the reason, never falling back to the CPU.
    for args in [
        vec!["generate", "--model", model, "--prompt-ids", "5", "--device", "cuda:99"],
        vec!["prefill-worker", "--model", model, "--device", "cuda:99"],
        vec!["decode-worker", "--model", model, "--device", "cuda:99"],
        vec!["up", "--model", model, "--device", "cuda:99"],
    ] {
        let o = tandem(&args);
        assert!(!o.status.success(), "{args:?}");
        let out = all_output(&o);
        assert!(out.contains("cuda:99"), "{args:?}: {out}");
        assert!(out.contains("GPU") || out.contains("CUDA") || out.contains("driver"), "{args:?}: {out}");
    }
    let o = tandem(&["generate", "--model", model, "--prompt-ids", "5", "--device", "tpu"]);
    assert!(!o.status.success());
    assert!(all_output(&o).contains("expected cpu, cuda or cuda:N"), "{}", all_output(&o));
    let o = tandem(&[
        "generate",
        "--model",
        model,
        "--prompt-ids",
        "5",
        "--max-tokens",
        "2",
        "--device",
        "cpu",
        "--threads",
        "1",
    ]);
    assert!(o.status.success(), "{}", all_output(&o));
}
