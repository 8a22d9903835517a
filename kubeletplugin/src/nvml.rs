//! GPU discovery and health events from NVML.
//!
//! The NVML calls the plugin makes are the small traits [`NvmlLibrary`], [`NvmlDevice`] and
//! [`NvmlEvents`], owned here: [`WrapperLibrary`] implements them with `nvml-wrapper` (which
//! loads `libnvidia-ml.so.1` at run time, so the plugin builds and starts without a GPU), and
//! [`FakeNvml`] with fixed data for tests. [`gather`] asks the library for the facts of every
//! GPU; `tessera_driver::inventory::discovered::resolve` decides what they mean.
//! [`NvmlDiscovery`] adds the health the event watcher ([`NvmlHealthWatcher`], on its own
//! thread because NVML's event wait blocks) has seen.

use std::collections::VecDeque;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use tessera_driver::health::{GpuEvent, GpuHealthTracker};
use tessera_driver::inventory::NodeInventory;
use tessera_driver::inventory::discovered::{self, DiscoveredGpu, DiscoveredMig, DiscoveredNode};
use tracing::{info, warn};

use crate::discovery::GpuDiscovery;
use crate::error::{Error, NvmlErrorKind, Result};

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

fn kind_of(e: &NvmlError) -> NvmlErrorKind {
    match e {
        NvmlError::LibloadingError(_)
        | NvmlError::DriverNotLoaded
        | NvmlError::LibraryNotFound
        | NvmlError::FailedToLoadSymbol(_)
        | NvmlError::Uninitialized
        | NvmlError::NoPermission => NvmlErrorKind::Unavailable,
        NvmlError::NotSupported | NvmlError::FunctionNotFound => NvmlErrorKind::NotSupported,
        NvmlError::NotFound | NvmlError::InvalidArg => NvmlErrorKind::NotFound,
        NvmlError::GpuLost => NvmlErrorKind::GpuLost,
        NvmlError::Timeout => NvmlErrorKind::Timeout,
        _ => NvmlErrorKind::Other,
    }
}

fn nvml_err(call: &'static str) -> impl Fn(NvmlError) -> Error {
    move |e| Error::Nvml {
        call,
        kind: kind_of(&e),
        message: e.to_string(),
    }
}

/// NVML through `nvml-wrapper`.
pub struct WrapperLibrary {
    nvml: Nvml,
}

impl std::fmt::Debug for WrapperLibrary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WrapperLibrary").finish_non_exhaustive()
    }
}

impl WrapperLibrary {
    /// Loads and initialises NVML from `library` (a file name searched the usual way, or a
    /// path). A node without the NVIDIA driver gets an error that says so.
    pub fn open(library: &Path) -> Result<Self> {
        let nvml = Nvml::builder()
            .lib_path(OsStr::new(library.as_os_str()))
            .init()
            .map_err(|e| Error::Nvml {
                call: "nvmlInit",
                kind: NvmlErrorKind::Unavailable,
                message: format!(
                    "cannot load NVML from {}: {e}; is the NVIDIA driver installed and its \
                     library mounted into the plugin's container? (--nvml-library names \
                     another path; --gpu-backend fake runs without GPUs)",
                    library.display()
                ),
            })?;
        Ok(Self { nvml })
    }
}

struct WrapperDevice<'n>(nvml_wrapper::Device<'n>);

impl NvmlDevice for WrapperDevice<'_> {
    fn name(&self) -> Result<String> {
        self.0.name().map_err(nvml_err("nvmlDeviceGetName"))
    }
    fn uuid(&self) -> Result<String> {
        self.0.uuid().map_err(nvml_err("nvmlDeviceGetUUID"))
    }
    fn brand(&self) -> Result<String> {
        self.0
            .brand()
            .map(|b| format!("{b:?}"))
            .map_err(nvml_err("nvmlDeviceGetBrand"))
    }
    fn architecture(&self) -> Result<String> {
        self.0
            .architecture()
            .map(|a| a.to_string())
            .map_err(nvml_err("nvmlDeviceGetArchitecture"))
    }
    fn compute_capability(&self) -> Result<(i32, i32)> {
        self.0
            .cuda_compute_capability()
            .map(|c| (c.major, c.minor))
            .map_err(nvml_err("nvmlDeviceGetCudaComputeCapability"))
    }
    fn memory_total(&self) -> Result<u64> {
        self.0
            .memory_info()
            .map(|m| m.total)
            .map_err(nvml_err("nvmlDeviceGetMemoryInfo"))
    }
    fn attributes(&self) -> Result<(u32, u32)> {
        self.0
            .attributes()
            .map(|a| (a.multiprocessor_count, a.gpu_instance_slice_count))
            .map_err(nvml_err("nvmlDeviceGetAttributes"))
    }
    fn pci_bus_id(&self) -> Result<String> {
        self.0
            .pci_info()
            .map(|p| p.bus_id)
            .map_err(nvml_err("nvmlDeviceGetPciInfo"))
    }
    fn numa_node(&self) -> Result<u32> {
        self.0
            .numa_node_id()
            .map_err(nvml_err("nvmlDeviceGetNumaNodeId"))
    }
    fn mig_enabled(&self) -> Result<bool> {
        self.0
            .mig_mode()
            .map(|m| m.current == 1)
            .map_err(nvml_err("nvmlDeviceGetMigMode"))
    }
    fn max_mig_devices(&self) -> Result<u32> {
        self.0
            .mig_device_count()
            .map_err(nvml_err("nvmlDeviceGetMaxMigDeviceCount"))
    }
    fn mig_device(&self, index: u32) -> Result<Box<dyn NvmlDevice + '_>> {
        self.0
            .mig_device_by_index(index)
            .map(|d| Box::new(WrapperDevice(d)) as Box<dyn NvmlDevice + '_>)
            .map_err(nvml_err("nvmlDeviceGetMigDeviceHandleByIndex"))
    }
    fn nvlink_remote(&self, link: u32) -> Result<Option<String>> {
        let link = self.0.link_wrapper_for(link);
        if !link
            .is_active()
            .map_err(nvml_err("nvmlDeviceGetNvLinkState"))?
        {
            return Ok(None);
        }
        link.remote_pci_info()
            .map(|p| Some(p.bus_id))
            .map_err(nvml_err("nvmlDeviceGetNvLinkRemotePciInfo"))
    }
}

struct WrapperEvents<'n> {
    set: nvml_wrapper::EventSet<'n>,
}

impl NvmlEvents for WrapperEvents<'_> {
    fn wait(&mut self, timeout: Duration) -> Result<Option<XidEvent>> {
        let ms = u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX);
        match self.set.wait(ms) {
            Ok(data) => {
                let uuid = data.device.uuid().map_err(nvml_err("nvmlDeviceGetUUID"))?;
                // NVML reports "unknown" when it cannot say which XID: count it as fatal
                // (the health model takes unknown XIDs as fatal) with an XID no table uses.
                let xid = match data.event_data {
                    Some(XidError::Value(x)) => x,
                    Some(XidError::Unknown) | None => u64::MAX,
                };
                Ok(Some(XidEvent { uuid, xid }))
            }
            Err(NvmlError::Timeout) => Ok(None),
            Err(e) => Err(nvml_err("nvmlEventSetWait")(e)),
        }
    }
}

impl NvmlLibrary for WrapperLibrary {
    fn driver_version(&self) -> Result<String> {
        self.nvml
            .sys_driver_version()
            .map_err(nvml_err("nvmlSystemGetDriverVersion"))
    }
    fn cuda_driver_version(&self) -> Result<i32> {
        self.nvml
            .sys_cuda_driver_version()
            .map_err(nvml_err("nvmlSystemGetCudaDriverVersion"))
    }
    fn device_count(&self) -> Result<u32> {
        self.nvml
            .device_count()
            .map_err(nvml_err("nvmlDeviceGetCount"))
    }
    fn device(&self, index: u32) -> Result<Box<dyn NvmlDevice + '_>> {
        self.nvml
            .device_by_index(index)
            .map(|d| Box::new(WrapperDevice(d)) as Box<dyn NvmlDevice + '_>)
            .map_err(nvml_err("nvmlDeviceGetHandleByIndex"))
    }
    fn events(&self) -> Result<Box<dyn NvmlEvents + '_>> {
        // A GPU that cannot report XIDs is left out; registering it would spoil the set.
        let count = self.device_count()?;
        let mut skip = std::collections::BTreeSet::new();
        'retry: loop {
            let mut set = self
                .nvml
                .create_event_set()
                .map_err(nvml_err("nvmlEventSetCreate"))?;
            for index in (0..count).filter(|i| !skip.contains(i)) {
                let device = self
                    .nvml
                    .device_by_index(index)
                    .map_err(nvml_err("nvmlDeviceGetHandleByIndex"))?;
                match device.register_events(EventTypes::CRITICAL_XID_ERROR, set) {
                    Ok(s) => set = s,
                    Err(e) => {
                        warn!(gpu = index, error = %e.error, "GPU cannot report XID events; its health comes from queries only");
                        skip.insert(index);
                        continue 'retry;
                    }
                }
            }
            return Ok(Box::new(WrapperEvents { set }));
        }
    }
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
    std::fs::read_to_string(sysfs.join("bus/pci/devices").join(bus_id).join("numa_node"))
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
            mig_devices.push(DiscoveredMig {
                uuid: mig.uuid()?,
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
}

impl std::fmt::Debug for NvmlDiscovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlDiscovery")
            .field("node_name", &self.node_name)
            .finish_non_exhaustive()
    }
}

fn locked<T>(m: &Mutex<T>) -> Result<MutexGuard<'_, T>> {
    m.lock()
        .map_err(|_| Error::Task("a thread panicked holding NVML state".to_owned()))
}

impl NvmlDiscovery {
    /// Discovery of `node_name`'s GPUs through `lib`; `sysfs` is where `/sys` is mounted.
    pub fn new(
        lib: Arc<dyn NvmlLibrary>,
        node_name: impl Into<String>,
        sysfs: impl Into<PathBuf>,
    ) -> Self {
        Self {
            lib,
            node_name: node_name.into(),
            sysfs: sysfs.into(),
            health: Arc::new(Mutex::new(GpuHealthTracker::new())),
            last: Mutex::new(None),
        }
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
        *previous = Some(facts);
        Ok(node)
    }
}

/// Takes one event (or none within `timeout`) into `health`; returns whether a GPU's health
/// changed.
pub fn watch_step(
    events: &mut dyn NvmlEvents,
    health: &Mutex<GpuHealthTracker>,
    timeout: Duration,
) -> Result<bool> {
    let Some(event) = events.wait(timeout)? else {
        return Ok(false);
    };
    let changed = locked(health)?.observe(&event.uuid, GpuEvent::Xid(event.xid));
    if changed {
        warn!(uuid = %event.uuid, xid = event.xid, "GPU is unhealthy after a critical XID");
    } else {
        info!(uuid = %event.uuid, xid = event.xid, "XID reported; the GPU's health is unchanged");
    }
    Ok(changed)
}

/// The thread that waits for XID events and wakes the inventory watcher on a health change.
#[derive(Debug)]
pub struct NvmlHealthWatcher {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl NvmlHealthWatcher {
    /// Starts waiting for events of `lib`'s GPUs, `wait` at a time (the longest a stop takes).
    pub fn start(
        lib: Arc<dyn NvmlLibrary>,
        health: Arc<Mutex<GpuHealthTracker>>,
        wake: Arc<tokio::sync::Notify>,
        wait: Duration,
    ) -> Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("nvml-events".to_owned())
            .spawn(move || {
                let mut events = match lib.events() {
                    Ok(e) => e,
                    Err(e) => {
                        warn!(error = %e, "no XID events; GPU health comes from queries only");
                        return;
                    }
                };
                while !stopping.load(Ordering::Relaxed) {
                    match watch_step(events.as_mut(), &health, wait) {
                        Ok(true) => wake.notify_one(),
                        Ok(false) => {}
                        Err(e) => {
                            warn!(error = %e, "waiting for NVML events failed");
                            std::thread::sleep(wait);
                        }
                    }
                }
            })
            .map_err(|e| Error::io("starting", "the NVML event thread", e))?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }

    /// Stops the thread (within one wait).
    pub fn shutdown(mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use tessera_driver::inventory::GpuMode;

    use super::*;

    const GIB: u64 = 1 << 30;

    fn gpu(index: u32, bus: &str) -> DiscoveredGpu {
        DiscoveredGpu {
            index,
            uuid: format!("GPU-{index:08x}-aaaa-bbbb-cccc-000000000000"),
            product_name: "NVIDIA H100 80GB HBM3".to_owned(),
            brand: "Nvidia".to_owned(),
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

    fn fake() -> FakeNvml {
        let mut a = gpu(0, "00000000:1B:00.0");
        let mut b = gpu(1, "00000000:43:00.0");
        a.nvlink_peers = vec!["00000000:43:00.0".to_owned()];
        b.nvlink_peers = vec!["00000000:1B:00.0".to_owned()];
        let mut m = gpu(2, "00000000:9A:00.0");
        m.mig_enabled = true;
        m.mig_devices = vec![DiscoveredMig {
            uuid: "MIG-11111111-2222-3333-4444-555555555555".to_owned(),
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
        let discovery = NvmlDiscovery::new(lib, "n", "/nonexistent-sysfs");
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
    fn a_fatal_xid_taints_the_gpu_and_an_application_xid_does_not() {
        let lib = Arc::new(fake());
        let discovery = NvmlDiscovery::new(Arc::clone(&lib) as Arc<dyn NvmlLibrary>, "n", "/x");
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
        let discovery = NvmlDiscovery::new(Arc::clone(&lib) as Arc<dyn NvmlLibrary>, "n", "/x");
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
