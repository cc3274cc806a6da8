//! Content codings. switchyard asks upstreams for none (`accept-encoding:
//! identity`), but one may compress anyway; gzip, deflate, br and zstd are
//! decoded, within a size limit, before anything classifies or relays the
//! body. The client never gets compressed bytes under a JSON or SSE label.

use std::io::{self, Write};

use bytes::Bytes;
use http::header::{HeaderMap, CONTENT_ENCODING};

/// The codings switchyard can decode, as `accept-encoding` tokens.
pub const DECODABLE: [&str; 5] = ["identity", "gzip", "deflate", "br", "zstd"];

/// A body's content coding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Coding {
    /// Not encoded.
    Identity,
    /// `gzip` (or `x-gzip`).
    Gzip,
    /// `deflate`: zlib-wrapped as HTTP says, or raw as some servers send it.
    Deflate,
    /// `br`.
    Brotli,
    /// `zstd`.
    Zstd,
}

impl Coding {
    /// The coding of a response. `None` for one switchyard cannot decode,
    /// including stacked codings (`gzip, br`), which no provider sends.
    #[must_use]
    pub fn of(headers: &HeaderMap) -> Option<Coding> {
        let Some(value) = headers.get(CONTENT_ENCODING) else {
            return Some(Coding::Identity);
        };
        let value = value.to_str().ok()?.trim().to_ascii_lowercase();
        match value.as_str() {
            "" | "identity" => Some(Coding::Identity),
            "gzip" | "x-gzip" => Some(Coding::Gzip),
            "deflate" => Some(Coding::Deflate),
            "br" => Some(Coding::Brotli),
            "zstd" => Some(Coding::Zstd),
            _ => None,
        }
    }
}

/// Collects decoded bytes, refusing to grow past `limit` (a decompression
/// bomb is a broken upstream, not a reason to run out of memory).
#[derive(Debug)]
struct Capped {
    buf: Vec<u8>,
    total: usize,
    limit: usize,
}

impl Write for Capped {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        self.total = self.total.saturating_add(data.len());
        if self.total > self.limit {
            return Err(io::Error::other("decoded body over the size limit"));
        }
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

enum Inner {
    Identity,
    /// `deflate` before its first bytes tell zlib from raw.
    DeflatePending(Capped),
    Gzip(flate2::write::GzDecoder<Capped>),
    Zlib(flate2::write::ZlibDecoder<Capped>),
    RawDeflate(flate2::write::DeflateDecoder<Capped>),
    Brotli(Box<brotli::DecompressorWriter<Capped>>),
    Zstd(zstd::stream::write::Decoder<'static, Capped>),
}

/// An incremental decoder of one body.
pub struct Decoder {
    inner: Inner,
    /// The limit is per [`Decoder::push`] (a stream), not for the whole body.
    per_push: bool,
}

impl std::fmt::Debug for Decoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Decoder").finish_non_exhaustive()
    }
}

impl Decoder {
    /// A decoder for `coding` that refuses more than `limit` decoded bytes in
    /// all, or (`per_push`) from any one [`Decoder::push`].
    ///
    /// # Errors
    /// Only if the zstd decoder cannot be set up.
    pub fn new(coding: Coding, limit: usize, per_push: bool) -> io::Result<Self> {
        let sink = Capped {
            buf: Vec::new(),
            total: 0,
            limit,
        };
        let inner = match coding {
            Coding::Identity => Inner::Identity,
            Coding::Gzip => Inner::Gzip(flate2::write::GzDecoder::new(sink)),
            Coding::Deflate => Inner::DeflatePending(sink),
            Coding::Brotli => Inner::Brotli(Box::new(brotli::DecompressorWriter::new(sink, 4096))),
            Coding::Zstd => Inner::Zstd(zstd::stream::write::Decoder::new(sink)?),
        };
        Ok(Self { inner, per_push })
    }

    fn sink(&mut self) -> Option<&mut Capped> {
        match &mut self.inner {
            Inner::Identity => None,
            Inner::DeflatePending(s) => Some(s),
            Inner::Gzip(d) => Some(d.get_mut()),
            Inner::Zlib(d) => Some(d.get_mut()),
            Inner::RawDeflate(d) => Some(d.get_mut()),
            Inner::Brotli(d) => Some(d.get_mut()),
            Inner::Zstd(d) => Some(d.get_mut()),
        }
    }

    /// Whether the body is not encoded (bytes pass through untouched).
    #[must_use]
    pub fn is_identity(&self) -> bool {
        matches!(self.inner, Inner::Identity)
    }

    /// Decodes the next piece of the body; returns all it decodes to, with
    /// nothing kept back in the decoder (a stream's event is relayed when
    /// its bytes come, not when the next ones do).
    ///
    /// # Errors
    /// Corrupt data, or more decoded bytes than the limit.
    pub fn push(&mut self, input: &[u8]) -> io::Result<Bytes> {
        if let Inner::DeflatePending(_) = self.inner {
            if input.is_empty() {
                return Ok(Bytes::new());
            }
            self.choose_deflate(input[0]);
        }
        if self.per_push {
            if let Some(sink) = self.sink() {
                sink.total = 0;
            }
        }
        let sink = match &mut self.inner {
            Inner::Identity => return Ok(Bytes::copy_from_slice(input)),
            Inner::DeflatePending(_) => return Ok(Bytes::new()),
            Inner::Gzip(d) => {
                d.write_all(input)?;
                d.flush()?;
                d.get_mut()
            }
            Inner::Zlib(d) => {
                d.write_all(input)?;
                d.flush()?;
                d.get_mut()
            }
            Inner::RawDeflate(d) => {
                d.write_all(input)?;
                d.flush()?;
                d.get_mut()
            }
            Inner::Brotli(d) => {
                d.write_all(input)?;
                d.flush()?;
                d.get_mut()
            }
            Inner::Zstd(d) => {
                d.write_all(input)?;
                d.flush()?;
                d.get_mut()
            }
        };
        Ok(Bytes::from(std::mem::take(&mut sink.buf)))
    }

    /// Ends the body in place (the decoder passes bytes through after it);
    /// returns the last decoded bytes.
    ///
    /// # Errors
    /// A body cut short, or corrupt data.
    pub fn finish_in_place(&mut self) -> io::Result<Bytes> {
        let this = std::mem::replace(
            self,
            Self {
                inner: Inner::Identity,
                per_push: self.per_push,
            },
        );
        this.finish()
    }

    /// Ends the body; returns the last decoded bytes.
    ///
    /// # Errors
    /// A body cut short, or corrupt data.
    pub fn finish(self) -> io::Result<Bytes> {
        let sink = match self.inner {
            Inner::Identity => return Ok(Bytes::new()),
            Inner::DeflatePending(sink) => sink,
            Inner::Gzip(d) => d.finish()?,
            Inner::Zlib(d) => d.finish()?,
            Inner::RawDeflate(d) => d.finish()?,
            Inner::Brotli(d) => d
                .into_inner()
                .map_err(|_| io::Error::other("truncated brotli data"))?,
            Inner::Zstd(mut d) => {
                d.flush()?;
                d.into_inner()
            }
        };
        Ok(Bytes::from(sink.buf))
    }

    /// A zlib stream starts with a CMF byte whose low nibble is 8 (deflate).
    fn choose_deflate(&mut self, first: u8) {
        let Inner::DeflatePending(sink) = std::mem::replace(&mut self.inner, Inner::Identity)
        else {
            return;
        };
        self.inner = if first & 0x0f == 8 {
            Inner::Zlib(flate2::write::ZlibDecoder::new(sink))
        } else {
            Inner::RawDeflate(flate2::write::DeflateDecoder::new(sink))
        };
    }
}

/// Decodes a whole body of `coding`, at most `limit` bytes decoded.
///
/// # Errors
/// Corrupt data, a cut body, or more than `limit` bytes.
pub fn decode_all(coding: Coding, body: &[u8], limit: usize) -> io::Result<Bytes> {
    if coding == Coding::Identity {
        return Ok(Bytes::copy_from_slice(body));
    }
    let mut decoder = Decoder::new(coding, limit, false)?;
    let mut out = decoder.push(body)?.to_vec();
    out.extend_from_slice(&decoder.finish()?);
    Ok(Bytes::from(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(coding: Coding, data: &[u8]) -> Vec<u8> {
        match coding {
            Coding::Identity => data.to_vec(),
            Coding::Gzip => {
                let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
                e.write_all(data).unwrap();
                e.finish().unwrap()
            }
            Coding::Deflate => {
                let mut e =
                    flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::fast());
                e.write_all(data).unwrap();
                e.finish().unwrap()
            }
            Coding::Brotli => {
                let mut out = Vec::new();
                {
                    let mut e = brotli::CompressorWriter::new(&mut out, 4096, 5, 22);
                    e.write_all(data).unwrap();
                }
                out
            }
            Coding::Zstd => zstd::stream::encode_all(data, 1).unwrap(),
        }
    }

    #[test]
    fn every_coding_round_trips_whole_and_in_pieces() {
        let text = b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n".repeat(200);
        for coding in [Coding::Gzip, Coding::Deflate, Coding::Brotli, Coding::Zstd] {
            let packed = encode(coding, &text);
            assert_eq!(
                decode_all(coding, &packed, 1 << 20).unwrap(),
                text,
                "{coding:?}"
            );
            let mut d = Decoder::new(coding, 1 << 20, true).unwrap();
            let mut out = Vec::new();
            for piece in packed.chunks(7) {
                out.extend_from_slice(&d.push(piece).unwrap());
            }
            out.extend_from_slice(&d.finish().unwrap());
            assert_eq!(out, text, "{coding:?} in pieces");
        }
        let mut raw = flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::fast());
        raw.write_all(&text).unwrap();
        let raw = raw.finish().unwrap();
        assert_eq!(
            decode_all(Coding::Deflate, &raw, 1 << 20).unwrap(),
            text,
            "raw deflate"
        );
    }

    /// A stream compressed with a flush after each event: every push gives
    /// back that event whole, none waits in the decoder for the next bytes.
    #[test]
    fn a_flushed_stream_decodes_each_event_when_its_bytes_come() {
        let events: Vec<Vec<u8>> = (0..4)
            .map(|i| format!("data: {{\"n\":{i}}}\n\n").into_bytes())
            .collect();
        let mut gzip = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        let mut zlib = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::fast());
        let mut brotli = brotli::CompressorWriter::new(Vec::new(), 4096, 5, 22);
        let mut pieces: Vec<(Coding, Vec<Vec<u8>>)> = vec![
            (Coding::Gzip, Vec::new()),
            (Coding::Deflate, Vec::new()),
            (Coding::Brotli, Vec::new()),
        ];
        let mut sent = [0usize; 3];
        for event in &events {
            gzip.write_all(event).unwrap();
            gzip.flush().unwrap();
            zlib.write_all(event).unwrap();
            zlib.flush().unwrap();
            brotli.write_all(event).unwrap();
            brotli.flush().unwrap();
            for (i, all) in [gzip.get_ref(), zlib.get_ref(), brotli.get_ref()]
                .into_iter()
                .enumerate()
            {
                pieces[i].1.push(all[sent[i]..].to_vec());
                sent[i] = all.len();
            }
        }
        for (coding, pieces) in pieces {
            let mut d = Decoder::new(coding, 1 << 20, true).unwrap();
            for (piece, event) in pieces.iter().zip(&events) {
                assert_eq!(&d.push(piece).unwrap()[..], &event[..], "{coding:?}");
            }
        }
    }

    #[test]
    fn a_bomb_stops_at_the_limit_and_junk_is_an_error() {
        let zeros = vec![0u8; 10 << 20];
        let packed = encode(Coding::Gzip, &zeros);
        assert!(packed.len() < 64 * 1024);
        assert!(decode_all(Coding::Gzip, &packed, 1 << 20).is_err());
        assert!(decode_all(Coding::Gzip, b"<html>not gzip</html>", 1 << 20).is_err());
    }

    #[test]
    fn codings_are_read_from_the_header() {
        let with = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(CONTENT_ENCODING, v.parse().unwrap());
            Coding::of(&h)
        };
        assert_eq!(Coding::of(&HeaderMap::new()), Some(Coding::Identity));
        assert_eq!(with("GZIP"), Some(Coding::Gzip));
        assert_eq!(with("br"), Some(Coding::Brotli));
        assert_eq!(with("gzip, br"), None);
        assert_eq!(with("compress"), None);
    }
}
