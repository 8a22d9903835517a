//! The backtracking search on one node, as kube-scheduler's structured allocator does it.
//!
//! Claims are allocated one after another, requests in order, devices one at a time; each
//! pick is checked (in use, capacity, counters, constraints) and undone when the rest cannot
//! be completed. The first complete solution wins. Candidates are tried in kube-scheduler's
//! order unless the placement policy reorders them. A step budget bounds the work.

use std::collections::HashMap;
use std::rc::Rc;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1 as res;

use super::booking;
use super::capacity::{self, Amounts};
use super::policy::{DeviceView, NodeView, PlacementPolicy, ScoreInput};
use super::request::{ClaimSpec, MAX_RESULTS, ReqSpec};
use super::snapshot::{SelectorCache, Snapshot};
use crate::error::Error;
use crate::rules::overcommit;
use crate::rules::quantity::Quantity;
use crate::rules::share::PerDeviceShare;

/// Why a search stopped without an answer for this node.
#[derive(Debug)]
pub(crate) enum Abort {
    /// The step budget ran out.
    Budget,
    /// A selector failed at runtime (kube-scheduler's allocator returns it as an error).
    Cel(Error),
    /// kube-scheduler's allocator returns an error for this node (e.g. "all devices" while a
    /// pool is being updated): not a misfit, the pod's scheduling attempt aborts.
    Error(String),
    /// The claim can never be allocated (a rule is broken).
    Fatal(String),
}

type Step = Result<bool, Abort>;

/// One device picked for one request.
#[derive(Debug, Clone)]
pub(crate) struct Pick {
    pub(crate) req: usize,
    pub(crate) alt: usize,
    pub(crate) device: usize,
    /// Consumed capacity recorded in the result (devices with `allowMultipleAllocations`).
    pub(crate) consumed: Option<Amounts>,
    /// Tessera's resolved share on a shared GPU.
    pub(crate) share: Option<PerDeviceShare>,
    /// Amounts this pick holds in-flight on the device (shares and multi-allocation devices).
    inflight: Option<Amounts>,
    /// What a batch share books beyond its guarantee (memory bytes, compute percent).
    pub(crate) over: Option<(u64, i64)>,
    /// A share's SM percentage and whether it guards its SMs ([`crate::rules::overcommit::threads`]).
    threads: Option<(i64, bool)>,
    exclusive: bool,
    counters: bool,
}

/// An attribute's values as a set of one type: a scalar is a set of one, a list its elements.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum AttrSet {
    Bool(Vec<bool>),
    Int(Vec<i64>),
    Str(Vec<String>),
    Version(Vec<String>),
}

impl AttrSet {
    /// The values both sets hold; values of different types never meet.
    fn intersect(&self, other: &Self) -> Self {
        fn common<T: PartialEq + Clone>(a: &[T], b: &[T]) -> Vec<T> {
            a.iter().filter(|x| b.contains(x)).cloned().collect()
        }
        match (self, other) {
            (Self::Bool(a), Self::Bool(b)) => Self::Bool(common(a, b)),
            (Self::Int(a), Self::Int(b)) => Self::Int(common(a, b)),
            (Self::Str(a), Self::Str(b)) => Self::Str(common(a, b)),
            (Self::Version(a), Self::Version(b)) => Self::Version(common(a, b)),
            _ => Self::Str(Vec::new()),
        }
    }

    fn is_empty(&self) -> bool {
        match self {
            Self::Bool(v) => v.is_empty(),
            Self::Int(v) => v.is_empty(),
            Self::Str(v) | Self::Version(v) => v.is_empty(),
        }
    }

    fn disjoint(&self, other: &Self) -> bool {
        self.intersect(other).is_empty()
    }

    /// Each value as a key that no value of another type shares.
    pub(crate) fn keys(&self) -> Vec<String> {
        match self {
            Self::Bool(v) => v.iter().map(|b| format!("b:{b}")).collect(),
            Self::Int(v) => v.iter().map(|i| format!("i:{i}")).collect(),
            Self::Str(v) => v.iter().map(|x| format!("s:{x}")).collect(),
            Self::Version(v) => v.iter().map(|x| format!("v:{x}")).collect(),
        }
    }
}

/// Per constraint, one entry per device added, in order (the search undoes picks last first).
/// `matchAttribute` keeps the values every device so far has in common: it holds while that
/// set is not empty. `distinctAttribute` keeps each device's values: they must not overlap.
#[derive(Debug, Clone)]
enum ConstraintState {
    Match { common: Vec<(usize, AttrSet)> },
    Distinct { values: Vec<(usize, AttrSet)> },
}

pub(crate) fn lookup_attr(snap: &Snapshot, dev: usize, name: &str) -> Option<AttrSet> {
    use crate::rules::published::AttributeValue as A;
    let entry = &snap.devices[dev];
    let device = entry.device();
    let attr = device.attribute(name).or_else(|| {
        let (domain, id) = name.split_once('/')?;
        if domain == entry.driver {
            device.attribute(id)
        } else {
            None
        }
    })?;
    match attr {
        A::String(s) => Some(AttrSet::Str(vec![s.to_string()])),
        A::Int(i) => Some(AttrSet::Int(vec![*i])),
        A::Bool(b) => Some(AttrSet::Bool(vec![*b])),
        A::Version(v) => Some(AttrSet::Version(vec![v.to_string()])),
        A::Strings(l) => Some(AttrSet::Str(l.to_vec())),
        A::Ints(l) => Some(AttrSet::Int(l.to_vec())),
        A::Bools(l) => Some(AttrSet::Bool(l.to_vec())),
        A::Versions(l) => Some(AttrSet::Version(l.to_vec())),
        A::Empty => None,
    }
}

/// Whether `toleration` tolerates `taint`, as Kubernetes decides it.
pub(crate) fn tolerates(toleration: &res::DeviceToleration, taint: &res::DeviceTaint) -> bool {
    if let Some(effect) = toleration.effect.as_deref().filter(|e| !e.is_empty())
        && effect != taint.effect
    {
        return false;
    }
    let key = toleration.key.as_deref().unwrap_or_default();
    if !key.is_empty() && key != taint.key {
        return false;
    }
    match toleration.operator.as_deref().unwrap_or("Equal") {
        "Exists" => true,
        "Equal" | "" => {
            !key.is_empty()
                && toleration.value.as_deref().unwrap_or_default()
                    == taint.value.as_deref().unwrap_or_default()
        }
        _ => false,
    }
}

/// How one device fares for one request, ignoring other picks of the same search.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    ClassMismatch,
    SelectorMismatch,
    NotShared,
    Tainted,
    InUse,
    TooFull,
    /// Smaller in all than what the request asks of one device, even when empty.
    TooSmall,
    /// Declares no capacity of a name the request asks for.
    Undeclared,
    Counters,
    Fits,
}

/// Static checks of a device for a request: selectors, taints, share eligibility.
pub(crate) fn static_outcome(
    snap: &Snapshot,
    cache: &mut SelectorCache,
    spec: &ReqSpec,
    dev: usize,
) -> Result<Outcome, Abort> {
    for &e in &spec.class_selectors {
        if !snap.eval(cache, e, dev).map_err(Abort::Cel)? {
            return Ok(Outcome::ClassMismatch);
        }
    }
    for &e in &spec.selectors {
        if !snap.eval(cache, e, dev).map_err(Abort::Cel)? {
            return Ok(Outcome::SelectorMismatch);
        }
    }
    let entry = &snap.devices[dev];
    // Only a `GpuShare` (Tessera's own config) needs a shared GPU: native capacity requests
    // take any device that declares the capacities, as kube-scheduler decides it.
    if spec.share.is_some() && !entry.tessera_shared {
        return Ok(Outcome::NotShared);
    }
    if entry
        .taints
        .iter()
        .any(|t| !spec.tolerations.iter().any(|tol| tolerates(tol, t)))
    {
        return Ok(Outcome::Tainted);
    }
    Ok(Outcome::Fits)
}

/// What device scores see: the node the search is on and the pod being placed.
#[derive(Clone, Copy)]
pub(crate) struct Scoring<'a> {
    pub(crate) node: &'a NodeView<'a>,
    pub(crate) input: &'a ScoreInput<'a>,
    /// The device index of each entry of the node's `gpu_free`.
    pub(crate) gpu_devices: &'a [usize],
}

/// For each request of `claim`, the fewest devices the requests after it can take.
fn later_minimum(claim: &ClaimSpec) -> Vec<usize> {
    let mut out = vec![0; claim.requests.len()];
    let mut sum = 0usize;
    for (r, alternatives) in claim.requests.iter().enumerate().rev() {
        out[r] = sum;
        let least = alternatives
            .iter()
            .map(|a| if a.all { 0 } else { a.count })
            .min()
            .unwrap_or(0);
        sum = sum.saturating_add(least);
    }
    out
}

/// The search state for one node.
pub(crate) struct Search<'a> {
    scoring: Scoring<'a>,
    snap: &'a Snapshot,
    cache: &'a mut SelectorCache,
    specs: &'a [ClaimSpec],
    policy: &'a dyn PlacementPolicy,
    node: &'a Node,
    node_devices: Vec<usize>,
    pub(crate) steps: u64,
    budget: u64,
    cands: HashMap<(usize, usize, usize), Rc<Vec<usize>>>,
    /// CEL runtime errors of candidates (claim, request, alternative, device), raised only when
    /// the search reaches the device free, as kube-scheduler evaluates selectors lazily.
    deferred: HashMap<(usize, usize, usize, usize), Error>,
    excl: Vec<(usize, usize)>,
    inflight: HashMap<usize, Amounts>,
    /// Over-committed memory bytes and compute of this search's batch picks, per device.
    inflight_over: HashMap<usize, (u64, i64)>,
    /// SM percentages of this search's share picks, and how many guard theirs, per device.
    inflight_threads: HashMap<usize, (i64, u32)>,
    holders: HashMap<usize, u32>,
    counters: HashMap<(usize, String), Amounts>,
    pub(crate) picks: Vec<Vec<Pick>>,
    constraints: Vec<Vec<ConstraintState>>,
    pub(crate) selected: Vec<Vec<usize>>,
    /// Per claim and request: the fewest devices the claim's later requests can take (their
    /// cheapest alternatives; "All" counts none), so a choice that cannot leave them room under
    /// the claim's result limit is dropped before any device is tried.
    later_minimum: Vec<Vec<usize>>,
}

impl<'a> Search<'a> {
    #[allow(clippy::too_many_arguments)] // Reason: internal constructor with distinct parts.
    pub(crate) fn new(
        snap: &'a Snapshot,
        cache: &'a mut SelectorCache,
        specs: &'a [ClaimSpec],
        policy: &'a dyn PlacementPolicy,
        node: &'a Node,
        node_devices: Vec<usize>,
        budget: u64,
        scoring: Scoring<'a>,
    ) -> Self {
        let constraints = specs
            .iter()
            .map(|c| {
                c.constraints
                    .iter()
                    .map(|k| {
                        if k.distinct {
                            ConstraintState::Distinct { values: Vec::new() }
                        } else {
                            ConstraintState::Match { common: Vec::new() }
                        }
                    })
                    .collect()
            })
            .collect();
        Self {
            scoring,
            snap,
            cache,
            specs,
            policy,
            node,
            node_devices,
            steps: 0,
            budget,
            cands: HashMap::new(),
            deferred: HashMap::new(),
            excl: Vec::new(),
            inflight: HashMap::new(),
            inflight_over: HashMap::new(),
            inflight_threads: HashMap::new(),
            holders: HashMap::new(),
            counters: HashMap::new(),
            picks: vec![Vec::new(); specs.len()],
            constraints,
            selected: specs.iter().map(|c| vec![0; c.requests.len()]).collect(),
            later_minimum: specs.iter().map(later_minimum).collect(),
        }
    }

    /// Runs the search; `Ok(true)` when every claim got its devices.
    ///
    /// As kube-scheduler's `Allocate`, every "all devices" request (and subrequest) of every
    /// claim is resolved before the search starts (`validateDeviceRequest`): a pool of this
    /// node being updated or invalid, or a selector failing on any device of the node, is an
    /// error however the search would go.
    pub(crate) fn run(&mut self) -> Step {
        for c in 0..self.specs.len() {
            for r in 0..self.specs[c].requests.len() {
                for a in 0..self.specs[c].requests[r].len() {
                    let spec = &self.specs[c].requests[r][a];
                    if !spec.all {
                        continue;
                    }
                    if let Some(pool) = self.unusable_pool() {
                        return Err(Abort::Error(format!(
                            "claim {}, request {}: asks for all devices, but {pool}",
                            self.specs[c].name, spec.full
                        )));
                    }
                    self.candidates(c, r, a)?;
                }
            }
        }
        self.step(0, 0, None, 0, 0)
    }

    /// Whether the device is held in a way that rules it out for request `spec` of claim `c`
    /// before anything else is looked at (kube-scheduler's `deviceInUse`, or for admin access
    /// `allocatingDeviceForClaim`): held whole by an allocation, or picked whole in this
    /// search (an admin-access pick included).
    fn in_use(&self, c: usize, spec: &ReqSpec, dev: usize) -> bool {
        let entry = &self.snap.devices[dev];
        let u = &self.snap.uses[dev];
        let excl_any = self.excl.iter().any(|&(d, _)| d == dev);
        if spec.admin {
            return !entry.multi && self.excl.iter().any(|&(d, cl)| d == dev && cl == c);
        }
        if entry.multi || spec.share.is_some() {
            return u.exclusive > 0 || excl_any;
        }
        let inflight_holders = self.holders.get(&dev).copied().unwrap_or(0);
        u.holders() > 0 || inflight_holders > 0 || excl_any
    }

    fn candidates(&mut self, c: usize, r: usize, a: usize) -> Result<Rc<Vec<usize>>, Abort> {
        if let Some(list) = self.cands.get(&(c, r, a)) {
            return Ok(Rc::clone(list));
        }
        let spec = &self.specs[c].requests[r][a];
        let mut list = Vec::new();
        for &dev in &self.node_devices {
            // "All" takes every selectable device; taints are checked when it is taken. Its
            // selectors' errors count at once; another request's only when it is reached.
            let outcome = match static_outcome(self.snap, self.cache, spec, dev) {
                Err(Abort::Cel(e)) if !spec.all => {
                    self.deferred.insert((c, r, a, dev), e);
                    list.push(dev);
                    continue;
                }
                other => other?,
            };
            if outcome == Outcome::Fits || (spec.all && outcome == Outcome::Tainted) {
                // "All" means all devices with room for the request's capacity, as
                // committed before this search (kube-scheduler decides it up front).
                if spec.all && !capacity_fits(self.snap, spec, dev, true) {
                    continue;
                }
                list.push(dev);
            }
        }
        if !spec.all {
            // Topology groups count only devices this request could still take: a busy GPU
            // must not make its island look big enough.
            // (An error here only means "not free"; the search reports it if it gets there.)
            let topology = spec.count > 1 && self.policy.prefers_topology();
            let free: Vec<bool> = list
                .iter()
                .map(|&dev| !topology || dynamic_outcome(self.snap, spec, dev) == Outcome::Fits)
                .collect();
            self.order(spec, &mut list, &free);
        }
        let list = Rc::new(list);
        self.cands.insert((c, r, a), Rc::clone(&list));
        Ok(list)
    }

    /// Orders a request's candidates: for a multi-device request (where the policy prefers
    /// topology) first the devices of an NVLink island with enough free devices for the
    /// whole request, island by island (the island holding the best-scored free device
    /// first), then likewise by NUMA node, then by the policy's device score and position.
    /// `free` says, per candidate, whether it has room for the request now.
    fn order(&self, spec: &ReqSpec, list: &mut [usize], free: &[bool]) {
        let topology = spec.count > 1 && self.policy.prefers_topology();
        let snap = self.snap;
        let scores: Vec<i64> = list
            .iter()
            .enumerate()
            .map(|(pos, &dev)| {
                let view = DeviceView {
                    position: pos,
                    used_permille: snap.fullness(dev),
                    gpu: self.scoring.gpu_devices.iter().position(|&d| d == dev),
                };
                self.policy
                    .device_score(&view, self.scoring.node, self.scoring.input)
            })
            .collect();
        // Per group: how many free candidates it holds and the best (score, position) among them.
        let groups = |key: &dyn Fn(usize) -> Option<&'a String>| {
            let mut map: HashMap<&'a String, (usize, (i64, usize))> = HashMap::new();
            if topology {
                for (pos, &dev) in list.iter().enumerate() {
                    if let (true, Some(g)) = (free[pos], key(dev)) {
                        let slot = map.entry(g).or_insert((0, (i64::MAX, usize::MAX)));
                        slot.0 += 1;
                        slot.1 = slot.1.min((scores[pos], pos));
                    }
                }
            }
            map
        };
        let island_key = |d: usize| snap.devices[d].nvlink.as_ref();
        let numa_key = |d: usize| snap.devices[d].numa.as_ref();
        let islands = groups(&island_key);
        let numas = groups(&numa_key);
        let rank = |map: &HashMap<&'a String, (usize, (i64, usize))>, g: Option<&'a String>| {
            g.and_then(|g| map.get(g))
                .filter(|(n, _)| *n >= spec.count)
                .map_or((true, (i64::MAX, usize::MAX)), |(_, best)| (false, *best))
        };
        let mut keyed: Vec<_> = list
            .iter()
            .enumerate()
            .map(|(pos, &dev)| {
                (
                    !free[pos],
                    rank(&islands, island_key(dev)),
                    rank(&numas, numa_key(dev)),
                    scores[pos],
                    pos,
                    dev,
                )
            })
            .collect();
        keyed.sort_unstable();
        for (slot, k) in list.iter_mut().zip(keyed) {
            *slot = k.5;
        }
    }

    /// One step of the search: device `d` of alternative `alt` of request `r` of claim `c`.
    /// `start` is where in the request's candidates the search for device `d` begins: after
    /// the device taken for `d - 1`, as kube-scheduler's `allocateOne` continues at its
    /// `startLocation`, so one request never takes a device twice (not even one that allows
    /// multiple allocations) and tries each set of devices once, not in every order.
    #[allow(clippy::many_single_char_names)] // Reason: c, r, a, d index claim, request, alternative, device throughout.
    fn step(&mut self, c: usize, r: usize, alt: Option<usize>, d: usize, start: usize) -> Step {
        self.steps += 1;
        if self.steps > self.budget {
            return Err(Abort::Budget);
        }
        if c >= self.specs.len() {
            return Ok(true);
        }
        let claim = &self.specs[c];
        if r >= claim.requests.len() {
            return self.step(c + 1, 0, None, 0, 0);
        }
        let Some(a) = alt else {
            if claim.first_available[r] {
                for a in 0..claim.requests[r].len() {
                    if self.step(c, r, Some(a), 0, 0)? {
                        self.selected[c][r] = a;
                        return Ok(true);
                    }
                }
                return Ok(false);
            }
            return self.step(c, r, Some(0), d, start);
        };
        let spec = &claim.requests[r][a];
        let cands = self.candidates(c, r, a)?;
        let needed = if spec.all { cands.len() } else { spec.count };
        if spec.all && needed == 0 {
            return Ok(false);
        }
        if d >= needed {
            return self.step(c, r + 1, None, 0, 0);
        }
        if self.picks[c]
            .len()
            .saturating_add(needed - d)
            .saturating_add(self.later_minimum[c][r])
            > MAX_RESULTS
        {
            return Ok(false);
        }
        if spec.all {
            let dev = cands[d];
            if !self.take(c, r, a, dev)? {
                return Ok(false);
            }
            if self.step(c, r, Some(a), d + 1, 0)? {
                return Ok(true);
            }
            self.untake(c);
            return Ok(false);
        }
        for (at, &dev) in cands.iter().enumerate().skip(start) {
            // In use first, selectors after: a selector's error on a device in use is never
            // raised (`allocateOne` checks `deviceInUse` before `isSelectable`).
            let spec = &self.specs[c].requests[r][a];
            if self.in_use(c, spec, dev) {
                continue;
            }
            if let Some(e) = self.deferred.get(&(c, r, a, dev)) {
                return Err(Abort::Cel(e.clone()));
            }
            if !self.take(c, r, a, dev)? {
                continue;
            }
            match self.step(c, r, Some(a), d + 1, at + 1) {
                Ok(true) => return Ok(true),
                Ok(false) => self.untake(c),
                Err(e) => {
                    self.untake(c);
                    return Err(e);
                }
            }
        }
        Ok(false)
    }

    /// Why the pool of this node that is being updated or is invalid cannot be used, if one
    /// is ("all devices" must see every device; kube-scheduler then returns an error).
    fn unusable_pool(&self) -> Option<&str> {
        self.snap
            .pools
            .iter()
            .filter(|p| p.scopes.iter().any(|s| s.matches(self.node)))
            .find_map(|p| p.unusable.as_deref())
    }

    fn used_with_inflight(&self, dev: usize) -> Amounts {
        let mut used = self.snap.uses[dev].consumed.clone();
        if let Some(i) = self.inflight.get(&dev) {
            capacity::add_into(&mut used, i);
        }
        used
    }

    /// Tries to pick `dev` for claim `c`, request `r`, alternative `a`.
    #[allow(clippy::many_single_char_names, clippy::too_many_lines)] // Reason: indices as in `step`; one decision read top to bottom.
    fn take(&mut self, c: usize, r: usize, a: usize, dev: usize) -> Result<bool, Abort> {
        let spec = &self.specs[c].requests[r][a];
        let entry = &self.snap.devices[dev];
        let u = &self.snap.uses[dev];
        let inflight_holders = self.holders.get(&dev).copied().unwrap_or(0);
        let excl_any = self.excl.iter().any(|&(d, _)| d == dev);
        let mut consumed = None;
        let mut inflight = None;
        let mut share = None;
        let mut over = None;
        let mut exclusive = false;
        // "All" takes the devices listed up front in kube-scheduler's `allocateDevice` order:
        // in use, shared counters, taints (the list includes tainted devices), each of which
        // fails the request; then the claim's constraints, which abort the attempt.
        if spec.all {
            let counters_needed = !spec.admin
                && !entry.consumes.is_empty()
                && u.holders() == 0
                && inflight_holders == 0;
            if self.in_use(c, spec, dev)
                || (counters_needed && !self.counters_fit(dev))
                || entry
                    .taints
                    .iter()
                    .any(|t| !spec.tolerations.iter().any(|tol| tolerates(tol, t)))
            {
                return Ok(false);
            }
            if !self.constraints_admit(c, r, a, dev) {
                return Err(Abort::Error(format!(
                    "claim {}, request {}: cannot add device {} because a claim constraint \
                     would not be satisfied",
                    self.specs[c].name,
                    spec.full,
                    entry.id()
                )));
            }
        }
        if spec.admin {
            if !entry.multi && self.excl.iter().any(|&(d, cl)| d == dev && cl == c) {
                return Ok(false);
            }
        } else if let Some(share_req) = spec.share.as_ref() {
            if !entry.tessera_shared || u.exclusive > 0 || excl_any {
                return Ok(false);
            }
            if spec.fragments_only && !super::delay::is_fragment(u) {
                return Ok(false);
            }
            // Each card of a share is a distinct GPU.
            if self.picks[c].iter().any(|p| p.device == dev && p.req == r) {
                return Ok(false);
            }
            let Ok(per) = share_req.per_device(entry.memory) else {
                return Ok(false);
            };
            if !self.claim_share_fits(c, dev, per) {
                return Ok(false);
            }
            let Some(booking) = booking::book_share(
                self.snap,
                dev,
                spec,
                per,
                self.inflight.get(&dev),
                self.inflight_over.get(&dev).copied(),
            ) else {
                return Ok(false);
            };
            // Only the guarantee is consumed (and written as consumedCapacity).
            let (mem, comp) = entry.share_names();
            let asked: Amounts = [
                (mem, Quantity::from_bytes(booking.memory.guaranteed)),
                (
                    comp,
                    Quantity::from_units(i64::try_from(booking.compute.guaranteed).unwrap_or(0)),
                ),
            ]
            .into();
            over = booking.overcommitted().then(|| booking.over());
            if entry.multi {
                let used = self.used_with_inflight(dev);
                let requests: Amounts = asked
                    .into_iter()
                    .filter(|(k, _)| entry.capacity.contains_key(k))
                    .collect();
                match capacity::try_consume(&entry.capacity, &requests, &[&used]) {
                    Err(m) => return Err(Abort::Fatal(m)),
                    Ok(None) => return Ok(false),
                    Ok(Some(x)) => {
                        consumed = Some(x.clone());
                        inflight = Some(x);
                    }
                }
            } else {
                inflight = Some(asked);
            }
            share = Some(per);
        } else {
            // Kubernetes' own sizing (`CmpRequestOverCapacity`): every requested capacity
            // must be declared, each declared one is consumed by its request policy.
            if self.in_use(c, spec, dev) {
                return Ok(false);
            }
            if spec.fragments_only && entry.tessera_shared && !super::delay::is_fragment(u) {
                return Ok(false);
            }
            let empty = Amounts::new();
            let requests = match &spec.capacity {
                None => Some(empty),
                Some(reqs) => capacity::resolve_requests(reqs, &entry.capacity),
            };
            let Some(requests) = requests else {
                return Ok(false);
            };
            let used = if entry.multi {
                self.used_with_inflight(dev)
            } else {
                Amounts::new()
            };
            match capacity::try_consume(&entry.capacity, &requests, &[&used]) {
                Err(m) => return Err(Abort::Fatal(m)),
                Ok(None) => return Ok(false),
                Ok(Some(x)) if entry.multi => {
                    consumed = Some(x.clone());
                    inflight = Some(x);
                }
                Ok(Some(_)) => exclusive = true,
            }
            if entry.tessera_shared && entry.multi {
                // What was booked of a Tessera GPU (a default one included) is a share the
                // node enforces. Its memory is whole bytes and its compute whole percent: a
                // fraction (possible only where a policy has no step, which Tessera's GPUs
                // never publish) could not be enforced, so such a GPU does not fit.
                let (mem, comp) = entry.share_names();
                let whole = |name: &str| -> Option<i64> {
                    consumed
                        .as_ref()
                        .and_then(|x| x.get(name))
                        .map_or(Some(0), |q| q.as_units())
                };
                let (Some(bytes), Some(pct)) = (
                    whole(&mem).and_then(|v| u64::try_from(v).ok()),
                    whole(&comp),
                ) else {
                    return Ok(false);
                };
                share = Some(PerDeviceShare {
                    memory_bytes: bytes,
                    compute_percent: pct,
                });
            }
        }
        // SMs an online share is guaranteed stay its own (`overcommit::threads_fit`).
        let threads = share.filter(|_| entry.tessera_shared).map(|per| {
            (
                overcommit::threads(per.compute_percent),
                overcommit::guards_sms(spec.tier, per.compute_percent),
            )
        });
        if let Some(t) = threads {
            let (used, guarded) = self
                .snap
                .share_threads(dev, self.inflight_threads.get(&dev).copied());
            if !overcommit::threads_fit(used, guarded, t) {
                return Ok(false);
            }
        }
        let holds = !spec.admin;
        // Counters are consumed when a device goes from free to held.
        let counters =
            holds && !entry.consumes.is_empty() && u.holders() == 0 && inflight_holders == 0;
        if counters && !self.counters_fit(dev) {
            return Ok(false);
        }
        if !self.add_constraints(c, r, a, dev) {
            return Ok(false);
        }
        if counters {
            for (set, amounts) in &entry.consumes {
                let slot = self
                    .counters
                    .entry((entry.pool_idx, set.clone()))
                    .or_default();
                capacity::add_into(slot, amounts);
            }
        }
        let mark = !entry.multi && (exclusive || spec.admin);
        if mark {
            self.excl.push((dev, c));
        }
        if holds {
            *self.holders.entry(dev).or_default() += 1;
        }
        if let Some(x) = &inflight {
            capacity::add_into(self.inflight.entry(dev).or_default(), x);
        }
        if let Some((m, k)) = over {
            let slot = self.inflight_over.entry(dev).or_default();
            *slot = (slot.0.saturating_add(m), slot.1.saturating_add(k));
        }
        if let Some((t, guards)) = threads {
            let slot = self.inflight_threads.entry(dev).or_default();
            *slot = (slot.0.saturating_add(t), slot.1 + u32::from(guards));
        }
        self.picks[c].push(Pick {
            req: r,
            alt: a,
            device: dev,
            consumed,
            share,
            inflight,
            over,
            threads,
            exclusive: mark,
            counters,
        });
        Ok(true)
    }

    /// Whether claim `c` may add `per` to what its earlier requests already share of GPU
    /// `dev`: the node gives one claim one budget per GPU (the shares of its requests add
    /// up, `node::prepared::PreparedClaim`), and that budget may use at most the GPU. Without
    /// over-commit the GPU's capacity already ensures it; a batch share may use more than
    /// it is guaranteed, so two of them could otherwise add up past the GPU and be refused
    /// only at prepare.
    fn claim_share_fits(&self, c: usize, dev: usize, per: PerDeviceShare) -> bool {
        let entry = &self.snap.devices[dev];
        let (memory, compute) = self.picks[c]
            .iter()
            .filter(|p| p.device == dev)
            .filter_map(|p| p.share)
            .fold((per.memory_bytes, per.compute_percent), |(m, k), s| {
                (
                    m.saturating_add(s.memory_bytes),
                    k.saturating_add(s.compute_percent),
                )
            });
        memory <= entry.memory && compute <= entry.compute
    }

    fn untake(&mut self, c: usize) {
        let Some(pick) = self.picks[c].pop() else {
            return;
        };
        let dev = pick.device;
        let spec = &self.specs[c].requests[pick.req][pick.alt];
        self.remove_constraints(c, pick.req, pick.alt, dev);
        if pick.exclusive
            && let Some(pos) = self.excl.iter().rposition(|&(d, cl)| d == dev && cl == c)
        {
            self.excl.remove(pos);
        }
        if !spec.admin
            && let Some(h) = self.holders.get_mut(&dev)
        {
            *h = h.saturating_sub(1);
        }
        if let Some(x) = &pick.inflight
            && let Some(slot) = self.inflight.get_mut(&dev)
        {
            capacity::sub_from(slot, x);
        }
        if let Some((m, k)) = pick.over
            && let Some(slot) = self.inflight_over.get_mut(&dev)
        {
            *slot = (slot.0.saturating_sub(m), slot.1.saturating_sub(k));
        }
        if let Some((t, guards)) = pick.threads
            && let Some(slot) = self.inflight_threads.get_mut(&dev)
        {
            *slot = (
                slot.0.saturating_sub(t),
                slot.1.saturating_sub(u32::from(guards)),
            );
        }
        if pick.counters {
            let entry = &self.snap.devices[dev];
            for (set, amounts) in &entry.consumes {
                if let Some(slot) = self.counters.get_mut(&(entry.pool_idx, set.clone())) {
                    capacity::sub_from(slot, amounts);
                }
            }
        }
    }

    fn counters_fit(&self, dev: usize) -> bool {
        let entry = &self.snap.devices[dev];
        let pool = &self.snap.pools[entry.pool_idx];
        for (set, amounts) in &entry.consumes {
            let total = pool.counters.get(set);
            let used = self.snap.counters_used[entry.pool_idx].get(set);
            let flight = self.counters.get(&(entry.pool_idx, set.clone()));
            for (name, q) in amounts {
                let get = |m: Option<&Amounts>| {
                    m.and_then(|m| m.get(name))
                        .copied()
                        .unwrap_or(Quantity::ZERO)
                };
                let need = get(used).saturating_add(get(flight)).saturating_add(*q);
                if need > get(total) {
                    return false;
                }
            }
        }
        true
    }

    #[allow(clippy::many_single_char_names)] // Reason: indices as in `step`.
    fn add_constraints(&mut self, c: usize, r: usize, a: usize, dev: usize) -> bool {
        let spec = &self.specs[c].requests[r][a];
        for (i, k) in self.specs[c].constraints.iter().enumerate() {
            if !k.applies(&spec.base, &spec.full) {
                continue;
            }
            let Some(next) = self.constraint_with(c, i, dev) else {
                for j in 0..i {
                    self.remove_one(c, j, &spec.base.clone(), &spec.full.clone(), dev);
                }
                return false;
            };
            match &mut self.constraints[c][i] {
                ConstraintState::Match { common: list }
                | ConstraintState::Distinct { values: list } => {
                    list.push((dev, next));
                }
            }
        }
        true
    }

    /// What constraint `i` of claim `c` keeps once `dev` is added, or `None` when the device
    /// breaks it (lacks the attribute, or its values do not meet the others').
    fn constraint_with(&self, c: usize, i: usize, dev: usize) -> Option<AttrSet> {
        let value = lookup_attr(self.snap, dev, &self.specs[c].constraints[i].attribute)?;
        match &self.constraints[c][i] {
            ConstraintState::Match { common } => match common.last() {
                None => Some(value),
                Some((_, set)) => Some(set.intersect(&value)).filter(|s| !s.is_empty()),
            },
            ConstraintState::Distinct { values } => values
                .iter()
                .all(|(_, y)| y.disjoint(&value))
                .then_some(value),
        }
    }

    /// Whether adding `dev` for alternative `a` of request `r` keeps every constraint of claim
    /// `c` that covers it (nothing is recorded).
    #[allow(clippy::many_single_char_names)] // Reason: indices as in `step`.
    fn constraints_admit(&self, c: usize, r: usize, a: usize, dev: usize) -> bool {
        let spec = &self.specs[c].requests[r][a];
        self.specs[c]
            .constraints
            .iter()
            .enumerate()
            .filter(|(_, k)| k.applies(&spec.base, &spec.full))
            .all(|(i, _)| self.constraint_with(c, i, dev).is_some())
    }

    fn remove_one(&mut self, c: usize, i: usize, base: &str, full: &str, dev: usize) {
        if !self.specs[c].constraints[i].applies(base, full) {
            return;
        }
        match &mut self.constraints[c][i] {
            ConstraintState::Match { common: list }
            | ConstraintState::Distinct { values: list } => {
                if let Some(pos) = list.iter().rposition(|(d, _)| *d == dev) {
                    list.remove(pos);
                }
            }
        }
    }

    fn remove_constraints(&mut self, c: usize, r: usize, a: usize, dev: usize) {
        let base = self.specs[c].requests[r][a].base.clone();
        let full = self.specs[c].requests[r][a].full.clone();
        for i in 0..self.specs[c].constraints.len() {
            self.remove_one(c, i, &base, &full, dev);
        }
    }
}

/// How one device fares for one request against committed use only (for failure reasons).
pub(crate) fn classify(
    snap: &Snapshot,
    cache: &mut SelectorCache,
    spec: &ReqSpec,
    dev: usize,
) -> Result<Outcome, Abort> {
    let o = static_outcome(snap, cache, spec, dev)?;
    if o != Outcome::Fits {
        return Ok(o);
    }
    Ok(dynamic_outcome(snap, spec, dev))
}

/// How a device that passed the static checks fares against committed use only.
fn dynamic_outcome(snap: &Snapshot, spec: &ReqSpec, dev: usize) -> Outcome {
    if spec.admin {
        return Outcome::Fits;
    }
    let entry = &snap.devices[dev];
    let u = &snap.uses[dev];
    if let Some(share) = spec.share.as_ref() {
        if u.exclusive > 0 {
            return Outcome::InUse;
        }
        let Ok(per) = share.per_device(entry.memory) else {
            return Outcome::TooSmall;
        };
        if booking::book_share(snap, dev, spec, per, None, None).is_none() {
            return Outcome::TooFull;
        }
    } else if (entry.multi && u.exclusive > 0) || (!entry.multi && u.holders() > 0) {
        return Outcome::InUse;
    } else if !capacity_fits(snap, spec, dev, true) {
        // A capacity the device does not declare, or a request too big even for the empty
        // device, is said as such, not as "too full".
        let declared = spec
            .capacity
            .as_ref()
            .is_none_or(|reqs| capacity::resolve_requests(reqs, &entry.capacity).is_some());
        return if !declared {
            Outcome::Undeclared
        } else if capacity_fits(snap, spec, dev, false) {
            Outcome::TooFull
        } else {
            Outcome::TooSmall
        };
    }
    if !entry.consumes.is_empty() && u.holders() == 0 {
        let pool = &snap.pools[entry.pool_idx];
        for (set, amounts) in &entry.consumes {
            for (name, q) in amounts {
                let get = |m: Option<&Amounts>| {
                    m.and_then(|m| m.get(name))
                        .copied()
                        .unwrap_or(Quantity::ZERO)
                };
                let used = get(snap.counters_used[entry.pool_idx].get(set));
                if used.saturating_add(*q) > get(pool.counters.get(set)) {
                    return Outcome::Counters;
                }
            }
        }
    }
    Outcome::Fits
}

/// Whether a device has room for a request's capacity: against committed use only when
/// `committed`, else on the empty device.
fn capacity_fits(snap: &Snapshot, spec: &ReqSpec, dev: usize, committed: bool) -> bool {
    let entry = &snap.devices[dev];
    let requests = match &spec.capacity {
        None => Some(Amounts::new()),
        Some(reqs) => capacity::resolve_requests(reqs, &entry.capacity),
    };
    let Some(requests) = requests else {
        return false;
    };
    let used = if entry.multi && committed {
        snap.uses[dev].consumed.clone()
    } else {
        Amounts::new()
    };
    matches!(
        capacity::try_consume(&entry.capacity, &requests, &[&used]),
        Ok(Some(_))
    )
}
