//! Why claims could not be placed: structured, countable, and readable.

use std::fmt;

/// How the devices a request could reach fared, summed over the candidate nodes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceCounts {
    /// Devices reachable from the candidate nodes.
    pub considered: u32,
    /// Rejected by the class's selectors.
    pub class_mismatch: u32,
    /// Matched the class but not the request's selectors.
    pub selector_mismatch: u32,
    /// Not a shared GPU, for a share request.
    pub not_shared: u32,
    /// Carrying a taint the request does not tolerate.
    pub tainted: u32,
    /// Held by other claims.
    pub in_use: u32,
    /// Without enough free capacity (memory, compute, or other consumable capacity).
    pub too_full: u32,
    /// Smaller in all than what the request asks of one device (a share larger than the card).
    pub too_small: u32,
    /// Declaring no capacity of a name the request asks for (kube-scheduler: "some requested
    /// capacity has not been defined").
    pub undeclared: u32,
    /// Their pool's shared counters are used up.
    pub counters_exhausted: u32,
    /// Could take the request on their own.
    pub fit: u32,
}

impl DeviceCounts {
    /// Devices that matched the class.
    pub fn matched_class(&self) -> u32 {
        self.considered - self.class_mismatch
    }
}

/// What a request looked for, in words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Wanted {
    /// Any free device its selectors accept.
    Device,
    /// A shared GPU with room for the share, e.g. `with 10Gi free and 50% compute`.
    Gpu {
        /// The room asked for, starting with `with`.
        room: String,
    },
    /// A device with room for native capacity requests, e.g. `with room for memory 10Gi`.
    Capacity {
        /// The room asked for, starting with `with`.
        room: String,
    },
}

/// The rule a claim failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FailureKind {
    /// Too few devices fit one request.
    NoDevice {
        /// What was looked for.
        wanted: Wanted,
        /// How many were needed.
        needed: u32,
    },
    /// Each request fits alone, but no node fits all of them (constraints, counts, other claims).
    NotTogether,
    /// No candidate node has enough devices, each fitting on its own, for a constraint.
    Constraint {
        /// The attribute, without its domain (e.g. `nvlinkDomain`).
        attribute: String,
        /// `distinctAttribute` (values must differ) rather than `matchAttribute`.
        distinct: bool,
        /// Devices the constrained requests need together.
        needed: u32,
        /// The most devices one node could offer under the constraint.
        best: u32,
    },
    /// No candidate node was given or reachable.
    NoNodes,
    /// The claim is malformed or asks for something that cannot exist (a rule is named).
    Invalid(String),
    /// A CEL selector failed at runtime.
    CelRuntime(String),
    /// kube-scheduler's allocator returned an error on a candidate node (a selector's runtime
    /// error, "all devices" while a pool is being updated, ...): that aborts the pod's whole
    /// scheduling attempt, whatever other nodes offer, so nothing is placed and the pod is
    /// tried again later. Not a rule of the claim: the cluster may change.
    Aborted {
        /// The node whose search failed.
        node: String,
        /// kube-scheduler's error there.
        error: String,
    },
    /// The search exceeded its step budget.
    SearchLimit(u64),
    /// No candidate node fits; the allocator was asked not to work out why (simulations).
    Unexplained,
    /// No candidate node has the pod's CPU and memory free (where the caller tracks them).
    HostResources {
        /// Candidate nodes without room.
        nodes: u32,
    },
}

/// Why one claim could not be placed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimFailure {
    /// `namespace/name`.
    pub claim: String,
    /// The request the failure is about, if one.
    pub request: Option<String>,
    /// The failed rule.
    pub kind: FailureKind,
    /// Device counts for the request (zero when not applicable).
    pub counts: DeviceCounts,
    /// Extra context, e.g. pools that are being updated.
    pub notes: Vec<String>,
}

/// The claims of a pod could not be placed together; one entry per failed claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unsatisfiable {
    /// The failures, in claim order.
    pub failures: Vec<ClaimFailure>,
}

impl Unsatisfiable {
    /// One claim's failure (`request`: the request it concerns, if one), without counts.
    pub(super) fn single(claim: String, request: Option<String>, kind: FailureKind) -> Self {
        Self {
            failures: vec![ClaimFailure {
                claim,
                request,
                kind,
                counts: DeviceCounts::default(),
                notes: Vec::new(),
            }],
        }
    }
}

fn plural(n: u32, word: &str) -> String {
    if n == 1 {
        format!("{n} {word}")
    } else {
        format!("{n} {word}s")
    }
}

impl fmt::Display for ClaimFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "claim {}", self.claim)?;
        if let Some(r) = &self.request {
            write!(f, " request {r}")?;
        }
        let c = &self.counts;
        match &self.kind {
            FailureKind::NoDevice { wanted, needed } => {
                let noun = match (wanted, *needed) {
                    (Wanted::Device, 1) => {
                        write!(f, ": no free device that matches")?;
                        "device"
                    }
                    (Wanted::Device, n) => {
                        write!(f, ": needs {n} free devices that match, found {}", c.fit)?;
                        "device"
                    }
                    (Wanted::Gpu { room }, 1) => {
                        write!(f, ": no GPU {room}")?;
                        "GPU"
                    }
                    (Wanted::Gpu { room }, n) => {
                        write!(f, ": needs {n} distinct GPUs {room}, found {}", c.fit)?;
                        "GPU"
                    }
                    (Wanted::Capacity { room }, 1) => {
                        write!(f, ": no device {room}")?;
                        "device"
                    }
                    (Wanted::Capacity { room }, n) => {
                        write!(f, ": needs {n} devices {room}, found {}", c.fit)?;
                        "device"
                    }
                };
                write!(f, ": {} matched the class", plural(c.matched_class(), noun))?;
                for (n, what) in [
                    (c.selector_mismatch, "rejected by the request's selectors"),
                    (c.not_shared, "not shared"),
                    (c.in_use, "in use"),
                    (c.too_full, "too full"),
                    (c.too_small, "smaller than the share asked of one card"),
                    (c.undeclared, "without a capacity the request asks for"),
                    (c.tainted, "tainted"),
                    (c.counters_exhausted, "out of shared counters"),
                ] {
                    if n > 0 {
                        write!(f, ", {n} {what}")?;
                    }
                }
                if *needed == 1 && c.fit > 0 {
                    write!(f, ", {} free", c.fit)?;
                }
            }
            FailureKind::Constraint {
                attribute,
                distinct,
                needed,
                best,
            } => {
                if *distinct {
                    write!(f, ": no {needed} devices with distinct {attribute} values")?;
                } else {
                    write!(f, ": no {needed} devices share one {attribute}")?;
                }
                write!(f, " (at most {best} on one node)")?;
            }
            FailureKind::NotTogether => write!(
                f,
                ": no node fits all requests of the pod's claims together (constraints, counts or capacity): {} fit on their own",
                plural(c.fit, "device")
            )?,
            FailureKind::NoNodes => write!(f, ": no candidate node")?,
            FailureKind::Invalid(m) | FailureKind::CelRuntime(m) => write!(f, ": {m}")?,
            FailureKind::Aborted { node, error } => write!(
                f,
                ": the scheduling attempt is aborted by an error on node {node}, as \
                 kube-scheduler aborts it (the pod stays pending and is retried, not placed on \
                 another node): {error}"
            )?,
            FailureKind::SearchLimit(n) => {
                write!(f, ": unsatisfiable: search limit of {n} steps reached")?;
            }
            FailureKind::Unexplained => write!(f, ": no candidate node fits")?,
            FailureKind::HostResources { nodes } => write!(
                f,
                ": no node has the pod's CPU and memory free ({} without room)",
                plural(*nodes, "node")
            )?,
        }
        for n in &self.notes {
            write!(f, "; {n}")?;
        }
        Ok(())
    }
}

impl fmt::Display for Unsatisfiable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, failure) in self.failures.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{failure}")?;
        }
        Ok(())
    }
}

impl std::error::Error for Unsatisfiable {}

#[cfg(test)]
mod tests {
    use super::*;

    /// Request `gpus` of `claim` found no `needed` devices `wanted`, after `counts`.
    fn no_device(claim: &str, wanted: Wanted, needed: u32, counts: DeviceCounts) -> ClaimFailure {
        ClaimFailure {
            claim: claim.into(),
            request: Some("gpus".into()),
            kind: FailureKind::NoDevice { wanted, needed },
            counts,
            notes: vec![],
        }
    }

    #[test]
    fn reads_like_the_operator_would_say_it() {
        let wanted = Wanted::Gpu {
            room: "with 10Gi free".into(),
        };
        let counts = DeviceCounts {
            considered: 14,
            class_mismatch: 2,
            too_full: 9,
            tainted: 3,
            ..DeviceCounts::default()
        };
        let failure = no_device("default/train", wanted, 1, counts);
        assert_eq!(
            failure.to_string(),
            "claim default/train request gpus: no GPU with 10Gi free: 12 GPUs matched the class, 9 too full, 3 tainted"
        );
    }

    #[test]
    fn counts_say_what_was_needed_and_found() {
        let counts = DeviceCounts {
            considered: 8,
            in_use: 7,
            fit: 1,
            ..DeviceCounts::default()
        };
        let plain = no_device("default/big", Wanted::Device, 8, counts);
        assert_eq!(
            plain.to_string(),
            "claim default/big request gpus: needs 8 free devices that match, found 1: 8 devices matched the class, 7 in use"
        );
        let share = ClaimFailure {
            kind: FailureKind::NoDevice {
                wanted: Wanted::Gpu {
                    room: "with 1Gi free".into(),
                },
                needed: 3,
            },
            counts: DeviceCounts {
                considered: 2,
                fit: 2,
                ..DeviceCounts::default()
            },
            ..plain.clone()
        };
        assert_eq!(
            share.to_string(),
            "claim default/big request gpus: needs 3 distinct GPUs with 1Gi free, found 2: 2 GPUs matched the class"
        );
        let island = ClaimFailure {
            kind: FailureKind::Constraint {
                attribute: "nvlinkDomain".into(),
                distinct: false,
                needed: 8,
                best: 4,
            },
            ..plain
        };
        assert_eq!(
            island.to_string(),
            "claim default/big request gpus: no 8 devices share one nvlinkDomain (at most 4 on one node)"
        );
    }
}
