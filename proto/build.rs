//! Compiles the kubelet APIs in `proto/` with protox, so no system `protoc` is needed.

use std::error::Error;

const FILES: [&str; 4] = [
    "pluginregistration/v1/api.proto",
    "dra/v1/api.proto",
    "dra/v1beta1/api.proto",
    "dra-health/v1alpha1/api.proto",
];

fn main() -> Result<(), Box<dyn Error>> {
    let fds = protox::compile(FILES, ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;
    for file in FILES {
        println!("cargo:rerun-if-changed=proto/{file}");
    }
    Ok(())
}
