//! The admission webhook over real HTTPS on 127.0.0.1: `AdmissionReview` v1 requests in, the
//! answers the API server expects out, with a certificate made by the test.
#![allow(clippy::unwrap_used, missing_docs)]

use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt as _, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use k8s_openapi::api::resource::v1 as res;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::{Value, json};
use tessera_controller::webhook::{
    self, AdmissionLookup, FakeAdmissionLookup, FakeBehaviour, WebhookConfig,
};
use tessera_driver::names;
use tokio::sync::oneshot;

/// A CA and a serving certificate for `localhost`, written as `tls.crt`/`tls.key` into `dir`;
/// returns the CA certificate the client trusts.
fn issue_certificate(dir: &Path) -> CertificateDer<'static> {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let params = rcgen::CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
    let cert = params.signed_by(&key, &ca).unwrap();
    // Written next to the target and renamed, as a Secret volume update swaps files.
    let write = |name: &str, text: String| {
        let tmp = dir.join(format!(".{name}.tmp"));
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, dir.join(name)).unwrap();
    };
    write("tls.crt", cert.pem());
    write("tls.key", key.serialize_pem());
    ca.der().clone()
}

/// A TLS client configuration that trusts `ca` alone.
fn trusting(ca: &CertificateDer<'static>) -> tokio_rustls::TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.clone()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

/// A TLS session with `localhost` over `tcp`.
async fn tls_over(
    tcp: tokio::net::TcpStream,
    connector: &tokio_rustls::TlsConnector,
) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    connector
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
}

struct Running {
    addr: std::net::SocketAddr,
    ca: CertificateDer<'static>,
    dir: tempfile::TempDir,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    async fn start(lookup: FakeAdmissionLookup) -> Self {
        Self::start_with(lookup, |_| ()).await
    }

    /// Starts the webhook with the configuration `configure` leaves.
    async fn start_with(
        lookup: FakeAdmissionLookup,
        configure: impl FnOnce(&mut WebhookConfig),
    ) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let ca = issue_certificate(dir.path());
        let mut config = WebhookConfig::new("127.0.0.1:0".parse().unwrap(), dir.path());
        configure(&mut config);
        let lookup: Arc<dyn AdmissionLookup> = Arc::new(lookup);
        let bound = webhook::bind(config, lookup).await.unwrap();
        let addr = bound.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            bound
                .run(async {
                    let _ = stopped.await;
                })
                .await
                .unwrap();
        });
        Self {
            addr,
            ca,
            dir,
            stop: Some(stop),
            task,
        }
    }

    /// Opens a TCP connection to the webhook and a TLS session over it trusting `ca`.
    async fn connect_trusting(
        &self,
        ca: &CertificateDer<'static>,
    ) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
        let tcp = tokio::net::TcpStream::connect(self.addr).await.unwrap();
        tls_over(tcp, &trusting(ca)).await
    }

    /// Sends one request over a fresh TLS connection trusting `ca`; returns status and body.
    async fn send_trusting(
        &self,
        ca: &CertificateDer<'static>,
        method: &str,
        path: &str,
        body: Vec<u8>,
    ) -> Result<(u16, Vec<u8>), String> {
        let tls = self.connect_trusting(ca).await.map_err(|e| e.to_string())?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        let request = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header("host", "localhost")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .unwrap();
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| e.to_string())?;
        let status = response.status().as_u16();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        Ok((status, body.to_vec()))
    }

    async fn send(&self, method: &str, path: &str, body: Vec<u8>) -> (u16, Vec<u8>) {
        self.send_trusting(&self.ca, method, path, body)
            .await
            .unwrap()
    }

    /// POSTs a review of `object` to `path`; returns the review's `response`.
    async fn review(&self, path: &str, request: Value) -> Value {
        let review = json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": request,
        });
        let (status, body) = self
            .send("POST", path, serde_json::to_vec(&review).unwrap())
            .await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        let answer: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(answer["apiVersion"], "admission.k8s.io/v1");
        assert_eq!(answer["kind"], "AdmissionReview");
        assert_eq!(answer["response"]["uid"], request["uid"]);
        answer["response"].clone()
    }

    /// Reviews the creation of the claim `object` in API `version` at `path`.
    async fn review_claim(&self, path: &str, version: &str, object: &Value) -> Value {
        self.review(path, share_claim_request(version, object, "CREATE"))
            .await
    }

    /// Reviews at `/mutate-pods` a pod whose one claim `gpu` is the ResourceClaim `claim`.
    async fn review_pod_using(&self, claim: &str) -> Value {
        self.review(
            "/mutate-pods",
            pod_request(
                &json!([{"name": "gpu", "resourceClaimName": claim}]),
                &json!({}),
            ),
        )
        .await
    }

    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.task.await.unwrap();
    }
}

fn pod_request(claims: &Value, extra_spec: &Value) -> Value {
    let mut spec = json!({
        "containers": [{"name": "main", "image": "cuda"}],
        "resourceClaims": claims,
    });
    for (k, v) in extra_spec.as_object().unwrap() {
        spec[k] = v.clone();
    }
    pod_create(
        "705ab4f5-6393-11e8-b7cc-42010a800002",
        &json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"generateName": "train-"}, "spec": spec}),
    )
}

/// The admission request `uid` for the creation of the pod `object` in team-a.
fn pod_create(uid: &str, object: &Value) -> Value {
    json!({
        "uid": uid,
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"},
        "namespace": "team-a",
        "operation": "CREATE",
        "object": object,
    })
}

fn claim(namespace: &str, name: &str, class: &str) -> res::ResourceClaim {
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": class}}]}},
    }))
    .unwrap()
}

fn template(namespace: &str, name: &str, class: &str) -> res::ResourceClaimTemplate {
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": class}}]}}},
    }))
    .unwrap()
}

fn decoded_patch(response: &Value) -> Value {
    assert_eq!(response["patchType"], "JSONPatch");
    // k8s-openapi's ByteString decodes the base64 the API server expects.
    let bytes: k8s_openapi::ByteString = serde_json::from_value(response["patch"].clone()).unwrap();
    serde_json::from_slice(&bytes.0).unwrap()
}

fn share_claim_request(version: &str, object: &Value, operation: &str) -> Value {
    json!({
        "uid": "u-claim",
        "kind": {"group": "resource.k8s.io", "version": version, "kind": "ResourceClaim"},
        "resource": {"group": "resource.k8s.io", "version": version, "resource": "resourceclaims"},
        "namespace": "team-a",
        "name": "share",
        "operation": operation,
        "object": object,
    })
}

/// The v1 claim `team-a/share` of the shared class asking for the capacity `requests`.
fn capacity_claim(requests: &Value) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "share", "namespace": "team-a"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": names::CLASS_SHARED_GPU,
            "capacity": {"requests": requests},
        }}]}},
    })
}

/// The message of a review `response` that must deny.
fn denial(response: &Value) -> &str {
    assert_eq!(response["allowed"], false, "{response}");
    response["status"]["message"].as_str().unwrap()
}

fn share_claim(compute: i64) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "share", "namespace": "team-a"},
        "spec": {"devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": names::CLASS_SHARED_GPU}}],
            "config": [{"requests": ["gpu"], "opaque": {"driver": names::DEFAULT_DRIVER_NAME, "parameters":
                {"apiVersion": names::CONFIG_API_VERSION, "kind": "GpuShare", "memory": "10Gi", "compute": compute}}}],
        }},
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_whose_claim_uses_the_shared_class_gets_the_scheduling_gate() {
    let lookup =
        FakeAdmissionLookup::new().with_claim(claim("team-a", "share", names::CLASS_SHARED_GPU));
    let hook = Running::start(lookup).await;
    let response = hook.review_pod_using("share").await;
    assert_eq!(response["allowed"], true);
    assert_eq!(
        decoded_patch(&response),
        json!([{"op": "add", "path": "/spec/schedulingGates", "value": [{"name": names::SCHEDULING_GATE}]}])
    );
    hook.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_using_an_annotated_class_gates_the_pod_and_keeps_its_other_gates() {
    let marked: res::DeviceClass = serde_json::from_value(json!({
        "metadata": {"name": "fast.example.com", "annotations": {names::ANNOTATION_ALLOCATE: "true"}},
        "spec": {},
    }))
    .unwrap();
    let lookup = FakeAdmissionLookup::new()
        .with_class(marked)
        .with_template(template("team-a", "fast", "fast.example.com"));
    let hook = Running::start(lookup).await;
    let response = hook
        .review(
            "/mutate-pods",
            pod_request(
                &json!([{"name": "gpu", "resourceClaimTemplateName": "fast"}]),
                &json!({"schedulingGates": [{"name": "example.com/quota"}]}),
            ),
        )
        .await;
    assert_eq!(
        decoded_patch(&response),
        json!([{"op": "add", "path": "/spec/schedulingGates/-", "value": {"name": names::SCHEDULING_GATE}}])
    );
    hook.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_with_whole_gpus_is_left_to_kube_scheduler() {
    let lookup = FakeAdmissionLookup::new().with_claim(claim("team-a", "whole", names::CLASS_GPU));
    let hook = Running::start(lookup).await;
    let response = hook.review_pod_using("whole").await;
    assert_eq!(response["allowed"], true);
    assert!(response.get("patch").is_none(), "{response}");
    assert!(response.get("warnings").is_none(), "{response}");
    hook.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_whose_claim_does_not_exist_yet_is_admitted_ungated_with_a_warning() {
    let hook = Running::start(FakeAdmissionLookup::new()).await;
    let response = hook.review_pod_using("later").await;
    assert_eq!(response["allowed"], true);
    assert!(response.get("patch").is_none());
    let warning = response["warnings"][0].as_str().unwrap();
    assert!(warning.contains("ResourceClaim later"), "{warning}");
    hook.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_server_that_does_not_answer_never_blocks_a_pod() {
    let lookup = FakeAdmissionLookup::new().behaving(FakeBehaviour::Hang);
    let hook = Running::start_with(lookup, |config| {
        config.lookup_timeout = Duration::from_millis(200);
    })
    .await;
    let response = hook.review_pod_using("share").await;
    assert_eq!(response["allowed"], true);
    assert!(response.get("patch").is_none());
    assert!(
        response["warnings"][0]
            .as_str()
            .unwrap()
            .contains("kube-scheduler")
    );
    hook.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_share_that_breaks_a_rule_is_denied_naming_the_field_and_the_rule() {
    let hook = Running::start(FakeAdmissionLookup::new()).await;
    let response = hook
        .review_claim("/validate-claims", "v1", &share_claim(7))
        .await;
    let message = denial(&response);
    assert_eq!(response["status"]["code"], 422);
    assert!(
        message.contains("ResourceClaim team-a/share")
            && message.contains("spec.devices.config[0].opaque.parameters.compute")
            && message.contains("multiple of 5"),
        "{message}"
    );
    hook.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_valid_share_is_admitted_in_every_served_version() {
    let hook = Running::start(FakeAdmissionLookup::new()).await;
    let response = hook
        .review_claim("/validate-claims", "v1", &share_claim(50))
        .await;
    assert_eq!(response["allowed"], true, "{response}");
    // v1beta1 keeps request fields flat, without `exactly`.
    let mut old = share_claim(50);
    old["apiVersion"] = json!("resource.k8s.io/v1beta1");
    old["spec"]["devices"]["requests"] =
        json!([{"name": "gpu", "deviceClassName": names::CLASS_SHARED_GPU}]);
    let response = hook.review_claim("/validate-claims", "v1beta1", &old).await;
    assert_eq!(response["allowed"], true, "{response}");
    hook.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_negative_capacity_request_is_denied() {
    let hook = Running::start(FakeAdmissionLookup::new()).await;
    let claim = capacity_claim(&json!({"gpu.tessera.dev/memory": "-5Gi"}));
    let response = hook.review_claim("/validate-claims", "v1", &claim).await;
    let message = denial(&response);
    assert!(
        message
            .contains("spec.devices.requests[0].exactly.capacity.requests.gpu.tessera.dev/memory")
            && message.contains("negative"),
        "{message}"
    );
    hook.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_is_checked_one_level_deeper() {
    let hook = Running::start(FakeAdmissionLookup::new()).await;
    let claim = share_claim(150);
    let request = json!({
        "uid": "u-template",
        "kind": {"group": "resource.k8s.io", "version": "v1", "kind": "ResourceClaimTemplate"},
        "resource": {"group": "resource.k8s.io", "version": "v1", "resource": "resourceclaimtemplates"},
        "namespace": "team-a",
        "name": "share",
        "operation": "CREATE",
        "object": {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": "share", "namespace": "team-a"},
            "spec": {"spec": claim["spec"].clone()},
        },
    });
    let response = hook.review("/validate-claims", request).await;
    let message = denial(&response);
    assert!(
        message.contains(
            "ResourceClaimTemplate team-a/share: spec.spec.devices.config[0].opaque.parameters.compute"
        ) && message.matches("spec.devices").count() == 1,
        "{message}"
    );
    hook.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_updates_of_a_claim_admitted_before_are_never_blocked() {
    let hook = Running::start(FakeAdmissionLookup::new()).await;
    let mut request = share_claim_request("v1", &share_claim(7), "UPDATE");
    let mut with_finalizer = share_claim(7);
    with_finalizer["metadata"]["finalizers"] = json!([names::CLAIM_FINALIZER]);
    request["oldObject"] = request["object"].clone();
    request["object"] = with_finalizer;
    let response = hook.review("/validate-claims", request).await;
    assert_eq!(response["allowed"], true, "{response}");
    hook.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validation_fails_closed_when_classes_cannot_be_read() {
    let lookup = FakeAdmissionLookup::new().behaving(FakeBehaviour::Fail("etcd is down".into()));
    let hook = Running::start(lookup).await;
    let response = hook
        .review_claim("/validate-claims", "v1", &share_claim(50))
        .await;
    let message = denial(&response);
    assert_eq!(response["status"]["code"], 503);
    assert!(message.contains("etcd is down"), "{message}");
    hook.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opaque_parameters_are_rewritten_canonically_at_creation() {
    let hook = Running::start(FakeAdmissionLookup::new()).await;
    let response = hook
        .review_claim("/mutate-claims", "v1", &share_claim(50))
        .await;
    assert_eq!(response["allowed"], true);
    let patch = decoded_patch(&response);
    assert_eq!(patch[0]["op"], "replace");
    assert_eq!(patch[0]["path"], "/spec/devices/config/0/opaque/parameters");
    assert_eq!(
        patch[0]["value"],
        share_claim(50)["spec"]["devices"]["config"][0]["opaque"]["parameters"]
    );
    hook.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_made_from_a_template_for_a_gated_pod_is_marked_for_the_controller() {
    let pod = |uid: &str, with_gate: bool| -> k8s_openapi::api::core::v1::Pod {
        let gates = if with_gate {
            json!([{"name": names::SCHEDULING_GATE}])
        } else {
            json!([])
        };
        serde_json::from_value(json!({
            "metadata": {"name": "train", "namespace": "team-a", "uid": uid},
            "spec": {"containers": [], "schedulingGates": gates}}))
        .unwrap()
    };
    let mut claim = share_claim(50);
    claim["metadata"]["ownerReferences"] = json!([{"apiVersion": "v1", "kind": "Pod",
        "name": "train", "uid": "u-train", "controller": true, "blockOwnerDeletion": true}]);
    claim["metadata"]["annotations"] = json!({"resource.kubernetes.io/pod-claim-name": "gpu"});
    let request = share_claim_request("v1", &claim, "CREATE");
    let ops = |response: &Value| -> Vec<(String, Value)> {
        if response["patch"].is_null() {
            return Vec::new();
        }
        decoded_patch(response)
            .as_array()
            .unwrap()
            .iter()
            .filter(|op| op["path"].as_str().unwrap().starts_with("/metadata"))
            .map(|op| (op["path"].as_str().unwrap().to_owned(), op["value"].clone()))
            .collect()
    };
    let gated = Running::start(FakeAdmissionLookup::new().with_pod(pod("u-train", true))).await;
    let response = gated.review("/mutate-claims", request.clone()).await;
    assert_eq!(
        ops(&response),
        vec![
            (
                "/metadata/finalizers".to_owned(),
                json!([names::CLAIM_FINALIZER])
            ),
            (
                "/metadata/annotations/gpu.tessera.dev~1allocated-by".to_owned(),
                json!("train")
            ),
        ]
    );
    gated.stop().await;
    // A pod that is not gated, a pod made again under the same name, no pod, a lookup that
    // fails: no mark (the controller, or kube-scheduler, writes what it needs).
    for lookup in [
        FakeAdmissionLookup::new().with_pod(pod("u-train", false)),
        FakeAdmissionLookup::new().with_pod(pod("u-other", true)),
        FakeAdmissionLookup::new(),
        FakeAdmissionLookup::new()
            .with_pod(pod("u-train", true))
            .behaving(FakeBehaviour::Fail("down".into())),
    ] {
        let hook = Running::start(lookup).await;
        let response = hook.review("/mutate-claims", request.clone()).await;
        assert_eq!(response["allowed"], true);
        assert_eq!(ops(&response), vec![]);
        hook.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_gets_an_http_error_never_a_crash() {
    let hook = Running::start(FakeAdmissionLookup::new()).await;
    let (status, _) = hook
        .send("POST", "/validate-claims", b"{not json".to_vec())
        .await;
    assert_eq!(status, 400);
    let (status, _) = hook
        .send(
            "POST",
            "/mutate-pods",
            br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}"#.to_vec(),
        )
        .await;
    assert_eq!(status, 400);
    let (status, _) = hook
        .send(
            "POST",
            "/validate-claims",
            vec![b' '; webhook::server::MAX_BODY_BYTES + 1],
        )
        .await;
    assert_eq!(status, 413);
    let (status, _) = hook.send("GET", "/validate-claims", Vec::new()).await;
    assert_eq!(status, 405);
    let (status, _) = hook.send("POST", "/nowhere", Vec::new()).await;
    assert_eq!(status, 404);
    // A claim whose object is not a claim at all is denied by validation, with the reason.
    let response = hook
        .review_claim(
            "/validate-claims",
            "v1",
            &json!({"spec": {"devices": "many"}}),
        )
        .await;
    assert_eq!(response["allowed"], false);
    // And the server still answers.
    let (status, body) = hook.send("GET", "/healthz", Vec::new()).await;
    assert_eq!((status, body.as_slice()), (200, b"ok\n".as_slice()));
    hook.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_certificate_is_served_on_the_next_connection() {
    let hook = Running::start(FakeAdmissionLookup::new()).await;
    let old_ca = hook.ca.clone();
    let new_ca = issue_certificate(hook.dir.path());
    let (status, _) = hook
        .send_trusting(&new_ca, "GET", "/healthz", Vec::new())
        .await
        .unwrap();
    assert_eq!(status, 200);
    let refused = hook
        .send_trusting(&old_ca, "GET", "/healthz", Vec::new())
        .await;
    assert!(refused.is_err(), "the old certificate is still served");
    hook.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_written_rotation_keeps_the_previous_certificate() {
    let hook = Running::start(FakeAdmissionLookup::new()).await;
    std::fs::write(hook.dir.path().join("tls.key"), "not a key").unwrap();
    let (status, _) = hook.send("GET", "/healthz", Vec::new()).await;
    assert_eq!(status, 200);
    hook.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_certificate_files_are_a_clear_configuration_error() {
    let dir = tempfile::tempdir().unwrap();
    let config = WebhookConfig::new("127.0.0.1:0".parse().unwrap(), dir.path());
    let err = webhook::bind(config, Arc::new(FakeAdmissionLookup::new()))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("tls.crt"), "{err}");
}

/// Opens `count` TCP connections to the webhook that never send a byte (no TLS handshake).
async fn idle_connections(addr: std::net::SocketAddr, count: usize) -> Vec<tokio::net::TcpStream> {
    let mut open = Vec::with_capacity(count);
    for _ in 0..count {
        open.push(tokio::net::TcpStream::connect(addr).await.unwrap());
    }
    open
}

/// Far longer than a review takes on an idle loopback, and shorter than the 9 s a review took
/// behind 600 idle connections when they held every connection slot for a 10 s handshake
/// timeout (issue 23); the test bound, not a measurement.
const REVIEW_BOUND: Duration = Duration::from_secs(8);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn six_hundred_idle_connections_do_not_hold_up_a_valid_review() {
    let hook = Running::start(FakeAdmissionLookup::new()).await;
    let idle = idle_connections(hook.addr, 600).await;
    let started = std::time::Instant::now();
    let response = tokio::time::timeout(
        REVIEW_BOUND,
        hook.review_claim("/validate-claims", "v1", &share_claim(50)),
    )
    .await
    .expect("a valid review answers while 600 idle connections are open");
    assert_eq!(response["allowed"], true, "{response}");
    // For docs/admission.md (printed with --nocapture); not asserted.
    eprintln!(
        "a valid review with {} idle connections open took {:?}",
        idle.len(),
        started.elapsed()
    );
    drop(idle);
    hook.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_that_never_handshake_or_never_ask_are_closed() {
    use tokio::io::AsyncReadExt as _;
    let hook = Running::start(FakeAdmissionLookup::new()).await;
    // No TLS handshake at all: closed after the handshake timeout.
    let mut silent = tokio::net::TcpStream::connect(hook.addr).await.unwrap();
    let mut byte = [0u8; 1];
    let read = tokio::time::timeout(REVIEW_BOUND, silent.read(&mut byte))
        .await
        .expect("the server closes a connection that does not start TLS");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    // A finished handshake and no request: closed after the idle timeout.
    let mut tls = hook.connect_trusting(&hook.ca).await.unwrap();
    let read = tokio::time::timeout(REVIEW_BOUND, tls.read(&mut byte))
        .await
        .expect("the server closes a connection that sends no request");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    hook.stop().await;
}

// --- Slow peers: connections that finish their handshake and then dribble or say nothing

/// How a slow peer uses each connection it opens.
#[derive(Debug, Clone, Copy)]
enum Slowness {
    /// Sends a review's head, then its body at one byte a second.
    Body,
    /// Finishes the TLS handshake and sends nothing.
    IdleAfterTls,
}

/// Peers that each keep one slow connection to the webhook open, opening another as soon as
/// the webhook closes theirs. They run on a runtime of their own (one thread), as a client
/// elsewhere would, and stop when dropped.
struct SlowPeers {
    runtime: Option<tokio::runtime::Runtime>,
    counts: Arc<PeerCounts>,
}

/// What slow peers have done so far.
#[derive(Debug, Default)]
struct PeerCounts {
    /// Connections whose TLS handshake finished, all told.
    handshakes: std::sync::atomic::AtomicUsize,
    /// Connections open now (handshake finished, not yet closed by the webhook).
    open: std::sync::atomic::AtomicUsize,
}

impl SlowPeers {
    /// Starts `count` peers of `slowness` against `hook`.
    /// Starts `count` peers of `slowness` against `hook`, connecting from the addresses `from`
    /// in turn.
    fn start(hook: &Running, count: usize, slowness: Slowness, from: &[IpAddr]) -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let counts = Arc::new(PeerCounts::default());
        let connector = trusting(&hook.ca);
        for address in from.iter().cycle().take(count) {
            runtime.spawn(hold_slow_connections(
                (*address, hook.addr),
                connector.clone(),
                slowness,
                Arc::clone(&counts),
            ));
        }
        Self {
            runtime: Some(runtime),
            counts,
        }
    }

    /// How many of the peers' connections are open (handshake finished, not yet closed).
    fn open(&self) -> usize {
        self.counts.open.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How many handshakes the peers have finished, all told.
    fn handshakes(&self) -> usize {
        self.counts
            .handshakes
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Waits until the peers have finished `count` handshakes, or `limit` passed; returns how
    /// many they had.
    async fn shook_hands(&self, count: usize, limit: Duration) -> usize {
        let started = std::time::Instant::now();
        while self.handshakes() < count && started.elapsed() < limit {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.handshakes()
    }
}

impl Drop for SlowPeers {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// A TCP connection to `to` from the address `from` (any of 127.0.0.0/8 on loopback), as a
/// peer other than the test's own client.
async fn connect_from(
    from: IpAddr,
    to: std::net::SocketAddr,
) -> std::io::Result<tokio::net::TcpStream> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.bind(std::net::SocketAddr::new(from, 0))?;
    socket.connect(to).await
}

/// One slow peer: opens a connection, uses it as `slowness` says until the webhook closes
/// it, and opens the next.
async fn hold_slow_connections(
    (from, to): (IpAddr, std::net::SocketAddr),
    connector: tokio_rustls::TlsConnector,
    slowness: Slowness,
    counts: Arc<PeerCounts>,
) {
    use std::sync::atomic::Ordering;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    loop {
        let tls = match connect_from(from, to).await {
            Ok(tcp) => tls_over(tcp, &connector).await,
            Err(e) => Err(e),
        };
        let Ok(tls) = tls else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        counts.handshakes.fetch_add(1, Ordering::Relaxed);
        counts.open.fetch_add(1, Ordering::Relaxed);
        let (mut from, mut to) = tokio::io::split(tls);
        let closed = async {
            let mut buffer = [0u8; 1024];
            while matches!(from.read(&mut buffer).await, Ok(n) if n > 0) {}
        };
        let send = async {
            if let Slowness::Body = slowness {
                let head = "POST /validate-claims HTTP/1.1\r\nhost: localhost\r\n\
                            content-type: application/json\r\ncontent-length: 4096\r\n\r\n";
                let mut sent = to.write_all(head.as_bytes()).await;
                while sent.is_ok() {
                    sent = to.write_all(b" ").await;
                    let _ = to.flush().await;
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
            std::future::pending::<()>().await;
        };
        tokio::select! {
            () = closed => {}
            () = send => {}
        }
        counts.open.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Running {
    /// Reviews a valid share at `/validate-claims` over a fresh connection, as the API server
    /// does; returns how long the answer took, or what went wrong.
    async fn timed_review(&self) -> Result<Duration, String> {
        let review = json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": share_claim_request("v1", &share_claim(50), "CREATE"),
        });
        let started = std::time::Instant::now();
        let (status, body) = self
            .send_trusting(
                &self.ca,
                "POST",
                "/validate-claims",
                serde_json::to_vec(&review).unwrap(),
            )
            .await?;
        let took = started.elapsed();
        let answer: Value = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
        if status == 200 && answer["response"]["allowed"] == true {
            Ok(took)
        } else {
            Err(format!("{status}: {}", String::from_utf8_lossy(&body)))
        }
    }
}

/// Where slow peers connect from: other addresses than the test's client (127.0.0.1), as pods
/// are other peers than the API server.
const OTHER_PEERS: [IpAddr; 3] = [
    IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, 2)),
    IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, 3)),
    IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, 4)),
];

/// The places of each stage of the small webhook the functional test runs (a quarter of them
/// for the waiting connections of one peer address): its slow peers, from three addresses, are
/// four times as many, and it needs few handshakes to be full (a debug build's handshakes are
/// slow).
const SMALL: usize = 8;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn valid_reviews_are_answered_while_slow_peers_hold_more_connections_than_are_served() {
    let hook = Running::start_with(FakeAdmissionLookup::new(), |config| {
        config.capacity = webhook::server::Capacity::of(SMALL, SMALL);
    })
    .await;
    let dribbling = SlowPeers::start(&hook, 2 * SMALL, Slowness::Body, &OTHER_PEERS);
    let idle = SlowPeers::start(&hook, 2 * SMALL, Slowness::IdleAfterTls, &OTHER_PEERS);
    // Each address has had its share of the places several times over.
    for peers in [&dribbling, &idle] {
        let shook = peers.shook_hands(4 * SMALL, REVIEW_BOUND).await;
        assert!(
            shook >= 4 * SMALL,
            "the slow peers finished {shook} handshakes"
        );
    }
    for review in 0..20 {
        let answered = tokio::time::timeout(REVIEW_BOUND, hook.timed_review()).await;
        assert!(
            matches!(answered, Ok(Ok(_))),
            "review {review} with {} dribbling and {} idle connections open: {answered:?}",
            dribbling.open(),
            idle.open(),
        );
    }
    drop((dribbling, idle));
    hook.stop().await;
}

/// More slow connections than the webhook serves at once by default (512); with d239c23 a
/// review waited behind them for a serving slot (1.1 s median, the issue measured).
const SLOW_PEERS: usize = 700;

/// The measurement behind issue 29's admission goal (p99 ≤ 0.2 s with 700 slow connections
/// open): p50, p99 and the worst of `TESSERA_REVIEW_SAMPLES` (default 200) valid reviews, each
/// over a fresh connection, alone and with 700 peers of each slowness: from another address
/// than the reviews, from three others, and from the reviews' own. Printed, not asserted (a release build measures
/// what the controller does; a debug build's handshakes are many times slower):
///
/// `cargo test -p tessera-controller --test webhook -- --ignored --nocapture review_times`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement, run by hand (see its comment)"]
async fn review_times_with_slow_peers_open() {
    let samples: usize = std::env::var("TESSERA_REVIEW_SAMPLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let limit = tessera_tests::host::open_files_for(4 * SLOW_PEERS as u64).unwrap();
    eprintln!("open-file limit {limit}");
    let hook = Running::start(FakeAdmissionLookup::new()).await;
    let ours = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);
    let one_other = &OTHER_PEERS[..1];
    for slow in [
        None,
        Some((Slowness::Body, one_other)),
        Some((Slowness::IdleAfterTls, one_other)),
        Some((Slowness::Body, &OTHER_PEERS[..])),
        Some((Slowness::IdleAfterTls, &OTHER_PEERS[..])),
        Some((Slowness::Body, &[ours][..])),
        Some((Slowness::IdleAfterTls, &[ours][..])),
    ] {
        let peers =
            slow.map(|(slowness, from)| SlowPeers::start(&hook, SLOW_PEERS, slowness, from));
        let mut open_at_start = 0;
        if let Some(peers) = &peers {
            peers.shook_hands(SLOW_PEERS, Duration::from_secs(30)).await;
            // Let the peers' connections reach the webhook's timeouts and come back.
            tokio::time::sleep(Duration::from_secs(3)).await;
            open_at_start = peers.open();
        }
        let mut times = Vec::with_capacity(samples);
        let mut failed = Vec::new();
        for _ in 0..samples {
            match hook.timed_review().await {
                Ok(took) => times.push(took),
                Err(e) => failed.push(e),
            }
        }
        times.sort();
        // The sample at `percent` per cent: the smallest that many per cent do not exceed.
        let at = |percent: usize| {
            let rank = (percent * times.len()).div_ceil(100).max(1);
            times.get(rank - 1).copied().unwrap_or_default()
        };
        eprintln!(
            "{:?} with {} slow peers ({open_at_start} connections open at the start, {} at the end): \
             {} reviews, p50 {:?}, p99 {:?}, worst {:?}, {} failed{}",
            slow,
            if slow.is_some() { SLOW_PEERS } else { 0 },
            peers.as_ref().map_or(0, SlowPeers::open),
            times.len(),
            at(50),
            at(99),
            times.last().copied().unwrap_or_default(),
            failed.len(),
            failed
                .first()
                .map(|e| format!(" (first: {e})"))
                .unwrap_or_default(),
        );
    }
    hook.stop().await;
}

// --- Pods written for the device-plugin world (design §7)

fn device_plugin_pod(limits: &Value, labels: &Value, dry_run: bool) -> Value {
    let mut request = pod_create(
        "dp-1",
        &json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "legacy", "namespace": "team-a", "labels": labels},
            "spec": {"containers": [{"name": "main", "image": "cuda",
                "resources": {"limits": limits, "requests": limits}}]}}),
    );
    request["dryRun"] = json!(dry_run);
    request
}

/// The templates the pure mapping names for the pod of `request`, with `replicas`.
fn mapped_templates(request: &Value, replicas: u32) -> Vec<String> {
    use tessera_driver::admission::device_plugin_names::{
        DevicePluginRequest, Options, map_request,
    };
    let pod: k8s_openapi::api::core::v1::Pod =
        serde_json::from_value(request["object"].clone()).unwrap();
    let asked = DevicePluginRequest::from_pod(&pod, "Pod team-a/legacy")
        .unwrap()
        .unwrap();
    let options = Options {
        shared_replicas: replicas,
        ..Options::default()
    };
    map_request(&asked, &options, "Pod team-a/legacy")
        .unwrap()
        .claims
        .into_iter()
        .map(|c| c.template)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_row_of_the_device_plugin_table_is_rewritten_into_claims_and_gated() {
    let hook = Running::start(FakeAdmissionLookup::new()).await;
    let rows = [
        (json!({"nvidia.com/gpu": "2"}), json!({})),
        (json!({"nvidia.com/mig-1g.10gb": "1"}), json!({})),
        (json!({"nvidia.com/gpu.shared": "1"}), json!({})),
        (json!({"baidu.com/v100_32g_cgpu": "1"}), json!({})),
        (
            json!({"baidu.com/a10_24g_cgpu": "2", "baidu.com/a10_24g_cgpu_memory": "10", "baidu.com/a10_24g_cgpu_core": "50"}),
            json!({}),
        ),
        (
            json!({"baidu.com/l20_cgpu": "1", "baidu.com/l20_cgpu_memory_percent": "25"}),
            json!({}),
        ),
        (
            json!({"aliyun.com/gpu-mem": "8"}),
            json!({"aliyun.com/gpu-count": "2"}),
        ),
        (
            json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "4096", "nvidia.com/gpucores": "30"}),
            json!({}),
        ),
    ];
    for (limits, labels) in rows {
        let request = device_plugin_pod(&limits, &labels, false);
        let response = hook.review("/mutate-pods", request.clone()).await;
        assert_eq!(response["allowed"], true, "{limits}: {response}");
        let patch = decoded_patch(&response);
        let ops = patch.as_array().unwrap();
        for name in limits.as_object().unwrap().keys() {
            let token = name.replace('/', "~1");
            for list in ["limits", "requests"] {
                let pointer = format!("/spec/containers/0/resources/{list}/{token}");
                assert!(
                    ops.iter()
                        .any(|o| o["op"] == "remove" && o["path"] == pointer),
                    "{limits}: no removal of {pointer} in {patch}"
                );
            }
        }
        let entries = ops
            .iter()
            .find(|o| o["path"] == "/spec/resourceClaims")
            .unwrap_or_else(|| panic!("{limits}: no resourceClaims in {patch}"));
        let templates: Vec<String> = entries["value"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["resourceClaimTemplateName"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(templates, mapped_templates(&request, 4), "{limits}");
        let claims = ops
            .iter()
            .find(|o| o["path"] == "/spec/containers/0/resources/claims")
            .unwrap();
        assert_eq!(claims["value"][0]["name"], entries["value"][0]["name"]);
        let annotations = ops
            .iter()
            .find(|o| o["path"] == "/metadata/annotations")
            .unwrap();
        let recorded = annotations["value"][names::ANNOTATION_DEVICE_PLUGIN_REQUEST]
            .as_str()
            .unwrap();
        for name in limits.as_object().unwrap().keys() {
            assert!(recorded.contains(name.as_str()), "{recorded}");
        }
        assert!(ops.iter().any(|o| o["path"] == "/spec/schedulingGates"
            && o["value"] == json!([{"name": names::SCHEDULING_GATE}])));
        // Dry run: the same answer, since the hook has no side effect to skip.
        let dry = hook
            .review("/mutate-pods", device_plugin_pod(&limits, &labels, true))
            .await;
        assert_eq!(dry, response, "{limits}");
    }
    hook.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hami_rounding_and_time_slicing_replicas_follow_the_options_and_warn() {
    let hook = Running::start_with(FakeAdmissionLookup::new(), |config| {
        config.shared_replicas = 2;
    })
    .await;
    let request = device_plugin_pod(&json!({"nvidia.com/gpu.shared": "1"}), &json!({}), false);
    let response = hook.review("/mutate-pods", request.clone()).await;
    let patch = decoded_patch(&response);
    let entries = patch
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["path"] == "/spec/resourceClaims")
        .unwrap();
    assert_eq!(
        entries["value"][0]["resourceClaimTemplateName"],
        mapped_templates(&request, 2)[0]
    );
    assert_ne!(mapped_templates(&request, 2), mapped_templates(&request, 4));

    let request = device_plugin_pod(
        &json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "3000"}),
        &json!({}),
        false,
    );
    let response = hook.review("/mutate-pods", request).await;
    assert_eq!(response["allowed"], true);
    let warnings = response["warnings"].to_string();
    assert!(warnings.contains("rounded up to 3Gi"), "{warnings}");
    hook.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_plugin_ask_that_breaks_a_rule_is_denied_naming_container_resource_and_rule() {
    let hook = Running::start(FakeAdmissionLookup::new()).await;
    let cases = [
        (
            json!({"baidu.com/v100_32g_cgpu": "1", "baidu.com/v100_32g_cgpu_core": "50"}),
            json!({}),
            "compute needs memory",
        ),
        (
            json!({"baidu.com/p4_8g_cgpu": "1"}),
            json!({}),
            "unknown GPU model",
        ),
        (
            json!({"aliyun.com/gpu-mem": "3"}),
            json!({"aliyun.com/gpu-count": "2"}),
            "not a whole number of GiB per card",
        ),
    ];
    for (limits, labels, rule) in cases {
        let response = hook
            .review("/mutate-pods", device_plugin_pod(&limits, &labels, false))
            .await;
        let message = denial(&response);
        assert_eq!(response["status"]["code"], 422, "{limits}");
        assert!(message.contains("Pod team-a/legacy"), "{message}");
        assert!(
            message.contains("spec.containers[0].resources.limits["),
            "{message}"
        );
        assert!(message.contains(rule), "{message}");
    }
    hook.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn init_containers_sidecars_and_own_claims_are_kept_and_a_node_name_is_left_alone() {
    let hook = Running::start(FakeAdmissionLookup::new().with_claim(claim(
        "team-a",
        "mine",
        names::CLASS_GPU,
    )))
    .await;
    let mut request = device_plugin_pod(&json!({"nvidia.com/gpu": "1"}), &json!({}), false);
    request["object"]["spec"]["initContainers"] = json!([{"name": "side", "image": "x", "restartPolicy": "Always",
        "resources": {"limits": {"nvidia.com/gpu.shared": "1"}}}]);
    request["object"]["spec"]["resourceClaims"] =
        json!([{"name": "own", "resourceClaimName": "mine"}]);
    request["object"]["spec"]["containers"][0]["resources"]["claims"] = json!([{"name": "own"}]);
    let response = hook.review("/mutate-pods", request.clone()).await;
    assert_eq!(response["allowed"], true);
    let patch = decoded_patch(&response);
    let ops: Vec<(String, String)> = patch
        .as_array()
        .unwrap()
        .iter()
        .filter(|o| o["op"] == "add")
        .map(|o| {
            (
                o["path"].as_str().unwrap().to_owned(),
                o["value"].to_string(),
            )
        })
        .collect();
    assert!(
        ops.contains(&(
            "/spec/initContainers/0/resources/claims".to_owned(),
            json!([{"name": "tessera-side"}]).to_string()
        )),
        "{ops:?}"
    );
    assert!(
        ops.contains(&(
            "/spec/containers/0/resources/claims/-".to_owned(),
            json!({"name": "tessera-main"}).to_string()
        )),
        "{ops:?}"
    );
    assert_eq!(
        ops.iter()
            .filter(|(p, _)| p == "/spec/resourceClaims/-")
            .count(),
        2
    );

    request["object"]["spec"]["nodeName"] = json!("node-a");
    let response = hook.review("/mutate-pods", request).await;
    assert_eq!(response["allowed"], true);
    assert!(response.get("patch").is_none(), "{response}");
    assert!(response["warnings"].to_string().contains("spec.nodeName"));
    hook.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_v1beta1_claim_is_denied_with_v1beta1_field_paths() {
    let hook = Running::start(FakeAdmissionLookup::new()).await;
    let claim = json!({
        "apiVersion": "resource.k8s.io/v1beta1",
        "kind": "ResourceClaim",
        "metadata": {"name": "share", "namespace": "team-a"},
        "spec": {"devices": {"requests": [{"name": "gpu",
            "deviceClassName": names::CLASS_SHARED_GPU,
            "capacity": {"requests": {"memory": "-5Gi"}},
        }]}},
    });
    let response = hook
        .review_claim("/validate-claims", "v1beta1", &claim)
        .await;
    let message = denial(&response);
    assert!(
        message.contains("spec.devices.requests[0].capacity.requests.memory: -5Gi is negative")
            && !message.contains("exactly"),
        "{message}"
    );
    hook.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_requests_the_policy_rounds_are_admitted_with_a_warning() {
    let hook = Running::start(FakeAdmissionLookup::new()).await;
    let claim = capacity_claim(&json!({"memory": "1500Mi", "compute": "7"}));
    let response = hook.review_claim("/validate-claims", "v1", &claim).await;
    assert_eq!(response["allowed"], true, "{response}");
    let warnings = response["warnings"].to_string();
    assert!(
        warnings.contains("memory 1500Mi rounds up to 2Gi")
            && warnings.contains("compute 7 rounds up to 10"),
        "{response}"
    );
    hook.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_schedules_the_simulation_reads_are_admitted_by_the_webhook() {
    let hook = Running::start(FakeAdmissionLookup::new()).await;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/schedules");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let object: Value = serde_yaml::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let request = json!({
            "uid": "u-schedule",
            "kind": {"group": "gpu.tessera.dev", "version": "v1alpha1", "kind": "GpuProfileSchedule"},
            "resource": {"group": "gpu.tessera.dev", "version": "v1alpha1", "resource": names::GPU_PROFILE_SCHEDULE.plural},
            "name": object["metadata"]["name"].clone(),
            "operation": "CREATE",
            "object": object,
        });
        let response = hook.review("/validate-schedules", request).await;
        assert_eq!(response["allowed"], true, "{}: {response}", path.display());
        seen += 1;
    }
    assert!(seen > 0, "no schedule in {}", dir.display());
    hook.stop().await;
}
