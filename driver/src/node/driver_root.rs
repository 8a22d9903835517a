//! Where the NVIDIA driver's files are under a driver root: the host's `/` (a driver
//! installed on the node) or the GPU operator's `/run/nvidia/driver` (a driver container's
//! root), mounted into the plugin's containers the way NVIDIA's DRA driver chart does. The
//! candidates are listed here; the binaries take the first that exists.

/// The NVML library.
pub const NVML_LIBRARY: &str = "libnvidia-ml.so.1";
/// The MPS control binary.
pub const MPS_CONTROL_BINARY: &str = "nvidia-cuda-mps-control";

/// Library directories, relative to the root, in the order they are tried: Debian and
/// Ubuntu's multiarch directories, then Red Hat's and the generic ones.
pub const LIBRARY_DIRS: [&str; 8] = [
    "usr/lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "usr/lib64",
    "usr/lib",
    "lib/x86_64-linux-gnu",
    "lib/aarch64-linux-gnu",
    "lib64",
    "lib",
];

/// Binary directories, relative to the root, in the order they are tried.
pub const BINARY_DIRS: [&str; 4] = ["usr/bin", "usr/local/bin", "bin", "usr/sbin"];

/// The paths `file` may have inside a root, relative to it, in the order they are tried.
pub fn candidates(dirs: &[&str], file: &str) -> Vec<String> {
    dirs.iter().map(|d| format!("/{d}/{file}")).collect()
}

/// `inside` (a path inside the root, starting with `/`) as seen from where the root is
/// mounted.
pub fn join(root: &str, inside: &str) -> String {
    let root = root.trim_end_matches('/');
    format!("{root}{inside}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvml_is_looked_for_in_the_multiarch_directories_first() {
        let c = candidates(&LIBRARY_DIRS, NVML_LIBRARY);
        assert_eq!(c[0], "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1");
        assert!(c.contains(&"/usr/lib64/libnvidia-ml.so.1".to_owned()));
        assert_eq!(
            candidates(&BINARY_DIRS, MPS_CONTROL_BINARY)[0],
            "/usr/bin/nvidia-cuda-mps-control"
        );
    }

    #[test]
    fn a_path_inside_a_root_joins_without_doubling_the_slash() {
        assert_eq!(join("/", "/usr/bin/x"), "/usr/bin/x");
        assert_eq!(
            join("/driver-root/", "/usr/bin/x"),
            "/driver-root/usr/bin/x"
        );
    }
}
