//! The kubelet plugin's record of prepared claims, as pure data and pure state transitions.
//!
//! The plugin writes this record to its state directory before and after it touches the CDI
//! directory, so a crash at any point leaves a claim either recorded as "prepare started" (a
//! repeated prepare or unprepare finishes the job) or "prepare completed". This module owns the
//! schema, its checksum, the transitions and the exclusivity rule; reading and writing the file
//! is the plugin's business.
//!
//! The file is JSON: `{"version": 1, "checksum": "<fnv1a-64 hex>", "data": {...}}`, where the
//! checksum covers the serialized `data` exactly as stored, so a torn or hand-edited file is
//! refused instead of silently forgetting claims. `data` records the boot it was written in: a
//! record from an earlier boot describes containers and CDI files that no longer exist (the CDI
//! directory is a tmpfs) and is dropped on load.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::node::cdi;
use crate::node::mps::MpsDaemon;
use crate::node::prepared::PreparedClaim;
use crate::rules::config::Tier;

mod holdings;

use holdings::Holdings;

/// The schema version this module writes and reads.
pub const CHECKPOINT_VERSION: u32 = 1;

const CONTEXT: &str = "checkpoint";

fn decode_err(message: impl Into<String>) -> Error {
    Error::Decode {
        context: CONTEXT.to_owned(),
        message: message.into(),
    }
}

/// How far preparing a claim got.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum PrepareState {
    /// The plugin decided to prepare the claim; its CDI spec may or may not be written.
    PrepareStarted,
    /// The CDI spec is written; the claim's devices are ready for containers.
    PrepareCompleted,
    /// The plugin decided to unprepare the claim; its CDI spec and host directories may be
    /// gone already. The claim still holds its devices until its entry is removed.
    UnprepareStarted,
}

/// A device a prepared claim holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HeldDevice {
    /// The request (`request` or `request/subrequest`) the device serves.
    pub request: String,
    /// The pool the device belongs to.
    pub pool: String,
    /// The device name within its pool.
    pub device: String,
    /// UUID of the physical GPU (a MIG instance's parent).
    pub gpu_uuid: String,
    /// Whether the device is a MIG instance.
    pub mig: bool,
    /// Whether the claim holds the device whole, excluding every other claim.
    pub exclusive: bool,
    /// The CDI device ids the runtime injects for this device.
    pub cdi_ids: Vec<String>,
    /// A shared device's memory limit in bytes (absent for a whole device).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share_memory_bytes: Option<u64>,
    /// A shared device's compute limit in percent, 0 when not isolated (absent for a whole
    /// device).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share_compute_percent: Option<i64>,
    /// The allocation result's `shareID` (absent for a device that allows one allocation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share_id: Option<String>,
    /// A shared device's tier (absent for a whole device; a share recorded before tiers were
    /// recorded reads as online, which protects it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share_tier: Option<Tier>,
}

impl HeldDevice {
    /// `pool/device`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.pool, self.device)
    }
}

/// What the checkpoint knows about one claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimEntry {
    /// The claim's namespace.
    pub namespace: String,
    /// The claim's name.
    pub name: String,
    /// How far preparing got.
    pub state: PrepareState,
    /// The claim's devices on this node, in allocation order.
    pub devices: Vec<HeldDevice>,
    /// Host directories made for the claim (enforcement state), removed on unprepare.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub host_dirs: Vec<String>,
    /// The MPS control daemon the claim's containers connect to (node enforcing with MPS,
    /// claim holding a share); the plugin keeps it running while a claim records it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mps_daemon: Option<MpsDaemon>,
}

/// Every claim the node has started or completed preparing, keyed by claim UID.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Checkpoint {
    /// The boot the record belongs to (`/proc/sys/kernel/random/boot_id`).
    pub boot_id: String,
    /// Claims by UID.
    pub claims: BTreeMap<String, ClaimEntry>,
}

/// The file's envelope. The checksum covers `data` as [`Checkpoint::encode`] serializes it;
/// the typed serialization is deterministic (fixed field order, sorted maps), so decoding
/// re-serializes and compares.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Envelope<T> {
    version: u32,
    checksum: String,
    data: T,
}

/// FNV-1a, 64 bits: detects torn writes and edits; not a defence against tampering, which
/// needs root on the node anyway.
fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        hash ^= u64::from(*b);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

/// The devices `claim` holds once prepared, with the CDI ids the kubelet gets for each.
pub fn held_devices(claim: &PreparedClaim) -> Vec<HeldDevice> {
    // `cdi::device_ids` lists each request's ids in device order; walk it the same way.
    let mut ids = cdi::device_ids(claim);
    let mut next = |request: &str| {
        ids.iter_mut()
            .find(|(r, _)| r == request)
            .and_then(|(_, list)| (!list.is_empty()).then(|| list.remove(0)))
    };
    claim
        .devices
        .iter()
        .map(|d| HeldDevice {
            request: d.request.clone(),
            pool: d.pool.clone(),
            device: d.device.clone(),
            gpu_uuid: d.gpu.uuid.clone(),
            mig: d.mig.is_some(),
            exclusive: d.share.is_none(),
            cdi_ids: next(&d.request).into_iter().collect(),
            share_memory_bytes: d.share.as_ref().map(|s| s.memory_bytes),
            share_compute_percent: d.share.as_ref().map(|s| s.compute_percent),
            share_id: d.share_id.clone(),
            share_tier: d.share.as_ref().map(|_| d.tier),
        })
        .collect()
}

/// What [`Checkpoint::begin_prepare`] decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Begin {
    /// The claim is already prepared: answer with the recorded devices, write nothing.
    AlreadyPrepared(Vec<HeldDevice>),
    /// The claim is now recorded as "prepare started": write the checkpoint, then the CDI spec.
    Started,
}

impl Checkpoint {
    /// An empty record for the boot `boot_id`.
    pub fn new(boot_id: impl Into<String>) -> Self {
        Self {
            boot_id: boot_id.into(),
            claims: BTreeMap::new(),
        }
    }

    /// Each recorded claim that has an MPS daemon, as (claim UID, its daemon), in UID order: what
    /// `crate::node::mps` decides the daemons from.
    pub fn mps_daemons(&self) -> impl Iterator<Item = (&str, &MpsDaemon)> {
        self.claims
            .iter()
            .filter_map(|(uid, e)| e.mps_daemon.as_ref().map(|d| (uid.as_str(), d)))
    }

    fn checksum(&self) -> Result<String> {
        let data = serde_json::to_vec(self).map_err(|e| decode_err(e.to_string()))?;
        Ok(format!("{:016x}", fnv1a64(&data)))
    }

    /// Serializes the record with its version and checksum: the bytes of the envelope
    /// `{"version", "checksum", "data"}` as serde writes it, with the record serialized once
    /// (it is written at every step of every call).
    pub fn encode(&self) -> Result<Vec<u8>> {
        let data = serde_json::to_vec(self).map_err(|e| decode_err(e.to_string()))?;
        let head = format!(
            "{{\"version\":{CHECKPOINT_VERSION},\"checksum\":\"{:016x}\",\"data\":",
            fnv1a64(&data)
        );
        let mut bytes = Vec::with_capacity(head.len() + data.len() + 1);
        bytes.extend_from_slice(head.as_bytes());
        bytes.extend_from_slice(&data);
        bytes.push(b'}');
        Ok(bytes)
    }

    /// Reads a record written by [`Checkpoint::encode`]. A record of another boot than
    /// `boot_id` is dropped (an empty record for `boot_id` comes back); a record of an unknown
    /// version or with a wrong checksum is an error.
    pub fn decode(bytes: &[u8], boot_id: &str) -> Result<Self> {
        let envelope: Envelope<serde_json::Value> =
            serde_json::from_slice(bytes).map_err(|e| decode_err(e.to_string()))?;
        if envelope.version != CHECKPOINT_VERSION {
            return Err(decode_err(format!(
                "version {} is not supported (this plugin reads version {CHECKPOINT_VERSION})",
                envelope.version
            )));
        }
        let record: Self =
            serde_json::from_value(envelope.data).map_err(|e| decode_err(e.to_string()))?;
        let actual = record.checksum()?;
        if actual != envelope.checksum {
            return Err(decode_err(format!(
                "checksum {} does not match the content ({actual}): the file is damaged",
                envelope.checksum
            )));
        }
        if record.boot_id != boot_id {
            return Ok(Self::new(boot_id));
        }
        Ok(record)
    }

    /// Records that preparing `claim` starts, unless it is already prepared. Refuses a claim
    /// that wants a device another recorded claim holds, when either of them holds it whole.
    /// `host_dirs` are the directories the plugin makes for the claim, `mps_daemon` the MPS
    /// daemon it needs (recorded with it, so a restarted plugin starts the daemon again). (One
    /// claim of [`Checkpoint::batch`].)
    pub fn begin_prepare(
        &mut self,
        claim: &PreparedClaim,
        host_dirs: Vec<String>,
        mps_daemon: Option<MpsDaemon>,
    ) -> Result<Begin> {
        self.batch().begin_prepare(claim, host_dirs, mps_daemon)
    }

    /// A batch of [`Checkpoint::begin_prepare`]s against this record: who holds what, and how
    /// much of each GPU's SMs, is indexed once, so each claim costs its own devices, not the
    /// whole record.
    pub fn batch(&mut self) -> PrepareBatch<'_> {
        let mut holdings = Holdings::default();
        for (uid, entry) in &self.claims {
            holdings.add(uid, &entry.devices, None);
        }
        PrepareBatch {
            record: self,
            holdings,
        }
    }

    /// Records that `uid`'s CDI spec is written. Returns its devices; an error when the claim
    /// was never started (a bug in the caller, or a concurrent unprepare won).
    pub fn complete_prepare(&mut self, uid: &str) -> Result<Vec<HeldDevice>> {
        let entry = self
            .claims
            .get_mut(uid)
            .ok_or_else(|| decode_err(format!("claim {uid} completed but was never started")))?;
        entry.state = PrepareState::PrepareCompleted;
        Ok(entry.devices.clone())
    }

    /// Records that unpreparing `uid` starts; returns whether the claim is recorded at all.
    pub fn begin_unprepare(&mut self, uid: &str) -> bool {
        match self.claims.get_mut(uid) {
            Some(entry) => {
                entry.state = PrepareState::UnprepareStarted;
                true
            }
            None => false,
        }
    }

    /// UIDs of the claims a crash left half done: prepare or unprepare started and not
    /// finished. Kubelet never got a success for a half-prepared claim, and asked to remove a
    /// half-unprepared one, so after a restart both are rolled back to "absent".
    pub fn unfinished(&self) -> Vec<String> {
        self.claims
            .iter()
            .filter(|(_, e)| e.state != PrepareState::PrepareCompleted)
            .map(|(uid, _)| uid.clone())
            .collect()
    }

    /// Forgets `uid`; returns whether it was recorded.
    pub fn remove(&mut self, uid: &str) -> bool {
        self.claims.remove(uid).is_some()
    }

    /// The claim recorded under `uid`.
    pub fn get(&self, uid: &str) -> Option<&ClaimEntry> {
        self.claims.get(uid)
    }
}

/// Claims begun one after another against one record ([`Checkpoint::batch`]).
#[derive(Debug)]
pub struct PrepareBatch<'a> {
    record: &'a mut Checkpoint,
    holdings: Holdings,
}

impl PrepareBatch<'_> {
    /// [`Checkpoint::begin_prepare`], checked against the claims recorded before the batch and
    /// those begun in it.
    pub fn begin_prepare(
        &mut self,
        claim: &PreparedClaim,
        host_dirs: Vec<String>,
        mps_daemon: Option<MpsDaemon>,
    ) -> Result<Begin> {
        if let Some(entry) = self.record.claims.get(&claim.uid)
            && entry.state == PrepareState::PrepareCompleted
        {
            return Ok(Begin::AlreadyPrepared(entry.devices.clone()));
        }
        let devices = held_devices(claim);
        if let Some((wanted, holder)) = self.holdings.conflict(&claim.uid, &devices) {
            return Err(Error::DeviceHeld {
                claim: claim.uid.clone(),
                device: wanted.key(),
                holder: holder.to_owned(),
            });
        }
        let earlier = self
            .record
            .claims
            .get(&claim.uid)
            .map(|entry| entry.devices.as_slice());
        self.holdings.check_sms(claim, &devices, earlier)?;
        self.holdings.add(&claim.uid, &devices, earlier);
        self.record.claims.insert(
            claim.uid.clone(),
            ClaimEntry {
                namespace: claim.namespace.clone(),
                name: claim.name.clone(),
                state: PrepareState::PrepareStarted,
                devices,
                host_dirs,
                mps_daemon,
            },
        );
        Ok(Begin::Started)
    }

    /// The record, with the claims begun so far.
    pub fn record(&mut self) -> &mut Checkpoint {
        self.record
    }
}

#[cfg(test)]
mod tests {

    use super::*;
    use crate::node::prepared::{GpuNode, MigNode, PreparedDevice};
    use crate::rules::share::PerDeviceShare;

    fn device(name: &str, gpu: &str, share: Option<u64>, mig: bool) -> PreparedDevice {
        PreparedDevice {
            request: "gpu".to_owned(),
            pool: "node-a".to_owned(),
            device: name.to_owned(),
            gpu: GpuNode {
                index: 0,
                uuid: gpu.to_owned(),
                minor: 0,
            },
            mig: mig.then(|| MigNode {
                uuid: format!("MIG-{name}"),
                gpu_instance: 0,
                compute_instance: 0,
                gpu_instance_cap_minor: 3,
                compute_instance_cap_minor: 4,
            }),
            share: share.map(|gib| PerDeviceShare {
                memory_bytes: gib << 30,
                compute_percent: 25,
            }),
            tier: crate::rules::config::Tier::Online,
            memory_overcommitted: false,
            share_id: None,
        }
    }

    fn claim(uid: &str, devices: Vec<PreparedDevice>) -> PreparedClaim {
        PreparedClaim {
            uid: uid.to_owned(),
            namespace: "ns".to_owned(),
            name: format!("claim-{uid}"),
            devices,
        }
    }

    /// Claim `uid` holding the one device [`device`] makes of the other arguments.
    fn one(uid: &str, name: &str, gpu: &str, share: Option<u64>, mig: bool) -> PreparedClaim {
        claim(uid, vec![device(name, gpu, share, mig)])
    }

    /// Begins `claim` in `record`, with no host directories.
    fn begin(record: &mut Checkpoint, claim: &PreparedClaim) -> Result<Begin> {
        record.begin_prepare(claim, Vec::new(), None)
    }

    /// Why `record` refuses to begin `claim`.
    fn refusal(record: &mut Checkpoint, claim: &PreparedClaim) -> String {
        begin(record, claim).unwrap_err().to_string()
    }

    #[test]
    fn encode_then_decode_round_trips() {
        let mut record = Checkpoint::new("boot-1");
        begin(&mut record, &one("u1", "gpu-0", "GPU-0", None, false)).unwrap();
        record.complete_prepare("u1").unwrap();
        let bytes = record.encode().unwrap();
        assert_eq!(Checkpoint::decode(&bytes, "boot-1").unwrap(), record);
    }

    #[test]
    fn record_from_another_boot_is_dropped() {
        let mut record = Checkpoint::new("boot-1");
        begin(&mut record, &one("u1", "gpu-0", "GPU-0", None, false)).unwrap();
        let decoded = Checkpoint::decode(&record.encode().unwrap(), "boot-2").unwrap();
        assert_eq!(decoded, Checkpoint::new("boot-2"));
    }

    #[test]
    fn damaged_record_is_refused() {
        let mut record = Checkpoint::new("boot-1");
        begin(&mut record, &one("u1", "gpu-0", "GPU-0", None, false)).unwrap();
        let text = String::from_utf8(record.encode().unwrap()).unwrap();
        let damaged = text.replace("gpu-0", "gpu-1");
        let err = Checkpoint::decode(damaged.as_bytes(), "boot-1").unwrap_err();
        assert!(err.to_string().contains("checksum"), "{err}");
    }

    #[test]
    fn unknown_version_is_refused() {
        let text = String::from_utf8(Checkpoint::new("b").encode().unwrap()).unwrap();
        let other = text.replace("\"version\":1", "\"version\":2");
        let err = Checkpoint::decode(other.as_bytes(), "b").unwrap_err();
        assert!(err.to_string().contains("version 2"), "{err}");
    }

    #[test]
    fn truncated_record_is_refused() {
        let bytes = Checkpoint::new("b").encode().unwrap();
        assert!(Checkpoint::decode(&bytes[..bytes.len() / 2], "b").is_err());
    }

    #[test]
    fn prepare_is_idempotent_for_completed_claim() {
        let mut record = Checkpoint::new("b");
        let c = one("u1", "gpu-0", "GPU-0", None, false);
        assert_eq!(begin(&mut record, &c).unwrap(), Begin::Started);
        let held = record.complete_prepare("u1").unwrap();
        assert_eq!(held[0].cdi_ids, vec!["k8s.gpu.tessera.dev/claim=u1-gpu-0"]);
        assert_eq!(
            begin(&mut record, &c).unwrap(),
            Begin::AlreadyPrepared(held)
        );
    }

    #[test]
    fn started_claim_starts_again() {
        let mut record = Checkpoint::new("b");
        let c = one("u1", "gpu-0", "GPU-0", None, false);
        begin(&mut record, &c).unwrap();
        assert_eq!(begin(&mut record, &c).unwrap(), Begin::Started);
    }

    fn share(uid: &str, compute: i64, tier: crate::rules::config::Tier) -> PreparedClaim {
        let mut d = device("gpu-0", "GPU-0", Some(4), false);
        d.share = Some(PerDeviceShare {
            memory_bytes: 4 << 30,
            compute_percent: compute,
        });
        d.tier = tier;
        claim(uid, vec![d])
    }

    #[test]
    fn beside_an_online_share_the_node_refuses_compute_past_the_gpu() {
        use crate::rules::config::Tier::{Batch, Online};
        let mut record = Checkpoint::new("b");
        begin(&mut record, &share("o", 70, Online)).unwrap();
        begin(&mut record, &share("b1", 30, Batch)).unwrap();
        let err = refusal(&mut record, &share("b2", 5, Batch));
        assert!(
            err.contains("claim ns/claim-b2 cannot be prepared"),
            "{err}"
        );
        assert!(err.contains("may use 5% compute beside 100%"), "{err}");
        // A re-prepare of a recorded claim does not count itself.
        begin(&mut record, &share("b1", 30, Batch)).unwrap();
        // Among batch shares the node leaves over-commit to the allocator's factor.
        let mut batch = Checkpoint::new("b");
        begin(&mut batch, &share("b1", 80, Batch)).unwrap();
        begin(&mut batch, &share("b2", 60, Batch)).unwrap();
        let err = refusal(&mut batch, &share("o", 5, Online));
        assert!(err.contains("may use 5% compute beside 140%"), "{err}");
        // Once the online share is gone, the GPU is batch-only again.
        record.remove("o");
        begin(&mut record, &share("b2", 80, Batch)).unwrap();
    }

    #[test]
    fn device_held_whole_refuses_another_claim() {
        let mut record = Checkpoint::new("b");
        begin(&mut record, &one("u1", "gpu-0", "GPU-0", None, false)).unwrap();
        let err = begin(&mut record, &one("u2", "gpu-0", "GPU-0", Some(4), false)).unwrap_err();
        assert_eq!(
            err,
            Error::DeviceHeld {
                claim: "u2".to_owned(),
                device: "node-a/gpu-0".to_owned(),
                holder: "u1".to_owned(),
            }
        );
    }

    #[test]
    fn shares_of_one_gpu_coexist() {
        let mut record = Checkpoint::new("b");
        begin(&mut record, &one("u1", "gpu-0", "GPU-0", Some(4), false)).unwrap();
        begin(&mut record, &one("u2", "gpu-0", "GPU-0", Some(8), false)).unwrap();
        assert_eq!(record.claims.len(), 2);
    }

    #[test]
    fn whole_gpu_and_its_mig_instance_exclude_each_other() {
        let mut record = Checkpoint::new("b");
        begin(&mut record, &one("u1", "gpu-0-mig-1", "GPU-0", None, true)).unwrap();
        assert!(begin(&mut record, &one("u2", "gpu-0", "GPU-0", Some(4), false)).is_err());
        begin(&mut record, &one("u3", "gpu-0-mig-2", "GPU-0", None, true)).unwrap();
    }

    #[test]
    fn removed_claim_frees_its_devices() {
        let mut record = Checkpoint::new("b");
        begin(&mut record, &one("u1", "gpu-0", "GPU-0", None, false)).unwrap();
        assert!(record.remove("u1"));
        assert!(!record.remove("u1"));
        begin(&mut record, &one("u2", "gpu-0", "GPU-0", None, false)).unwrap();
    }

    #[test]
    fn half_done_claims_are_unfinished() {
        let mut record = Checkpoint::new("b");
        for (uid, gpu) in [("u1", "gpu-0"), ("u2", "gpu-1"), ("u3", "gpu-2")] {
            begin(&mut record, &one(uid, gpu, gpu, None, false)).unwrap();
        }
        record.complete_prepare("u2").unwrap();
        record.complete_prepare("u3").unwrap();
        assert!(record.begin_unprepare("u3"));
        assert!(!record.begin_unprepare("nope"));
        assert_eq!(record.unfinished(), vec!["u1".to_owned(), "u3".to_owned()]);
        let bytes = record.encode().unwrap();
        assert_eq!(Checkpoint::decode(&bytes, "b").unwrap(), record);
    }

    #[test]
    fn completing_an_unknown_claim_is_an_error() {
        assert!(Checkpoint::new("b").complete_prepare("nope").is_err());
    }

    #[test]
    fn a_batch_checks_each_claim_against_the_record_and_the_batch() {
        let mut record = Checkpoint::new("boot-1");
        begin(&mut record, &one("u1", "gpu-0", "GPU-0", None, false)).unwrap();
        let mut batch = record.batch();
        let mut in_batch = |claim: PreparedClaim| batch.begin_prepare(&claim, Vec::new(), None);
        // Held whole before the batch.
        let err = in_batch(one("u2", "gpu-0", "GPU-0", Some(1), false)).unwrap_err();
        assert!(
            matches!(err, Error::DeviceHeld { ref holder, .. } if holder == "u1"),
            "{err}"
        );
        // Shares of one GPU begun in the batch do not exclude each other...
        for uid in ["s1", "s2"] {
            let share = one(uid, "gpu-1", "GPU-1", Some(1), false);
            assert_eq!(in_batch(share).unwrap(), Begin::Started);
        }
        // ...but exclude a whole claim, and a MIG instance of their GPU.
        let err = in_batch(one("w", "gpu-1", "GPU-1", None, false)).unwrap_err();
        assert!(matches!(err, Error::DeviceHeld { .. }), "{err}");
        let err = in_batch(one("m", "gpu-1-mig", "GPU-1", None, true)).unwrap_err();
        assert!(
            matches!(err, Error::DeviceHeld { ref device, .. } if device == "node-a/gpu-1-mig"),
            "{err}"
        );
        // A claim begun again is not its own holder.
        let again = one("s1", "gpu-1", "GPU-1", Some(1), false);
        assert_eq!(in_batch(again).unwrap(), Begin::Started);
        assert_eq!(record.claims.len(), 3);
    }

    #[test]
    fn a_batch_of_ten_thousand_shares_begins_each_once() {
        // Linear: the index is built once; each claim looks up only its own devices.
        let mut record = Checkpoint::new("boot-1");
        let mut batch = record.batch();
        for i in 0..10_000 {
            let gpu = format!("GPU-{}", i % 8);
            // Batch shares: over-committing compute is allowed among them (online ones would
            // pass 100% beside an online share, which the node refuses).
            let mut d = device(&format!("gpu-{}", i % 8), &gpu, Some(1), false);
            d.tier = crate::rules::config::Tier::Batch;
            let share = claim(&format!("u{i}"), vec![d]);
            assert_eq!(
                batch.begin_prepare(&share, Vec::new(), None).unwrap(),
                Begin::Started
            );
        }
        assert_eq!(record.claims.len(), 10_000);
    }

    #[test]
    fn a_started_claim_is_recorded_with_its_mps_daemon_in_the_one_write() {
        let mut record = Checkpoint::new("boot-1");
        let daemon = crate::testing::mps_daemon(&["GPU-0"]);
        let begun = record
            .begin_prepare(
                &one("u1", "gpu-0", "GPU-0", Some(2), false),
                Vec::new(),
                Some(daemon.clone()),
            )
            .unwrap();
        assert_eq!(begun, Begin::Started);
        let entry = record.get("u1").unwrap();
        assert_eq!(entry.state, PrepareState::PrepareStarted);
        assert_eq!(entry.mps_daemon, Some(daemon));
    }

    #[test]
    fn the_encoding_is_the_envelope_serde_writes() {
        let mut record = Checkpoint::new("boot-1");
        record
            .begin_prepare(
                &one("u1", "gpu-0", "GPU-0", Some(2), false),
                vec!["/run/tessera/hami/u1".to_owned()],
                None,
            )
            .unwrap();
        let envelope = Envelope {
            version: CHECKPOINT_VERSION,
            checksum: record.checksum().unwrap(),
            data: &record,
        };
        assert_eq!(
            record.encode().unwrap(),
            serde_json::to_vec(&envelope).unwrap()
        );
    }
}
