//! What kubelet sends as `:authority`, made acceptable to the HTTP/2 server under tonic.
//!
//! Kubelet's plugin watcher dials the registration socket by its bare path, and grpc-go then
//! sends the percent-encoded path as the request's `:authority`
//! (`%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2F…-reg.sock`); other gRPC clients send the raw
//! path, an empty value, or `localhost`. On a unix socket the value means nothing, but the
//! HTTP/2 server under tonic (`h2`) parses it as a URI authority and resets every stream whose
//! value is not one, so without this layer kubelet could never call `GetInfo`.
//!
//! [`AuthorityShim`] wraps each accepted connection below tonic. It passes the client's bytes
//! through unchanged, except for header blocks: it decodes each one with the client's HPACK
//! state, replaces an `:authority` that is not a valid URI authority with `localhost`, and
//! encodes the block again as plain literals (never indexed, no Huffman), so the server's HPACK
//! decoder never holds a dynamic table of the client's. `DATA` and every other frame are
//! streamed through as they arrive; the server's answers are not touched. What is kept per
//! connection is bounded: one header block ([`MAX_HEADER_BLOCK`]) and the client's HPACK table
//! ([`MAX_HPACK_TABLE`]). Input that breaks HTTP/2 framing ends the connection with an error,
//! as the server itself would.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::transport::server::Connected;
use tracing::debug;

use crate::error::{Error, Result};

/// The client connection preface (RFC 9113 §3.4).
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEADER_LEN: usize = 9;
const TYPE_HEADERS: u8 = 0x1;
const TYPE_CONTINUATION: u8 = 0x9;
const FLAG_END_STREAM: u8 = 0x1;
const FLAG_END_HEADERS: u8 = 0x4;
const FLAG_PADDED: u8 = 0x8;
const FLAG_PRIORITY: u8 = 0x20;
const PRIORITY_LEN: usize = 5;
/// The initial `SETTINGS_MAX_FRAME_SIZE`, which every peer accepts: rewritten header blocks go
/// out in frames no larger.
const MAX_OUT_FRAME: usize = 16_384;
/// The largest header block (over all its frames) a connection may send.
pub const MAX_HEADER_BLOCK: usize = 1 << 20;
/// The largest HPACK dynamic table a client may ask for (the server advertises the default,
/// 4,096 octets).
pub const MAX_HPACK_TABLE: usize = 1 << 16;
/// What replaces an `:authority` that is not a URI authority.
pub const REPLACEMENT_AUTHORITY: &str = "localhost";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for the connection preface.
    Preface,
    /// Reading frames.
    Frames,
    /// Not HTTP/2 with prior knowledge: everything passes untouched (the server refuses it).
    Transparent,
}

/// A header block being collected over a `HEADERS` frame and its `CONTINUATION`s.
struct PendingBlock {
    stream: u32,
    end_stream: bool,
    priority: Option<[u8; PRIORITY_LEN]>,
    fragment: Vec<u8>,
}

/// The rewriting of one connection's client-to-server bytes: a pure state machine, fed the
/// bytes as they arrive, writing what the server should read.
pub struct AuthorityRewriter {
    phase: Phase,
    /// Bytes received and not yet handled (a partial frame header or header frame).
    pending: Vec<u8>,
    /// Payload bytes of a pass-through frame still to come.
    passthrough: usize,
    block: Option<PendingBlock>,
    decoder: loona_hpack::Decoder<'static>,
    rewritten: u64,
}

impl Default for AuthorityRewriter {
    fn default() -> Self {
        Self::new()
    }
}

impl AuthorityRewriter {
    /// A rewriter for a new connection.
    pub fn new() -> Self {
        let mut decoder = loona_hpack::Decoder::new();
        decoder.set_max_allowed_table_size(MAX_HPACK_TABLE);
        Self {
            phase: Phase::Preface,
            pending: Vec::new(),
            passthrough: 0,
            block: None,
            decoder,
            rewritten: 0,
        }
    }

    /// How many `:authority` values were replaced so far.
    pub fn rewritten(&self) -> u64 {
        self.rewritten
    }

    /// Takes the next bytes from the client and appends what the server should read to `out`.
    /// Bytes of an incomplete frame header or header frame are kept for the next call.
    pub fn feed(&mut self, input: &[u8], out: &mut Vec<u8>) -> Result<()> {
        let mut input = input;
        if self.phase == Phase::Transparent {
            out.extend_from_slice(input);
            return Ok(());
        }
        // Stream the rest of a pass-through frame without buffering it.
        if self.pending.is_empty() && self.passthrough > 0 {
            let n = self.passthrough.min(input.len());
            out.extend_from_slice(&input[..n]);
            self.passthrough -= n;
            input = &input[n..];
        }
        self.pending.extend_from_slice(input);
        let mut pos = 0;
        let result = self.process(&mut pos, out);
        self.pending.drain(..pos);
        result
    }

    fn process(&mut self, pos: &mut usize, out: &mut Vec<u8>) -> Result<()> {
        if self.phase == Phase::Preface {
            let have = self.pending.len().min(PREFACE.len());
            if self.pending[..have] != PREFACE[..have] {
                self.phase = Phase::Transparent;
                out.extend_from_slice(&self.pending);
                *pos = self.pending.len();
                return Ok(());
            }
            if have < PREFACE.len() {
                return Ok(());
            }
            out.extend_from_slice(PREFACE);
            *pos = PREFACE.len();
            self.phase = Phase::Frames;
        }
        loop {
            let rest = &self.pending[*pos..];
            if self.passthrough > 0 {
                let n = self.passthrough.min(rest.len());
                out.extend_from_slice(&rest[..n]);
                self.passthrough -= n;
                *pos += n;
                if self.passthrough > 0 {
                    return Ok(());
                }
                continue;
            }
            if rest.len() < FRAME_HEADER_LEN {
                return Ok(());
            }
            let len = usize::from(rest[0]) << 16 | usize::from(rest[1]) << 8 | usize::from(rest[2]);
            let kind = rest[3];
            let flags = rest[4];
            let stream = u32::from_be_bytes([rest[5], rest[6], rest[7], rest[8]]) & 0x7fff_ffff;
            let is_header_frame = kind == TYPE_HEADERS || kind == TYPE_CONTINUATION;
            if self.block.is_some() && kind != TYPE_CONTINUATION {
                return Err(Error::Http2(format!(
                    "frame type {kind:#x} inside the header block of stream {stream}"
                )));
            }
            if !is_header_frame {
                out.extend_from_slice(&rest[..FRAME_HEADER_LEN]);
                *pos += FRAME_HEADER_LEN;
                self.passthrough = len;
                continue;
            }
            let collected = self.block.as_ref().map_or(0, |b| b.fragment.len());
            if len > MAX_HEADER_BLOCK - collected {
                return Err(Error::Http2(format!(
                    "header block of stream {stream} is larger than {MAX_HEADER_BLOCK} bytes"
                )));
            }
            if rest.len() < FRAME_HEADER_LEN + len {
                return Ok(());
            }
            let payload = &rest[FRAME_HEADER_LEN..FRAME_HEADER_LEN + len];
            if kind == TYPE_HEADERS {
                self.block = Some(headers_frame(stream, flags, payload)?);
            } else {
                let Some(block) = self.block.as_mut().filter(|b| b.stream == stream) else {
                    return Err(Error::Http2(format!(
                        "CONTINUATION on stream {stream} without a header block in progress"
                    )));
                };
                block.fragment.extend_from_slice(payload);
            }
            *pos += FRAME_HEADER_LEN + len;
            if flags & FLAG_END_HEADERS != 0
                && let Some(block) = self.block.take()
            {
                self.emit(&block, out)?;
            }
        }
    }

    /// Decodes a complete header block, replaces a bad `:authority`, and writes the block as
    /// plain literals in a `HEADERS` frame and as many `CONTINUATION`s as it needs.
    fn emit(&mut self, block: &PendingBlock, out: &mut Vec<u8>) -> Result<()> {
        let mut encoded = Vec::with_capacity(block.fragment.len() + 64);
        let mut replaced = None;
        self.decoder
            .decode_with_cb(&block.fragment, |name, value| {
                if name.as_ref() == b":authority" && !is_authority(&value) {
                    replaced = Some(String::from_utf8_lossy(&value).into_owned());
                    encode_literal(&mut encoded, &name, REPLACEMENT_AUTHORITY.as_bytes());
                } else {
                    encode_literal(&mut encoded, &name, &value);
                }
            })
            .map_err(|e| Error::Http2(format!("header block of stream {}: {e:?}", block.stream)))?;
        if let Some(original) = replaced {
            self.rewritten += 1;
            debug!(
                stream = block.stream,
                authority = %original,
                replacement = REPLACEMENT_AUTHORITY,
                "replaced an :authority that is not a URI authority"
            );
        }
        let first_room = MAX_OUT_FRAME - block.priority.map_or(0, |p| p.len());
        let (first, mut rest) = encoded.split_at(first_room.min(encoded.len()));
        let mut flags = if block.end_stream { FLAG_END_STREAM } else { 0 };
        if block.priority.is_some() {
            flags |= FLAG_PRIORITY;
        }
        if rest.is_empty() {
            flags |= FLAG_END_HEADERS;
        }
        let priority = block.priority.as_ref().map_or(&[][..], |p| &p[..]);
        frame_header(
            out,
            priority.len() + first.len(),
            TYPE_HEADERS,
            flags,
            block.stream,
        );
        out.extend_from_slice(priority);
        out.extend_from_slice(first);
        while !rest.is_empty() {
            let (chunk, tail) = rest.split_at(MAX_OUT_FRAME.min(rest.len()));
            let flags = if tail.is_empty() { FLAG_END_HEADERS } else { 0 };
            frame_header(out, chunk.len(), TYPE_CONTINUATION, flags, block.stream);
            out.extend_from_slice(chunk);
            rest = tail;
        }
        Ok(())
    }
}

/// The header block fragment of a `HEADERS` frame, without its padding and priority fields.
fn headers_frame(stream: u32, flags: u8, payload: &[u8]) -> Result<PendingBlock> {
    let mut body = payload;
    let mut pad = 0;
    if flags & FLAG_PADDED != 0 {
        let Some((&len, tail)) = body.split_first() else {
            return Err(Error::Http2(format!(
                "padded HEADERS of stream {stream} has no pad length"
            )));
        };
        pad = usize::from(len);
        body = tail;
    }
    let mut priority = None;
    if flags & FLAG_PRIORITY != 0 {
        if body.len() < PRIORITY_LEN {
            return Err(Error::Http2(format!(
                "HEADERS of stream {stream} is too short for its priority"
            )));
        }
        let (p, tail) = body.split_at(PRIORITY_LEN);
        let mut fields = [0; PRIORITY_LEN];
        fields.copy_from_slice(p);
        priority = Some(fields);
        body = tail;
    }
    if pad > body.len() {
        return Err(Error::Http2(format!(
            "HEADERS of stream {stream} has more padding than payload"
        )));
    }
    Ok(PendingBlock {
        stream,
        end_stream: flags & FLAG_END_STREAM != 0,
        priority,
        fragment: body[..body.len() - pad].to_vec(),
    })
}

/// Whether the server's HTTP/2 layer takes `value` as an `:authority`.
fn is_authority(value: &[u8]) -> bool {
    http::uri::Authority::try_from(value).is_ok()
}

fn frame_header(out: &mut Vec<u8>, len: usize, kind: u8, flags: u8, stream: u32) {
    // Every length written here is at most MAX_OUT_FRAME, well inside 24 bits.
    let len = u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes();
    out.extend_from_slice(&len[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&(stream & 0x7fff_ffff).to_be_bytes());
}

/// A "literal header field never indexed" with a literal name (RFC 7541 §6.2.3), no Huffman.
fn encode_literal(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.push(0x10);
    encode_string(out, name);
    encode_string(out, value);
}

fn encode_string(out: &mut Vec<u8>, s: &[u8]) {
    encode_integer(out, 0x00, 7, s.len());
    out.extend_from_slice(s);
}

/// An HPACK integer with an N-bit prefix (RFC 7541 §5.1); `high` holds the bits above it.
pub(crate) fn encode_integer(out: &mut Vec<u8>, high: u8, prefix_bits: u32, value: usize) {
    let max = (1usize << prefix_bits) - 1;
    if value < max {
        out.push(high | u8::try_from(value).unwrap_or(u8::MAX));
        return;
    }
    out.push(high | u8::try_from(max).unwrap_or(u8::MAX));
    let mut rest = value - max;
    while rest >= 0x80 {
        out.push(u8::try_from(rest & 0x7f).unwrap_or(0) | 0x80);
        rest >>= 7;
    }
    out.push(u8::try_from(rest).unwrap_or(0));
}

/// A connection whose client bytes go through an [`AuthorityRewriter`] on their way to the
/// server; what the server writes goes out unchanged.
pub struct AuthorityShim<S> {
    inner: S,
    rewriter: AuthorityRewriter,
    out: Vec<u8>,
    out_pos: usize,
    scratch: Box<[u8]>,
    eof: bool,
}

impl<S> AuthorityShim<S> {
    /// Wraps an accepted connection.
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            rewriter: AuthorityRewriter::new(),
            out: Vec::new(),
            out_pos: 0,
            scratch: vec![0; 16 * 1024].into_boxed_slice(),
            eof: false,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for AuthorityShim<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.out_pos < this.out.len() {
                let n = buf.remaining().min(this.out.len() - this.out_pos);
                buf.put_slice(&this.out[this.out_pos..this.out_pos + n]);
                this.out_pos += n;
                if this.out_pos == this.out.len() {
                    this.out.clear();
                    this.out_pos = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                return Poll::Ready(Ok(()));
            }
            let mut read = ReadBuf::new(&mut this.scratch);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut read))?;
            if read.filled().is_empty() {
                this.eof = true;
                continue;
            }
            this.rewriter
                .feed(read.filled(), &mut this.out)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for AuthorityShim<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

impl<S: Connected> Connected for AuthorityShim<S> {
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests;
