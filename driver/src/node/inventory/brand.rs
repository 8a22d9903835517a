//! A GPU's `brand` attribute: one spelling for each NVML brand, whoever reports it.
//!
//! NVML reports a brand as a number (`nvmlBrandType_t`). The NVML backend and the fake
//! inventory's model table must publish the same text for the same brand, or a selector
//! tested on fake nodes misses real GPUs (an H200 was published as `Nvidia` by NVML and as
//! `NVIDIA` by the fake inventory). The spelling is the brand as NVIDIA writes it in
//! product names and `nvidia-smi -q` ("Product Brand").

/// The published spelling of NVML brand `code` (`nvmlBrandType_t`); `Unknown` for a code
/// this table does not know (a newer driver's brand).
pub fn brand_name(code: u32) -> &'static str {
    match code {
        1 => "Quadro",
        2 => "Tesla",
        3 => "NVS",
        4 => "GRID",
        5 => "GeForce",
        6 => "Titan",
        7 => "NVIDIA Virtual Applications",
        8 => "NVIDIA Virtual PC",
        9 => "NVIDIA Virtual Compute Server",
        10 => "NVIDIA RTX Virtual Workstation",
        11 => "NVIDIA Cloud Gaming",
        12 => "Quadro RTX",
        13 => "NVIDIA RTX",
        14 => "NVIDIA",
        15 => "GeForce RTX",
        16 => "TITAN RTX",
        _ => "Unknown",
    }
}

/// Every spelling [`brand_name`] gives, known codes first.
pub fn brand_names() -> impl Iterator<Item = &'static str> {
    (0..=16).map(brand_name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_nvidia_brand_is_spelled_as_nvidia_writes_it() {
        // NVML_BRAND_NVIDIA (14): H100, H200, A100 and their kin.
        assert_eq!(brand_name(14), "NVIDIA");
        assert_eq!(brand_name(2), "Tesla");
        assert_eq!(brand_name(5), "GeForce");
        assert_eq!(brand_name(99), "Unknown");
    }

    #[test]
    fn every_model_of_the_fake_inventory_has_a_brand_nvml_can_report() {
        let known: Vec<&str> = brand_names().collect();
        for model in super::super::models::MODELS {
            assert!(
                known.contains(&model.brand),
                "{}: brand {:?} is not one NVML reports",
                model.id,
                model.brand
            );
        }
    }
}
