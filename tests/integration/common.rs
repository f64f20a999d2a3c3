//! Shared helpers: the committed tiny model and its float64 reference.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use k3ring::checkpoint::safetensors::parse_header_json;
use k3ring::engine::{open_resident, Opened};
use kernels::{Isa, Kernels};

pub fn tiny_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-k3")
}

pub fn open(dir: &Path, threads: usize, isa: Isa) -> Opened {
    open_resident(dir, threads, Kernels::with_isa(isa).unwrap()).unwrap()
}

/// `reference.json` of a model directory.
pub fn reference_json(dir: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(dir.join("reference.json")).unwrap()).unwrap()
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// One tensor of `reference.safetensors`, widened to f64 (F32) or kept as integers (I32).
pub struct RefTensor {
    pub shape: Vec<usize>,
    pub data: Vec<f64>,
}

/// Reads every tensor of `reference.safetensors`.
pub fn reference_tensors(dir: &Path) -> HashMap<String, RefTensor> {
    let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let entries = parse_header_json(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    let mut out = HashMap::new();
    for (name, e) in entries {
        let raw = &data[e.data_offsets[0] as usize..e.data_offsets[1] as usize];
        let values: Vec<f64> = match e.dtype.name() {
            "F32" => raw.chunks_exact(4).map(|c| f64::from(f32::from_le_bytes(c.try_into().unwrap()))).collect(),
            "I32" => raw.chunks_exact(4).map(|c| f64::from(i32::from_le_bytes(c.try_into().unwrap()))).collect(),
            "F64" => raw.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap())).collect(),
            other => panic!("unexpected dtype {other} for {name}"),
        };
        out.insert(name, RefTensor { shape: e.shape.iter().map(|&d| d as usize).collect(), data: values });
    }
    out
}

/// max |a - b| / max |b|.
pub fn rel_max_diff(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-30);
    a.iter().zip(b).fold(0.0f64, |m, (x, y)| m.max((f64::from(*x) - y).abs())) / scale
}

pub fn argmax(row: &[f32]) -> u32 {
    k3ring::engine::sampling::argmax(row) as u32
}

/// Packs the trunk of `model` into a fresh temp dir.
pub fn pack(model: &Path) -> tempfile::TempDir {
    let out = tempfile::tempdir().unwrap();
    let cfg = k3ring::config::Config::from_model_dir(model).unwrap();
    let index = k3ring::checkpoint::CheckpointIndex::open(model).unwrap();
    k3ring::storage::pack::write_pack(model, &cfg, &index, out.path(), |_, _| {}).unwrap();
    out
}

/// The tiny fixture's reference prompt.
pub fn prompt() -> Vec<u32> {
    ids(&reference_json(&tiny_dir())["prompt_ids"])
}

/// Runs the k3ring binary with `args` and `stdin`: (exit code, stdout, stderr).
pub fn k3ring_stdin(args: &[&str], stdin: &str) -> (i32, String, String) {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let mut child = Command::new(env!("CARGO_BIN_EXE_k3ring"))
        .args(args)
        .env_remove("RUST_LOG")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // A command that refuses its flags exits before reading stdin: the write then fails with
    // a broken pipe, which is the child's business (its exit code and stderr say why), not ours.
    if let Err(e) = child.stdin.take().unwrap().write_all(stdin.as_bytes()) {
        assert_eq!(e.kind(), std::io::ErrorKind::BrokenPipe, "writing the child's stdin: {e}");
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Waits for `child` (spawned with piped stdout and stderr), killing it after `limit`: (exit
/// code, stdout, stderr); code -1 when it had to be killed.
pub fn wait_bounded(mut child: std::process::Child, limit: std::time::Duration) -> (i32, String, String) {
    use std::io::Read;
    let deadline = std::time::Instant::now() + limit;
    let (mut stdout, mut stderr) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let out = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stdout.read_to_string(&mut text);
        text
    });
    let err = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            child.kill().unwrap();
            break child.wait().unwrap();
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    (status.code().unwrap_or(-1), out.join().unwrap(), err.join().unwrap())
}
