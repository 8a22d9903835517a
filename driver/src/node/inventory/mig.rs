//! Placing MIG instances on a GPU: every instance needs a start placement valid for its profile,
//! no two instances may overlap in memory slices, and the compute slices must fit.

use super::models::{GpuModel, MigProfile};

/// One instance to place: its profile and, when the file fixes it, its placement.
#[derive(Debug, Clone, Copy)]
pub(super) struct Wanted {
    pub(super) profile: &'static MigProfile,
    pub(super) placement: Option<u32>,
}

/// Why a set of instances cannot be placed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum PlaceError {
    /// More compute slices than the GPU has.
    TooManySlices { needed: u32, available: u32 },
    /// The slices fit in number but no valid placement exists.
    NoPlacement,
}

/// Finds a placement for every instance, deterministically: larger instances first, each at the
/// lowest free valid start, backtracking when a later one does not fit. Returns
/// `(profile, placement)` pairs ordered by placement.
pub(super) fn place(
    model: &GpuModel,
    wanted: &[Wanted],
) -> Result<Vec<(&'static MigProfile, u32)>, PlaceError> {
    let needed: u32 = wanted.iter().map(|w| w.profile.compute_slices).sum();
    if needed > model.mig_compute_slices {
        return Err(PlaceError::TooManySlices {
            needed,
            available: model.mig_compute_slices,
        });
    }
    let mut order: Vec<Wanted> = wanted.to_vec();
    // Fixed placements first, then the largest; ties by name so the search is deterministic.
    order.sort_by(|a, b| {
        a.placement
            .is_none()
            .cmp(&b.placement.is_none())
            .then(b.profile.memory_slices.cmp(&a.profile.memory_slices))
            .then(b.profile.compute_slices.cmp(&a.profile.compute_slices))
            .then(a.profile.name.cmp(b.profile.name))
            .then(a.placement.cmp(&b.placement))
    });
    let mut chosen = Vec::with_capacity(order.len());
    if !search(&order, 0, 0, &mut chosen) {
        return Err(PlaceError::NoPlacement);
    }
    let mut placed: Vec<(&'static MigProfile, u32)> = order
        .iter()
        .zip(chosen)
        .map(|(w, start)| (w.profile, start))
        .collect();
    placed.sort_by(|a, b| a.1.cmp(&b.1).then(a.0.name.cmp(b.0.name)));
    Ok(placed)
}

fn mask(profile: &MigProfile, start: u32) -> u32 {
    ((1_u32 << profile.memory_slices) - 1) << start
}

fn search(order: &[Wanted], i: usize, used: u32, chosen: &mut Vec<u32>) -> bool {
    let Some(w) = order.get(i) else {
        return true;
    };
    // Identical unfixed instances take ascending placements, which prunes permutations.
    let floor = match (i.checked_sub(1).and_then(|p| order.get(p)), chosen.last()) {
        (Some(prev), Some(&last))
            if prev.placement.is_none()
                && w.placement.is_none()
                && prev.profile.name == w.profile.name =>
        {
            last + 1
        }
        _ => 0,
    };
    let candidates: Vec<u32> = match w.placement {
        Some(p) => vec![p],
        None => w
            .profile
            .placements
            .iter()
            .copied()
            .filter(|&p| p >= floor)
            .collect(),
    };
    for start in candidates {
        if !w.profile.placements.contains(&start) {
            continue;
        }
        let m = mask(w.profile, start);
        if used & m != 0 {
            continue;
        }
        chosen.push(start);
        if search(order, i + 1, used | m, chosen) {
            return true;
        }
        chosen.pop();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::inventory::models::lookup;

    fn wanted(model: &GpuModel, profiles: &[&str]) -> Vec<Wanted> {
        profiles
            .iter()
            .map(|p| Wanted {
                profile: model.mig_profile(p).expect("profile"),
                placement: None,
            })
            .collect()
    }

    #[test]
    fn seven_small_instances_fill_an_a100() {
        let m = lookup("a100-40g").expect("model");
        let placed = place(m, &wanted(m, &["1g.5gb"; 7])).expect("fits");
        let starts: Vec<u32> = placed.iter().map(|p| p.1).collect();
        assert_eq!(starts, vec![0, 1, 2, 3, 4, 5, 6]);
    }

    #[test]
    fn mixed_instances_are_packed_without_overlap() {
        let m = lookup("a100-40g").expect("model");
        let placed = place(m, &wanted(m, &["2g.10gb", "3g.20gb", "2g.10gb"])).expect("fits");
        assert_eq!(placed.len(), 3);
        let mut used = 0;
        for (p, s) in &placed {
            assert_eq!(used & mask(p, *s), 0);
            used |= mask(p, *s);
        }
    }

    #[test]
    fn too_many_slices_are_rejected() {
        let m = lookup("a100-40g").expect("model");
        assert_eq!(
            place(m, &wanted(m, &["4g.20gb", "4g.20gb"])),
            Err(PlaceError::TooManySlices {
                needed: 8,
                available: 7
            })
        );
        // 4g and 3g fit in number, but two 4g-sized regions do not exist for 4g+4g; and
        // 4g.20gb plus 1g.10gb x2 plus 1g.5gb fit 7 slices yet need 9 memory slices.
        assert_eq!(
            place(m, &wanted(m, &["4g.20gb", "1g.10gb", "1g.10gb", "1g.5gb"])),
            Err(PlaceError::NoPlacement)
        );
    }
}
