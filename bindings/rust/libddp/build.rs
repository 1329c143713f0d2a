// Tests and examples of this crate find libddp at run time through an rpath to libddp-sys's directory.
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_DDP_ROOT");
    if let Ok(root) = std::env::var("DEP_DDP_ROOT") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", root);
    }
}
