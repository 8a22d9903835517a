//! The node loop of one placement: candidates pre-filtered without a search (a sound lower
//! bound of the pod's need against each node's summary, and its host room), handed out in the
//! policy's order (scores memoized per node), and searched one after another until one fits;
//! a pod that fits nowhere is diagnosed.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1 as res;

use super::abort::{Hazards, aborted};
use super::ask::pod_ask;
use super::diagnose::diagnose;
use super::policy::{NodeView, ScoreInput};
use super::reach::{class_matches_multi, node_devices};
use super::reason::{FailureKind, Unsatisfiable};
use super::request::ClaimSpec;
use super::result;
use super::search::{self, Abort, Search};
use super::snapshot::{MEMO_PER_NODE, NodeSummary, SelectorCache, Snapshot};
use super::{Allocator, Placement};
use crate::placement::fragmentation::HostResources;
use crate::rules::share::MemoryAsk;

impl Allocator {
    /// Places prepared claims; `explain` diagnoses a pod that fits nowhere.
    #[allow(clippy::too_many_lines, clippy::too_many_arguments)] // Reason: the whole decision in one place: order, search, build.
    pub(super) fn place_specs(
        &self,
        snapshot: &Snapshot,
        cache: &mut SelectorCache,
        claims: &[&res::ResourceClaim],
        specs: &[ClaimSpec],
        candidates: &[Node],
        host: &HostResources,
        explain: bool,
    ) -> Result<Placement, Unsatisfiable> {
        let first = specs.first().map(|s| s.name.clone()).unwrap_or_default();
        if candidates.is_empty() {
            return Err(Unsatisfiable::single(first, None, FailureKind::NoNodes));
        }
        let need = quick_need(snapshot, cache, specs);
        // Policies that order nodes look at every candidate, so the cached id list is made
        // exact first; first-fit usually stops early and checks only the nodes it visits.
        let ids = snapshot.candidate_ids(cache, candidates, self.policy.orders_nodes());
        let id_of = |pos: usize| ids.get(snapshot, candidates, pos);
        let empty = NodeSummary::default();
        let summary = |pos: usize| id_of(pos).map_or(&empty, |id| &snapshot.summaries[id]);
        let host_of = |pos: usize| id_of(pos).and_then(|id| snapshot.hosts[id]);
        let host_fits = |pos: usize| host_of(pos).is_none_or(|h| h.free().holds(host));
        let may_fit = |pos: usize| {
            host_fits(pos) && (!snapshot.global.is_empty() || need.may_fit(summary(pos)))
        };
        let ask = pod_ask(specs, host);
        // CPU-only pods take no GPU and hold nothing back; where their CPU goes is the
        // policies' concern (stranded GPU).
        let held_back = snapshot
            .model_free
            .held_back(u64::from(ask.cards) * u64::from(ask.gpu_milli), |m| {
                snapshot.workload.model_pressure(Some(m))
            });
        let input = ScoreInput {
            ask: &ask,
            workload: &snapshot.workload,
            model_shares: &snapshot.model_shares,
            gaps: &snapshot.gaps,
            held_back: &held_back,
        };
        let view = |pos: usize| {
            let s = summary(pos);
            let h = host_of(pos);
            NodeView {
                name: candidates[pos].metadata.name.as_deref().unwrap_or_default(),
                position: pos,
                devices: s.devices,
                used_permille: s.used_permille,
                gpu_free: &s.gpu_free,
                model: s.model.as_deref(),
                host_free: h.map(|h| h.free()),
                host_total: h.map(|h| h.allocatable),
            }
        };
        // Policy order is (score, position); a heap hands out only the nodes actually tried.
        let positions: Box<dyn Iterator<Item = usize>> = if self.policy.orders_nodes() {
            let memo = &mut cache.scores;
            let cacheable = self.policy.cacheable();
            if cacheable
                && (memo.policy != self.policy.name()
                    || memo.workload != snapshot.workload.version()
                    || memo.nodes.len() != snapshot.summaries.len())
            {
                self.policy.name().clone_into(&mut memo.policy);
                memo.workload = snapshot.workload.version();
                memo.nodes = vec![(u64::MAX, Vec::new()); snapshot.summaries.len()];
            }
            let mut scored: Vec<Reverse<((i64, i64), usize)>> =
                Vec::with_capacity(candidates.len());
            for pos in (0..candidates.len()).filter(|&pos| may_fit(pos)) {
                let id = id_of(pos).filter(|_| cacheable);
                let cached = id.and_then(|id| {
                    let (version, entries) = &memo.nodes[id];
                    (*version == snapshot.node_versions[id])
                        .then(|| entries.iter().find(|(a, _)| *a == ask).map(|e| e.1))
                        .flatten()
                });
                let score = cached.unwrap_or_else(|| {
                    let score = self.policy.node_score(&view(pos), &input);
                    if let Some(id) = id {
                        let slot = &mut memo.nodes[id];
                        if slot.0 != snapshot.node_versions[id] || slot.1.len() >= MEMO_PER_NODE {
                            *slot = (snapshot.node_versions[id], Vec::new());
                        }
                        slot.1.push((ask.clone(), score));
                    }
                    score
                });
                let rank = self.policy.node_rank(&view(pos), &input);
                scored.push(Reverse(((rank, score), pos)));
            }
            let mut heap = BinaryHeap::from(scored);
            Box::new(std::iter::from_fn(move || {
                heap.pop().map(|Reverse((_, pos))| pos)
            }))
        } else {
            Box::new((0..candidates.len()).filter(move |&pos| may_fit(pos)))
        };
        let hazards = Hazards::of(snapshot, cache, specs);
        let run_at = |cache: &mut SelectorCache, pos: usize, budget: u64| {
            let node = &candidates[pos];
            let node_view = view(pos);
            let scoring = search::Scoring {
                node: &node_view,
                input: &input,
                gpu_devices: &summary(pos).gpu_devices,
            };
            let devices = node_devices(snapshot, node, id_of(pos));
            let mut search = Search::new(
                snapshot,
                cache,
                specs,
                self.policy.as_ref(),
                node,
                devices,
                budget,
                scoring,
            );
            let outcome = search.run();
            let picks = std::mem::take(&mut search.picks);
            let selected = std::mem::take(&mut search.selected);
            (outcome, search.steps, picks, selected)
        };
        // An error on a node aborts the attempt (kube-scheduler); a misfit moves on.
        let stop = |pos: usize, abort: Abort| -> Unsatisfiable {
            let kind = match abort {
                Abort::Budget => FailureKind::SearchLimit(self.options.max_steps),
                Abort::Cel(e) => aborted(&candidates[pos], e.to_string()),
                Abort::Error(m) => aborted(&candidates[pos], m),
                Abort::Fatal(m) => FailureKind::Invalid(m),
            };
            Unsatisfiable::single(first.clone(), None, kind)
        };
        let mut budget = self.options.max_steps;
        let mut searched = vec![false; candidates.len()];
        let mut found = None;
        for pos in positions {
            searched[pos] = true;
            let (outcome, steps, picks, selected) = run_at(cache, pos, budget);
            budget = budget.saturating_sub(steps);
            match outcome {
                Ok(true) => {
                    found = Some((pos, picks, selected));
                    break;
                }
                Ok(false) => {}
                Err(abort) => return Err(stop(pos, abort)),
            }
        }
        // The nodes not searched where an error could happen are searched too: an error
        // there aborts the attempt even though a node fits (`super::abort`).
        if !hazards.none() {
            for pos in 0..candidates.len() {
                if searched[pos] || !host_fits(pos) || !hazards.on(snapshot, &candidates[pos]) {
                    continue;
                }
                let (outcome, steps, _, _) = run_at(cache, pos, budget);
                budget = budget.saturating_sub(steps);
                if let Err(abort) = outcome {
                    return Err(stop(pos, abort));
                }
            }
        }
        if let Some((pos, picks, selected)) = found {
            let node_name = candidates[pos].metadata.name.clone().unwrap_or_default();
            let allocations = specs
                .iter()
                .zip(claims)
                .enumerate()
                .map(|(i, (spec, claim))| {
                    result::build(
                        &self.options.driver_name,
                        snapshot,
                        spec,
                        claim,
                        &picks[i],
                        &selected[i],
                        &node_name,
                    )
                })
                .collect();
            return Ok(Placement {
                node: node_name,
                allocations,
            });
        }
        let without_room = (0..candidates.len()).filter(|&pos| !host_fits(pos)).count();
        if specs.is_empty() || without_room == candidates.len() {
            let nodes = u32::try_from(without_room).unwrap_or(u32::MAX);
            return Err(Unsatisfiable::single(
                first,
                None,
                FailureKind::HostResources { nodes },
            ));
        }
        if !explain {
            return Err(Unsatisfiable::single(first, None, FailureKind::Unexplained));
        }
        let ids = snapshot.candidate_ids(cache, candidates, true);
        Err(diagnose(snapshot, cache, specs, candidates, &ids))
    }
}

/// A sound lower bound of what a pod needs of one node, to skip nodes without searching.
#[derive(Debug, Default)]
struct QuickNeed {
    plain: u32,
    share_cards: u32,
    share_memory: u64,
    /// The largest `memoryPercent` of a share (0: none).
    share_percent: u8,
}

impl QuickNeed {
    fn may_fit(&self, s: &NodeSummary) -> bool {
        s.free_plain >= self.plain
            && (self.share_cards == 0
                || (s.share_avail >= self.share_cards
                    && s.share_max_free >= self.share_memory
                    && (self.share_percent == 0
                        || s.share_free
                            .iter()
                            .filter(|&&(free, total)| {
                                crate::rules::share::percent_bytes(total, self.share_percent)
                                    <= free
                            })
                            .count()
                            >= self.share_cards as usize)))
    }
}

fn quick_need(snap: &Snapshot, cache: &mut SelectorCache, specs: &[ClaimSpec]) -> QuickNeed {
    let mut need = QuickNeed::default();
    for claim in specs {
        for (alts, &fa) in claim.requests.iter().zip(&claim.first_available) {
            let [req] = alts.as_slice() else { continue };
            if fa || req.admin || req.all {
                continue;
            }
            let count = u32::try_from(req.count).unwrap_or(u32::MAX);
            // Over-committed memory may fit where no memory is free: no sound bound.
            if req.share.is_some() && req.overcommit.memory.overcommits() {
                continue;
            }
            if let Some(share) = &req.share {
                need.share_cards = need.share_cards.max(share.cards);
                match share.memory {
                    MemoryAsk::Bytes(b) => {
                        need.share_memory = need.share_memory.max(b);
                    }
                    MemoryAsk::Percent(p) => {
                        need.share_percent = need.share_percent.max(p);
                    }
                }
            } else if req.capacity.is_none() && !class_matches_multi(snap, cache, req) {
                need.plain += count;
            }
        }
    }
    need
}
