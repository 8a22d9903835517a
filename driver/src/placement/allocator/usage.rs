//! What every device has in use: the operator's view of a snapshot (`tessera demo`, and the
//! controller's inspect view).

use crate::rules::quantity::{Format, Quantity};

use super::Snapshot;

/// The use of one device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceUsage {
    /// The driver that publishes it.
    pub driver: String,
    /// Its pool.
    pub pool: String,
    /// Its name.
    pub device: String,
    /// Allocations holding the whole device.
    pub exclusive: u32,
    /// Share allocations on it.
    pub shares: u32,
    /// Its memory (0 when it declares none).
    pub memory_total: Quantity,
    /// Memory in use: all of it when held whole, else what its shares are guaranteed.
    pub memory_used: Quantity,
    /// Compute in use, in percent: 100 when held whole, else what its shares are guaranteed.
    pub compute_used: i64,
    /// Memory booked by batch shares beyond their guarantee ([`crate::rules::overcommit`]).
    pub memory_overcommitted: Quantity,
    /// Compute booked by batch shares beyond their guarantee, in percent.
    pub compute_overcommitted: i64,
}

impl Snapshot {
    /// The use of every device, in snapshot order (pools, then devices as published).
    pub fn device_usage(&self) -> Vec<DeviceUsage> {
        self.devices
            .iter()
            .zip(&self.uses)
            .map(|(entry, used)| {
                let (memory_name, compute_name) = entry.share_names();
                let memory_total = entry
                    .capacity
                    .get(&memory_name)
                    .map_or(Quantity::ZERO, |c| c.value);
                let whole = used.exclusive > 0;
                let memory_used = if whole {
                    memory_total
                } else {
                    used.consumed
                        .get(&memory_name)
                        .copied()
                        .unwrap_or(Quantity::ZERO)
                };
                let compute_used = if whole {
                    100
                } else {
                    used.consumed
                        .get(&compute_name)
                        .and_then(|q| q.as_units())
                        .unwrap_or(0)
                };
                // Memory prints as bytes do (`47Gi`), whatever style the shares were written in.
                let memory_used = Quantity::from_nanos(memory_used.nanos(), Format::BinarySi);
                let over = |name: &str| used.over.get(name).copied().unwrap_or(Quantity::ZERO);
                let memory_overcommitted =
                    Quantity::from_nanos(over(&memory_name).nanos(), Format::BinarySi);
                let compute_overcommitted = over(&compute_name).as_units().unwrap_or(0);
                DeviceUsage {
                    driver: entry.driver.clone(),
                    pool: entry.pool.clone(),
                    device: entry.device().name.clone(),
                    exclusive: used.exclusive,
                    shares: used.shares,
                    memory_total,
                    memory_used,
                    compute_used,
                    memory_overcommitted,
                    compute_overcommitted,
                }
            })
            .collect()
    }
}
