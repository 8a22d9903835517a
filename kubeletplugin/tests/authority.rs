//! Both sockets answer gRPC calls whatever `:authority` the client sends, over real unix sockets,
//! with a raw HTTP/2 client that writes its header blocks the way grpc-go does when kubelet's
//! plugin watcher dials a socket by its path: the percent-encoded path as `:authority`, added
//! to the connection's HPACK table and named by index on the next call.
#![allow(clippy::unwrap_used, missing_docs)]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use prost::Message as _;
use tessera_kubelet_plugin::claims::ClaimRef;
use tessera_kubelet_plugin::claims::cancel::Cancel;
use tessera_kubelet_plugin::claims::preparer::{ClaimPreparer, KubeletDevice};
use tessera_kubelet_plugin::kubelet::server::{self, PluginConfig};
use tessera_kubelet_plugin::{Error, Result};
use tessera_proto::dra::v1;
use tessera_proto::pluginregistration::v1 as reg;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::UnixStream;

const DRIVER: &str = "gpu.tessera.dev";
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Answers every claim with "not found": the calls themselves are what is tested.
struct NoClaims;

#[tonic::async_trait]
impl ClaimPreparer for NoClaims {
    async fn prepare_all(
        self: Arc<Self>,
        claims: Vec<ClaimRef>,
        _cancel: Cancel,
    ) -> Vec<Result<Vec<KubeletDevice>>> {
        claims
            .into_iter()
            .map(|claim| {
                Err(Error::ClaimNotFound {
                    namespace: claim.namespace,
                    name: claim.name,
                })
            })
            .collect()
    }

    async fn unprepare_all(
        self: Arc<Self>,
        claims: Vec<ClaimRef>,
        _cancel: Cancel,
    ) -> Vec<Result<()>> {
        claims.iter().map(|_| Ok(())).collect()
    }
}

/// The `:authority` grpc-go derives from a target that is a bare socket path: the path with
/// every byte but the unreserved ones percent-encoded.
fn percent_encoded(path: &Path) -> String {
    let mut out = String::new();
    for b in path.to_str().unwrap().bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(char::from(b));
        } else {
            write!(out, "%{b:02X}").unwrap();
        }
    }
    out
}

fn integer(out: &mut Vec<u8>, high: u8, prefix_bits: u32, value: usize) {
    let max = (1usize << prefix_bits) - 1;
    if value < max {
        out.push(high | u8::try_from(value).unwrap());
        return;
    }
    out.push(high | u8::try_from(max).unwrap());
    let mut rest = value - max;
    while rest >= 0x80 {
        out.push(u8::try_from(rest & 0x7f).unwrap() | 0x80);
        rest >>= 7;
    }
    out.push(u8::try_from(rest).unwrap());
}

/// A literal with incremental indexing; `name_index` 0 means a literal name.
fn indexed_literal(out: &mut Vec<u8>, name_index: usize, name: &str, value: &str) {
    integer(out, 0x40, 6, name_index);
    if name_index == 0 {
        integer(out, 0, 7, name.len());
        out.extend_from_slice(name.as_bytes());
    }
    integer(out, 0, 7, value.len());
    out.extend_from_slice(value.as_bytes());
}

/// An "indexed header field" (RFC 7541 §6.1) naming table entry `index`.
fn indexed(index: u8) -> u8 {
    0x80 | index
}

fn frame(out: &mut Vec<u8>, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
    let len = u32::try_from(payload.len()).unwrap().to_be_bytes();
    out.extend_from_slice(&len[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
}

fn grpc_message(message: &[u8]) -> Vec<u8> {
    let mut out = vec![0];
    out.extend_from_slice(&u32::try_from(message.len()).unwrap().to_be_bytes());
    out.extend_from_slice(message);
    out
}

/// What came back on one stream.
#[derive(Debug, Default)]
struct Answer {
    headers: Vec<Vec<(String, String)>>,
    data: Vec<u8>,
    reset: Option<u32>,
    ended: bool,
}

impl Answer {
    fn field(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .flatten()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The one gRPC message of a unary answer.
    fn message(&self) -> &[u8] {
        assert!(self.data.len() >= 5, "no message: {self:?}");
        &self.data[5..]
    }
}

/// Calls `path` twice on one connection, as grpc-go would: the first call's header block adds
/// `:path` and `:authority` to the HPACK table, the second names them by index. Returns the
/// two answers.
async fn call_twice(socket: &Path, authority: &str, path: &str, request: &[u8]) -> [Answer; 2] {
    let mut conn = UnixStream::connect(socket).await.unwrap();
    let mut out = PREFACE.to_vec();
    frame(&mut out, 0x4, 0, 0, &[]);
    let mut first = vec![0x83, 0x86]; // :method POST, :scheme http
    indexed_literal(&mut first, 4, "", path);
    indexed_literal(&mut first, 1, "", authority);
    indexed_literal(&mut first, 31, "", "application/grpc");
    indexed_literal(&mut first, 0, "te", "trailers");
    // Newest first: te (62), content-type (63), :authority (64), :path (65).
    let second = vec![
        0x83,
        0x86,
        indexed(65),
        indexed(64),
        indexed(63),
        indexed(62),
    ];
    for (stream, block) in [(1, first), (3, second)] {
        frame(&mut out, 0x1, 0x4, stream, &block);
        frame(&mut out, 0x0, 0x1, stream, &grpc_message(request));
    }
    conn.write_all(&out).await.unwrap();

    let mut answers: BTreeMap<u32, Answer> = BTreeMap::new();
    let mut decoder = loona_hpack::Decoder::new();
    let mut buf = Vec::new();
    let done = |a: &BTreeMap<u32, Answer>| {
        [1, 3]
            .iter()
            .all(|s| a.get(s).is_some_and(|a| a.ended || a.reset.is_some()))
    };
    let read = async {
        while !done(&answers) {
            let mut chunk = [0u8; 4096];
            let n = conn.read(&mut chunk).await.unwrap();
            assert!(n > 0, "the server closed the connection: {answers:?}");
            buf.extend_from_slice(&chunk[..n]);
            while buf.len() >= 9 {
                let len =
                    usize::from(buf[0]) << 16 | usize::from(buf[1]) << 8 | usize::from(buf[2]);
                if buf.len() < 9 + len {
                    break;
                }
                let (kind, flags) = (buf[3], buf[4]);
                let stream = u32::from_be_bytes([buf[5], buf[6], buf[7], buf[8]]);
                let payload = buf[9..9 + len].to_vec();
                buf.drain(..9 + len);
                match kind {
                    0x0 => {
                        let a = answers.entry(stream).or_default();
                        a.data.extend_from_slice(&payload);
                        a.ended |= flags & 0x1 != 0;
                    }
                    0x1 => {
                        assert!(flags & 0x4 != 0, "the server split a header block");
                        let fields = decoder
                            .decode(&payload)
                            .unwrap()
                            .into_iter()
                            .map(|(n, v)| {
                                (String::from_utf8(n).unwrap(), String::from_utf8(v).unwrap())
                            })
                            .collect();
                        let a = answers.entry(stream).or_default();
                        a.headers.push(fields);
                        a.ended |= flags & 0x1 != 0;
                    }
                    0x3 => {
                        let code =
                            u32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]]);
                        answers.entry(stream).or_default().reset = Some(code);
                    }
                    0x4 if flags & 0x1 == 0 => {
                        let mut ack = Vec::new();
                        frame(&mut ack, 0x4, 0x1, 0, &[]);
                        conn.write_all(&ack).await.unwrap();
                    }
                    0x6 if flags & 0x1 == 0 => {
                        let mut pong = Vec::new();
                        frame(&mut pong, 0x6, 0x1, 0, &payload);
                        conn.write_all(&pong).await.unwrap();
                    }
                    0x7 => panic!("the server sent GOAWAY: {payload:?}"),
                    _ => {}
                }
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(20), read)
        .await
        .expect("no answer within 20 s");
    [answers.remove(&1).unwrap(), answers.remove(&3).unwrap()]
}

fn assert_ok(answer: &Answer, context: &str) {
    assert_eq!(
        answer.reset, None,
        "{context}: stream reset (1 = PROTOCOL_ERROR): {answer:?}"
    );
    assert_eq!(
        answer.field(":status"),
        Some("200"),
        "{context}: {answer:?}"
    );
    assert_eq!(
        answer.field("grpc-status"),
        Some("0"),
        "{context}: {answer:?}"
    );
}

#[tokio::test]
async fn both_sockets_answer_every_authority_a_client_may_send() {
    let dir = tempfile::tempdir().unwrap();
    let config = PluginConfig {
        driver_name: DRIVER.to_owned(),
        registration_dir: dir.path().join("plugins_registry"),
        plugin_dir: dir.path().join("plugins").join(DRIVER),
    };
    let plugin = server::start(config.clone(), Arc::new(NoClaims)).unwrap();
    let reg_socket = config.registration_socket();
    let dra_socket = config.dra_socket();
    let prepare = v1::NodePrepareResourcesRequest {
        claims: vec![v1::Claim {
            namespace: "default".to_owned(),
            uid: "uid-1".to_owned(),
            name: "claim-1".to_owned(),
        }],
    }
    .encode_to_vec();
    for authority in [
        percent_encoded(&reg_socket),
        percent_encoded(&dra_socket),
        reg_socket.display().to_string(),
        String::new(),
        "localhost".to_owned(),
    ] {
        let answers = call_twice(
            &reg_socket,
            &authority,
            "/pluginregistration.Registration/GetInfo",
            &[],
        )
        .await;
        for (i, answer) in answers.iter().enumerate() {
            let context = format!("GetInfo call {i} with :authority {authority:?}");
            assert_ok(answer, &context);
            let info = reg::PluginInfo::decode(answer.message()).unwrap();
            assert_eq!(info.name, DRIVER, "{context}");
            assert_eq!(info.endpoint, dra_socket.display().to_string(), "{context}");
        }

        let answers = call_twice(
            &dra_socket,
            &authority,
            "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
            &prepare,
        )
        .await;
        for (i, answer) in answers.iter().enumerate() {
            let context = format!("NodePrepareResources call {i} with :authority {authority:?}");
            assert_ok(answer, &context);
            let response = v1::NodePrepareResourcesResponse::decode(answer.message()).unwrap();
            let claim = &response.claims["uid-1"];
            assert!(claim.error.contains("not found"), "{context}: {claim:?}");
        }
    }
    plugin.shutdown().await.unwrap();
}
