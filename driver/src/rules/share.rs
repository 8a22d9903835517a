//! The share model: what a fractional GPU request means and the rules it must follow.
//!
//! A share comes either from a [`GpuShare`] opaque config (totals over the request's `count`
//! cards) or from Kubernetes-native `capacity.requests` (per card, as the API defines them).
//! Both become a [`ShareRequest`]; at allocation, [`ShareRequest::per_device`] turns it into the
//! exact [`PerDeviceShare`] of one card. Every broken rule is an [`Error::Share`] naming the
//! field, the value and the rule; nothing is rounded silently.

use std::collections::BTreeMap;

use crate::error::{Error, Result};
use crate::names;
use crate::rules::config::GpuShare;
use crate::rules::quantity::Quantity;

/// Bytes in one GiB, the unit of share memory.
pub const GIB: u64 = 1 << 30;
/// Compute is granted in steps of this many percent.
pub const COMPUTE_STEP: i64 = 5;

/// How a request sizes its memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryAsk {
    /// Exactly this many bytes on every card.
    Bytes(u64),
    /// This percent (1..=100) of every card's memory.
    Percent(u8),
}

/// A validated share request, already split per card.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShareRequest {
    /// Memory on each card.
    pub memory: MemoryAsk,
    /// Compute percent on each card; 0 means not isolated.
    pub compute: i64,
    /// Number of distinct cards the share spreads over.
    pub cards: u32,
}

/// The exact share one device gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PerDeviceShare {
    /// Memory limit in bytes.
    pub memory_bytes: u64,
    /// Compute limit in percent; 0 means not isolated.
    pub compute_percent: i64,
}

fn share_err(field: &str, message: impl Into<String>) -> Error {
    Error::Share {
        field: field.to_owned(),
        message: message.into(),
    }
}

fn gib_text(bytes: u64) -> String {
    Quantity::from_bytes(bytes).to_string()
}

/// `percent` of `device_memory`, rounded down to whole MiB (the unit CUDA limits are set in).
pub fn percent_bytes(device_memory: u64, percent: u8) -> u64 {
    let mib = 1_u64 << 20;
    let bytes = u128::from(device_memory) * u128::from(percent) / 100;
    let bytes = u64::try_from(bytes).unwrap_or(u64::MAX);
    bytes - bytes % mib
}

/// Checks per-card compute: 5..=100 in steps of 5.
fn check_card_compute(field: &str, per_card: i64, detail: &str) -> Result<()> {
    if !(COMPUTE_STEP..=100).contains(&per_card) {
        return Err(share_err(
            field,
            format!("{detail}compute {per_card} per card is outside 5..100"),
        ));
    }
    if per_card % COMPUTE_STEP != 0 {
        return Err(share_err(
            field,
            format!("{detail}compute {per_card} per card is not a multiple of {COMPUTE_STEP}"),
        ));
    }
    Ok(())
}

/// Memory as a whole, non-negative number of bytes.
fn memory_bytes(field: &str, memory: Quantity) -> Result<u64> {
    if memory.is_negative() {
        return Err(share_err(field, format!("memory {memory} is negative")));
    }
    memory
        .as_units()
        .and_then(|b| u64::try_from(b).ok())
        .ok_or_else(|| {
            share_err(
                field,
                format!("memory {memory} is not a whole number of bytes"),
            )
        })
}

/// What `capacity.requests` come to under the request policies of Tessera's shared GPUs
/// (memory: default 1Gi, minimum 1Gi, step 1Gi; compute: default 0, 0..100, step 5), and how
/// they were rounded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoundedRequests {
    /// Memory per card, in bytes.
    pub memory_bytes: u64,
    /// Compute per card, in percent (0: not isolated).
    pub compute: i64,
    /// One line per capacity whose value differs from what was asked, e.g.
    /// `memory 1500Mi rounds up to 2Gi (steps of 1Gi)`.
    pub notes: Vec<String>,
}

/// Applies the request policies of Tessera's shared GPUs to `capacity.requests`, as
/// kube-scheduler does (upstream's `roundUpRange` and default filling): below the minimum
/// rises to it, between steps rounds up to the next step from the minimum, absent takes the
/// default. `field` prefixes error fields. Errors: a negative request and compute above 100
/// (more than any GPU of Tessera holds). Other capacities are left to the device's own policy.
pub fn round_capacity_requests(
    requests: &BTreeMap<String, Quantity>,
    field: &str,
) -> Result<RoundedRequests> {
    let mut notes = Vec::new();
    let mut memory = None;
    let mut compute = None;
    for (name, value) in requests {
        let short = name
            .strip_prefix(&format!("{}/", names::DEFAULT_DRIVER_NAME))
            .unwrap_or(name);
        let f = format!("{field}.{name}");
        if value.is_negative() {
            return Err(share_err(
                &f,
                format!("{short} {value} is negative; capacity requests must be at least 0"),
            ));
        }
        match short {
            names::CAP_MEMORY => memory = Some((*value, f)),
            names::CAP_COMPUTE => compute = Some((*value, f)),
            // Any other capacity a GPU declares is booked by its own request policy, as
            // kube-scheduler books it; one it does not declare makes the GPU not fit.
            _ => {}
        }
    }
    let gib = i64::try_from(GIB).unwrap_or(i64::MAX);
    let memory_bytes = match memory {
        None => {
            notes.push("memory not requested: the policy default 1Gi applies".to_owned());
            GIB
        }
        Some((value, f)) => {
            let out_of_range = || share_err(&f, format!("memory {value} is out of range"));
            if value > Quantity::from_units(i64::MAX) {
                return Err(out_of_range());
            }
            let asked = value.ceil_units();
            let rounded = round_up(asked, gib, gib).ok_or_else(out_of_range)?;
            let bytes = u64::try_from(rounded).map_err(|_| out_of_range())?;
            if Quantity::from_bytes(bytes) != value {
                let why = if asked < gib {
                    "the minimum"
                } else {
                    "the next step of 1Gi"
                };
                notes.push(format!(
                    "memory {value} rounds up to {} ({why})",
                    Quantity::from_bytes(bytes)
                ));
            }
            bytes
        }
    };
    let compute = match compute {
        None => 0,
        Some((value, f)) => {
            let rounded = round_up(value.ceil_units(), 0, COMPUTE_STEP).unwrap_or(i64::MAX);
            if value > Quantity::from_units(100) || rounded > 100 {
                return Err(share_err(
                    &f,
                    format!("compute {value} is above the policy's maximum of 100"),
                ));
            }
            if Quantity::from_units(rounded) != value {
                notes.push(format!(
                    "compute {value} rounds up to {rounded} (steps of {COMPUTE_STEP})"
                ));
            }
            rounded
        }
    };
    Ok(RoundedRequests {
        memory_bytes,
        compute,
        notes,
    })
}

/// `value` raised to `min`, then rounded up to `min` plus a whole number of `step`s; `None`
/// when that does not fit in an `i64`.
fn round_up(value: i64, min: i64, step: i64) -> Option<i64> {
    if value <= min {
        return Some(min);
    }
    let above = value.checked_sub(min)?;
    let steps = above / step + i64::from(above % step != 0);
    min.checked_add(steps.checked_mul(step)?)
}

impl ShareRequest {
    /// Validates a [`GpuShare`] for a request of `count` cards. `field` prefixes error fields
    /// (e.g. `spec.devices.config[0].opaque.parameters`).
    pub fn from_gpu_share(share: &GpuShare, count: u32, field: &str) -> Result<Self> {
        let f = |name: &str| format!("{field}.{name}");
        if count == 0 {
            return Err(share_err(&f("count"), "a share needs at least one card"));
        }
        let cards = i64::from(count);
        let over = if count > 1 {
            format!(" over {count} cards")
        } else {
            String::new()
        };
        let memory = match (share.memory, share.memory_percent) {
            (Some(_), Some(_)) => {
                return Err(share_err(
                    &f("memoryPercent"),
                    "memory and memoryPercent are exclusive: set one",
                ));
            }
            (None, None) => {
                return Err(share_err(field, "a share needs memory or memoryPercent"));
            }
            (None, Some(pct)) => {
                if !(1..=100).contains(&pct) {
                    return Err(share_err(
                        &f("memoryPercent"),
                        format!("memoryPercent {pct} is outside 1..100"),
                    ));
                }
                MemoryAsk::Percent(
                    u8::try_from(pct)
                        .map_err(|_| share_err(&f("memoryPercent"), "out of range"))?,
                )
            }
            (Some(q), None) => {
                let bytes = memory_bytes(&f("memory"), q)?;
                if bytes % GIB != 0 {
                    return Err(share_err(
                        &f("memory"),
                        format!("memory {q} is not a whole number of GiB"),
                    ));
                }
                let per_card = bytes / u64::from(count);
                if bytes % u64::from(count) != 0 || per_card % GIB != 0 {
                    return Err(share_err(
                        &f("memory"),
                        format!("memory {q}{over} is not a whole number of GiB per card"),
                    ));
                }
                if per_card < GIB {
                    return Err(share_err(
                        &f("memory"),
                        format!("memory {q}{over} is less than the minimum of 1Gi per card"),
                    ));
                }
                MemoryAsk::Bytes(per_card)
            }
        };
        let compute = match share.compute {
            None => 0,
            Some(c) => {
                if c < 0 {
                    return Err(share_err(&f("compute"), format!("compute {c} is negative")));
                }
                if c % cards != 0 {
                    return Err(share_err(
                        &f("compute"),
                        format!("compute {c}{over} is not a whole number of percent per card"),
                    ));
                }
                let per_card = c / cards;
                check_card_compute(
                    &f("compute"),
                    per_card,
                    &if count > 1 {
                        format!("compute {c}{over}: ")
                    } else {
                        String::new()
                    },
                )?;
                per_card
            }
        };
        Ok(Self {
            memory,
            compute,
            cards: count,
        })
    }

    /// Sizes a share from Kubernetes-native `capacity.requests` (per card, as the DRA API
    /// defines them) for a request of `count` cards, exactly as kube-scheduler applies the
    /// request policies Tessera's shared GPUs publish (see [`round_capacity_requests`]): a
    /// request between steps rounds up, one below the minimum rises to it, an absent one takes
    /// the default. Refused: a negative request and compute above the policy's maximum. A
    /// request for another capacity is booked where a device declares it; a device that does
    /// not declare it does not fit (a typo never means "no limit").
    pub fn from_capacity_requests(
        requests: &BTreeMap<String, Quantity>,
        count: u32,
        field: &str,
    ) -> Result<Self> {
        let rounded = round_capacity_requests(requests, field)?;
        if count == 0 {
            return Err(share_err(field, "a share needs at least one card"));
        }
        Ok(Self {
            memory: MemoryAsk::Bytes(rounded.memory_bytes),
            compute: rounded.compute,
            cards: count,
        })
    }

    /// The exact share of one card with `device_memory` bytes. Percent shares are converted
    /// here, rounded down to whole MiB (the unit CUDA limits are set in), and the result is
    /// recorded in the allocation so the node enforces exactly this number.
    pub fn per_device(&self, device_memory: u64) -> Result<PerDeviceShare> {
        let memory_bytes = match self.memory {
            MemoryAsk::Bytes(b) => b,
            MemoryAsk::Percent(p) => {
                let bytes = percent_bytes(device_memory, p);
                if bytes == 0 {
                    return Err(share_err(
                        "memoryPercent",
                        format!("{p}% of {} is less than 1Mi", gib_text(device_memory)),
                    ));
                }
                bytes
            }
        };
        if memory_bytes > device_memory {
            return Err(share_err(
                "memory",
                format!(
                    "a share of {} exceeds one card of {}",
                    gib_text(memory_bytes),
                    gib_text(device_memory)
                ),
            ));
        }
        Ok(PerDeviceShare {
            memory_bytes,
            compute_percent: self.compute,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn share(memory: Option<&str>, pct: Option<i64>, compute: Option<i64>) -> GpuShare {
        GpuShare {
            api_version: names::CONFIG_API_VERSION.into(),
            kind: names::GPU_SHARE_KIND.into(),
            memory: memory.map(|m| Quantity::parse(m).unwrap()),
            memory_percent: pct,
            compute,
            tier: None,
            patience: None,
        }
    }

    fn err(s: &GpuShare, count: u32) -> String {
        ShareRequest::from_gpu_share(s, count, "cfg")
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn splits_totals_over_cards() {
        let r =
            ShareRequest::from_gpu_share(&share(Some("20Gi"), None, Some(100)), 2, "cfg").unwrap();
        assert_eq!(r.memory, MemoryAsk::Bytes(10 * GIB));
        assert_eq!(r.compute, 50);
        assert_eq!(
            r.per_device(80 * GIB).unwrap(),
            PerDeviceShare {
                memory_bytes: 10 * GIB,
                compute_percent: 50
            }
        );
    }

    #[test]
    fn names_the_rule_each_share_breaks() {
        assert!(
            err(&share(Some("10Gi"), None, None), 3)
                .contains("memory 10Gi over 3 cards is not a whole number of GiB per card")
        );
        assert!(err(&share(Some("512Mi"), None, None), 1).contains("not a whole number of GiB"));
        assert!(err(&share(Some("1Gi"), None, Some(7)), 1).contains("not a multiple of 5"));
        assert!(err(&share(Some("1Gi"), None, Some(105)), 1).contains("outside 5..100"));
        assert!(err(&share(None, None, Some(50)), 1).contains("needs memory"));
        assert!(err(&share(Some("1Gi"), Some(10), None), 1).contains("exclusive"));
        assert!(err(&share(None, Some(0), None), 1).contains("outside 1..100"));
        assert!(err(&share(Some("-5Gi"), None, None), 1).contains("negative"));
        assert!(err(&share(Some("2Gi"), None, Some(15)), 2).contains("compute 15 over 2 cards"));
        assert!(err(&share(Some("2Gi"), None, Some(6)), 2).contains("outside 5..100"));
    }

    #[test]
    fn converts_percent_per_model_and_refuses_oversized_shares() {
        let r = ShareRequest::from_gpu_share(&share(None, Some(25), None), 1, "cfg").unwrap();
        assert_eq!(r.per_device(80 * GIB).unwrap().memory_bytes, 20 * GIB);
        assert_eq!(r.per_device(15 * GIB).unwrap().memory_bytes, 3840 << 20);
        let big = ShareRequest::from_gpu_share(&share(Some("20Gi"), None, None), 1, "cfg").unwrap();
        assert!(
            big.per_device(16 * GIB)
                .unwrap_err()
                .to_string()
                .contains("exceeds one card")
        );
    }

    #[test]
    fn native_requests_are_rounded_as_kube_scheduler_rounds_them() {
        let q = |s: &str| Quantity::parse(s).unwrap();
        let round = |pairs: &[(&str, &str)]| {
            let req: BTreeMap<String, Quantity> =
                pairs.iter().map(|(k, v)| ((*k).to_owned(), q(v))).collect();
            round_capacity_requests(&req, "c")
        };
        let r = round(&[("memory", "1500Mi"), ("compute", "7")]).unwrap();
        assert_eq!((r.memory_bytes, r.compute), (2 * GIB, 10));
        assert_eq!(
            r.notes,
            [
                "memory 1500Mi rounds up to 2Gi (the next step of 1Gi)",
                "compute 7 rounds up to 10 (steps of 5)"
            ]
        );
        let r = round(&[("memory", "100Mi")]).unwrap();
        assert_eq!((r.memory_bytes, r.compute), (GIB, 0));
        assert_eq!(r.notes, ["memory 100Mi rounds up to 1Gi (the minimum)"]);
        let r = round(&[("memory", "10Gi"), ("compute", "50")]).unwrap();
        assert!(r.notes.is_empty());
        let r = round(&[("compute", "50")]).unwrap();
        assert_eq!(r.memory_bytes, GIB);
        assert!(
            round(&[("compute", "101")])
                .unwrap_err()
                .to_string()
                .contains("maximum of 100")
        );
        assert!(
            round(&[("memory", "-1Gi")])
                .unwrap_err()
                .to_string()
                .contains("negative")
        );
    }

    #[test]
    fn validates_native_capacity_requests() {
        let mut req = BTreeMap::new();
        req.insert("memory".to_owned(), Quantity::parse("10Gi").unwrap());
        req.insert("compute".to_owned(), Quantity::parse("50").unwrap());
        let r = ShareRequest::from_capacity_requests(&req, 1, "capacity.requests").unwrap();
        assert_eq!(r.compute, 50);
        req.insert("memory".to_owned(), Quantity::parse("-5Gi").unwrap());
        assert!(
            ShareRequest::from_capacity_requests(&req, 1, "c")
                .unwrap_err()
                .to_string()
                .contains("negative")
        );
        // Without memory, the policy default applies, as kube-scheduler fills it in.
        req.remove("memory");
        let r = ShareRequest::from_capacity_requests(&req, 1, "c").unwrap();
        assert_eq!(r.memory, MemoryAsk::Bytes(GIB));
    }
}
