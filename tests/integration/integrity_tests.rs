//! Integrity (issue 13): expert checksums checked on every read, a content fingerprint that
//! survives a copy, `pack --verify` that finds a flipped byte anywhere, a pack that cleans up
//! after a failure and refuses a concurrent pack, and the embedded model's cached copy checked
//! by content.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use k3ring::checkpoint::CheckpointIndex;
use k3ring::storage::pack::fingerprint::sampled_windows;
use k3ring::storage::pack::{Manifest, PackError};

use crate::checkpoint_tests::{copy_tiny, k3ring};
use crate::common::*;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn streamed(model: &Path, trunk: &Path, extra: &[&str]) -> (i32, String, String) {
    let args = ["run", "--model", s(model), "--trunk", s(trunk), "--mem-gb", "0.01", "--prompt", "Once upon a time"];
    k3ring(&[&args[..], &["--gen", "4"], extra].concat())
}

fn flip(path: &Path, at: u64) {
    let mut bytes = std::fs::read(path).unwrap();
    bytes[at as usize] ^= 0x24;
    std::fs::write(path, bytes).unwrap();
}

/// Whether byte `at` of shard `shard` lies in one of the windows the fingerprint samples.
fn sampled(index: &CheckpointIndex, shard: usize, at: u64) -> bool {
    sampled_windows(&index.shards[shard]).iter().any(|&(o, l)| (o..o + l).contains(&at))
}

/// (shard path, byte) of a byte of `tensor` that the fingerprint does not sample.
fn unsampled_byte(index: &CheckpointIndex, tensor: usize) -> Option<(PathBuf, u64)> {
    let t = &index.tensors[tensor];
    let at = (t.offset..t.offset + t.len).find(|&b| !sampled(index, t.shard, b))?;
    Some((index.shards[t.shard].path.clone(), at))
}

fn stale(model: &Path, trunk: &Path) -> bool {
    let index = CheckpointIndex::open(model).unwrap();
    match Manifest::load(trunk).unwrap().check_source(trunk, model, &index) {
        Ok(()) => false,
        Err(PackError::Stale { .. }) => true,
        Err(e) => panic!("{e}"),
    }
}

// ---- expert checksums ----

#[test]
fn an_expert_changed_after_packing_stops_the_run_with_exit_3_naming_layer_expert_and_file() {
    let (_tmp, model) = copy_tiny();
    let trunk = pack(&model);
    let (code, clean, err) = streamed(&model, trunk.path(), &[]);
    assert_eq!(code, 0, "{err}");
    // A byte of the packed weights (never a scale, which could fail for another reason) of
    // every expert that has one outside the fingerprint's samples (nearly all), so the first
    // expert the routing picks is almost surely damaged, and one soon after surely.
    let index = CheckpointIndex::open(&model).unwrap();
    let mut flipped = Vec::new();
    for r in index.experts.iter() {
        if let Some((shard, at)) = [0, 2, 4].iter().find_map(|&p| unsampled_byte(&index, r.parts[p])) {
            flip(&shard, at);
            flipped.push((r.layer, r.expert, shard));
        }
    }
    assert!(flipped.len() > 150, "{} of 192 experts damaged", flipped.len());
    assert!(!stale(&model, trunk.path()), "bytes outside the samples keep the fingerprint");
    let (code, out, err) = streamed(&model, trunk.path(), &[]);
    assert_eq!(code, 3, "{err}");
    assert!(out.is_empty(), "no token from damaged bytes: {out}");
    let named = flipped.iter().any(|(l, e, shard)| {
        err.contains(&format!("layer {l} expert {e} in {}: fails its checksum (manifest ", shard.display()))
    });
    assert!(named, "{err}");
    // The opt-out runs on the damaged bytes.
    let (code, unchecked, err) = streamed(&model, trunk.path(), &["--no-verify-experts"]);
    assert_eq!(code, 0, "{err}");
    assert_ne!(unchecked, clean, "the damage changes the output, which is why experts are checked");
}

#[test]
fn no_verify_experts_needs_trunk() {
    let dir = tiny_dir();
    let args = ["run", "--model", s(&dir), "--prompt", "x", "--gen", "1", "--no-verify-experts"];
    let (code, _, err) = k3ring(&args);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--no-verify-experts needs --trunk DIR"), "{err}");
}

#[test]
fn a_pack_from_before_expert_checksums_is_refused_with_a_re_pack_hint() {
    let trunk = pack(&tiny_dir());
    let path = trunk.path().join("trunk.manifest.json");
    let text = std::fs::read_to_string(&path).unwrap().replace("\"version\": 3", "\"version\": 2");
    std::fs::write(&path, text).unwrap();
    let (code, _, err) = streamed(&tiny_dir(), trunk.path(), &[]);
    assert_eq!(code, 3, "{err}");
    assert!(
        err.contains("trunk.manifest.json: the pack was made by an older k3ring (before expert checksums): its format is v2, this k3ring reads v3; run `k3ring pack` again"),
        "{err}"
    );
    // `pack` replaces it.
    let (code, out, err) = k3ring(&["pack", "--model", s(&tiny_dir()), "--out", s(trunk.path())]);
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("packed "), "{out}");
}

#[test]
fn a_manifest_without_an_experts_checksum_is_refused() {
    let trunk = pack(&tiny_dir());
    let path = trunk.path().join("trunk.manifest.json");
    let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    m["experts"][0]["checksums"].as_array_mut().unwrap().truncate(3);
    std::fs::write(&path, serde_json::to_vec(&m).unwrap()).unwrap();
    let (code, _, err) = streamed(&tiny_dir(), trunk.path(), &[]);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("trunk.manifest.json: no checksum for layer 1 expert 3 of the checkpoint"), "{err}");
    // The advice, `k3ring pack` again, mends it (it once answered "up to date").
    let (code, out, err) = k3ring(&["pack", "--model", s(&tiny_dir()), "--out", s(trunk.path())]);
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("packed ") && err.contains("no checksum for layer 1 expert 3"), "{out}{err}");
    let (code, _, err) = streamed(&tiny_dir(), trunk.path(), &[]);
    assert_eq!(code, 0, "{err}");
}

// ---- the fingerprint ----

#[test]
fn a_copy_with_new_modification_times_keeps_its_pack() {
    let trunk = pack(&tiny_dir());
    let (_tmp, model) = copy_tiny();
    let old = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000_000);
    for entry in std::fs::read_dir(&model).unwrap() {
        std::fs::File::options().write(true).open(entry.unwrap().path()).unwrap().set_modified(old).unwrap();
    }
    assert!(!stale(&model, trunk.path()));
    let (code, out, err) = k3ring(&["pack", "--model", s(&model), "--out", s(trunk.path())]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("is up to date"), "{out}");
    let (code, _, err) = streamed(&model, trunk.path(), &[]);
    assert_eq!(code, 0, "{err}");
}

#[test]
fn a_changed_sampled_byte_or_header_invalidates_the_pack() {
    let (_tmp, model) = copy_tiny();
    let trunk = pack(&model);
    let index = CheckpointIndex::open(&model).unwrap();
    let shard = &index.shards[1];
    let (offset, _) = sampled_windows(shard)[3];
    flip(&shard.path, offset + 17);
    assert!(stale(&model, trunk.path()), "a sampled byte");
    flip(&shard.path, offset + 17);
    assert!(!stale(&model, trunk.path()), "restored");
    // Same length, other header bytes: the metadata's "pt" becomes "PT".
    let bytes = std::fs::read(&shard.path).unwrap();
    let header = &bytes[..shard.data_start as usize];
    let at = header.windows(4).position(|w| w == b"\"pt\"").unwrap();
    let mut edited = bytes.clone();
    edited[at + 1..at + 3].copy_from_slice(b"PT");
    std::fs::write(&shard.path, edited).unwrap();
    assert!(stale(&model, trunk.path()), "a header byte");
    let (code, _, err) = streamed(&model, trunk.path(), &[]);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("made from another checkpoint"), "{err}");
}

// ---- pack --verify ----

#[test]
fn pack_verify_finds_a_flipped_byte_anywhere() {
    let (_tmp, model) = copy_tiny();
    let out = tempfile::tempdir().unwrap();
    let verify = || k3ring(&["pack", "--model", s(&model), "--out", s(out.path()), "--verify"]);
    let (code, stdout, err) = verify();
    assert_eq!(code, 0, "{err}");
    assert!(stdout.contains("verified 15 trunk units") && stdout.contains("192 experts"), "{stdout}");
    assert!(stdout.contains("every one matches"), "{stdout}");
    let index = CheckpointIndex::open(&model).unwrap();
    let manifest = Manifest::load(out.path()).unwrap();
    let pack_file = out.path().join("trunk.pack");
    let unit = |name: &str| manifest.units.iter().find(|u| u.unit == name).unwrap().offset;
    let expert = index.experts.get(7, 11).unwrap();
    let (expert_shard, expert_byte) = unsampled_byte(&index, expert.parts[4]).unwrap();
    let trunk_tensor = index.get("language_model.model.layers.9.self_attn.o_proj.weight").unwrap();
    let trunk_id = index.tensors.iter().position(|t| t.name == trunk_tensor.name).unwrap();
    let (trunk_shard, trunk_byte) = unsampled_byte(&index, trunk_id).unwrap();
    let expert_file = expert_shard.display().to_string();
    let trunk_file = trunk_shard.display().to_string();
    let cases: [(&str, PathBuf, u64, Vec<&str>); 5] = [
        ("a packed layer", pack_file.clone(), unit("layer.5") + 300, vec!["unit layer.5 fails its checksum"]),
        ("packed padding", pack_file.clone(), unit("layer.6") - 1, vec!["unit layer.5 fails its checksum", "padding"]),
        (
            "the packed embedding",
            pack_file.clone(),
            unit("embed") + 128 * 40 + 3,
            vec!["unit embed fails its checksum", "1 embedding row(s) fail their checksums, the first row 40"],
        ),
        ("an expert in a shard", expert_shard.clone(), expert_byte, vec!["layer 7 expert 11 in ", &expert_file]),
        (
            "a trunk tensor in a shard",
            trunk_shard.clone(),
            trunk_byte,
            vec![
                "unit layer.9 tensor language_model.model.layers.9.self_attn.o_proj.weight differs from ",
                &trunk_file,
            ],
        ),
    ];
    for (what, file, at, names) in cases {
        flip(&file, at);
        let (code, _, err) = verify();
        assert_eq!(code, 3, "{what}: {err}");
        assert!(err.contains("k3ring: error: `k3ring pack --verify` found "), "{what}: {err}");
        for name in names {
            assert!(err.contains(name), "{what}: {name:?} not in {err}");
        }
        flip(&file, at);
    }
    let (code, _, err) = verify();
    assert_eq!(code, 0, "restored: {err}");
}

// ---- a failed or concurrent pack ----

/// Runs `k3ring pack` with a file size limit of `limit` bytes (SIGXFSZ ignored, so a write past
/// it fails with EFBIG as a full disk fails with ENOSPC).
fn pack_with_file_size_limit(model: &Path, out: &Path, limit: u64) -> (i32, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_k3ring"));
    cmd.args(["pack", "--model", s(model), "--out", s(out)]).env_remove("RUST_LOG");
    // SAFETY: between fork and exec the closure only makes two async-signal-safe calls
    // (signal, setrlimit) on values it owns; it allocates nothing and takes no lock.
    unsafe {
        cmd.pre_exec(move || {
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            let lim = libc::rlimit { rlim_cur: limit, rlim_max: limit };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let o = cmd.output().unwrap();
    (o.status.code().unwrap_or(-1), String::from_utf8_lossy(&o.stderr).into_owned())
}

fn leftovers(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != "trunk.lock")
        .collect()
}

#[test]
fn a_pack_that_cannot_write_removes_its_partial_file() {
    let out = tempfile::tempdir().unwrap();
    let (code, err) = pack_with_file_size_limit(&tiny_dir(), out.path(), 64 << 10);
    assert_eq!(code, 4, "{err}");
    assert!(err.contains("trunk.pack.partial") && err.contains("File too large"), "{err}");
    assert_eq!(leftovers(out.path()), Vec::<String>::new(), "nothing left but the lock file");
}

/// A tmpfs smaller than the pack, mounted on a temp dir (root only); unmounted on drop.
struct SmallDisk(tempfile::TempDir);

impl SmallDisk {
    fn mount(bytes: u64) -> Option<SmallDisk> {
        let dir = tempfile::tempdir().unwrap();
        let size = format!("size={bytes}");
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &size, "tmpfs", s(dir.path())])
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|st| st.success());
        ok.then_some(SmallDisk(dir))
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.0.path()).status();
    }
}

#[test]
fn a_pack_onto_a_full_disk_removes_its_partial_file() {
    let Some(disk) = SmallDisk::mount(512 << 10) else {
        println!("skipped: cannot mount a small tmpfs here (needs root)");
        return;
    };
    let (code, _, err) = k3ring(&["pack", "--model", s(&tiny_dir()), "--out", s(disk.0.path())]);
    assert_eq!(code, 4, "{err}");
    assert!(err.contains("cannot write") && err.contains("trunk.pack.partial"), "{err}");
    assert!(err.contains("No space left on device"), "{err}");
    assert_eq!(leftovers(disk.0.path()), Vec::<String>::new(), "nothing left but the lock file");
}

#[test]
fn a_second_pack_into_one_directory_is_refused_while_the_first_holds_the_lock() {
    let out = tempfile::tempdir().unwrap();
    let held = k3ring::storage::pack::lock::PackLock::acquire(out.path()).unwrap();
    let (code, _, err) = k3ring(&["pack", "--model", s(&tiny_dir()), "--out", s(out.path())]);
    assert_eq!(code, 4, "{err}");
    assert_eq!(
        err,
        format!(
            "k3ring: error: another `k3ring pack` is writing into {0} (it holds {0}/trunk.lock); wait for it to \
             finish, or pack into another --out\n",
            out.path().display()
        )
    );
    drop(held);
    let (code, _, err) = k3ring(&["pack", "--model", s(&tiny_dir()), "--out", s(out.path())]);
    assert_eq!(code, 0, "{err}");
}

#[test]
fn concurrent_packs_into_one_directory_never_race() {
    let out = tempfile::tempdir().unwrap();
    let runs: Vec<_> = (0..4)
        .map(|_| {
            Command::new(env!("CARGO_BIN_EXE_k3ring"))
                .args(["pack", "--model", s(&tiny_dir()), "--out", s(out.path())])
                .env_remove("RUST_LOG")
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut packed = 0;
    for run in runs {
        let o = run.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        match o.status.code() {
            Some(0) => packed += 1,
            Some(4) => assert!(err.contains("another `k3ring pack` is writing into"), "{err}"),
            other => panic!("exit {other:?}: {err}"),
        }
    }
    assert!(packed >= 1);
    let (code, out_text, err) = k3ring(&["pack", "--model", s(&tiny_dir()), "--out", s(out.path()), "--verify"]);
    assert_eq!(code, 0, "{err}");
    assert!(out_text.contains("up to date") && out_text.contains("every one matches"), "{out_text}");
}

// ---- the embedded model ----

#[test]
fn a_damaged_cached_copy_of_the_embedded_model_is_rewritten() {
    let cache = tempfile::tempdir().unwrap();
    let run = || {
        let o = Command::new(env!("CARGO_BIN_EXE_k3ring"))
            .args(["run", "--prompt", "Once upon a time", "--gen", "6", "--ignore-eos"])
            .env("XDG_CACHE_HOME", cache.path())
            .env_remove("RUST_LOG")
            .output()
            .unwrap();
        (
            o.status.code().unwrap(),
            String::from_utf8_lossy(&o.stdout).into_owned(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    let (code, clean, err) = run();
    assert_eq!(code, 0, "{err}");
    let dir = std::fs::read_dir(cache.path().join("k3ring")).unwrap().next().unwrap().unwrap().path();
    let index = CheckpointIndex::open(&dir).unwrap();
    let head = index.get("language_model.lm_head.weight").unwrap();
    let shard = index.shards[head.shard].path.clone();
    for b in 0..64 {
        flip(&shard, head.offset + 2 * b + 1);
    }
    let (code, again, err) = run();
    assert_eq!(code, 0, "{err}");
    assert_eq!(again, clean, "the run used the built-in bytes");
    assert!(err.contains("k3ring: warning: the cached copy of the embedded tiny model in "), "{err}");
    assert!(err.contains(&format!("was damaged ({} differed", shard.file_name().unwrap().to_str().unwrap())), "{err}");
}

/// The dead end of issue 35: a damaged pack makes `run` say "run `k3ring pack` again", and `pack`
/// then re-packs it (it used to answer "up to date; nothing to do"); `--force` re-packs an
/// intact one; the advice, followed, makes the run succeed.
#[test]
fn pack_repacks_a_damaged_pack_and_force_repacks_an_intact_one() {
    let trunk = pack(&tiny_dir());
    let (code, clean, err) = streamed(&tiny_dir(), trunk.path(), &[]);
    assert_eq!(code, 0, "{err}");
    let m = Manifest::load(trunk.path()).unwrap();
    let unit = m.units.iter().max_by_key(|u| u.len).unwrap();
    flip(&trunk.path().join("trunk.pack"), unit.offset + 5);
    let (code, _, err) = streamed(&tiny_dir(), trunk.path(), &[]);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("run `k3ring pack` again"), "{err}");
    let repack =
        |extra: &[&str]| k3ring(&[&["pack", "--model", s(&tiny_dir()), "--out", s(trunk.path())][..], extra].concat());
    let (code, out, err) = repack(&[]);
    assert_eq!(code, 0, "{err}");
    assert!(!out.contains("up to date"), "{out}");
    let want = format!(
        "k3ring: the trunk pack in {} was packed again: unit {} fails its checksum",
        trunk.path().display(),
        unit.unit
    );
    assert!(err.contains(&want), "{err}");
    let (code, again, err) = streamed(&tiny_dir(), trunk.path(), &[]);
    assert_eq!((code, again), (0, clean), "{err}");
    let (code, out, _) = repack(&[]);
    assert!(code == 0 && out.contains("is up to date"), "{out}");
    let (code, out, err) = repack(&["--force"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("packed ") && err.contains("was packed again: --force"), "{out} {err}");
}

/// A manifest naming a tensor the checkpoint lacks (a pack of another layout, or a hand edit):
/// the advice, `pack --force`, writes a pack the run takes.
#[test]
fn a_pack_tensor_the_checkpoint_lacks_is_mended_by_pack_force() {
    let trunk = pack(&tiny_dir());
    let path = trunk.path().join("trunk.manifest.json");
    let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    m["units"][0]["tensors"][0]["name"] = serde_json::json!("model.no_such_tensor.weight");
    std::fs::write(&path, serde_json::to_vec(&m).unwrap()).unwrap();
    let (code, _, err) = streamed(&tiny_dir(), trunk.path(), &[]);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("model.no_such_tensor.weight which the checkpoint lacks: run `k3ring pack --force`"), "{err}");
    let (code, out, err) = k3ring(&["pack", "--force", "--model", s(&tiny_dir()), "--out", s(trunk.path())]);
    assert_eq!(code, 0, "{out}{err}");
    let (code, _, err) = streamed(&tiny_dir(), trunk.path(), &[]);
    assert_eq!(code, 0, "{err}");
}

/// A manifest that puts a tensor in another unit (it once panicked reading through the wrong
/// unit's view) is refused with exit 3, and `pack --force`, as advised, mends it.
#[test]
fn a_pack_tensor_in_another_unit_is_refused_and_mended_by_pack_force() {
    let trunk = pack(&tiny_dir());
    let path = trunk.path().join("trunk.manifest.json");
    let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let units = m["units"].as_array_mut().unwrap();
    let at = |units: &Vec<serde_json::Value>, name: &str| units.iter().position(|u| u["unit"] == name).unwrap();
    let (l0, l1) = (at(units, "layer.0"), at(units, "layer.1"));
    // The largest of layer 1's tensors that lies within layer 0's bytes (so no bounds check
    // catches it): read through layer 0's view, it was the panic.
    let room = units[l0]["len"].as_u64().unwrap();
    let tensors = units[l1]["tensors"].as_array_mut().unwrap();
    let fits = |t: &serde_json::Value| t["offset"].as_u64().unwrap() + t["len"].as_u64().unwrap() <= room;
    let pick = (0..tensors.len()).filter(|&i| fits(&tensors[i])).max_by_key(|&i| tensors[i]["len"].as_u64()).unwrap();
    let moved = tensors.remove(pick);
    let name = moved["name"].as_str().unwrap().to_owned();
    units[l0]["tensors"].as_array_mut().unwrap().push(moved);
    std::fs::write(&path, serde_json::to_vec(&m).unwrap()).unwrap();
    for budget in ["0.004", "0.01"] {
        let (code, _, err) = streamed(&tiny_dir(), trunk.path(), &["--mem-gb", budget]);
        assert_eq!(code, 3, "--mem-gb {budget}: {err}");
        assert!(
            err.contains(&format!("holds {name} in unit layer.0, where it does not belong: run `k3ring pack --force`")),
            "{err}"
        );
    }
    let (code, out, err) = k3ring(&["pack", "--force", "--model", s(&tiny_dir()), "--out", s(trunk.path())]);
    assert_eq!(code, 0, "{out}{err}");
    let (code, _, err) = streamed(&tiny_dir(), trunk.path(), &["--mem-gb", "0.004"]);
    assert_eq!(code, 0, "{err}");
}

/// A manifest that leaves one of a unit's matrices out (a hand edit, or a pack of another
/// layout) is refused with exit 3 whether the unit streams whole or in pieces, and `pack`,
/// as advised, mends it.
#[test]
fn a_pack_missing_a_tensor_is_refused_and_mended_by_the_pack_command_it_names() {
    let trunk = pack(&tiny_dir());
    let path = trunk.path().join("trunk.manifest.json");
    let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let units = m["units"].as_array_mut().unwrap();
    let l1 = units.iter().position(|u| u["unit"] == "layer.1").unwrap();
    let tensors = units[l1]["tensors"].as_array_mut().unwrap();
    let largest = (0..tensors.len()).max_by_key(|&i| tensors[i]["len"].as_u64()).unwrap();
    let name = tensors.remove(largest)["name"].as_str().unwrap().to_owned();
    std::fs::write(&path, serde_json::to_vec(&m).unwrap()).unwrap();
    let mut advice = None;
    for budget in ["0.004", "0.01"] {
        let (code, _, err) = streamed(&tiny_dir(), trunk.path(), &["--mem-gb", budget]);
        assert_eq!(code, 3, "--mem-gb {budget}: {err}");
        let want = format!("the trunk pack lacks {name} of unit layer.1: run `k3ring pack --force`");
        assert!(err.contains(&want), "--mem-gb {budget}: {err}");
        advice = Some("--force");
    }
    let extra: Vec<&str> = advice.into_iter().filter(|a| !a.is_empty()).collect();
    let (code, out, err) =
        k3ring(&[&["pack", "--model", s(&tiny_dir()), "--out", s(trunk.path())][..], &extra[..]].concat());
    assert_eq!(code, 0, "{out}{err}");
    let (code, _, err) = streamed(&tiny_dir(), trunk.path(), &["--mem-gb", "0.004"]);
    assert_eq!(code, 0, "{err}");
}
