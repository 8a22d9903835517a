//! The caches shared by every allocation on one snapshot: compiled CEL selectors and their
//! per-device results, what each class selects, the last candidate list's node ids, and the
//! policies' node scores.

use std::collections::HashMap;
use std::sync::{Arc, MutexGuard};

use k8s_openapi::api::core::v1::Node;

use super::Snapshot;
use crate::error::{Error, Result};
use crate::rules::cel::CompiledExpression;

/// Cached node scores of one policy, valid while node, pod ask and workload stay the same.
#[derive(Debug, Default)]
pub(crate) struct ScoreMemo {
    pub(crate) policy: String,
    pub(crate) workload: u64,
    /// Per node id: the node version the entries belong to, and (ask, score) pairs.
    pub(crate) nodes: Vec<(u64, Vec<(crate::placement::allocator::PodAsk, i64)>)>,
}

/// Most asks remembered per node before its entries are dropped.
pub(crate) const MEMO_PER_NODE: usize = 64;

/// Compiled selectors and their per-device results, shared by every allocation on a snapshot.
#[derive(Debug, Default)]
pub(crate) struct SelectorCache {
    ids: HashMap<String, usize>,
    exprs: Vec<Arc<CompiledExpression>>,
    /// Per expression, per device: 0 unknown, 1 false, 2 true, 3 error.
    results: Vec<Vec<u8>>,
    errors: HashMap<(usize, usize), Error>,
    /// Per class: whether its selectors match any device with `allowMultipleAllocations`.
    pub(crate) class_matches_multi: HashMap<String, bool>,
    /// Per class: the devices its selectors select (devices never change in a snapshot).
    pub(crate) class_devices: HashMap<String, Arc<Vec<usize>>>,
    /// Per class and request selectors: the GPU models of the devices they select.
    pub(crate) request_models: HashMap<(String, Vec<usize>), Arc<Vec<String>>>,
    /// Per class and request selectors: the devices where one of them fails at runtime.
    pub(crate) error_devices: HashMap<(String, Vec<usize>), Arc<Vec<usize>>>,
    candidate_names: Arc<Vec<String>>,
    candidate_ids: Arc<Vec<Option<usize>>>,
    /// Node scores of cacheable policies.
    pub(crate) scores: ScoreMemo,
}

/// The node ids of the last candidate list seen; trusted per position only where the name
/// still matches, so a stale list costs lookups, never a wrong node.
#[derive(Debug, Clone)]
pub(crate) struct CandidateIds {
    names: Arc<Vec<String>>,
    ids: Arc<Vec<Option<usize>>>,
    /// Checked against this very candidate list: every position is right.
    exact: bool,
}

impl CandidateIds {
    /// The node id of candidate `pos` (`None` for a node without local devices).
    pub(crate) fn get(&self, snap: &Snapshot, candidates: &[Node], pos: usize) -> Option<usize> {
        if self.exact {
            return self.ids.get(pos).copied().flatten();
        }
        let name = candidates[pos].metadata.name.as_deref().unwrap_or_default();
        match (self.names.get(pos), self.ids.get(pos)) {
            (Some(cached), Some(&id)) if cached == name => id,
            _ => snap.node_ids.get(name).copied(),
        }
    }
}

impl Snapshot {
    /// The node ids of `candidates`, refreshing the cached list when it differs (every
    /// position is then exact); with `refresh` false the last list is reused as it is.
    pub(crate) fn candidate_ids(
        &self,
        cache: &mut SelectorCache,
        candidates: &[Node],
        refresh: bool,
    ) -> CandidateIds {
        let same = || {
            cache.candidate_names.len() == candidates.len()
                && cache
                    .candidate_names
                    .iter()
                    .zip(candidates)
                    .all(|(a, n)| a.as_str() == n.metadata.name.as_deref().unwrap_or_default())
        };
        let exact = refresh;
        if refresh && !same() {
            let names: Vec<String> = candidates
                .iter()
                .map(|n| n.metadata.name.clone().unwrap_or_default())
                .collect();
            cache.candidate_ids = Arc::new(
                names
                    .iter()
                    .map(|n| self.node_ids.get(n).copied())
                    .collect(),
            );
            cache.candidate_names = Arc::new(names);
        }
        CandidateIds {
            names: Arc::clone(&cache.candidate_names),
            ids: Arc::clone(&cache.candidate_ids),
            exact,
        }
    }

    /// Locks the selector cache for one allocation run.
    pub(crate) fn selectors(&self) -> MutexGuard<'_, SelectorCache> {
        self.selectors
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Compiles (once) an expression and returns its id in the cache.
    pub(crate) fn compile(&self, cache: &mut SelectorCache, expression: &str) -> Result<usize> {
        if let Some(&id) = cache.ids.get(expression) {
            return Ok(id);
        }
        let compiled = self.cel.compile(expression)?;
        let id = cache.exprs.len();
        cache.exprs.push(compiled);
        cache.results.push(vec![0; self.devices.len()]);
        cache.ids.insert(expression.to_owned(), id);
        Ok(id)
    }

    /// Whether expression `expr` selects device `idx` (evaluated once, then cached).
    pub(crate) fn eval(&self, cache: &mut SelectorCache, expr: usize, idx: usize) -> Result<bool> {
        match cache.results[expr][idx] {
            1 => return Ok(false),
            2 => return Ok(true),
            3 => {
                if let Some(e) = cache.errors.get(&(expr, idx)) {
                    return Err(e.clone());
                }
            }
            _ => {}
        }
        match cache.exprs[expr].evaluate(&self.devices[idx].cel()) {
            Ok(b) => {
                cache.results[expr][idx] = if b { 2 } else { 1 };
                Ok(b)
            }
            Err(e) => {
                cache.results[expr][idx] = 3;
                cache.errors.insert((expr, idx), e.clone());
                Err(e)
            }
        }
    }
}
