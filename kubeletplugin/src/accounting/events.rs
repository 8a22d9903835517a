//! Telling a pod that its claim went over its booking: the [`EventSink`] seam, Events through
//! kube-runtime's [`Recorder`] ([`KubeEvents`]: events.k8s.io/v1, a repeat within its cache
//! time a series on the first) and a recorder of what it was handed ([`FakeEvents`]). Both take
//! the Event from [`pod_event`], so tests see what the Recorder gets.

#[cfg(any(test, feature = "testing"))]
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use tessera_driver::names;
use tessera_driver::node::accounting::OverBooking;

use crate::error::{Error, Result};

/// What the plugin did to the pod's processes, as the Event's `action`.
pub const ACTION_STOP_PROCESSES: &str = "StopProcesses";

/// Where over-booking Events go.
#[tonic::async_trait]
pub trait EventSink: Send + Sync {
    /// Records a Warning Event on the pod `over` names.
    async fn record(&self, over: &OverBooking) -> Result<()>;
}

/// The Warning Event on `over`'s pod and the pod it is about. The note is the over-booking's
/// message, cut at `tessera_kubeapi::events::NOTE_BYTES` (on a character boundary, saying so)
/// when a long list of stopped processes makes it longer.
pub fn pod_event(over: &OverBooking) -> (Event, ObjectReference) {
    let note = tessera_kubeapi::events::note(&over.message());
    let event = Event {
        type_: EventType::Warning,
        reason: names::REASON_GPU_MEMORY_OVER_BOOKING.to_owned(),
        note: Some(note),
        action: ACTION_STOP_PROCESSES.to_owned(),
        secondary: None,
    };
    let pod = ObjectReference {
        api_version: Some(names::CORE_API_V1.to_owned()),
        kind: Some(names::POD.kind.to_owned()),
        namespace: Some(over.namespace.clone()),
        name: Some(over.pod_name.clone()),
        uid: Some(over.pod_uid.clone()),
        ..ObjectReference::default()
    };
    (event, pod)
}

/// Events through the API server, reported by the plugin (`reportingController`) on its node
/// (`reportingInstance`).
#[derive(Clone)]
pub struct KubeEvents {
    recorder: Recorder,
    node: String,
}

impl std::fmt::Debug for KubeEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeEvents")
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

impl KubeEvents {
    /// Events reported by the plugin on `node`.
    pub fn new(client: kube::Client, node: impl Into<String>) -> Self {
        let node = node.into();
        let reporter = Reporter {
            controller: names::KUBELET_PLUGIN_COMPONENT.to_owned(),
            // At most the 128 characters an Event's `reportingInstance` may have.
            instance: Some(tessera_driver::rules::limits::reporting_instance(&node)),
        };
        Self {
            recorder: Recorder::new(client, reporter),
            node,
        }
    }
}

#[tonic::async_trait]
impl EventSink for KubeEvents {
    async fn record(&self, over: &OverBooking) -> Result<()> {
        let (event, pod) = pod_event(over);
        self.recorder.publish(&event, &pod).await.map_err(|e| {
            Error::api(
                format!(
                    "recording an Event on Pod {}/{}",
                    over.namespace, over.pod_name
                ),
                &e,
            )
        })
    }
}

/// What [`FakeEvents`] was handed: the fields of one Event and the object it is about.
#[cfg(any(test, feature = "testing"))]
#[derive(Debug, Clone, PartialEq)]
pub struct RecordedEvent {
    /// Whether the Event is a Warning (else Normal).
    pub warning: bool,
    /// Its reason.
    pub reason: String,
    /// Its note (the message `kubectl describe` shows).
    pub note: Option<String>,
    /// Its action.
    pub action: String,
    /// The object it is about.
    pub regarding: ObjectReference,
}

/// Records the Events it would hand the Recorder.
#[cfg(any(test, feature = "testing"))]
#[derive(Debug, Clone, Default)]
pub struct FakeEvents {
    events: Arc<Mutex<Vec<RecordedEvent>>>,
}

#[cfg(any(test, feature = "testing"))]
impl FakeEvents {
    /// No Events yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The Events so far.
    pub fn events(&self) -> Vec<RecordedEvent> {
        self.events
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

#[cfg(any(test, feature = "testing"))]
#[tonic::async_trait]
impl EventSink for FakeEvents {
    async fn record(&self, over: &OverBooking) -> Result<()> {
        let (event, regarding) = pod_event(over);
        let recorded = RecordedEvent {
            warning: event.type_ == EventType::Warning,
            reason: event.reason,
            note: event.note,
            action: event.action,
            regarding,
        };
        self.events
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(recorded);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use tessera_driver::node::accounting::ClaimName;
    use tessera_kubeapi::events::NOTE_BYTES;

    use super::*;

    fn over(stopped: u32) -> OverBooking {
        OverBooking {
            namespace: "team".to_owned(),
            pod_name: "trainer".to_owned(),
            pod_uid: "pod-uid".to_owned(),
            claims: vec![ClaimName {
                namespace: "team".to_owned(),
                name: "train".to_owned(),
                uid: "claim-uid".to_owned(),
            }],
            gpu_uuid: "GPU-1".to_owned(),
            booked_bytes: 10 << 30,
            used_bytes: 20 << 30,
            stopped: (0..stopped).map(|pid| (100_000 + pid, 1 << 30)).collect(),
        }
    }

    #[test]
    fn the_event_is_a_warning_on_the_pod_with_the_overbookings_message() {
        let over = over(2);
        let (event, pod) = pod_event(&over);
        assert_eq!(event.type_, EventType::Warning);
        assert_eq!(event.reason, names::REASON_GPU_MEMORY_OVER_BOOKING);
        assert_eq!(event.action, ACTION_STOP_PROCESSES);
        assert_eq!(event.note, Some(over.message()));
        assert_eq!(pod.kind.as_deref(), Some("Pod"));
        assert_eq!(pod.namespace.as_deref(), Some("team"));
        assert_eq!(pod.name.as_deref(), Some("trainer"));
        assert_eq!(pod.uid.as_deref(), Some("pod-uid"));
    }

    #[test]
    fn a_note_longer_than_the_api_allows_is_cut_and_says_so() {
        let over = over(200);
        assert!(over.message().len() > NOTE_BYTES);
        let note = pod_event(&over).0.note.unwrap();
        assert!(note.len() <= NOTE_BYTES, "{} bytes", note.len());
        assert!(note.ends_with(" …"), "{note}");
        assert!(over.message().starts_with(note.trim_end_matches(" …")));
    }
}
