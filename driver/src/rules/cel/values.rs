//! The CEL values Tessera adds: `kubernetes.Quantity`, `kubernetes.Semver`, and the domain
//! maps of `device.attributes` / `device.capacity`, where an unknown domain reads as `{}`.

use std::any::Any;
use std::cmp::Ordering;
use std::sync::LazyLock;

use cel::ExecutionError;
use cel::common::traits::{self, Container, Indexer, Iterable, Sizer};
use cel::common::types::{CelInt, CelMap, MAP_TYPE, Type};
use cel::common::value::{CowVal, StaticVal, Val};

use crate::rules::quantity::Quantity;

/// The type of `quantity(...)` values and of capacities, named as upstream names it.
pub(crate) static QUANTITY_TYPE: LazyLock<Type> =
    LazyLock::new(|| Type::new_opaque_type("kubernetes.Quantity"));

/// The type of `semver(...)` values and of version attributes.
pub(crate) static SEMVER_TYPE: LazyLock<Type> =
    LazyLock::new(|| Type::new_opaque_type("kubernetes.Semver"));

/// Makes `$val`, a one-field wrapper whose field compares with `==`, a CEL value of the opaque
/// type `$ty`: equal to another `$val` holding an equal value, and to nothing else.
macro_rules! opaque_val {
    ($val:ident, $ty:ident) => {
        impl Val for $val {
            fn get_type(&self) -> &Type {
                &$ty
            }

            fn cel_type() -> &'static Type {
                &$ty
            }

            fn equals(&self, other: &dyn Val) -> bool {
                other.downcast_ref::<$val>().is_some_and(|o| o.0 == self.0)
            }

            fn clone_as_boxed<'v>(&self) -> Box<dyn Val + 'v>
            where
                Self: 'v,
            {
                Box::new(Clone::clone(self))
            }

            fn as_any(&self) -> Option<&dyn Any> {
                Some(self)
            }
        }

        impl StaticVal for $val {}
    };
}

/// An exact Kubernetes quantity as a CEL value.
#[derive(Debug, Clone, Copy)]
pub(crate) struct QuantityVal(pub(crate) Quantity);

opaque_val!(QuantityVal, QUANTITY_TYPE);

/// One dot-separated pre-release identifier; numeric ones order below alphanumeric ones.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum PreRelease {
    Numeric(u64),
    Alpha(String),
}

/// A semantic version (semver.org 2.0.0). Build metadata is kept but never compared.
#[derive(Debug, Clone)]
pub(crate) struct Semver {
    pub(crate) major: u64,
    pub(crate) minor: u64,
    pub(crate) patch: u64,
    pre: Vec<PreRelease>,
}

impl PartialEq for Semver {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Semver {}
impl PartialOrd for Semver {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Semver {
    fn cmp(&self, other: &Self) -> Ordering {
        (self.major, self.minor, self.patch)
            .cmp(&(other.major, other.minor, other.patch))
            .then_with(|| match (self.pre.is_empty(), other.pre.is_empty()) {
                (true, true) => Ordering::Equal,
                // A release ranks above any of its pre-releases.
                (true, false) => Ordering::Greater,
                (false, true) => Ordering::Less,
                (false, false) => self.pre.cmp(&other.pre),
            })
    }
}

fn is_ident_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '-'
}

fn parse_number(part: &str, what: &str) -> Result<u64, String> {
    if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("{what} version {part:?} is not a number"));
    }
    if part.len() > 1 && part.starts_with('0') {
        return Err(format!("{what} version {part:?} has a leading zero"));
    }
    part.parse()
        .map_err(|_| format!("{what} version {part:?} is out of range"))
}

impl Semver {
    /// Parses a strict semantic version: `MAJOR.MINOR.PATCH[-PRE][+BUILD]`.
    pub(crate) fn parse(text: &str) -> Result<Self, String> {
        if text.is_empty() {
            return Err("empty version".into());
        }
        let (rest, build) = match text.split_once('+') {
            Some((r, b)) => (r, Some(b)),
            None => (text, None),
        };
        if let Some(build) = build
            && build
                .split('.')
                .any(|id| id.is_empty() || !id.chars().all(is_ident_char))
        {
            return Err(format!("invalid build metadata {build:?}"));
        }
        let mut parts = rest.splitn(3, '.');
        let major = parse_number(parts.next().unwrap_or_default(), "major")?;
        let minor = parse_number(
            parts
                .next()
                .ok_or("no minor version (want MAJOR.MINOR.PATCH)")?,
            "minor",
        )?;
        let tail = parts
            .next()
            .ok_or("no patch version (want MAJOR.MINOR.PATCH)")?;
        let (patch, pre) = match tail.split_once('-') {
            Some((p, pre)) => (p, Some(pre)),
            None => (tail, None),
        };
        let patch = parse_number(patch, "patch")?;
        let mut pre_ids = Vec::new();
        for id in pre.map(|p| p.split('.')).into_iter().flatten() {
            if id.is_empty() || !id.chars().all(is_ident_char) {
                return Err(format!("invalid pre-release identifier {id:?}"));
            }
            if id.bytes().all(|b| b.is_ascii_digit()) {
                pre_ids.push(PreRelease::Numeric(parse_number(id, "pre-release")?));
            } else {
                pre_ids.push(PreRelease::Alpha(id.to_owned()));
            }
        }
        Ok(Self {
            major,
            minor,
            patch,
            pre: pre_ids,
        })
    }

    /// Parses after upstream's normalisation: a leading `v` dropped, leading zeros removed,
    /// and a missing minor or patch filled with `0`.
    pub(crate) fn parse_normalized(text: &str) -> Result<Self, String> {
        let text = text.strip_prefix('v').unwrap_or(text);
        let mut parts: Vec<String> = text
            .splitn(3, '.')
            .map(|p| {
                if p.len() <= 1 {
                    return p.to_owned();
                }
                let trimmed = p.trim_start_matches('0');
                if trimmed.starts_with(|c: char| c.is_ascii_digit()) {
                    trimmed.to_owned()
                } else {
                    format!("0{trimmed}")
                }
            })
            .collect();
        if parts.len() < 3 {
            if parts.last().is_some_and(|p| p.contains(['+', '-'])) {
                return Err("a short version cannot carry pre-release or build metadata".into());
            }
            parts.resize(3, "0".to_owned());
        }
        Self::parse(&parts.join("."))
    }
}

/// A semantic version as a CEL value.
#[derive(Debug, Clone)]
pub(crate) struct SemverVal(pub(crate) Semver);

opaque_val!(SemverVal, SEMVER_TYPE);

/// `device.attributes` and `device.capacity`: a map from domain to inner map, where a domain
/// the device lacks reads as an empty map, as upstream does, so `"x" in
/// device.attributes["other.domain"]` is simply false.
#[derive(Debug, Clone, Default)]
pub(crate) struct DomainMap {
    domains: CelMap<'static>,
    empty: CelMap<'static>,
}

impl DomainMap {
    pub(crate) fn new(domains: CelMap<'static>) -> Self {
        Self {
            domains,
            empty: CelMap::default(),
        }
    }
}

impl Indexer for DomainMap {
    fn get<'b, 'v>(&'b self, idx: &dyn Val) -> Result<CowVal<'b, 'v>, ExecutionError>
    where
        Self: 'v,
    {
        match Indexer::get(&self.domains, idx) {
            Err(ExecutionError::NoSuchKey(_)) => Ok(CowVal::Borrowed(&self.empty)),
            other => other,
        }
    }

    fn steal<'v>(self: Box<Self>, idx: &dyn Val) -> Result<Box<dyn Val + 'v>, ExecutionError>
    where
        Self: 'v,
    {
        self.get(idx).map(CowVal::into_owned)
    }
}

impl Container for DomainMap {
    fn contains(&self, value: &dyn Val) -> Result<bool, ExecutionError> {
        Container::contains(&self.domains, value)
    }
}

impl Iterable for DomainMap {
    fn iter<'b, 'v>(&'b self) -> Box<dyn traits::Iterator<'b, 'v> + 'b>
    where
        Self: 'v,
    {
        Iterable::iter(&self.domains)
    }
}

impl Sizer for DomainMap {
    fn size(&self) -> CelInt {
        Sizer::size(&self.domains)
    }
}

impl Val for DomainMap {
    fn get_type(&self) -> &Type {
        &MAP_TYPE
    }

    fn cel_type() -> &'static Type {
        &MAP_TYPE
    }

    fn as_container(&self) -> Option<&dyn Container> {
        Some(self)
    }

    fn as_indexer<'b, 'v>(&'b self) -> Option<&'b (dyn Indexer + 'v)>
    where
        Self: 'v,
    {
        Some(self)
    }

    fn as_iterable<'b, 'v>(&'b self) -> Option<&'b (dyn Iterable + 'v)>
    where
        Self: 'v,
    {
        Some(self)
    }

    fn as_sizer(&self) -> Option<&dyn Sizer> {
        Some(self)
    }

    fn equals(&self, other: &dyn Val) -> bool {
        match other.downcast_ref::<DomainMap>() {
            Some(o) => self.domains.equals(&o.domains),
            None => self.domains.equals(other),
        }
    }

    fn clone_as_boxed<'v>(&self) -> Box<dyn Val + 'v>
    where
        Self: 'v,
    {
        Box::new(self.clone())
    }

    fn as_any(&self) -> Option<&dyn Any> {
        Some(self)
    }
}

impl StaticVal for DomainMap {}
