//! Which Unix user a share claim's MPS daemon serves.
//!
//! NVIDIA documents that one MPS control daemon runs a server for one user at a time: a client
//! of another user is queued until every client of the running server has exited. One daemon
//! for every claim on a GPU set would make a pod of one user wait, at CUDA initialisation, for
//! the pods of another. So a node runs one daemon per (GPU set, user), and the user comes from
//! the pods the claim is reserved for (`status.reservedFor`), as kubelet starts them: the
//! `securityContext.runAsUser` of each container that uses the claim, or of its pod. The rule,
//! as one pure function ([`claim_user`]):
//!
//! * every container that uses the claim (init containers included) must have a user set, at
//!   container or pod level: without one the process runs as the image's `USER`, which the
//!   node cannot know ([`UserReason::Unknown`]);
//! * they must all name the same user ([`UserReason::Mixed`]): a claim's containers get one
//!   CDI spec, so one daemon;
//! * a pod in a user namespace (`hostUsers: false`) is refused ([`UserReason::UserNamespace`]):
//!   its processes run on the host as a uid kubelet maps, not as `runAsUser`, and MPS keys on
//!   the host uid;
//! * a claim that none of its pods' containers uses needs no user (`Ok(None)`);
//! * a claim whose reserved pods the node could not read is refused ([`UserReason::NoPod`]).
//!
//! A refusal is an error for that claim that names the pod, the container and what to set.

use std::collections::BTreeSet;
use std::fmt;

use k8s_openapi::api::core::v1::{Container, Pod};
use k8s_openapi::api::resource::v1::ResourceClaim;

use crate::node::accounting::pod_consumers;

/// Why the node cannot tell which user a claim's containers run as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UserReason {
    /// A container that uses the claim sets no `runAsUser`, nor does its pod.
    Unknown {
        /// The pod.
        pod: String,
        /// The container.
        container: String,
    },
    /// The pod runs in a user namespace (`hostUsers: false`).
    UserNamespace {
        /// The pod.
        pod: String,
    },
    /// The containers that use the claim run as different users.
    Mixed {
        /// Each `(pod, container, uid)`.
        users: Vec<(String, String, i64)>,
    },
    /// A `runAsUser` that is not a Unix uid.
    Invalid {
        /// The pod.
        pod: String,
        /// The container.
        container: String,
        /// The value.
        uid: i64,
    },
    /// None of the pods the claim is reserved for could be read.
    NoPod,
}

/// A claim the node cannot serve with one MPS daemon per user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserRefusal {
    /// `namespace/name` of the claim.
    pub claim: String,
    /// Why.
    pub reason: UserReason,
}

impl fmt::Display for UserRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "claim {}: ", self.claim)?;
        match &self.reason {
            UserReason::Unknown { pod, container } => write!(
                f,
                "pod {pod:?}, container {container:?} sets no securityContext.runAsUser (nor \
                 does the pod), so it runs as its image's user, which the node cannot know; set \
                 runAsUser"
            )?,
            UserReason::UserNamespace { pod } => write!(
                f,
                "pod {pod:?} runs in a user namespace (hostUsers: false), so its processes get \
                 a host uid the node cannot know; run MPS shares with hostUsers: true"
            )?,
            UserReason::Mixed { users } => {
                write!(f, "its containers run as different users (")?;
                for (i, (pod, container, uid)) in users.iter().enumerate() {
                    if i > 0 {
                        write!(f, ", ")?;
                    }
                    write!(f, "pod {pod:?} container {container:?}: {uid}")?;
                }
                write!(f, "); give them one runAsUser, or use one claim per user")?;
            }
            UserReason::Invalid {
                pod,
                container,
                uid,
            } => write!(
                f,
                "pod {pod:?}, container {container:?}: runAsUser {uid} is not a Unix uid"
            )?,
            UserReason::NoPod => write!(
                f,
                "none of the pods it is reserved for could be read, so the node cannot tell \
                 which user its containers run as"
            )?,
        }
        write!(
            f,
            " (an MPS daemon serves one Unix user at a time: the node runs one per GPU set and \
             user; docs/cdi.md, \"MPS with several users\")"
        )
    }
}

impl std::error::Error for UserRefusal {}

/// The names under which `pod` refers to `claim` in its containers' `resources.claims`: its
/// `spec.resourceClaims` entries that name the claim, directly or through the claim kubelet's
/// controller generated from a template (`status.resourceClaimStatuses`).
fn pod_claim_names(pod: &Pod, claim: &str) -> BTreeSet<String> {
    let generated = |entry: &str| {
        pod.status
            .iter()
            .flat_map(|s| s.resource_claim_statuses.iter().flatten())
            .any(|s| s.name == entry && s.resource_claim_name.as_deref() == Some(claim))
    };
    pod.spec
        .iter()
        .flat_map(|s| s.resource_claims.iter().flatten())
        .filter(|c| c.resource_claim_name.as_deref() == Some(claim) || generated(&c.name))
        .map(|c| c.name.clone())
        .collect()
}

fn uses(container: &Container, names: &BTreeSet<String>) -> bool {
    container
        .resources
        .iter()
        .flat_map(|r| r.claims.iter().flatten())
        .any(|c| names.contains(&c.name))
}

/// The Unix user the containers that use `claim` run as, from `pods` (the pods its
/// `status.reservedFor` names, as the node read them; a pod missing there is skipped, and a pod
/// whose UID is not the reserved one is another pod). `Ok(None)`: no container uses the claim.
pub fn claim_user(claim: &ResourceClaim, pods: &[Pod]) -> Result<Option<u32>, UserRefusal> {
    let name = claim.metadata.name.as_deref().unwrap_or_default();
    let refuse = |reason| UserRefusal {
        claim: format!(
            "{}/{name}",
            claim.metadata.namespace.as_deref().unwrap_or_default()
        ),
        reason,
    };
    let mut found = 0usize;
    let mut users: Vec<(String, String, i64)> = Vec::new();
    for consumer in pod_consumers(claim) {
        let Some(pod) = pods.iter().find(|p| {
            p.metadata.name.as_deref() == Some(consumer.name.as_str())
                && p.metadata.uid.as_deref() == Some(consumer.uid.as_str())
        }) else {
            continue;
        };
        found += 1;
        let Some(spec) = &pod.spec else {
            continue;
        };
        let names = pod_claim_names(pod, name);
        let containers = spec
            .init_containers
            .iter()
            .flatten()
            .chain(&spec.containers)
            .filter(|c| uses(c, &names));
        let pod_user = spec.security_context.as_ref().and_then(|s| s.run_as_user);
        for container in containers {
            if spec.host_users == Some(false) {
                return Err(refuse(UserReason::UserNamespace {
                    pod: consumer.name.clone(),
                }));
            }
            let user = container
                .security_context
                .as_ref()
                .and_then(|s| s.run_as_user)
                .or(pod_user);
            let Some(uid) = user else {
                return Err(refuse(UserReason::Unknown {
                    pod: consumer.name.clone(),
                    container: container.name.clone(),
                }));
            };
            users.push((consumer.name.clone(), container.name.clone(), uid));
        }
    }
    if found == 0 {
        return Err(refuse(UserReason::NoPod));
    }
    let distinct: BTreeSet<i64> = users.iter().map(|(_, _, uid)| *uid).collect();
    match distinct.into_iter().collect::<Vec<_>>().as_slice() {
        [] => Ok(None),
        [uid] => u32::try_from(*uid).map(Some).map_err(|_| {
            let (pod, container, uid) = users[0].clone();
            refuse(UserReason::Invalid {
                pod,
                container,
                uid,
            })
        }),
        _ => Err(refuse(UserReason::Mixed { users })),
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{
        PodResourceClaim, PodResourceClaimStatus, PodSecurityContext, PodSpec, PodStatus,
        ResourceRequirements, SecurityContext,
    };
    use k8s_openapi::api::resource::v1::{ResourceClaimConsumerReference, ResourceClaimStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;

    /// Claim `share` in `team`, reserved for `pods` (by name; UID `uid-<name>`).
    fn claim(pods: &[&str]) -> ResourceClaim {
        ResourceClaim {
            metadata: ObjectMeta {
                namespace: Some("team".to_owned()),
                name: Some("share".to_owned()),
                ..ObjectMeta::default()
            },
            status: Some(ResourceClaimStatus {
                reserved_for: Some(
                    pods.iter()
                        .map(|p| ResourceClaimConsumerReference {
                            resource: "pods".to_owned(),
                            name: (*p).to_owned(),
                            uid: format!("uid-{p}"),
                            api_group: None,
                        })
                        .collect(),
                ),
                ..ResourceClaimStatus::default()
            }),
            ..ResourceClaim::default()
        }
    }

    /// A container named `name`; when `uses`, it uses the pod's claim entry `gpu`.
    fn container(name: &str, uses: bool, run_as: Option<i64>) -> Container {
        Container {
            name: name.to_owned(),
            resources: uses.then(|| ResourceRequirements {
                claims: Some(vec![k8s_openapi::api::core::v1::ResourceClaim {
                    name: "gpu".to_owned(),
                    request: None,
                }]),
                ..ResourceRequirements::default()
            }),
            security_context: run_as.map(|uid| SecurityContext {
                run_as_user: Some(uid),
                ..SecurityContext::default()
            }),
            ..Container::default()
        }
    }

    /// Pod `name` whose entry `gpu` names claim `share`, running `containers`, with the pod's
    /// own `runAsUser`.
    fn pod(name: &str, run_as: Option<i64>, containers: Vec<Container>) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                uid: Some(format!("uid-{name}")),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec {
                containers,
                resource_claims: Some(vec![PodResourceClaim {
                    name: "gpu".to_owned(),
                    resource_claim_name: Some("share".to_owned()),
                    ..PodResourceClaim::default()
                }]),
                security_context: run_as.map(|uid| PodSecurityContext {
                    run_as_user: Some(uid),
                    ..PodSecurityContext::default()
                }),
                ..PodSpec::default()
            }),
            ..Pod::default()
        }
    }

    #[test]
    fn the_user_is_the_containers_run_as_user_or_else_the_pods() {
        let p = pod(
            "a",
            Some(1000),
            vec![
                container("main", true, None),
                container("side", true, Some(1000)),
            ],
        );
        assert_eq!(claim_user(&claim(&["a"]), &[p]), Ok(Some(1000)));
    }

    #[test]
    fn only_containers_that_use_the_claim_count() {
        let p = pod(
            "a",
            None,
            vec![
                container("main", true, Some(0)),
                container("proxy", false, None),
            ],
        );
        assert_eq!(claim_user(&claim(&["a"]), &[p]), Ok(Some(0)));
    }

    #[test]
    fn a_container_without_a_user_is_refused_by_name() {
        let p = pod("a", None, vec![container("main", true, None)]);
        let err = claim_user(&claim(&["a"]), &[p]).unwrap_err();
        assert_eq!(
            err.reason,
            UserReason::Unknown {
                pod: "a".to_owned(),
                container: "main".to_owned()
            }
        );
        let text = err.to_string();
        assert!(text.starts_with("claim team/share: pod \"a\""), "{text}");
        assert!(text.contains("set runAsUser"), "{text}");
    }

    #[test]
    fn pods_of_one_claim_with_different_users_are_refused() {
        let a = pod("a", Some(1000), vec![container("main", true, None)]);
        let b = pod("b", Some(2000), vec![container("main", true, None)]);
        let err = claim_user(&claim(&["a", "b"]), &[a, b]).unwrap_err();
        assert!(matches!(err.reason, UserReason::Mixed { .. }), "{err}");
        assert!(
            err.to_string()
                .contains("pod \"b\" container \"main\": 2000")
        );
    }

    #[test]
    fn a_pod_in_a_user_namespace_is_refused() {
        let mut p = pod("a", Some(0), vec![container("main", true, None)]);
        p.spec.as_mut().unwrap().host_users = Some(false);
        assert_eq!(
            claim_user(&claim(&["a"]), &[p]).unwrap_err().reason,
            UserReason::UserNamespace {
                pod: "a".to_owned()
            }
        );
    }

    #[test]
    fn an_init_container_that_uses_the_claim_counts() {
        let mut p = pod("a", Some(1000), vec![container("main", true, None)]);
        p.spec.as_mut().unwrap().init_containers = Some(vec![container("warm", true, Some(0))]);
        assert!(matches!(
            claim_user(&claim(&["a"]), &[p]).unwrap_err().reason,
            UserReason::Mixed { .. }
        ));
    }

    #[test]
    fn a_claim_from_a_template_is_found_through_the_pods_status() {
        let mut p = pod("a", Some(42), vec![container("main", true, None)]);
        let spec = p.spec.as_mut().unwrap();
        spec.resource_claims = Some(vec![PodResourceClaim {
            name: "gpu".to_owned(),
            resource_claim_template_name: Some("tmpl".to_owned()),
            ..PodResourceClaim::default()
        }]);
        p.status = Some(PodStatus {
            resource_claim_statuses: Some(vec![PodResourceClaimStatus {
                name: "gpu".to_owned(),
                resource_claim_name: Some("share".to_owned()),
            }]),
            ..PodStatus::default()
        });
        assert_eq!(claim_user(&claim(&["a"]), &[p]), Ok(Some(42)));
    }

    #[test]
    fn a_pod_that_is_not_the_reserved_one_or_is_missing_does_not_count() {
        let mut other = pod("a", Some(7), vec![container("main", true, None)]);
        other.metadata.uid = Some("uid-recreated".to_owned());
        assert_eq!(
            claim_user(&claim(&["a"]), &[other]).unwrap_err().reason,
            UserReason::NoPod
        );
        let unused = pod("a", None, vec![container("main", false, None)]);
        assert_eq!(claim_user(&claim(&["a", "gone"]), &[unused]), Ok(None));
    }

    #[test]
    fn a_negative_user_is_not_a_uid() {
        let p = pod("a", Some(-1), vec![container("main", true, None)]);
        assert!(matches!(
            claim_user(&claim(&["a"]), &[p]).unwrap_err().reason,
            UserReason::Invalid { uid: -1, .. }
        ));
    }
}
