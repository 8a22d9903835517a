//! The API server's own validation of the objects the offline tools read.
//!
//! `tessera allocate` and `tessera validate` read plain YAML that never went through an API
//! server; where the API server would refuse an object, they refuse it too, naming the object,
//! the field and the rule. The rules and limits are those of upstream's
//! `pkg/apis/resource/validation` (Kubernetes 1.36) for the v1 shape every served version is
//! converted to, and the object-metadata rules every kind shares. Every check is linear in the
//! size of the object.
//!
//! ```text
//! let problems = validate_object(&object, &cel);   // empty: the API server would accept it
//! ```

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1 as res;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::Object;
use crate::error::Error;
use crate::rules::cel::{CelCache, MAX_EXPRESSION_LENGTH};
use crate::rules::limits::{self, MAX_REQUESTS};
use crate::rules::quantity::Quantity;

/// `DeviceConstraintsMaxSize`.
pub const MAX_CONSTRAINTS: usize = 32;
/// `DeviceConfigMaxSize`.
pub const MAX_CONFIGS: usize = 32;
/// `DeviceSelectorsMaxSize`.
pub const MAX_SELECTORS: usize = 32;
/// `FirstAvailableDeviceRequestMaxSize`.
pub const MAX_SUBREQUESTS: usize = 8;
/// `DeviceTolerationsMaxLength`.
pub const MAX_TOLERATIONS: usize = 16;
/// `OpaqueParametersMaxLength`: bytes of one opaque config's parameters.
pub const MAX_OPAQUE_PARAMETERS: usize = 10 * 1024;

/// Every rule the API server applies to `object` that `object` breaks; empty when it would be
/// accepted. CEL selectors are compiled (syntax, types, cost) with `cel`.
pub fn validate_object(object: &Object, cel: &CelCache) -> Vec<Error> {
    let mut v = Problems::new(describe(object));
    let cluster_scoped = matches!(
        object,
        Object::DeviceClass(_) | Object::ResourceSlice(_) | Object::Node(_)
    );
    v.metadata(object.metadata(), cluster_scoped);
    match object {
        Object::DeviceClass(c) => v.class_spec(&c.spec, cel),
        Object::ResourceSlice(s) => v.slice_spec(&s.spec),
        Object::ResourceClaim(c) => v.claim_spec(&c.spec, "spec", cel),
        Object::ResourceClaimTemplate(t) => v.claim_spec(&t.spec.spec, "spec.spec", cel),
        Object::Node(_) | Object::Pod(_) => {}
    }
    v.errors
}

/// `Kind name` or `Kind namespace/name`, as errors name an object.
pub fn describe(object: &Object) -> String {
    let meta = object.metadata();
    let name = meta.name.as_deref().unwrap_or("(unnamed)");
    match (object, meta.namespace.as_deref()) {
        (Object::DeviceClass(_) | Object::ResourceSlice(_) | Object::Node(_), _) => {
            format!("{} {name}", object.kind())
        }
        (_, ns) => format!("{} {}/{name}", object.kind(), ns.unwrap_or("default")),
    }
}

struct Problems {
    object: String,
    errors: Vec<Error>,
}

impl Problems {
    fn new(object: String) -> Self {
        Self {
            object,
            errors: Vec::new(),
        }
    }

    fn push(&mut self, field: impl Into<String>, message: impl Into<String>) {
        self.errors
            .push(Error::invalid(&self.object, field, message.into()));
    }

    fn at_most(&mut self, field: &str, len: usize, max: usize, what: &str) {
        if len > max {
            self.push(field, format!("{len} {what}; at most {max} are allowed"));
        }
    }

    fn dns_label(&mut self, field: &str, value: &str) {
        if value.is_empty() {
            self.push(field, "required");
        } else if !limits::is_dns_label(value) {
            self.push(
                field,
                format!(
                    "{value:?} must be a DNS label (lower-case letters, digits and '-', at most {} characters)",
                    limits::MAX_DNS_LABEL
                ),
            );
        }
    }

    fn dns_subdomain(&mut self, field: &str, value: &str, max: usize) {
        if value.is_empty() {
            self.push(field, "required");
        } else if !limits::is_dns_subdomain(value, max) {
            self.push(
                field,
                format!("{value:?} must be a DNS subdomain of at most {max} characters"),
            );
        }
    }

    fn metadata(&mut self, meta: &ObjectMeta, cluster_scoped: bool) {
        match (&meta.name, &meta.generate_name) {
            (Some(name), _) => self.dns_subdomain("metadata.name", name, limits::MAX_DNS_SUBDOMAIN),
            (None, Some(_)) => self.push(
                "metadata.name",
                "required: generateName is resolved by the API server, the offline tools need a name",
            ),
            (None, None) => self.push("metadata.name", "required"),
        }
        for (field, message) in meta
            .labels
            .as_ref()
            .map(object_meta::label_problems)
            .into_iter()
            .flatten()
            .chain(
                meta.annotations
                    .as_ref()
                    .map(object_meta::annotation_problems)
                    .into_iter()
                    .flatten(),
            )
        {
            self.push(field, message);
        }
        if let Some(ns) = &meta.namespace {
            if cluster_scoped {
                self.push(
                    "metadata.namespace",
                    "not allowed on a cluster-scoped object",
                );
            } else {
                self.dns_label("metadata.namespace", ns);
            }
        }
    }

    fn cel(&mut self, field: &str, expression: &str, cel: &CelCache) {
        if expression.len() > MAX_EXPRESSION_LENGTH {
            self.push(
                field,
                format!(
                    "{} bytes long, more than the limit of {MAX_EXPRESSION_LENGTH}",
                    expression.len()
                ),
            );
        } else if let Err(e) = cel.compile(expression) {
            self.push(field, e.to_string());
        }
    }

    fn selectors(
        &mut self,
        field: &str,
        selectors: Option<&Vec<res::DeviceSelector>>,
        cel: &CelCache,
    ) {
        let selectors = selectors.map_or(&[][..], Vec::as_slice);
        self.at_most(field, selectors.len(), MAX_SELECTORS, "selectors");
        for (i, s) in selectors.iter().enumerate() {
            match &s.cel {
                Some(c) => self.cel(&format!("{field}[{i}].cel.expression"), &c.expression, cel),
                None => self.push(format!("{field}[{i}].cel"), "required"),
            }
        }
    }

    fn opaque(&mut self, field: &str, opaque: Option<&res::OpaqueDeviceConfiguration>) {
        let Some(o) = opaque else {
            self.push(format!("{field}.opaque"), "required");
            return;
        };
        self.dns_subdomain(
            &format!("{field}.opaque.driver"),
            &o.driver,
            limits::MAX_DOMAIN_LENGTH,
        );
        let len = serde_json::to_string(&o.parameters.0).map_or(0, |s| s.len());
        if len > MAX_OPAQUE_PARAMETERS {
            self.push(
                format!("{field}.opaque.parameters"),
                format!("{len} bytes; at most {MAX_OPAQUE_PARAMETERS} are allowed"),
            );
        }
        if !o.parameters.0.is_object() {
            self.push(
                format!("{field}.opaque.parameters"),
                "must be a JSON object",
            );
        }
    }

    fn class_spec(&mut self, spec: &res::DeviceClassSpec, cel: &CelCache) {
        self.selectors("spec.selectors", spec.selectors.as_ref(), cel);
        let configs = spec.config.as_deref().unwrap_or_default();
        self.at_most("spec.config", configs.len(), MAX_CONFIGS, "configs");
        for (i, c) in configs.iter().enumerate() {
            self.opaque(&format!("spec.config[{i}]"), c.opaque.as_ref());
        }
    }

    fn quantity(
        &mut self,
        field: &str,
        q: &k8s_openapi::apimachinery::pkg::api::resource::Quantity,
    ) -> Option<Quantity> {
        match Quantity::from_k8s(q) {
            Ok(v) => Some(v),
            Err(e) => {
                self.push(field, e.to_string());
                None
            }
        }
    }

    fn allocation_mode(&mut self, field: &str, mode: Option<&str>, count: Option<i64>) {
        match mode.unwrap_or("ExactCount") {
            "ExactCount" => {
                if let Some(c) = count.filter(|c| *c <= 0) {
                    self.push(
                        format!("{field}.count"),
                        format!("{c}: must be greater than zero"),
                    );
                }
            }
            "All" => {
                if let Some(c) = count.filter(|c| *c != 0) {
                    self.push(
                        format!("{field}.count"),
                        format!("{c}: must not be specified when allocationMode is 'All'"),
                    );
                }
            }
            other => self.push(
                format!("{field}.allocationMode"),
                format!(
                    "unsupported value {other:?}: supported values are \"All\", \"ExactCount\""
                ),
            ),
        }
    }

    #[allow(
        clippy::too_many_arguments,
        reason = "the fields exactly and firstAvailable share"
    )]
    fn device_request(
        &mut self,
        field: &str,
        class: &str,
        selectors: Option<&Vec<res::DeviceSelector>>,
        mode: Option<&str>,
        count: Option<i64>,
        tolerations: usize,
        capacity: Option<&res::CapacityRequirements>,
        cel: &CelCache,
    ) {
        self.dns_subdomain(
            &format!("{field}.deviceClassName"),
            class,
            limits::MAX_DNS_SUBDOMAIN,
        );
        self.selectors(&format!("{field}.selectors"), selectors, cel);
        self.allocation_mode(field, mode, count);
        self.at_most(
            &format!("{field}.tolerations"),
            tolerations,
            MAX_TOLERATIONS,
            "tolerations",
        );
        for (name, q) in capacity
            .and_then(|c| c.requests.as_ref())
            .into_iter()
            .flatten()
        {
            let f = format!("{field}.capacity.requests[{name}]");
            if let Err(m) = limits::check_qualified_name(name) {
                self.push(f.clone(), m);
            }
            self.quantity(&f, q);
        }
    }

    #[allow(
        clippy::too_many_lines,
        reason = "every rule of a claim's requests, constraints and configs, read top to bottom"
    )]
    fn claim_spec(&mut self, spec: &res::ResourceClaimSpec, prefix: &str, cel: &CelCache) {
        let Some(devices) = &spec.devices else {
            return;
        };
        let field = format!("{prefix}.devices");
        let requests = devices.requests.as_deref().unwrap_or_default();
        self.at_most(
            &format!("{field}.requests"),
            requests.len(),
            MAX_REQUESTS,
            "requests",
        );
        // request name -> its subrequest names (empty for an exact request)
        let mut names: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
        for (i, r) in requests.iter().enumerate() {
            let rf = format!("{field}.requests[{i}]");
            self.dns_label(&format!("{rf}.name"), &r.name);
            if !r.name.is_empty() && names.contains_key(r.name.as_str()) {
                self.push(
                    format!("{rf}.name"),
                    format!("duplicate request name {:?}", r.name),
                );
            }
            let subs = names.entry(r.name.as_str()).or_default();
            let first = r.first_available.as_deref().filter(|s| !s.is_empty());
            match (&r.exactly, first) {
                (Some(ex), None) => self.device_request(
                    &format!("{rf}.exactly"),
                    &ex.device_class_name,
                    ex.selectors.as_ref(),
                    ex.allocation_mode.as_deref(),
                    ex.count,
                    ex.tolerations.as_ref().map_or(0, Vec::len),
                    ex.capacity.as_ref(),
                    cel,
                ),
                (None, Some(list)) => {
                    self.at_most(
                        &format!("{rf}.firstAvailable"),
                        list.len(),
                        MAX_SUBREQUESTS,
                        "subrequests",
                    );
                    for (j, sub) in list.iter().enumerate() {
                        let sf = format!("{rf}.firstAvailable[{j}]");
                        self.dns_label(&format!("{sf}.name"), &sub.name);
                        if !sub.name.is_empty() && !subs.insert(sub.name.as_str()) {
                            self.push(
                                format!("{sf}.name"),
                                format!("duplicate subrequest name {:?}", sub.name),
                            );
                        }
                        self.device_request(
                            &sf,
                            &sub.device_class_name,
                            sub.selectors.as_ref(),
                            sub.allocation_mode.as_deref(),
                            sub.count,
                            sub.tolerations.as_ref().map_or(0, Vec::len),
                            sub.capacity.as_ref(),
                            cel,
                        );
                    }
                }
                (None, None) => self.push(
                    rf,
                    "exactly one of `exactly` or `firstAvailable` is required",
                ),
                (Some(_), Some(_)) => self.push(
                    rf,
                    "exactly one of `exactly` or `firstAvailable` is required, but both are set",
                ),
            }
        }
        let known = |name: &str| match name.split_once('/') {
            None => names.contains_key(name),
            Some((parent, sub)) => names.get(parent).is_some_and(|s| s.contains(sub)),
        };
        let constraints = devices.constraints.as_deref().unwrap_or_default();
        self.at_most(
            &format!("{field}.constraints"),
            constraints.len(),
            MAX_CONSTRAINTS,
            "constraints",
        );
        for (i, c) in constraints.iter().enumerate() {
            let cf = format!("{field}.constraints[{i}]");
            self.request_refs(&format!("{cf}.requests"), c.requests.as_deref(), &known);
            match (&c.match_attribute, &c.distinct_attribute) {
                (Some(a), None) => self.fully_qualified(&format!("{cf}.matchAttribute"), a),
                (None, Some(a)) => self.fully_qualified(&format!("{cf}.distinctAttribute"), a),
                _ => self.push(
                    cf,
                    "exactly one of `matchAttribute` or `distinctAttribute` is required",
                ),
            }
        }
        let configs = devices.config.as_deref().unwrap_or_default();
        self.at_most(
            &format!("{field}.config"),
            configs.len(),
            MAX_CONFIGS,
            "configs",
        );
        for (i, c) in configs.iter().enumerate() {
            let cf = format!("{field}.config[{i}]");
            self.request_refs(&format!("{cf}.requests"), c.requests.as_deref(), &known);
            self.opaque(&cf, c.opaque.as_ref());
        }
    }

    fn request_refs(&mut self, field: &str, refs: Option<&[String]>, known: &dyn Fn(&str) -> bool) {
        let refs = refs.unwrap_or_default();
        self.at_most(field, refs.len(), MAX_REQUESTS, "entries");
        let mut seen = BTreeSet::new();
        for (i, name) in refs.iter().enumerate() {
            if !known(name) {
                self.push(
                    format!("{field}[{i}]"),
                    format!(
                        "{name:?} must be the name of a request of the claim, or request/subrequest"
                    ),
                );
            } else if !seen.insert(name.as_str()) {
                self.push(format!("{field}[{i}]"), format!("duplicate entry {name:?}"));
            }
        }
    }

    fn fully_qualified(&mut self, field: &str, name: &str) {
        if !name.contains('/') {
            self.push(
                field,
                format!("{name:?} must be a fully qualified name (domain/id)"),
            );
        } else if let Err(m) = limits::check_qualified_name(name) {
            self.push(field, m);
        }
    }

    #[allow(
        clippy::too_many_lines,
        reason = "every rule of a slice spec, in the order upstream checks them"
    )]
    fn slice_spec(&mut self, spec: &res::ResourceSliceSpec) {
        self.dns_subdomain("spec.driver", &spec.driver, limits::MAX_DOMAIN_LENGTH);
        let pool = &spec.pool;
        if pool.name.is_empty() {
            self.push("spec.pool.name", "required");
        } else if pool.name.len() > limits::MAX_DNS_SUBDOMAIN
            || !pool
                .name
                .split('/')
                .all(|p| limits::is_dns_subdomain(p, limits::MAX_DNS_SUBDOMAIN))
        {
            self.push(
                "spec.pool.name",
                format!(
                    "{:?} must be DNS subdomains separated by '/', at most {} characters",
                    pool.name,
                    limits::MAX_DNS_SUBDOMAIN
                ),
            );
        }
        if pool.resource_slice_count <= 0 {
            self.push(
                "spec.pool.resourceSliceCount",
                format!("{}: must be greater than zero", pool.resource_slice_count),
            );
        }
        if pool.generation < 0 {
            self.push(
                "spec.pool.generation",
                format!("{}: must be greater than or equal to zero", pool.generation),
            );
        }
        let mut set = Vec::new();
        if let Some(n) = &spec.node_name {
            if n.is_empty() {
                self.push(
                    "spec.nodeName",
                    "must be either unset or set to a non-empty string",
                );
            } else {
                set.push("nodeName");
                self.dns_subdomain("spec.nodeName", n, limits::MAX_DNS_SUBDOMAIN);
            }
        }
        if let Some(sel) = &spec.node_selector {
            set.push("nodeSelector");
            if sel.node_selector_terms.len() != 1 {
                self.push(
                    "spec.nodeSelector.nodeSelectorTerms",
                    "must have exactly one node selector term",
                );
            }
        }
        for (value, name) in [
            (spec.all_nodes, "allNodes"),
            (spec.per_device_node_selection, "perDeviceNodeSelection"),
        ] {
            match value {
                Some(true) => set.push(name),
                Some(false) => self.push(
                    format!("spec.{name}"),
                    "must be either unset or set to true",
                ),
                None => {}
            }
        }
        let which = "exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection` is required";
        match set.len() {
            0 => self.push("spec", which),
            1 => {}
            _ => self.push("spec", format!("{which}, but {} are set", set.join(", "))),
        }
        let devices = spec.devices.as_deref().unwrap_or_default();
        if spec.shared_counters.is_some() && spec.devices.is_some() {
            self.push(
                "spec",
                "only one of `sharedCounters` or `devices` is allowed",
            );
        }
        let advanced = devices.iter().any(|d| {
            d.taints.as_ref().is_some_and(|t| !t.is_empty())
                || d.consumes_counters.as_ref().is_some_and(|c| !c.is_empty())
                || d.attributes.iter().flatten().any(|(_, a)| {
                    a.bools.is_some()
                        || a.ints.is_some()
                        || a.strings.is_some()
                        || a.versions.is_some()
                })
        });
        let max = if advanced {
            limits::MAX_DEVICES_PER_SLICE_WITH_TAINTS
        } else {
            limits::MAX_DEVICES_PER_SLICE
        };
        if devices.len() > max {
            self.push(
                "spec.devices",
                format!(
                    "{} devices; at most {max} are allowed{}",
                    devices.len(),
                    if advanced {
                        " when devices have taints, consume counters or list attributes"
                    } else {
                        ""
                    }
                ),
            );
            // Checking each device of an oversized slice only buries the one error that matters.
            return;
        }
        let per_device = spec.per_device_node_selection == Some(true);
        let mut seen = BTreeSet::new();
        for (i, d) in devices.iter().enumerate() {
            let f = format!("spec.devices[{i}]");
            self.dns_label(&format!("{f}.name"), &d.name);
            if !d.name.is_empty() && !seen.insert(d.name.as_str()) {
                self.push(
                    format!("{f}.name"),
                    format!("duplicate device name {:?}", d.name),
                );
            }
            self.device(&f, d, per_device);
        }
    }

    fn device(&mut self, f: &str, d: &res::Device, per_device: bool) {
        let attributes = d.attributes.as_ref();
        let capacities = d.capacity.as_ref();
        let total = attributes.map_or(0, BTreeMap::len) + capacities.map_or(0, BTreeMap::len);
        if total > limits::MAX_ATTRIBUTES_AND_CAPACITIES {
            self.push(
                f,
                format!(
                    "{total} attributes and capacities; at most {} are allowed",
                    limits::MAX_ATTRIBUTES_AND_CAPACITIES
                ),
            );
            return;
        }
        for (name, a) in attributes.into_iter().flatten() {
            let af = format!("{f}.attributes[{name}]");
            if let Err(m) = limits::check_qualified_name(name) {
                self.push(af.clone(), m);
            }
            self.attribute(&af, a);
        }
        let shareable = d.allow_multiple_allocations == Some(true);
        for (name, c) in capacities.into_iter().flatten() {
            let cf = format!("{f}.capacity[{name}]");
            if let Err(m) = limits::check_qualified_name(name) {
                self.push(cf.clone(), m);
            }
            let value = self.quantity(&format!("{cf}.value"), &c.value);
            if let Some(v) = value.filter(|v| v.is_negative()) {
                self.push(format!("{cf}.value"), format!("{v}: must not be negative"));
            }
            if let Some(policy) = &c.request_policy {
                if shareable {
                    self.request_policy(&format!("{cf}.requestPolicy"), policy, value);
                } else {
                    self.push(
                        format!("{cf}.requestPolicy"),
                        "allowMultipleAllocations must be true",
                    );
                }
            }
        }
        self.at_most(
            &format!("{f}.taints"),
            d.taints.as_ref().map_or(0, Vec::len),
            limits::MAX_TAINTS_PER_DEVICE,
            "taints",
        );
        let own = [
            d.node_name.as_ref().map(|n| ("nodeName", n.is_empty())),
            d.node_selector.as_ref().map(|_| ("nodeSelector", false)),
            d.all_nodes.map(|a| ("allNodes", !a)),
        ];
        let set: Vec<&str> = own.iter().flatten().map(|(n, _)| *n).collect();
        if per_device {
            for (name, empty) in own.iter().flatten() {
                if *empty {
                    self.push(format!("{f}.{name}"), "must not be empty or false");
                }
            }
            if set.len() != 1 {
                self.push(
                    f,
                    "exactly one of `nodeName`, `nodeSelector`, or `allNodes` is required when `perDeviceNodeSelection` is set",
                );
            }
        } else if !set.is_empty() {
            self.push(
                f,
                "`nodeName`, `nodeSelector` and `allNodes` can only be set if `perDeviceNodeSelection` is set to true in the ResourceSlice spec",
            );
        }
    }

    fn attribute(&mut self, f: &str, a: &res::DeviceAttribute) {
        let mut fields = 0;
        let string = |this: &mut Self, field: String, s: &str, version: bool| {
            if s.len() > limits::MAX_VALUE_LENGTH {
                this.push(
                    field,
                    format!(
                        "{} characters; at most {} are allowed",
                        s.len(),
                        limits::MAX_VALUE_LENGTH
                    ),
                );
            } else if version && !limits::is_semver(s) {
                this.push(
                    field,
                    format!("{s:?} must be a semantic version (semver.org 2.0.0)"),
                );
            }
        };
        if a.bool.is_some() {
            fields += 1;
        }
        if a.int.is_some() {
            fields += 1;
        }
        if let Some(s) = &a.string {
            fields += 1;
            string(self, format!("{f}.string"), s, false);
        }
        if let Some(s) = &a.version {
            fields += 1;
            string(self, format!("{f}.version"), s, true);
        }
        let lists = [
            ("bools", a.bools.as_ref().map(Vec::len)),
            ("ints", a.ints.as_ref().map(Vec::len)),
            ("strings", a.strings.as_ref().map(Vec::len)),
            ("versions", a.versions.as_ref().map(Vec::len)),
        ];
        for (name, len) in lists {
            if let Some(len) = len {
                fields += 1;
                if len == 0 {
                    self.push(format!("{f}.{name}"), "must not be empty if specified");
                }
            }
        }
        for (i, s) in a.strings.iter().flatten().enumerate() {
            string(self, format!("{f}.strings[{i}]"), s, false);
        }
        for (i, s) in a.versions.iter().flatten().enumerate() {
            string(self, format!("{f}.versions[{i}]"), s, true);
        }
        if fields != 1 {
            self.push(f, "exactly one value must be specified");
        }
    }

    #[allow(
        clippy::too_many_lines,
        reason = "the rules of one request policy, in the order upstream checks them"
    )]
    fn request_policy(
        &mut self,
        f: &str,
        policy: &res::CapacityRequestPolicy,
        capacity: Option<Quantity>,
    ) {
        let values = policy.valid_values.as_deref().unwrap_or_default();
        if !values.is_empty() && policy.valid_range.is_some() {
            self.push(
                f,
                "exactly one policy can be specified, not both `validValues` and `validRange`",
            );
            return;
        }
        let default = match &policy.default {
            Some(q) => self.quantity(&format!("{f}.default"), q),
            None if !values.is_empty() || policy.valid_range.is_some() => {
                self.push(
                    format!("{f}.default"),
                    "required when `validValues` or `validRange` is set",
                );
                return;
            }
            None => None,
        };
        let above = |v: Quantity| capacity.is_some_and(|c| v > c);
        if !values.is_empty() {
            let mut previous: Option<Quantity> = None;
            let mut found_default = false;
            for (i, q) in values.iter().enumerate() {
                let vf = format!("{f}.validValues[{i}]");
                let Some(v) = self.quantity(&vf, q) else {
                    continue;
                };
                if previous.is_some_and(|p| v < p) {
                    self.push(vf.clone(), "values must be sorted in ascending order");
                } else if previous.is_some_and(|p| v == p) {
                    self.push(vf.clone(), format!("duplicate value {v}"));
                }
                if above(v) {
                    self.push(vf, "option is larger than the capacity value");
                }
                found_default |= default == Some(v);
                previous = Some(v);
            }
            if !found_default && default.is_some() {
                self.push(
                    format!("{f}.validValues"),
                    "the default value is not one of the valid values",
                );
            }
        }
        let Some(range) = &policy.valid_range else {
            return;
        };
        let rf = format!("{f}.validRange");
        let Some(min) = self.quantity(&format!("{rf}.min"), &range.min) else {
            return;
        };
        if above(min) {
            self.push(format!("{rf}.min"), "min is larger than the capacity value");
        }
        if default.is_some_and(|d| d < min) {
            self.push(
                format!("{rf}.default"),
                format!("default is less than min {min}"),
            );
        }
        let max = range
            .max
            .as_ref()
            .and_then(|q| self.quantity(&format!("{rf}.max"), q));
        if let Some(max) = max {
            if min > max {
                self.push(
                    format!("{rf}.max"),
                    format!("min {min} is larger than max {max}"),
                );
            }
            if above(max) {
                self.push(format!("{rf}.max"), "max is larger than the capacity value");
            }
            if default.is_some_and(|d| d > max) {
                self.push(
                    format!("{rf}.default"),
                    format!("default is more than max {max}"),
                );
            }
        }
        let Some(step) = range
            .step
            .as_ref()
            .and_then(|q| self.quantity(&format!("{rf}.step"), q))
        else {
            return;
        };
        if step.is_negative() || step.is_zero() {
            self.push(format!("{rf}.step"), "must be greater than zero");
            return;
        }
        if min.checked_add(step).is_none_or(above) {
            self.push(
                format!("{rf}.step"),
                "one step above min is larger than the capacity value",
            );
        }
        for value in default.into_iter().chain(max) {
            let off_step = value
                .nanos()
                .checked_sub(min.nanos())
                .is_none_or(|d| d % step.nanos() != 0);
            if off_step {
                self.push(
                    format!("{rf}.step"),
                    format!("{value} is not a whole number of steps ({step}) from min ({min})"),
                );
            }
        }
    }
}

mod object_meta;

pub use object_meta::MAX_ANNOTATIONS_BYTES;

#[cfg(test)]
mod tests;
