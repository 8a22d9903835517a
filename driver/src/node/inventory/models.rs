//! The built-in table of GPU models a fake inventory can name.
//!
//! Figures are what NVML reports on a real card: `memory_bytes` is NVML's usable total (a little
//! less than the marketing size), `multiprocessors` the SM count, and the MIG profiles are the
//! GPU-instance profiles with their memory, compute-slice count and valid start placements.
//! Placements are counted in memory slices (8 per GPU, 4 on A30), as `nvidia-smi mig -lgipp`
//! prints them.

const MIB: u64 = 1024 * 1024;

/// One MIG GPU-instance profile of a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigProfile {
    /// Profile name as NVIDIA writes it, e.g. `1g.10gb`.
    pub name: &'static str,
    /// Usable memory of an instance, in bytes.
    pub memory_bytes: u64,
    /// Compute slices (the `g` count) the instance takes.
    pub compute_slices: u32,
    /// Memory slices the instance occupies, starting at its placement.
    pub memory_slices: u32,
    /// Streaming multiprocessors of an instance.
    pub multiprocessors: u32,
    /// Valid start placements, in memory slices.
    pub placements: &'static [u32],
}

/// A GPU model Tessera knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuModel {
    /// Short, lower-case id, e.g. `a100-80g`; the value of the `model` attribute.
    pub id: &'static str,
    /// Other names accepted when looking the model up (matched case-insensitively).
    pub aliases: &'static [&'static str],
    /// Product name as NVML reports it.
    pub product_name: &'static str,
    /// Brand as NVML reports it (`Tesla`, `NVIDIA`, `GeForce`).
    pub brand: &'static str,
    /// Architecture, e.g. `Ampere`.
    pub architecture: &'static str,
    /// CUDA compute capability, `major.minor`.
    pub compute_capability: &'static str,
    /// Usable memory as NVML reports it, in bytes.
    pub memory_bytes: u64,
    /// Streaming multiprocessors.
    pub multiprocessors: u32,
    /// Compute slices of the whole GPU in MIG mode (7 on A100/H100/H200, 4 on A30); 0 when
    /// the model is not MIG-capable.
    pub mig_compute_slices: u32,
    /// Memory slices of the whole GPU in MIG mode (8; 4 on A30).
    pub mig_memory_slices: u32,
    /// MIG GPU-instance profiles; empty when the model is not MIG-capable.
    pub mig_profiles: &'static [MigProfile],
}

impl GpuModel {
    /// Whether the model can be split into MIG instances.
    pub fn mig_capable(&self) -> bool {
        !self.mig_profiles.is_empty()
    }

    /// The MIG profile of this model with the given name (exact, case-insensitive).
    pub fn mig_profile(&self, name: &str) -> Option<&'static MigProfile> {
        self.mig_profiles
            .iter()
            .find(|p| p.name.eq_ignore_ascii_case(name))
    }
}

const fn mig(
    name: &'static str,
    memory_mib: u64,
    compute_slices: u32,
    memory_slices: u32,
    multiprocessors: u32,
    placements: &'static [u32],
) -> MigProfile {
    MigProfile {
        name,
        memory_bytes: memory_mib * MIB,
        compute_slices,
        memory_slices,
        multiprocessors,
        placements,
    }
}

/// The six profiles of a GPU cut into seven compute and eight memory slices (A100, H100,
/// H200), from each profile's name, memory (MiB) and multiprocessors: the slices and the
/// placements are the layout's, the same on each of these models.
const fn seven_slices(profiles: [(&'static str, u64, u32); 6]) -> [MigProfile; 6] {
    const LAYOUT: [(u32, u32, &[u32]); 6] = [
        (1, 1, &[0, 1, 2, 3, 4, 5, 6]),
        (1, 2, &[0, 2, 4, 6]),
        (2, 2, &[0, 2, 4]),
        (3, 4, &[0, 4]),
        (4, 4, &[0]),
        (7, 8, &[0]),
    ];
    let mut out = [mig("", 0, 0, 0, 0, &[]); 6];
    let mut i = 0;
    while i < 6 {
        let (name, memory_mib, multiprocessors) = profiles[i];
        let (compute_slices, memory_slices, placements) = LAYOUT[i];
        out[i] = mig(
            name,
            memory_mib,
            compute_slices,
            memory_slices,
            multiprocessors,
            placements,
        );
        i += 1;
    }
    out
}

const A100_40G_MIG: &[MigProfile] = &seven_slices([
    ("1g.5gb", 4864, 14),
    ("1g.10gb", 9856, 14),
    ("2g.10gb", 9856, 28),
    ("3g.20gb", 19968, 42),
    ("4g.20gb", 19968, 56),
    ("7g.40gb", 40192, 98),
]);

const A100_80G_MIG: &[MigProfile] = &seven_slices([
    ("1g.10gb", 9728, 14),
    ("1g.20gb", 19968, 14),
    ("2g.20gb", 19968, 28),
    ("3g.40gb", 40192, 42),
    ("4g.40gb", 40192, 56),
    ("7g.80gb", 80384, 98),
]);

const A30_MIG: &[MigProfile] = &[
    mig("1g.6gb", 5836, 1, 1, 14, &[0, 1, 2, 3]),
    mig("2g.12gb", 11788, 2, 2, 28, &[0, 2]),
    mig("4g.24gb", 23692, 4, 4, 56, &[0]),
];

const H100_80G_MIG: &[MigProfile] = &seven_slices([
    ("1g.10gb", 9984, 16),
    ("1g.20gb", 19968, 26),
    ("2g.20gb", 19968, 32),
    ("3g.40gb", 40448, 60),
    ("4g.40gb", 40448, 64),
    ("7g.80gb", 80896, 132),
]);

const H200_141G_MIG: &[MigProfile] = &seven_slices([
    ("1g.18gb", 16384, 16),
    ("1g.35gb", 32768, 26),
    ("2g.35gb", 32768, 32),
    ("3g.71gb", 69632, 60),
    ("4g.71gb", 69632, 64),
    ("7g.141gb", 140_288, 132),
]);

#[allow(
    clippy::too_many_arguments,
    reason = "a table row; named by position in MODELS"
)]
const fn model(
    id: &'static str,
    aliases: &'static [&'static str],
    product_name: &'static str,
    brand: &'static str,
    architecture: &'static str,
    compute_capability: &'static str,
    memory_mib: u64,
    multiprocessors: u32,
    mig_profiles: &'static [MigProfile],
) -> GpuModel {
    let (mig_compute_slices, mig_memory_slices) = if mig_profiles.is_empty() {
        (0, 0)
    } else {
        // The largest profile spans the whole GPU.
        let whole = mig_profiles[mig_profiles.len() - 1];
        (whole.compute_slices, whole.memory_slices)
    };
    GpuModel {
        id,
        aliases,
        product_name,
        brand,
        architecture,
        compute_capability,
        memory_bytes: memory_mib * MIB,
        multiprocessors,
        mig_compute_slices,
        mig_memory_slices,
        mig_profiles,
    }
}

/// Every model Tessera knows, in a stable order.
///
/// The H20 variants and the A800/H800 carry the figures of their better-known siblings where
/// NVIDIA publishes none per product: A800 as A100 80 GB, H800 as H100 80 GB (MIG profiles
/// included); the MIG profiles of the H20 family are not modelled. On a real node the plugin
/// publishes what NVML reports, whatever this table says.
///
/// The Alibaba GPU trace's undisclosed codes `G1`, `G2` and `G3` are aliases of stand-in
/// products (A10, A100 40 GB and A100 80 GB): the trace only needs them distinct and
/// plausibly sized; see docs/inventory.md.
pub static MODELS: &[GpuModel] = &[
    model(
        "p100-16g",
        &["p100", "Tesla P100"],
        "Tesla P100-PCIE-16GB",
        "Tesla",
        "Pascal",
        "6.0",
        16280,
        56,
        &[],
    ),
    model(
        "v100-16g",
        &["v100", "V100M16", "Tesla V100"],
        "Tesla V100-SXM2-16GB",
        "Tesla",
        "Volta",
        "7.0",
        16160,
        80,
        &[],
    ),
    model(
        "v100-32g",
        &["V100M32"],
        "Tesla V100-SXM2-32GB",
        "Tesla",
        "Volta",
        "7.0",
        32510,
        80,
        &[],
    ),
    model(
        "t4-16g",
        &["t4"],
        "Tesla T4",
        "Tesla",
        "Turing",
        "7.5",
        15360,
        40,
        &[],
    ),
    model(
        "a10-24g",
        &["a10", "G1"],
        "NVIDIA A10",
        "NVIDIA",
        "Ampere",
        "8.6",
        23028,
        72,
        &[],
    ),
    model(
        "a30-24g",
        &["a30"],
        "NVIDIA A30",
        "NVIDIA",
        "Ampere",
        "8.0",
        24576,
        56,
        A30_MIG,
    ),
    model(
        "a100-40g",
        &["a100-40gb", "G2"],
        "NVIDIA A100-SXM4-40GB",
        "NVIDIA",
        "Ampere",
        "8.0",
        40960,
        108,
        A100_40G_MIG,
    ),
    model(
        "a100-80g",
        &["a100", "a100-80gb", "G3"],
        "NVIDIA A100-SXM4-80GB",
        "NVIDIA",
        "Ampere",
        "8.0",
        81920,
        108,
        A100_80G_MIG,
    ),
    model(
        "a800-80g",
        &["a800", "a800-80gb", "NVIDIA A800 80GB PCIe"],
        "NVIDIA A800-SXM4-80GB",
        "NVIDIA",
        "Ampere",
        "8.0",
        81920,
        108,
        A100_80G_MIG,
    ),
    model(
        "h100-80g",
        &["h100", "h100-80gb"],
        "NVIDIA H100 80GB HBM3",
        "NVIDIA",
        "Hopper",
        "9.0",
        81559,
        132,
        H100_80G_MIG,
    ),
    model(
        "h800-80g",
        &["h800", "h800-80gb", "NVIDIA H800 PCIe"],
        "NVIDIA H800",
        "NVIDIA",
        "Hopper",
        "9.0",
        81559,
        132,
        H100_80G_MIG,
    ),
    model(
        "h20-96g",
        &["h20", "h20-96gb"],
        "NVIDIA H20",
        "NVIDIA",
        "Hopper",
        "9.0",
        97871,
        78,
        &[],
    ),
    model(
        "h20-141g",
        &["h20-141gb"],
        "NVIDIA H20 141GB HBM3e",
        "NVIDIA",
        "Hopper",
        "9.0",
        143_771,
        78,
        &[],
    ),
    model(
        "h20z-141g",
        &["h20z", "h20z-141gb"],
        "NVIDIA H20Z",
        "NVIDIA",
        "Hopper",
        "9.0",
        143_771,
        78,
        &[],
    ),
    model(
        "h200-141g",
        &["h200", "h200-141gb"],
        "NVIDIA H200",
        "NVIDIA",
        "Hopper",
        "9.0",
        143_771,
        132,
        H200_141G_MIG,
    ),
    model(
        "l20-48g",
        &["l20"],
        "NVIDIA L20",
        "NVIDIA",
        "Ada Lovelace",
        "8.9",
        46068,
        92,
        &[],
    ),
    model(
        "rtx-3090",
        &["3090", "rtx3090", "rtx-3090-24g"],
        "NVIDIA GeForce RTX 3090",
        "GeForce",
        "Ampere",
        "8.6",
        24576,
        82,
        &[],
    ),
    model(
        "rtx-4090",
        &["4090", "rtx4090", "rtx-4090-24g"],
        "NVIDIA GeForce RTX 4090",
        "GeForce",
        "Ada Lovelace",
        "8.9",
        24564,
        128,
        &[],
    ),
];

/// Looks a model up by id, alias or product name, case-insensitively.
pub fn lookup(name: &str) -> Option<&'static GpuModel> {
    let name = name.trim();
    MODELS.iter().find(|m| {
        m.id.eq_ignore_ascii_case(name)
            || m.product_name.eq_ignore_ascii_case(name)
            || m.aliases.iter().any(|a| a.eq_ignore_ascii_case(name))
    })
}

/// The ids of every known model, comma-separated, for error messages.
pub fn known_ids() -> String {
    MODELS.iter().map(|m| m.id).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_resolves_to_one_model() {
        let mut seen = std::collections::BTreeSet::new();
        for m in MODELS {
            for name in std::iter::once(m.id)
                .chain(std::iter::once(m.product_name))
                .chain(m.aliases.iter().copied())
            {
                assert!(seen.insert(name.to_ascii_lowercase()), "{name} twice");
                assert_eq!(lookup(name).map(|f| f.id), Some(m.id));
            }
        }
    }

    #[test]
    fn trace_models_are_known() {
        for code in ["G1", "G2", "G3", "T4", "P100", "V100M16", "V100M32", "A10"] {
            assert!(lookup(code).is_some(), "{code}");
        }
        assert_eq!(lookup("v100m32").map(|m| m.id), Some("v100-32g"));
    }

    #[test]
    fn mig_profiles_fit_their_gpu() {
        for m in MODELS.iter().filter(|m| m.mig_capable()) {
            for p in m.mig_profiles {
                assert!(
                    p.compute_slices <= m.mig_compute_slices,
                    "{} {}",
                    m.id,
                    p.name
                );
                assert!(p.memory_bytes <= m.memory_bytes, "{} {}", m.id, p.name);
                for &start in p.placements {
                    assert!(start + p.memory_slices <= m.mig_memory_slices);
                }
            }
        }
    }
}
