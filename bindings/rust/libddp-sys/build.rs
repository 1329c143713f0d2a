// Links libddp: from $LIBDDP_DIR if set, else this repository's build/lib, else the system path.
use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-env-changed=LIBDDP_DIR");
    let dir = match env::var_os("LIBDDP_DIR") {
        Some(d) => Some(PathBuf::from(d)),
        None => {
            let repo = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap()).join("../../../build/lib");
            if repo.join("libddp.so").exists() { repo.canonicalize().ok() } else { None }
        }
    };
    if let Some(d) = dir {
        println!("cargo:rustc-link-search=native={}", d.display());
        println!("cargo:root={}", d.display()); // dependents read it as DEP_DDP_ROOT
    }
    println!("cargo:rustc-link-lib=dylib=ddp");
}
