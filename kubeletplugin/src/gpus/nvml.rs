//! GPU discovery and health events from NVML.
//!
//! The NVML calls the plugin makes are the small traits [`NvmlLibrary`], [`NvmlDevice`] and
//! [`NvmlEvents`], owned here: [`WrapperLibrary`] implements them with `nvml-wrapper` (which
//! loads `libnvidia-ml.so.1` at run time, so the plugin builds and starts without a GPU), and
//! [`FakeNvml`] with fixed data for tests. [`gather`] asks the library for the facts of every
//! GPU; `tessera_driver::node::inventory::discovered::resolve` decides what they mean.
//! [`NvmlDiscovery`] adds the health the event watcher ([`NvmlHealthWatcher`], on its own
//! thread because NVML's event wait blocks) has seen, and the driver's MIG capability table
//! (`crate::gpus::mig_minors`).

mod events;
#[cfg(any(test, feature = "testing"))]
mod fake;
mod wrapper;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tessera_driver::node::health::{GpuEvent, GpuHealthTracker};
use tessera_driver::node::inventory::discovered::{
    self, DiscoveredGpu, DiscoveredMig, DiscoveredNode,
};
use tessera_driver::node::inventory::{MigIds, MigMinors, NodeInventory};
use tessera_driver::node::slices;
use tracing::{info, warn};

use crate::error::{Error, NvmlErrorKind, Result};
use crate::gpus::discovery::GpuDiscovery;
use crate::gpus::mig_minors::MigMinorsFile;

pub use events::{NvmlHealthWatcher, watch_step};
#[cfg(any(test, feature = "testing"))]
pub use fake::{FakeNvml, FakeNvmlGpu};
pub use wrapper::WrapperLibrary;

/// NVML's limit of `NVLinks` per GPU (`NVML_NVLINK_MAX_LINKS`).
pub const MAX_NVLINKS: u32 = 18;

/// The NVML library of a node.
pub trait NvmlLibrary: Send + Sync {
    /// The NVIDIA driver version.
    fn driver_version(&self) -> Result<String>;
    /// The CUDA driver version, encoded `1000 * major + 10 * minor`.
    fn cuda_driver_version(&self) -> Result<i32>;
    /// How many GPUs NVML sees.
    fn device_count(&self) -> Result<u32>;
    /// The GPU with NVML index `index`.
    fn device(&self, index: u32) -> Result<Box<dyn NvmlDevice + '_>>;
    /// A subscription to critical XID events of every GPU that supports them.
    fn events(&self) -> Result<Box<dyn NvmlEvents + '_>>;
}

/// One GPU, or one MIG device of a GPU.
pub trait NvmlDevice {
    /// The product name (for a MIG device, `<product> MIG <profile>`).
    fn name(&self) -> Result<String>;
    /// `GPU-<uuid>` or `MIG-<uuid>`.
    fn uuid(&self) -> Result<String>;
    /// The brand, e.g. `Tesla`.
    fn brand(&self) -> Result<String>;
    /// The architecture, e.g. `Ampere`.
    fn architecture(&self) -> Result<String>;
    /// CUDA compute capability (major, minor).
    fn compute_capability(&self) -> Result<(i32, i32)>;
    /// Total memory in bytes.
    fn memory_total(&self) -> Result<u64>;
    /// Streaming multiprocessors and GPU-instance slices.
    fn attributes(&self) -> Result<(u32, u32)>;
    /// PCI bus id as NVML writes it.
    fn pci_bus_id(&self) -> Result<String>;
    /// The NUMA node.
    fn numa_node(&self) -> Result<u32>;
    /// The minor number of the GPU's device node, `/dev/nvidia<minor>`
    /// (`nvmlDeviceGetMinorNumber`).
    fn minor_number(&self) -> Result<u32>;
    /// A MIG device's GPU instance id (`nvmlDeviceGetGpuInstanceId`).
    fn gpu_instance_id(&self) -> Result<u32>;
    /// A MIG device's compute instance id within its GPU instance
    /// (`nvmlDeviceGetComputeInstanceId`).
    fn compute_instance_id(&self) -> Result<u32>;
    /// Whether MIG mode is enabled (an error of kind `NotSupported` when the GPU has no MIG).
    fn mig_enabled(&self) -> Result<bool>;
    /// How many MIG devices the GPU can have.
    fn max_mig_devices(&self) -> Result<u32>;
    /// The MIG device in slot `index` (an error of kind `NotFound` for an empty slot).
    fn mig_device(&self, index: u32) -> Result<Box<dyn NvmlDevice + '_>>;
    /// The PCI bus id at the far end of NVLink `link` when the link is active.
    fn nvlink_remote(&self, link: u32) -> Result<Option<String>>;
}

/// A critical XID error of one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XidEvent {
    /// The GPU's UUID.
    pub uuid: String,
    /// The XID.
    pub xid: u64,
}

/// Critical XID events, waited for one at a time.
pub trait NvmlEvents {
    /// The next event within `timeout`, or `None`.
    fn wait(&mut self, timeout: Duration) -> Result<Option<XidEvent>>;
}

/// The `PCIe` root complex of a PCI device from sysfs: the `pci<domain>:<bus>` component of
/// the device's canonical path under `<sysfs>/bus/pci/devices/`.
pub fn pcie_root_from_sysfs(sysfs: &Path, bus_id: &str) -> Option<String> {
    let path = std::fs::canonicalize(sysfs.join("bus/pci/devices").join(bus_id)).ok()?;
    path.components()
        .filter_map(|c| c.as_os_str().to_str())
        .find(|c| c.starts_with("pci") && c.contains(':'))
        .map(str::to_owned)
}

/// The NUMA node of a PCI device from sysfs (`numa_node`; -1, meaning none, gives `None`).
pub fn numa_from_sysfs(sysfs: &Path, bus_id: &str) -> Option<u32> {
    let path = sysfs.join("bus/pci/devices").join(bus_id).join("numa_node");
    crate::claims::input_file::read_text(&path, "numa_node")
        .ok()?
        .trim()
        .parse()
        .ok()
}

fn optional<T>(r: Result<T>) -> Result<Option<T>> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(Error::Nvml {
            kind: NvmlErrorKind::NotSupported | NvmlErrorKind::NotFound,
            ..
        }) => Ok(None),
        Err(e) => Err(e),
    }
}

fn gather_gpu(device: &dyn NvmlDevice, index: u32, sysfs: &Path) -> Result<DiscoveredGpu> {
    let pci_bus_id = device.pci_bus_id()?;
    let short_bus = pci_bus_id
        .rsplit_once(':')
        .and_then(|(head, tail)| {
            let (domain, bus) = head.split_once(':')?;
            let domain = &domain[domain.len().saturating_sub(4)..];
            Some(format!("{domain}:{bus}:{tail}").to_ascii_lowercase())
        })
        .unwrap_or_else(|| pci_bus_id.to_ascii_lowercase());
    let mig_enabled = optional(device.mig_enabled())?;
    let mut mig_devices = Vec::new();
    if mig_enabled == Some(true) {
        for slot in 0..device.max_mig_devices()? {
            let Some(mig) = optional(device.mig_device(slot))? else {
                continue;
            };
            let (multiprocessors, compute_slices) = mig.attributes()?;
            // Ids NVML cannot give leave the instance unnamed: the node refuses to prepare it
            // rather than guess its capability minors.
            let ids = match (
                optional(mig.gpu_instance_id())?,
                optional(mig.compute_instance_id())?,
            ) {
                (Some(gpu_instance), Some(compute_instance)) => Some(MigIds {
                    gpu_instance,
                    compute_instance,
                }),
                _ => None,
            };
            mig_devices.push(DiscoveredMig {
                uuid: mig.uuid()?,
                ids,
                name: mig.name()?,
                memory_bytes: mig.memory_total()?,
                multiprocessors,
                compute_slices,
                placement: None,
            });
        }
    }
    let mut nvlink_peers = Vec::new();
    for link in 0..MAX_NVLINKS {
        match optional(device.nvlink_remote(link))? {
            Some(Some(peer)) => nvlink_peers.push(peer),
            Some(None) => {}
            // Links are numbered from 0: the first unsupported one ends the list.
            None => break,
        }
    }
    Ok(DiscoveredGpu {
        index,
        minor: device.minor_number()?,
        uuid: device.uuid()?,
        product_name: device.name()?,
        brand: device.brand()?,
        architecture: device.architecture()?,
        compute_capability: device.compute_capability()?,
        memory_bytes: device.memory_total()?,
        multiprocessors: if mig_enabled == Some(true) {
            None
        } else {
            optional(device.attributes())?.map(|(sms, _)| sms)
        },
        pcie_root: pcie_root_from_sysfs(sysfs, &short_bus),
        numa_node: optional(device.numa_node())?.or_else(|| numa_from_sysfs(sysfs, &short_bus)),
        pci_bus_id,
        mig_capable: mig_enabled.is_some(),
        mig_enabled: mig_enabled == Some(true),
        mig_devices,
        nvlink_peers,
    })
}

/// The facts of every GPU of the node. A GPU that answers with "GPU is lost" is left out of
/// `gpus` and its index returned in the second list.
pub fn gather(
    lib: &dyn NvmlLibrary,
    node_name: &str,
    sysfs: &Path,
) -> Result<(DiscoveredNode, Vec<u32>)> {
    let mut node = DiscoveredNode {
        name: node_name.to_owned(),
        driver_version: lib.driver_version()?,
        cuda_driver_version: lib.cuda_driver_version()?,
        gpus: Vec::new(),
    };
    let mut lost = Vec::new();
    for index in 0..lib.device_count()? {
        let gathered = lib
            .device(index)
            .and_then(|d| gather_gpu(d.as_ref(), index, sysfs));
        match gathered {
            Ok(gpu) => node.gpus.push(gpu),
            Err(Error::Nvml {
                kind: NvmlErrorKind::GpuLost,
                ..
            }) => lost.push(index),
            Err(e) => return Err(e),
        }
    }
    Ok((node, lost))
}

/// Discovery through NVML, with the health the event watcher and earlier discoveries saw.
pub struct NvmlDiscovery {
    lib: Arc<dyn NvmlLibrary>,
    node_name: String,
    sysfs: PathBuf,
    health: Arc<Mutex<GpuHealthTracker>>,
    last: Mutex<Option<DiscoveredNode>>,
    mig_minors: Arc<dyn MigMinorsFile>,
    /// Why the last discovery found no usable MIG capability table, as logged.
    no_table: Mutex<Option<String>>,
    /// The MIG instances the last discovery could not offer, and why, as logged.
    unoffered: Mutex<Vec<(String, String)>>,
}

impl std::fmt::Debug for NvmlDiscovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlDiscovery")
            .field("node_name", &self.node_name)
            .finish_non_exhaustive()
    }
}

pub(crate) fn locked<T>(m: &Mutex<T>) -> Result<MutexGuard<'_, T>> {
    m.lock()
        .map_err(|_| Error::Task("a thread panicked holding NVML state".to_owned()))
}

impl NvmlDiscovery {
    /// Discovery of `node_name`'s GPUs through `lib`; `sysfs` is where `/sys` is mounted, and
    /// `mig_minors` the driver's MIG capability table.
    pub fn new(
        lib: Arc<dyn NvmlLibrary>,
        node_name: impl Into<String>,
        sysfs: impl Into<PathBuf>,
        mig_minors: Arc<dyn MigMinorsFile>,
    ) -> Self {
        Self {
            lib,
            node_name: node_name.into(),
            sysfs: sysfs.into(),
            health: Arc::new(Mutex::new(GpuHealthTracker::new())),
            last: Mutex::new(None),
            mig_minors,
            no_table: Mutex::new(None),
            unoffered: Mutex::new(Vec::new()),
        }
    }

    /// Logs, once per change, each MIG instance of `node` the node cannot name and so does
    /// not publish (`slices::unoffered`): a claim could never be prepared on it.
    fn report_unoffered(&self, node: &NodeInventory) -> Result<()> {
        let now = slices::unoffered(node);
        let mut reported = locked(&self.unoffered)?;
        if *reported != now {
            for (device, why) in &now {
                warn!(device = %device, error = %why, "MIG instance not published");
            }
            *reported = now;
        }
        Ok(())
    }

    /// The driver's MIG capability table, or `None` (then the node offers no MIG device)
    /// when it is absent or does not read; why is logged once per change, on a node with MIG
    /// instances.
    fn mig_minors_table(&self, node: &NodeInventory) -> Result<Option<MigMinors>> {
        let (table, why) = match self.mig_minors.read() {
            Ok(Some(text)) => match MigMinors::parse(&text) {
                Ok(table) => (Some(table), None),
                Err(e) => (None, Some(e.to_string())),
            },
            Ok(None) => (
                None,
                Some("the driver lists no MIG capability minors".to_owned()),
            ),
            Err(e) => (None, Some(e.to_string())),
        };
        let has_mig = node.gpus.iter().any(|g| !g.mig_instances.is_empty());
        let mut reported = locked(&self.no_table)?;
        let why = why.filter(|_| has_mig);
        if *reported != why {
            if let Some(why) = &why {
                warn!(
                    error = %why,
                    "no MIG capability table: no MIG device is published or prepared on this node"
                );
            }
            reported.clone_from(&why);
        }
        Ok(table)
    }

    /// The GPUs' health, shared with the event watcher.
    pub fn health(&self) -> Arc<Mutex<GpuHealthTracker>> {
        Arc::clone(&self.health)
    }

    /// The library.
    pub fn library(&self) -> Arc<dyn NvmlLibrary> {
        Arc::clone(&self.lib)
    }
}

impl GpuDiscovery for NvmlDiscovery {
    fn discover(&self) -> Result<NodeInventory> {
        let (mut facts, lost) = gather(self.lib.as_ref(), &self.node_name, &self.sysfs)?;
        let mut previous = locked(&self.last)?;
        let mut tracker = locked(&self.health)?;
        for g in &facts.gpus {
            if tracker.observe(&g.uuid, GpuEvent::Answering) {
                info!(gpu = g.index, uuid = %g.uuid, "GPU answers again");
            }
        }
        for index in lost {
            // A lost GPU keeps the facts it had, so it stays published, tainted.
            let before = previous
                .as_ref()
                .and_then(|n| n.gpus.iter().find(|g| g.index == index).cloned());
            let Some(gpu) = before else {
                return Err(Error::Nvml {
                    call: "discovery",
                    kind: NvmlErrorKind::GpuLost,
                    message: format!("GPU {index} is lost and was never seen answering"),
                });
            };
            if tracker.observe(&gpu.uuid, GpuEvent::Lost) {
                warn!(gpu = index, uuid = %gpu.uuid, "GPU is lost");
            }
            facts.gpus.push(gpu);
        }
        facts.gpus.sort_by_key(|g| g.index);
        let mut node = discovered::resolve(&facts)?;
        tracker.apply(&mut node);
        node.mig_minors = self.mig_minors_table(&node)?;
        self.report_unoffered(&node)?;
        *previous = Some(facts);
        Ok(node)
    }
}

#[cfg(test)]
mod tests {

    use tessera_driver::node::inventory::GpuMode;

    use super::*;
    use crate::gpus::mig_minors::FakeMigMinors;

    const GIB: u64 = 1 << 30;

    fn gpu(index: u32, bus: &str) -> DiscoveredGpu {
        DiscoveredGpu {
            index,
            minor: index,
            uuid: format!("GPU-{index:08x}-aaaa-bbbb-cccc-000000000000"),
            product_name: "NVIDIA H100 80GB HBM3".to_owned(),
            brand: "NVIDIA".to_owned(),
            architecture: "Hopper".to_owned(),
            compute_capability: (9, 0),
            memory_bytes: 80 * GIB,
            multiprocessors: Some(132),
            pci_bus_id: bus.to_owned(),
            numa_node: Some(index / 2),
            mig_capable: true,
            ..DiscoveredGpu::default()
        }
    }

    fn no_table() -> Arc<dyn MigMinorsFile> {
        Arc::new(FakeMigMinors(None))
    }

    fn fake() -> FakeNvml {
        let mut a = gpu(0, "00000000:1B:00.0");
        let mut b = gpu(1, "00000000:43:00.0");
        a.nvlink_peers = vec!["00000000:43:00.0".to_owned()];
        b.nvlink_peers = vec!["00000000:1B:00.0".to_owned()];
        let mut m = gpu(2, "00000000:9A:00.0");
        m.mig_enabled = true;
        m.mig_devices = vec![DiscoveredMig {
            uuid: "MIG-11111111-2222-3333-4444-555555555555".to_owned(),
            ids: Some(MigIds {
                gpu_instance: 0,
                compute_instance: 0,
            }),
            name: "NVIDIA H100 80GB HBM3 MIG 7g.80gb".to_owned(),
            memory_bytes: 80 * GIB,
            multiprocessors: 132,
            compute_slices: 7,
            placement: None,
        }];
        FakeNvml::new(vec![a, b, m])
    }

    #[test]
    fn nvml_facts_become_the_nodes_inventory() {
        let lib = Arc::new(fake());
        let discovery = NvmlDiscovery::new(lib, "n", "/nonexistent-sysfs", no_table());
        let node = discovery.discover().unwrap();
        assert_eq!(node.gpus.len(), 3);
        assert_eq!(node.gpus[0].model, "h100-80g");
        assert_eq!(node.gpus[0].pci_bus_id, "0000:1b:00.0");
        assert_eq!(node.gpus[0].nvlink_domain.as_deref(), Some("n-nvlink-0"));
        assert_eq!(node.gpus[1].nvlink_domain.as_deref(), Some("n-nvlink-0"));
        assert_eq!(node.gpus[2].nvlink_domain, None);
        assert_eq!(node.gpus[1].numa_node, Some(0));
        assert_eq!(node.gpus[0].driver_version, "550.54.15");
        assert_eq!(node.gpus[0].cuda_driver_version, "12.4");
        assert_eq!(node.gpus[2].mode, GpuMode::Mig);
        assert_eq!(
            node.gpus[2].mig_instances[0].device_name(2),
            "gpu-2-mig-7g-80gb-0"
        );
        assert!(node.gpus.iter().all(|g| g.healthy));
    }

    #[test]
    fn discovery_keeps_nvmls_minor_and_mig_ids_and_the_drivers_capability_table() {
        let mut lib = fake();
        let gpus = lib.gpus_mut();
        gpus[2].facts.minor = 7;
        if let Some(ids) = gpus[2].facts.mig_devices[0].ids.as_mut() {
            ids.gpu_instance = 5;
        }
        let table = "config 1\nmonitor 2\ngpu7/gi5/access 993\ngpu7/gi5/ci0/access 994\n";
        let discovery = NvmlDiscovery::new(
            Arc::new(lib),
            "n",
            "/x",
            Arc::new(FakeMigMinors(Some(table.to_owned()))),
        );
        let node = discovery.discover().unwrap();
        assert_eq!(node.gpus[2].minor, 7);
        let ids = node.gpus[2].mig_instances[0].ids.unwrap();
        assert_eq!((ids.gpu_instance, ids.compute_instance), (5, 0));
        assert_eq!(node.mig_minors.unwrap().minors(7, 5, 0), Some((993, 994)));
    }

    #[test]
    fn a_mig_device_nvml_gives_no_ids_is_discovered_without_them_and_not_published() {
        let mut lib = fake();
        lib.gpus_mut()[2].facts.mig_devices[0].ids = None;
        let table = "config 1\nmonitor 2\ngpu2/gi0/access 30\ngpu2/gi0/ci0/access 31\n";
        let discovery = NvmlDiscovery::new(
            Arc::new(lib),
            "n",
            "/x",
            Arc::new(FakeMigMinors(Some(table.to_owned()))),
        );
        let node = discovery.discover().unwrap();
        assert_eq!(node.gpus[2].mig_instances[0].ids, None);
        let unoffered = slices::unoffered(&node);
        assert_eq!(unoffered.len(), 1);
        assert_eq!(unoffered[0].0, "gpu-2-mig-7g-80gb-0");
        let published = slices::render(&node, &slices::RenderOptions::default()).unwrap();
        assert!(
            published
                .iter()
                .flat_map(|s| s.spec.devices.iter().flatten())
                .all(|d| !d.name.contains("-mig-")),
            "a MIG device without ids is not offered"
        );
    }

    #[test]
    fn an_absent_or_malformed_capability_table_leaves_the_node_without_one() {
        for table in [None, Some("gpu0/gi0/access three\n".to_owned())] {
            let discovery =
                NvmlDiscovery::new(Arc::new(fake()), "n", "/x", Arc::new(FakeMigMinors(table)));
            let node = discovery.discover().unwrap();
            assert_eq!(node.mig_minors, None);
            assert_eq!(node.gpus.len(), 3, "the GPUs are still discovered");
        }
    }

    #[test]
    fn a_fatal_xid_taints_the_gpu_and_an_application_xid_does_not() {
        let lib = Arc::new(fake());
        let discovery = NvmlDiscovery::new(
            Arc::clone(&lib) as Arc<dyn NvmlLibrary>,
            "n",
            "/x",
            no_table(),
        );
        let health = discovery.health();
        let mut events = lib.events().unwrap();
        let uuid = gpu(1, "").uuid;
        lib.push_xid(&uuid, 13);
        assert!(!watch_step(events.as_mut(), &health, Duration::ZERO).unwrap());
        assert!(discovery.discover().unwrap().gpus[1].healthy);
        lib.push_xid(&uuid, 79);
        assert!(watch_step(events.as_mut(), &health, Duration::ZERO).unwrap());
        let node = discovery.discover().unwrap();
        assert!(!node.gpus[1].healthy);
        assert!(node.gpus[0].healthy);
    }

    #[test]
    fn a_lost_gpu_stays_published_unhealthy_and_recovers_when_it_answers() {
        let lib = Arc::new(fake());
        let discovery = NvmlDiscovery::new(
            Arc::clone(&lib) as Arc<dyn NvmlLibrary>,
            "n",
            "/x",
            no_table(),
        );
        discovery.discover().unwrap();
        lib.set_lost(0, true);
        let node = discovery.discover().unwrap();
        assert_eq!(node.gpus.len(), 3);
        assert!(!node.gpus[0].healthy);
        lib.set_lost(0, false);
        assert!(discovery.discover().unwrap().gpus[0].healthy);
    }

    #[test]
    fn a_missing_nvml_library_is_a_clear_error() {
        let e = WrapperLibrary::open(Path::new("/nonexistent/libnvidia-ml.so.1")).unwrap_err();
        let text = e.to_string();
        assert!(text.contains("cannot load NVML"), "{text}");
        assert!(text.contains("/nonexistent/libnvidia-ml.so.1"), "{text}");
        assert!(text.contains("--gpu-backend fake"), "{text}");
    }

    #[test]
    fn the_pcie_root_and_numa_node_come_from_sysfs() {
        let sys = tempfile::tempdir().unwrap();
        let real = sys
            .path()
            .join("devices/pci0000:80/0000:80:01.0/0000:8a:00.0");
        std::fs::create_dir_all(&real).unwrap();
        let devices = sys.path().join("bus/pci/devices");
        std::fs::create_dir_all(&devices).unwrap();
        std::os::unix::fs::symlink(&real, devices.join("0000:8a:00.0")).unwrap();
        assert_eq!(
            pcie_root_from_sysfs(sys.path(), "0000:8a:00.0").as_deref(),
            Some("pci0000:80")
        );
        std::fs::write(real.join("numa_node"), "1\n").unwrap();
        assert_eq!(numa_from_sysfs(sys.path(), "0000:8a:00.0"), Some(1));
        std::fs::write(real.join("numa_node"), "-1\n").unwrap();
        assert_eq!(numa_from_sysfs(sys.path(), "0000:8a:00.0"), None);
        assert_eq!(pcie_root_from_sysfs(sys.path(), "0000:8b:00.0"), None);
    }
}
