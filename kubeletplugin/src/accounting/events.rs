//! Telling a pod that its claim went over its booking: the [`EventSink`] seam, core v1 Events
//! through the plugin's API client ([`KubeEvents`]) and a recorder ([`FakeEvents`]). Both build
//! the Event with [`event_object`], so tests see the object the API server gets.

#[cfg(any(test, feature = "testing"))]
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use tessera_driver::names;
use tessera_driver::node::accounting::OverBooking;

use crate::error::{Error, Result};

/// Where over-booking Events go.
#[tonic::async_trait]
pub trait EventSink: Send + Sync {
    /// Records a Warning Event on the pod `over` names.
    async fn record(&self, over: &OverBooking) -> Result<()>;
}

/// The Warning Event on `over`'s pod, reported by the plugin on `node` at `now`: a core v1
/// Event of the legacy shape (no `eventTime`), as kubelet's own recorder writes them.
pub fn event_object(over: &OverBooking, node: &str, now: Timestamp) -> Event {
    Event {
        metadata: ObjectMeta {
            // Unique per pod and moment, as kubelet's recorder names its Events.
            name: Some(format!("{}.{:x}", over.pod_name, now.as_nanosecond())),
            namespace: Some(over.namespace.clone()),
            ..ObjectMeta::default()
        },
        involved_object: ObjectReference {
            api_version: Some(names::CORE_API_V1.to_owned()),
            kind: Some(names::POD.kind.to_owned()),
            namespace: Some(over.namespace.clone()),
            name: Some(over.pod_name.clone()),
            uid: Some(over.pod_uid.clone()),
            ..ObjectReference::default()
        },
        reason: Some(names::REASON_GPU_MEMORY_OVER_BOOKING.to_owned()),
        message: Some(over.message()),
        type_: Some("Warning".to_owned()),
        source: Some(EventSource {
            component: Some(names::KUBELET_PLUGIN_COMPONENT.to_owned()),
            host: Some(node.to_owned()),
        }),
        reporting_component: Some(names::KUBELET_PLUGIN_COMPONENT.to_owned()),
        reporting_instance: Some(node.to_owned()),
        first_timestamp: Some(Time(now)),
        last_timestamp: Some(Time(now)),
        count: Some(1),
        ..Event::default()
    }
}

/// Events through the API server.
#[derive(Clone)]
pub struct KubeEvents {
    client: kube::Client,
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
        Self {
            client,
            node: node.into(),
        }
    }
}

#[tonic::async_trait]
impl EventSink for KubeEvents {
    async fn record(&self, over: &OverBooking) -> Result<()> {
        let event = event_object(over, &self.node, Timestamp::now());
        Api::<Event>::namespaced(self.client.clone(), &over.namespace)
            .create(&PostParams::default(), &event)
            .await
            .map(|_| ())
            .map_err(|e| {
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

#[cfg(any(test, feature = "testing"))]
/// Records the Events it would post.
#[derive(Debug, Clone, Default)]
pub struct FakeEvents {
    events: Arc<Mutex<Vec<Event>>>,
}

#[cfg(any(test, feature = "testing"))]
impl FakeEvents {
    /// No Events yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The Events so far.
    pub fn events(&self) -> Vec<Event> {
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
        let event = event_object(over, "fake-node", Timestamp::now());
        self.events
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(event);
        Ok(())
    }
}
