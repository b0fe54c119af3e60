//! Builds the MPI watch that `mpiflow launch` preloads into the programs it supervises
//! (src/launch/mpi_watch.c, a shared object embedded in the library: src/launch/watch.rs).

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let src = "src/launch/mpi_watch.c";
    println!("cargo:rerun-if-changed={src}");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let lib = out.join("libmpiflow_mpi_watch.so");
    let compiler = cc::Build::new().get_compiler();
    let status = Command::new(compiler.path())
        .args([
            "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror", "-o",
        ])
        .arg(&lib)
        .arg(src)
        .args(["-ldl", "-lpthread"])
        .status()
        .unwrap_or_else(|e| panic!("cannot run the C compiler {:?}: {e}", compiler.path()));
    assert!(status.success(), "building {src} failed");
}
