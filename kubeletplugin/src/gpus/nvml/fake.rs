//! NVML with fixed answers, for tests: GPUs from discovered facts, XID events from a queue.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tessera_driver::node::inventory::MigIds;
use tessera_driver::node::inventory::discovered::{DiscoveredGpu, DiscoveredMig};

use super::{NvmlDevice, NvmlEvents, NvmlLibrary, XidEvent, locked};
use crate::error::{Error, NvmlErrorKind, Result};

/// One fake GPU of [`FakeNvml`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FakeNvmlGpu {
    /// What the fake answers for the GPU.
    pub facts: DiscoveredGpu,
    /// Whether every query of the GPU fails with "GPU is lost".
    pub lost: bool,
}

/// NVML with fixed answers: GPUs from [`DiscoveredGpu`] facts, XID events from a queue.
#[derive(Debug, Default)]
pub struct FakeNvml {
    /// The driver version.
    pub driver_version: String,
    /// The encoded CUDA driver version.
    pub cuda_driver_version: i32,
    gpus: Mutex<Vec<FakeNvmlGpu>>,
    events: Arc<Mutex<VecDeque<XidEvent>>>,
}

impl FakeNvml {
    /// A library with these GPUs.
    pub fn new(gpus: Vec<DiscoveredGpu>) -> Self {
        Self {
            driver_version: "550.54.15".to_owned(),
            cuda_driver_version: 12040,
            gpus: Mutex::new(
                gpus.into_iter()
                    .map(|facts| FakeNvmlGpu { facts, lost: false })
                    .collect(),
            ),
            events: Arc::default(),
        }
    }

    /// Queues an XID event.
    pub fn push_xid(&self, uuid: &str, xid: u64) {
        if let Ok(mut q) = self.events.lock() {
            q.push_back(XidEvent {
                uuid: uuid.to_owned(),
                xid,
            });
        }
    }

    /// The fake's GPUs, to change what it answers.
    pub fn gpus_mut(&mut self) -> &mut Vec<FakeNvmlGpu> {
        self.gpus
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Makes GPU `index` lost (every query fails) or answering again.
    pub fn set_lost(&self, index: u32, lost: bool) {
        if let Ok(mut gpus) = self.gpus.lock() {
            for g in gpus.iter_mut().filter(|g| g.facts.index == index) {
                g.lost = lost;
            }
        }
    }
}

fn fake_lost(call: &'static str) -> Error {
    Error::Nvml {
        call,
        kind: NvmlErrorKind::GpuLost,
        message: "GPU is lost".to_owned(),
    }
}

fn fake_unsupported(call: &'static str) -> Error {
    Error::Nvml {
        call,
        kind: NvmlErrorKind::NotSupported,
        message: "not supported".to_owned(),
    }
}

struct FakeDevice {
    gpu: Option<FakeNvmlGpu>,
    mig: Option<DiscoveredMig>,
}

impl FakeDevice {
    /// A MIG device's ids; like NVML, not supported on a whole GPU (nor where the facts give
    /// none).
    fn mig_ids(&self, call: &'static str) -> Result<MigIds> {
        self.gpu(call)?;
        self.mig
            .as_ref()
            .and_then(|m| m.ids)
            .ok_or_else(|| fake_unsupported(call))
    }

    fn gpu(&self, call: &'static str) -> Result<&DiscoveredGpu> {
        match &self.gpu {
            Some(g) if g.lost => Err(fake_lost(call)),
            Some(g) => Ok(&g.facts),
            None => Err(fake_unsupported(call)),
        }
    }
}

impl NvmlDevice for FakeDevice {
    fn name(&self) -> Result<String> {
        match &self.mig {
            Some(m) => Ok(m.name.clone()),
            None => Ok(self.gpu("name")?.product_name.clone()),
        }
    }
    fn uuid(&self) -> Result<String> {
        match &self.mig {
            Some(m) => Ok(m.uuid.clone()),
            None => Ok(self.gpu("uuid")?.uuid.clone()),
        }
    }
    fn brand(&self) -> Result<String> {
        Ok(self.gpu("brand")?.brand.clone())
    }
    fn architecture(&self) -> Result<String> {
        Ok(self.gpu("architecture")?.architecture.clone())
    }
    fn compute_capability(&self) -> Result<(i32, i32)> {
        Ok(self.gpu("compute capability")?.compute_capability)
    }
    fn memory_total(&self) -> Result<u64> {
        match &self.mig {
            Some(m) => Ok(m.memory_bytes),
            None => Ok(self.gpu("memory")?.memory_bytes),
        }
    }
    fn attributes(&self) -> Result<(u32, u32)> {
        match &self.mig {
            Some(m) => Ok((m.multiprocessors, m.compute_slices)),
            None => self
                .gpu("attributes")?
                .multiprocessors
                .map(|sms| (sms, 0))
                .ok_or_else(|| fake_unsupported("attributes")),
        }
    }
    fn pci_bus_id(&self) -> Result<String> {
        Ok(self.gpu("pci")?.pci_bus_id.clone())
    }
    fn numa_node(&self) -> Result<u32> {
        self.gpu("numa")?
            .numa_node
            .ok_or_else(|| fake_unsupported("numa"))
    }
    fn minor_number(&self) -> Result<u32> {
        Ok(self.gpu("minor number")?.minor)
    }
    fn gpu_instance_id(&self) -> Result<u32> {
        self.mig_ids("gpu instance id").map(|ids| ids.gpu_instance)
    }
    fn compute_instance_id(&self) -> Result<u32> {
        self.mig_ids("compute instance id")
            .map(|ids| ids.compute_instance)
    }
    fn mig_enabled(&self) -> Result<bool> {
        let g = self.gpu("mig mode")?;
        if g.mig_capable {
            Ok(g.mig_enabled)
        } else {
            Err(fake_unsupported("mig mode"))
        }
    }
    fn max_mig_devices(&self) -> Result<u32> {
        Ok(7)
    }
    fn mig_device(&self, index: u32) -> Result<Box<dyn NvmlDevice + '_>> {
        let g = self.gpu("mig device")?;
        let mig = g
            .mig_devices
            .get(index as usize)
            .cloned()
            .ok_or(Error::Nvml {
                call: "mig device",
                kind: NvmlErrorKind::NotFound,
                message: "no MIG device in this slot".to_owned(),
            })?;
        Ok(Box::new(FakeDevice {
            gpu: self.gpu.clone(),
            mig: Some(mig),
        }))
    }
    fn nvlink_remote(&self, link: u32) -> Result<Option<String>> {
        let g = self.gpu("nvlink")?;
        match g.nvlink_peers.get(link as usize) {
            Some(peer) => Ok(Some(peer.clone())),
            None if link < 12 => Ok(None),
            None => Err(fake_unsupported("nvlink")),
        }
    }
}

struct FakeEvents {
    queue: Arc<Mutex<VecDeque<XidEvent>>>,
}

impl NvmlEvents for FakeEvents {
    fn wait(&mut self, timeout: Duration) -> Result<Option<XidEvent>> {
        let next = locked(&self.queue)?.pop_front();
        if next.is_none() {
            std::thread::sleep(timeout.min(Duration::from_millis(10)));
        }
        Ok(next)
    }
}

impl NvmlLibrary for FakeNvml {
    fn driver_version(&self) -> Result<String> {
        Ok(self.driver_version.clone())
    }
    fn cuda_driver_version(&self) -> Result<i32> {
        Ok(self.cuda_driver_version)
    }
    fn device_count(&self) -> Result<u32> {
        Ok(u32::try_from(locked(&self.gpus)?.len()).unwrap_or(u32::MAX))
    }
    fn device(&self, index: u32) -> Result<Box<dyn NvmlDevice + '_>> {
        let gpu = locked(&self.gpus)?
            .iter()
            .find(|g| g.facts.index == index)
            .cloned();
        match gpu {
            Some(g) => Ok(Box::new(FakeDevice {
                gpu: Some(g),
                mig: None,
            })),
            None => Err(Error::Nvml {
                call: "device",
                kind: NvmlErrorKind::NotFound,
                message: format!("no GPU {index}"),
            }),
        }
    }
    fn events(&self) -> Result<Box<dyn NvmlEvents + '_>> {
        Ok(Box::new(FakeEvents {
            queue: Arc::clone(&self.events),
        }))
    }
}
