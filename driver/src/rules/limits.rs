//! The validation limits of resource.k8s.io/v1 objects (`ResourceSlices`, and the claim limits the
//! share rules also need), as the API server enforces them, so rendering and validation fail with a
//! clear error instead of producing an object the API server would reject.

/// `DeviceRequestsMaxSize` (= `AllocationResultsMaxSize`): the requests of one claim, and devices
/// one claim can be allocated.
pub const MAX_REQUESTS: usize = 32;
/// Devices per slice.
pub const MAX_DEVICES_PER_SLICE: usize = 128;
/// Devices per slice when any device of the slice has taints or consumes counters.
pub const MAX_DEVICES_PER_SLICE_WITH_TAINTS: usize = 64;
/// Attributes and capacities of one device, together.
pub const MAX_ATTRIBUTES_AND_CAPACITIES: usize = 32;
/// Length of the identifier part of an attribute or capacity name.
pub const MAX_ID_LENGTH: usize = 32;
/// Length of the domain part of a qualified name, and of a driver name.
pub const MAX_DOMAIN_LENGTH: usize = 63;
/// Length of a string or version attribute value.
pub const MAX_VALUE_LENGTH: usize = 64;
/// Taints of one device.
pub const MAX_TAINTS_PER_DEVICE: usize = 16;
/// Length of a DNS label (device names).
pub const MAX_DNS_LABEL: usize = 63;
/// Length of a DNS subdomain (object, node and pool names).
pub const MAX_DNS_SUBDOMAIN: usize = 253;

/// Length of an Event's `reportingInstance` (events.k8s.io/v1, also that of its `action` and
/// `reason`); an Event with a longer one is refused.
pub const MAX_REPORTING_INSTANCE: usize = 128;

/// Eight hex digits of a name-based hash of `text` (UUID v5 in Tessera's namespace): what a name
/// too long for its field keeps of its tail, so two long names that share a prefix stay apart.
pub fn name_hash(text: &str) -> String {
    let namespace = uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_DNS, b"gpu.tessera.dev");
    let mut hash = uuid::Uuid::new_v5(&namespace, text.as_bytes())
        .simple()
        .to_string();
    hash.truncate(8);
    hash
}

/// The `reportingInstance` of the Events a component reports on node `node`: the node's name
/// when it fits the field's 128 characters; a longer one (node names may have 253) is cut to a
/// prefix, `-`, and [`name_hash`] of the whole name, so the API server does not refuse every
/// Event of that node.
pub fn reporting_instance(node: &str) -> String {
    if node.len() <= MAX_REPORTING_INSTANCE {
        return node.to_owned();
    }
    let hash = name_hash(node);
    let mut keep = MAX_REPORTING_INSTANCE - hash.len() - 1;
    while !node.is_char_boundary(keep) {
        keep -= 1;
    }
    format!("{}-{hash}", &node[..keep])
}

/// The largest input file the binaries read: `tessera`'s input files, and the kubelet plugin's
/// checkpoint, boot id, `--fake-claims` and `--fake-inventory` files (`kubectl` sends objects
/// of at most 3 MiB each; this leaves room for thousands of them in one file).
pub const MAX_INPUT_BYTES: usize = 64 << 20;

/// A DNS label (RFC 1123): lower-case letters, digits and '-', alphanumeric at both ends.
pub(crate) fn is_dns_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= MAX_DNS_LABEL
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

/// A DNS subdomain (RFC 1123): dot-separated DNS labels, at most `max` characters in all.
pub(crate) fn is_dns_subdomain(s: &str, max: usize) -> bool {
    !s.is_empty() && s.len() <= max && s.split('.').all(is_dns_label)
}

/// A C identifier: a letter or '_', then letters, digits and '_'.
pub(crate) fn is_c_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Checks an attribute or capacity name (`id` or `domain/id`); `Err` says which rule it breaks.
pub(crate) fn check_qualified_name(name: &str) -> Result<(), String> {
    let (domain, id) = match name.split_once('/') {
        Some((d, i)) => (Some(d), i),
        None => (None, name),
    };
    if let Some(d) = domain
        && !is_dns_subdomain(d, MAX_DOMAIN_LENGTH)
    {
        return Err(format!(
            "domain {d:?} must be a DNS subdomain of at most {MAX_DOMAIN_LENGTH} characters"
        ));
    }
    if !is_c_identifier(id) {
        return Err(format!("{id:?} must be a C identifier"));
    }
    if id.len() > MAX_ID_LENGTH {
        return Err(format!("{id:?} is longer than {MAX_ID_LENGTH} characters"));
    }
    Ok(())
}

/// Whether `s` is a semantic version per semver.org 2.0.0.
pub(crate) fn is_semver(s: &str) -> bool {
    let (rest, build) = match s.split_once('+') {
        Some((r, b)) => (r, Some(b)),
        None => (s, None),
    };
    let (core, pre) = match rest.split_once('-') {
        Some((c, p)) => (c, Some(p)),
        None => (rest, None),
    };
    let numeric = |p: &str| {
        !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) && (p == "0" || !p.starts_with('0'))
    };
    let ident =
        |p: &str| !p.is_empty() && p.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    let core_parts: Vec<&str> = core.split('.').collect();
    core_parts.len() == 3
        && core_parts.iter().all(|p| numeric(p))
        && pre.is_none_or(|p| {
            p.split('.')
                .all(|id| ident(id) && (!id.bytes().all(|b| b.is_ascii_digit()) || numeric(id)))
        })
        && build.is_none_or(|b| b.split('.').all(ident))
}

/// Turns a version as NVIDIA writes it into semver: missing minor/patch become 0 and leading
/// zeros are dropped (`12.4` -> `12.4.0`, `535.104.05` -> `535.104.5`). `None` when it is not
/// one to three dot-separated numbers, optionally followed by a semver pre-release or build.
pub fn normalize_version(text: &str) -> Option<String> {
    let text = text.trim();
    let split = text.find(['-', '+']).unwrap_or(text.len());
    let (core, suffix) = text.split_at(split);
    let parts: Vec<&str> = core.split('.').collect();
    if parts.is_empty() || parts.len() > 3 {
        return None;
    }
    let mut numbers = Vec::with_capacity(3);
    for p in parts {
        if p.is_empty() || p.len() > 20 || !p.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        numbers.push(p.parse::<u64>().ok()?);
    }
    numbers.resize(3, 0);
    let out = format!("{}.{}.{}{suffix}", numbers[0], numbers[1], numbers[2]);
    is_semver(&out).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_name_that_fits_is_the_reporting_instance_and_a_longer_one_is_cut_with_its_hash() {
        assert_eq!(reporting_instance("gpu-node-1"), "gpu-node-1");
        let at_limit = "n".repeat(MAX_REPORTING_INSTANCE);
        assert_eq!(reporting_instance(&at_limit), at_limit);

        let a = format!("{}.a", "x".repeat(250));
        let b = format!("{}.b", "x".repeat(250));
        let (ra, rb) = (reporting_instance(&a), reporting_instance(&b));
        assert_eq!(ra.len(), MAX_REPORTING_INSTANCE);
        assert_eq!(rb.len(), MAX_REPORTING_INSTANCE);
        assert_ne!(ra, rb, "two long names with one prefix stay apart");
        assert!(ra.starts_with(&"x".repeat(119)), "{ra}");
        assert_eq!(
            ra,
            reporting_instance(&a),
            "the same name, the same instance"
        );
    }

    #[test]
    fn a_long_name_is_cut_at_a_character_boundary() {
        let name = "é".repeat(200);
        let r = reporting_instance(&name);
        assert!(r.len() <= MAX_REPORTING_INSTANCE, "{}", r.len());
        assert!(r.starts_with('é'));
    }

    #[test]
    fn versions_are_normalized_to_semver() {
        assert_eq!(normalize_version("550.54.15").as_deref(), Some("550.54.15"));
        assert_eq!(normalize_version("12.4").as_deref(), Some("12.4.0"));
        assert_eq!(normalize_version("8").as_deref(), Some("8.0.0"));
        assert_eq!(
            normalize_version("535.104.05").as_deref(),
            Some("535.104.5")
        );
        assert_eq!(
            normalize_version("1.2.3-rc.1").as_deref(),
            Some("1.2.3-rc.1")
        );
        assert_eq!(normalize_version("1.2.3.4"), None);
        assert_eq!(normalize_version("v1.2"), None);
        assert_eq!(normalize_version(""), None);
        assert_eq!(normalize_version("1.2.3-01"), None);
    }

    #[test]
    fn names_follow_the_api_rules() {
        assert!(is_dns_label("gpu-0-mig-1g-5gb-0"));
        assert!(!is_dns_label("gpu-0-mig-1g.5gb-0"));
        assert!(!is_dns_label(&"a".repeat(64)));
        assert!(is_dns_subdomain("gpu.tessera.dev", 63));
        assert!(!is_dns_subdomain("Gpu.tessera.dev", 63));
        assert!(check_qualified_name("resource.kubernetes.io/pciBusID").is_ok());
        assert!(check_qualified_name("productName").is_ok());
        assert!(check_qualified_name("9lives").is_err());
        assert!(check_qualified_name(&"a".repeat(33)).is_err());
    }
}
