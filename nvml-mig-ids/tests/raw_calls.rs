//! The two raw calls against a library with NVML's C ABI, built from
//! `fake_nvml/libnvidia-ml.c` with the system C compiler and loaded the way the plugin loads
//! the real one (`nvml-wrapper`, by path). What this checks is the unsafe code's side of the
//! ABI: the symbol each call looks up, the out-pointer NVML writes, NVML's return codes, and a
//! library without the symbols (a driver too old to export them) answering an error rather
//! than a panic. Whether a real driver gives the ids a MIG GPU's table lists needs a MIG GPU.

use std::path::{Path, PathBuf};
use std::process::Command;

use nvml_wrapper::Nvml;
use nvml_wrapper::error::NvmlError;
use tessera_nvml_mig_ids::{compute_instance_id, gpu_instance_id};

/// Builds the fake library (with `defines`) into a folder of its own per test (tests run in
/// parallel) and returns its path.
fn build(name: &str, defines: &[&str]) -> PathBuf {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fake_nvml/libnvidia-ml.c");
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("fake-nvml-{name}"));
    std::fs::create_dir_all(&dir).expect("create the library's folder");
    let lib = dir.join("libnvidia-ml.so.1");
    let status = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".to_owned()))
        .args(["-shared", "-fPIC", "-O0", "-Wall", "-Werror", "-o"])
        .arg(&lib)
        .args(defines)
        .arg(&source)
        .status()
        .expect("run the C compiler (cc, or $CC) to build the fake NVML library");
    assert!(
        status.success(),
        "the C compiler failed on {}",
        source.display()
    );
    lib
}

fn open(lib: &Path) -> Nvml {
    Nvml::builder()
        .lib_path(lib.as_os_str())
        .init()
        .expect("the fake library initialises")
}

#[test]
fn a_mig_devices_ids_are_the_ones_nvml_writes() {
    let nvml = open(&build("mig", &[]));
    let mig = nvml.device_by_index(0).expect("device 0");
    assert_eq!(gpu_instance_id(&mig).expect("gpu instance id"), 3);
    assert_eq!(compute_instance_id(&mig).expect("compute instance id"), 1);
}

#[test]
fn a_whole_gpu_has_no_instance_ids_and_nvml_says_so() {
    let nvml = open(&build("whole", &[]));
    let whole = nvml.device_by_index(1).expect("device 1");
    assert!(matches!(
        gpu_instance_id(&whole),
        Err(NvmlError::NotSupported)
    ));
    assert!(matches!(
        compute_instance_id(&whole),
        Err(NvmlError::NotSupported)
    ));
}

#[test]
fn a_driver_without_the_calls_answers_an_error_not_a_panic() {
    let nvml = open(&build("without-ids", &["-DWITHOUT_INSTANCE_IDS"]));
    let mig = nvml.device_by_index(0).expect("device 0");
    assert!(matches!(
        gpu_instance_id(&mig),
        Err(NvmlError::FailedToLoadSymbol(_))
    ));
    assert!(matches!(
        compute_instance_id(&mig),
        Err(NvmlError::FailedToLoadSymbol(_))
    ));
}
