use proptest::prelude::*;

use super::*;

const KUBELET_AUTHORITY: &str =
    "%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2Fgpu.tessera.dev-reg.sock";

/// A frame as the server reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Frame {
    kind: u8,
    flags: u8,
    stream: u32,
    payload: Vec<u8>,
}

/// An "indexed header field" (RFC 7541 §6.1) naming table entry `index`.
fn indexed(index: u8) -> u8 {
    0x80 | index
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    frame_header(&mut out, payload.len(), kind, flags, stream);
    out.extend_from_slice(payload);
    out
}

fn parse_frames(mut bytes: &[u8]) -> Vec<Frame> {
    let mut frames = Vec::new();
    while !bytes.is_empty() {
        let len = usize::from(bytes[0]) << 16 | usize::from(bytes[1]) << 8 | usize::from(bytes[2]);
        frames.push(Frame {
            kind: bytes[3],
            flags: bytes[4],
            stream: u32::from_be_bytes([bytes[5], bytes[6], bytes[7], bytes[8]]),
            payload: bytes[9..9 + len].to_vec(),
        });
        bytes = &bytes[9 + len..];
    }
    frames
}

/// A "literal with incremental indexing" whose name is the static entry `name_index`, as
/// grpc-go's encoder writes `:authority` and `:path`.
fn indexed_name_literal(block: &mut Vec<u8>, name_index: usize, value: &str) {
    encode_integer(block, 0x40, 6, name_index);
    encode_string(block, value.as_bytes());
}

/// The request header block of a gRPC call as a grpc-go client sends it: the authority and
/// path added to the client's dynamic table.
fn request_block(authority: &str) -> Vec<u8> {
    let mut block = Vec::new();
    block.push(0x83); // :method POST
    block.push(0x86); // :scheme http
    indexed_name_literal(&mut block, 4, "/pluginregistration.Registration/GetInfo");
    indexed_name_literal(&mut block, 1, authority);
    indexed_name_literal(&mut block, 31, "application/grpc");
    block
}

/// Runs the client bytes through a rewriter and decodes what the server reads: the
/// non-header frames, and each header block as its decoded fields.
fn through(chunks: &[Vec<u8>]) -> (Vec<Frame>, Vec<Vec<(String, String)>>) {
    let mut rewriter = AuthorityRewriter::new();
    let mut out = Vec::new();
    for c in chunks {
        rewriter.feed(c, &mut out).unwrap();
    }
    assert_eq!(&out[..PREFACE.len()], PREFACE);
    let frames = parse_frames(&out[PREFACE.len()..]);
    let mut server = loona_hpack::Decoder::new();
    let mut blocks = Vec::new();
    let mut current: Option<Vec<u8>> = None;
    let mut others = Vec::new();
    for f in frames {
        match f.kind {
            TYPE_HEADERS => {
                assert!(current.is_none());
                assert_eq!(f.flags & FLAG_PADDED, 0, "padding is dropped");
                let start = if f.flags & FLAG_PRIORITY != 0 { 5 } else { 0 };
                current = Some(f.payload[start..].to_vec());
            }
            TYPE_CONTINUATION => current.as_mut().unwrap().extend_from_slice(&f.payload),
            _ => others.push(f.clone()),
        }
        if (f.kind == TYPE_HEADERS || f.kind == TYPE_CONTINUATION)
            && f.flags & FLAG_END_HEADERS != 0
        {
            let block = current.take().unwrap();
            let fields = server
                .decode(&block)
                .unwrap()
                .into_iter()
                .map(|(n, v)| (String::from_utf8(n).unwrap(), String::from_utf8(v).unwrap()))
                .collect();
            blocks.push(fields);
        }
    }
    assert!(current.is_none(), "a header block was left open");
    (others, blocks)
}

fn authority_of(fields: &[(String, String)]) -> Option<&str> {
    fields
        .iter()
        .find(|(n, _)| n == ":authority")
        .map(|(_, v)| v.as_str())
}

fn client_bytes(blocks: &[Vec<u8>]) -> Vec<u8> {
    let mut bytes = PREFACE.to_vec();
    bytes.extend(frame(0x4, 0, 0, &[])); // SETTINGS
    for (i, b) in blocks.iter().enumerate() {
        let stream = u32::try_from(2 * i + 1).unwrap();
        bytes.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS, stream, b));
        bytes.extend(frame(0x0, FLAG_END_STREAM, stream, &[0, 0, 0, 0, 0]));
    }
    bytes
}

#[test]
fn kubelets_percent_encoded_socket_path_becomes_localhost() {
    let (others, blocks) = through(&[client_bytes(&[request_block(KUBELET_AUTHORITY)])]);
    assert_eq!(authority_of(&blocks[0]), Some(REPLACEMENT_AUTHORITY));
    assert_eq!(
        blocks[0].len(),
        5,
        "every other field is kept: {:?}",
        blocks[0]
    );
    assert_eq!(
        blocks[0][2],
        (
            ":path".to_owned(),
            "/pluginregistration.Registration/GetInfo".to_owned()
        )
    );
    // SETTINGS and DATA pass untouched.
    assert_eq!(others.len(), 2);
    assert_eq!(others[1].payload, vec![0, 0, 0, 0, 0]);
}

#[test]
fn raw_path_and_empty_authorities_are_replaced_and_valid_ones_kept() {
    for (sent, seen) in [
        (
            "/var/lib/kubelet/plugins/gpu.tessera.dev/dra.sock",
            "localhost",
        ),
        ("", "localhost"),
        ("localhost", "localhost"),
        ("tessera.example:8080", "tessera.example:8080"),
    ] {
        let (_, blocks) = through(&[client_bytes(&[request_block(sent)])]);
        assert_eq!(authority_of(&blocks[0]), Some(seen), "sent {sent:?}");
    }
}

#[test]
fn the_clients_dynamic_table_is_followed_across_requests() {
    // The second request names its authority and path by dynamic index only, as grpc-go does
    // on a connection that has sent them before (entries 62.. are the newest first).
    let first = request_block(KUBELET_AUTHORITY);
    let second = vec![0x83, 0x86, indexed(64), indexed(63), indexed(62)];
    let (_, blocks) = through(&[client_bytes(&[first, second])]);
    assert_eq!(blocks.len(), 2);
    assert_eq!(authority_of(&blocks[1]), Some(REPLACEMENT_AUTHORITY));
    assert_eq!(blocks[0], blocks[1]);
}

#[test]
fn bytes_arriving_one_at_a_time_give_the_same_result() {
    let bytes = client_bytes(&[request_block(KUBELET_AUTHORITY)]);
    let whole = through(std::slice::from_ref(&bytes));
    let chunks: Vec<Vec<u8>> = bytes.iter().map(|b| vec![*b]).collect();
    assert_eq!(through(&chunks), whole);
}

#[test]
fn padding_priority_and_continuations_are_handled() {
    let block = request_block(KUBELET_AUTHORITY);
    let (a, b) = block.split_at(7);
    let mut payload = vec![3]; // pad length
    payload.extend([0x80, 0, 0, 1, 15]); // exclusive dependency on stream 1, weight 16
    payload.extend_from_slice(a);
    payload.extend([0, 0, 0]);
    let mut bytes = PREFACE.to_vec();
    bytes.extend(frame(
        TYPE_HEADERS,
        FLAG_PADDED | FLAG_PRIORITY | FLAG_END_STREAM,
        3,
        &payload,
    ));
    bytes.extend(frame(TYPE_CONTINUATION, FLAG_END_HEADERS, 3, b));
    let mut rewriter = AuthorityRewriter::new();
    let mut out = Vec::new();
    rewriter.feed(&bytes, &mut out).unwrap();
    let frames = parse_frames(&out[PREFACE.len()..]);
    assert_eq!(frames.len(), 1);
    let f = &frames[0];
    assert_eq!(
        f.flags,
        FLAG_PRIORITY | FLAG_END_STREAM | FLAG_END_HEADERS,
        "padding dropped, priority and end of stream kept"
    );
    assert_eq!(&f.payload[..5], &[0x80, 0, 0, 1, 15]);
    let fields = loona_hpack::Decoder::new().decode(&f.payload[5..]).unwrap();
    assert!(fields.contains(&(b":authority".to_vec(), b"localhost".to_vec())));
    assert_eq!(rewriter.rewritten(), 1);
}

#[test]
fn a_large_header_block_goes_out_in_continuations() {
    let mut block = request_block(KUBELET_AUTHORITY);
    let mut big = Vec::new();
    encode_integer(&mut big, 0x00, 4, 0);
    encode_string(&mut big, b"x-big");
    encode_string(&mut big, &vec![b'v'; 40_000]);
    block.extend(big);
    let (_, blocks) = through(&[client_bytes(&[block])]);
    assert_eq!(blocks[0].last().unwrap().1.len(), 40_000);
    let mut rewriter = AuthorityRewriter::new();
    let mut out = Vec::new();
    let mut block = request_block("x");
    encode_integer(&mut block, 0x00, 4, 0);
    encode_string(&mut block, b"x-big");
    encode_string(&mut block, &vec![b'v'; 40_000]);
    rewriter.feed(&client_bytes(&[block]), &mut out).unwrap();
    let frames = parse_frames(&out[PREFACE.len()..]);
    assert!(frames.iter().all(|f| f.payload.len() <= MAX_OUT_FRAME));
    assert_eq!(
        frames
            .iter()
            .filter(|f| f.kind == TYPE_CONTINUATION)
            .count(),
        2
    );
}

#[test]
fn data_frames_stream_through_without_waiting_for_their_end() {
    let mut rewriter = AuthorityRewriter::new();
    let mut out = Vec::new();
    let mut bytes = PREFACE.to_vec();
    bytes.extend(frame(0x0, 0, 1, &[7; 1000]));
    rewriter
        .feed(&bytes[..PREFACE.len() + 9 + 10], &mut out)
        .unwrap();
    assert_eq!(
        out.len(),
        PREFACE.len() + 9 + 10,
        "header and the first payload bytes"
    );
    rewriter
        .feed(&bytes[PREFACE.len() + 9 + 10..], &mut out)
        .unwrap();
    assert_eq!(out, bytes);
}

#[test]
fn a_connection_without_the_http2_preface_passes_untouched() {
    let mut rewriter = AuthorityRewriter::new();
    let mut out = Vec::new();
    rewriter.feed(b"GET / HTTP/1.1\r\n\r\n", &mut out).unwrap();
    assert_eq!(out, b"GET / HTTP/1.1\r\n\r\n");
}

#[test]
fn broken_framing_is_an_error_not_a_guess() {
    let mut rewriter = AuthorityRewriter::new();
    let mut out = Vec::new();
    let mut bytes = PREFACE.to_vec();
    bytes.extend(frame(TYPE_CONTINUATION, FLAG_END_HEADERS, 1, &[0x82]));
    assert!(matches!(
        rewriter.feed(&bytes, &mut out),
        Err(Error::Http2(_))
    ));

    let mut rewriter = AuthorityRewriter::new();
    let mut bytes = PREFACE.to_vec();
    bytes.extend(frame(TYPE_HEADERS, 0, 1, &[0x82]));
    bytes.extend(frame(0x0, 0, 1, &[]));
    assert!(matches!(
        rewriter.feed(&bytes, &mut out),
        Err(Error::Http2(_))
    ));

    let mut rewriter = AuthorityRewriter::new();
    let mut bytes = PREFACE.to_vec();
    bytes.extend(frame(
        TYPE_HEADERS,
        FLAG_END_HEADERS,
        1,
        &[0xff, 0xff, 0xff, 0x7f],
    ));
    assert!(matches!(
        rewriter.feed(&bytes, &mut out),
        Err(Error::Http2(_))
    ));
}

#[test]
fn a_header_block_past_the_bound_is_refused_before_it_is_buffered() {
    let mut rewriter = AuthorityRewriter::new();
    let mut out = Vec::new();
    let mut bytes = PREFACE.to_vec();
    // Only the frame header of a 4 MiB HEADERS frame: refused without waiting for the rest.
    frame_header(&mut bytes, 4 << 20, TYPE_HEADERS, 0, 1);
    assert!(matches!(
        rewriter.feed(&bytes, &mut out),
        Err(Error::Http2(_))
    ));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("TESSERA_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256)
    ))]

    /// Whatever a client sends after the preface, the rewriter answers bytes or an error,
    /// never a panic, and keeps no more than one frame's worth of input.
    #[test]
    fn arbitrary_client_bytes_never_panic(
        body in proptest::collection::vec(any::<u8>(), 0..4096),
        split in 0usize..4096,
    ) {
        let mut bytes = PREFACE.to_vec();
        bytes.extend(&body);
        let split = split.min(bytes.len());
        let mut rewriter = AuthorityRewriter::new();
        let mut out = Vec::new();
        if rewriter.feed(&bytes[..split], &mut out).is_ok() {
            let _ = rewriter.feed(&bytes[split..], &mut out);
        }
        prop_assert!(rewriter.pending.len() <= bytes.len());
    }

    /// Arbitrary HPACK bytes inside well-formed header frames, two blocks on one connection so
    /// the second meets whatever table the first left: decoded and re-encoded, or an error.
    #[test]
    fn arbitrary_hpack_blocks_never_panic(
        first in proptest::collection::vec(any::<u8>(), 0..512),
        second in proptest::collection::vec(any::<u8>(), 0..512),
    ) {
        let mut rewriter = AuthorityRewriter::new();
        let mut out = Vec::new();
        let bytes = client_bytes(&[first, second]);
        if rewriter.feed(&bytes, &mut out).is_ok() {
            let frames = parse_frames(&out[PREFACE.len()..]);
            prop_assert!(frames.iter().all(|f| f.payload.len() <= MAX_OUT_FRAME));
        }
    }

    /// Header blocks of arbitrary field bytes, however they are cut into chunks, reach the
    /// server decodable and with the same fields, `:authority` aside.
    #[test]
    fn arbitrary_header_fields_survive_any_chunking(
        fields in proptest::collection::vec(
            ("[a-z-]{1,12}", proptest::collection::vec(any::<u8>(), 0..64)),
            0..8,
        ),
        authority in proptest::collection::vec(any::<u8>(), 0..80),
        chunk in 1usize..64,
    ) {
        let mut block = Vec::new();
        encode_integer(&mut block, 0x40, 6, 1);
        encode_string(&mut block, &authority);
        for (name, value) in &fields {
            encode_integer(&mut block, 0x40, 6, 0);
            encode_string(&mut block, name.as_bytes());
            encode_string(&mut block, value);
        }
        let bytes = client_bytes(&[block]);
        let chunks: Vec<Vec<u8>> = bytes.chunks(chunk).map(<[u8]>::to_vec).collect();
        let mut rewriter = AuthorityRewriter::new();
        let mut out = Vec::new();
        for c in &chunks {
            rewriter.feed(c, &mut out).unwrap();
        }
        let frames = parse_frames(&out[PREFACE.len()..]);
        let headers = frames.iter().find(|f| f.kind == TYPE_HEADERS).unwrap();
        let decoded = loona_hpack::Decoder::new().decode(&headers.payload).unwrap();
        prop_assert_eq!(decoded.len(), fields.len() + 1);
        let expected = if is_authority(&authority) { authority.clone() } else { b"localhost".to_vec() };
        prop_assert_eq!(&decoded[0], &(b":authority".to_vec(), expected));
        for (got, (name, value)) in decoded[1..].iter().zip(&fields) {
            prop_assert_eq!(got, &(name.as_bytes().to_vec(), value.clone()));
        }
        prop_assert!(is_authority(&decoded[0].1));
    }
}
