// Finds libddp and links it. In order: $LIBDDP_DIR; this repository's build/lib; the repository's
// Makefile, run here when the library was never built (`make lib`); a system-wide install. When
// none works it stops with one line that says what to do.
use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

const HELP: &str = "set LIBDDP_DIR to the directory that holds libddp.so, or run `make` in the libddp repository";

fn has_lib(dir: &Path) -> bool {
    dir.join("libddp.so").exists()
}

// Runs `make lib` in the repository; its output is shown only when it fails.
fn build_in(repo: &Path) -> Result<(), String> {
    let jobs = env::var("NUM_JOBS").unwrap_or_else(|_| "2".to_string());
    let out = Command::new(env::var("MAKE").unwrap_or_else(|_| "make".to_string()))
        .arg("-C")
        .arg(repo)
        .arg(format!("-j{}", jobs))
        .arg("lib")
        .output()
        .map_err(|e| format!("cannot run make: {}", e))?;
    if out.status.success() {
        return Ok(());
    }
    eprintln!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    Err(format!("`make lib` in {} failed ({})", repo.display(), out.status))
}

fn system_dir() -> Option<PathBuf> {
    ["/usr/local/lib", "/usr/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64"]
        .iter()
        .map(PathBuf::from)
        .find(|d| has_lib(d))
}

fn find() -> Result<Option<PathBuf>, String> {
    if let Some(d) = env::var_os("LIBDDP_DIR") {
        let d = PathBuf::from(d);
        if !has_lib(&d) {
            return Err(format!("LIBDDP_DIR={} holds no libddp.so", d.display()));
        }
        return Ok(Some(d));
    }
    let repo = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap()).join("../../..");
    let built = repo.join("build/lib");
    if has_lib(&built) {
        return Ok(built.canonicalize().ok());
    }
    if repo.join("Makefile").exists() && repo.join("include/ddp.h").exists() {
        build_in(&repo)?;
        if has_lib(&built) {
            return Ok(built.canonicalize().ok());
        }
        return Err(format!("`make lib` in {} made no build/lib/libddp.so", repo.display()));
    }
    match system_dir() {
        Some(d) => Ok(Some(d)),
        None => Err("no libddp found".to_string()),
    }
}

fn main() {
    println!("cargo:rerun-if-env-changed=LIBDDP_DIR");
    println!("cargo:rerun-if-changed=build.rs");
    match find() {
        Ok(Some(d)) => {
            println!("cargo:rustc-link-search=native={}", d.display());
            println!("cargo:root={}", d.display()); // dependents read it as DEP_DDP_ROOT
        }
        Ok(None) => {}
        Err(why) => panic!("libddp-sys: {}: {}", why, HELP),
    }
    println!("cargo:rustc-link-lib=dylib=ddp");
}
