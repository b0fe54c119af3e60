//! Tensors: a dtype, a shape, a name, and one contiguous, 64-byte-aligned buffer.
//!
//! The wire header lives *inside* the tensor's allocation, in the bytes right before the
//! payload, and is rewritten whenever the metadata changes. A send is therefore one
//! contiguous message `[header | payload]` straight from the tensor's memory: no
//! serialisation copy, one MPI message, and MPI's zero-copy paths for large payloads. A
//! receive lands the same way, and the header that arrived is checked against the
//! tensor's own before the call returns. (Repeats of the same tensor between the same two
//! ranks go as the payload alone, see [`crate::transport::p2p`].)
//!
//! Payloads of 2 MiB and more start a whole huge page into their allocation (the header sits
//! at the end of the first one), so they are huge-page aligned like a plain MPI buffer (a
//! payload off that boundary makes the kernel's single copy touch one more page per huge
//! page). Payloads of 4 KiB to 2 MiB start a page into theirs, page-aligned like OSU's
//! buffers; smaller ones [`HEADER_ROOM`] bytes in.
//!
//! Wire header (little-endian, 8-byte multiple, at most [`HEADER_ROOM`] bytes):
//! `magic u32 | dtype u8 | ndim u8 | name_len u8 | header_len/8 u8 | numel u64 |
//! dims u64 x ndim | name bytes, zero-padded`. Names longer than [`MAX_WIRE_NAME`] bytes
//! travel as a prefix plus a hash.

pub(crate) mod buffer;
pub(crate) mod dtype;

use std::fmt;

use ndarray::{ArrayViewD, ArrayViewMutD, IxDyn};

pub use buffer::AlignedBuf;
pub use dtype::{DType, Element};

/// Bytes reserved before the payload for the wire header.
pub const HEADER_ROOM: usize = 128;
/// Bytes after the payload that let a receive detect a longer message than expected, and
/// hold a whole padded message that lands at the payload's place (see
/// [`crate::transport::p2p`]).
pub const TAIL_ROOM: usize = HEADER_ROOM + WIRE_PAD;
/// Bytes a sender may put after a whole message so that its length differs from that of
/// a payload-only message (see [`crate::transport::p2p`]); receivers accept and ignore them.
pub const WIRE_PAD: usize = 8;
/// At most this many dimensions.
pub const MAX_DIMS: usize = 8;
/// Names up to this many bytes travel as they are.
pub const MAX_WIRE_NAME: usize = 48;
const MAGIC: u32 = 0x4D46_5431; // "MFT1"

/// Errors from building, viewing or receiving tensors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TensorError {
    #[error("tensor {name:?} is {actual}, not {expected}")]
    DType {
        name: String,
        expected: DType,
        actual: DType,
    },
    #[error("shape {shape:?} has {numel} elements but the data has {len}")]
    Length {
        shape: Vec<usize>,
        numel: usize,
        len: usize,
    },
    #[error("cannot reshape {from:?} to {to:?}: element counts differ")]
    Reshape { from: Vec<usize>, to: Vec<usize> },
    #[error("shape {0:?} has more than 8 dimensions")]
    TooManyDims(Vec<usize>),
    #[error("received {theirs} but expected {ours}")]
    Mismatch { ours: String, theirs: String },
    #[error("received {got} bytes that are not an mpiflow tensor message")]
    NotATensor { got: usize },
}

/// A dense tensor.
#[derive(Clone)]
pub struct Tensor {
    buf: AlignedBuf,
    dtype: DType,
    shape: Vec<usize>,
    name: String,
    header_len: usize,
    /// A copy of the wire header, to check a receive with one comparison.
    header: [u8; HEADER_ROOM],
    /// FNV-1a of the wire header: name, dtype and shape in one number.
    signature: u64,
    /// Payload bytes (numel x dtype size; neither changes after construction), kept
    /// because every send and receive asks.
    nbytes: usize,
    /// Offset of the payload in `buf`: [`HEADER_ROOM`], a page for payloads of 4 KiB and
    /// more, a whole huge page for payloads of 2 MiB and more, so that they start on a
    /// page or huge-page boundary like a plain buffer.
    at: usize,
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tensor({})", self.describe())
    }
}

fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// The name as it travels: as is, or a prefix and a hash when too long.
fn wire_name(name: &str) -> Vec<u8> {
    let b = name.as_bytes();
    if b.len() <= MAX_WIRE_NAME {
        return b.to_vec();
    }
    let hash = crate::hash::fnv1a(b);
    let mut out = b[..31].to_vec();
    out.extend_from_slice(format!("#{hash:016x}").as_bytes());
    out
}

fn describe(name: &str, dtype: DType, shape: &[usize]) -> String {
    let dims: Vec<String> = shape.iter().map(ToString::to_string).collect();
    format!("'{name}' {dtype}[{}]", dims.join(","))
}

/// A header decoded from received bytes.
struct WireHeader {
    dtype: Option<DType>,
    shape: Vec<usize>,
    name: String,
    header_len: usize,
    numel: usize,
}

fn decode_header(bytes: &[u8]) -> Option<WireHeader> {
    if bytes.len() < 16 || u32::from_le_bytes(bytes[0..4].try_into().ok()?) != MAGIC {
        return None;
    }
    let (ndim, name_len, header_len) =
        (bytes[5] as usize, bytes[6] as usize, bytes[7] as usize * 8);
    if ndim > MAX_DIMS
        || name_len > MAX_WIRE_NAME
        || header_len > HEADER_ROOM
        || header_len > bytes.len()
    {
        return None;
    }
    if 16 + 8 * ndim + name_len > header_len {
        return None;
    }
    let u64_at =
        |o: usize| u64::from_le_bytes(bytes[o..o + 8].try_into().expect("8 bytes")) as usize;
    let shape = (0..ndim).map(|i| u64_at(16 + 8 * i)).collect();
    let name_at = 16 + 8 * ndim;
    Some(WireHeader {
        dtype: DType::from_code(bytes[4]),
        shape,
        name: String::from_utf8_lossy(&bytes[name_at..name_at + name_len]).into_owned(),
        header_len,
        numel: u64_at(8),
    })
}

/// What a received wire header describes, for messages: `'name' dtype[dims]`.
pub fn describe_header(bytes: &[u8]) -> String {
    match decode_header(bytes) {
        Some(WireHeader {
            dtype: Some(d),
            shape,
            name,
            ..
        }) => describe(&name, d, &shape),
        Some(h) => format!("'{}' of unknown dtype", h.name),
        None => format!(
            "{} bytes that are not an mpiflow tensor header",
            bytes.len()
        ),
    }
}

impl Tensor {
    /// A zero-filled tensor.
    pub fn zeros(dtype: DType, shape: &[usize]) -> Result<Tensor, TensorError> {
        if shape.len() > MAX_DIMS {
            return Err(TensorError::TooManyDims(shape.to_vec()));
        }
        let nbytes = numel(shape) * dtype.size();
        let at = if nbytes >= buffer::HUGE {
            buffer::HUGE
        } else if nbytes >= buffer::PAGE {
            buffer::PAGE
        } else {
            HEADER_ROOM
        };
        let mut t = Tensor {
            buf: AlignedBuf::zeroed(at + nbytes.next_multiple_of(64) + TAIL_ROOM),
            dtype,
            shape: shape.to_vec(),
            name: String::new(),
            header_len: 0,
            header: [0; HEADER_ROOM],
            signature: 0,
            nbytes,
            at,
        };
        t.write_header();
        Ok(t)
    }

    /// A tensor holding a copy of `data`.
    pub fn from_slice<T: Element>(shape: &[usize], data: &[T]) -> Result<Tensor, TensorError> {
        if numel(shape) != data.len() {
            return Err(TensorError::Length {
                shape: shape.to_vec(),
                numel: numel(shape),
                len: data.len(),
            });
        }
        let mut t = Tensor::zeros(T::DTYPE, shape)?;
        t.as_mut_slice::<T>()?.copy_from_slice(data);
        Ok(t)
    }

    /// The same tensor with a name.
    pub fn named(mut self, name: &str) -> Tensor {
        self.set_name(name);
        self
    }

    pub fn set_name(&mut self, name: &str) {
        self.name = name.to_string();
        self.write_header();
    }

    pub fn reshape(&mut self, shape: &[usize]) -> Result<(), TensorError> {
        if numel(shape) != self.numel() {
            return Err(TensorError::Reshape {
                from: self.shape.clone(),
                to: shape.to_vec(),
            });
        }
        if shape.len() > MAX_DIMS {
            return Err(TensorError::TooManyDims(shape.to_vec()));
        }
        self.shape = shape.to_vec();
        self.write_header();
        Ok(())
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn numel(&self) -> usize {
        numel(&self.shape)
    }

    pub fn nbytes(&self) -> usize {
        self.nbytes
    }

    /// `'name' f32[2,3]`, as error messages show tensors.
    pub fn describe(&self) -> String {
        describe(&self.name, self.dtype, &self.shape)
    }

    /// The payload bytes.
    #[inline]
    pub fn bytes(&self) -> &[u8] {
        &self.buf.as_slice()[self.at..self.at + self.nbytes()]
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let n = self.nbytes();
        let at = self.at;
        &mut self.buf.as_mut_slice()[at..at + n]
    }

    fn check<T: Element>(&self) -> Result<(), TensorError> {
        if T::DTYPE == self.dtype {
            Ok(())
        } else {
            Err(TensorError::DType {
                name: self.name.clone(),
                expected: T::DTYPE,
                actual: self.dtype,
            })
        }
    }

    /// The elements, if `T` is the tensor's dtype.
    pub fn as_slice<T: Element>(&self) -> Result<&[T], TensorError> {
        self.check::<T>()?;
        let n = self.numel();
        // SAFETY: the payload starts 128 bytes into a 64-byte-aligned allocation, so it is
        // aligned for every element type; it holds n initialised elements of T (dtype checked;
        // every bit pattern is a valid value of these plain types).
        Ok(unsafe { std::slice::from_raw_parts(self.buf.as_ptr().add(self.at).cast::<T>(), n) })
    }

    pub fn as_mut_slice<T: Element>(&mut self) -> Result<&mut [T], TensorError> {
        self.check::<T>()?;
        let n = self.numel();
        // SAFETY: as in as_slice, with exclusive access through &mut self.
        Ok(unsafe {
            std::slice::from_raw_parts_mut(self.buf.as_mut_ptr().add(self.at).cast::<T>(), n)
        })
    }

    /// An `ndarray` view (no copy).
    pub fn view<T: Element>(&self) -> Result<ArrayViewD<'_, T>, TensorError> {
        let shape = IxDyn(&self.shape);
        Ok(ArrayViewD::from_shape(shape, self.as_slice::<T>()?).expect("shape matches length"))
    }

    pub fn view_mut<T: Element>(&mut self) -> Result<ArrayViewMutD<'_, T>, TensorError> {
        let shape = IxDyn(&self.shape.clone());
        Ok(ArrayViewMutD::from_shape(shape, self.as_mut_slice::<T>()?)
            .expect("shape matches length"))
    }

    fn write_header(&mut self) {
        let name = wire_name(&self.name);
        let len = (16 + 8 * self.shape.len() + name.len()).next_multiple_of(8);
        debug_assert!(len <= HEADER_ROOM);
        let h = &mut self.header;
        h.fill(0);
        h[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        h[4] = self.dtype.code();
        h[5] = self.shape.len() as u8;
        h[6] = name.len() as u8;
        h[7] = (len / 8) as u8;
        h[8..16].copy_from_slice(&(numel(&self.shape) as u64).to_le_bytes());
        for (i, d) in self.shape.iter().enumerate() {
            h[16 + 8 * i..24 + 8 * i].copy_from_slice(&(*d as u64).to_le_bytes());
        }
        let at = 16 + 8 * self.shape.len();
        h[at..at + name.len()].copy_from_slice(&name);
        self.header_len = len;
        self.signature = crate::hash::fnv1a(&self.header[..len]);
        self.restore_header();
    }

    /// The wire header alone (what a [`crate::transport::channel::Channel`] exchanges once).
    pub fn wire_header(&self) -> &[u8] {
        &self.header[..self.header_len]
    }

    /// A hash of name, dtype and shape (of the wire header), kept up to date: ranks compare
    /// lists of tensors by it without formatting them.
    pub fn signature(&self) -> u64 {
        self.signature
    }

    /// Puts the header copy back in front of the payload.
    pub(crate) fn restore_header(&mut self) {
        let len = self.header_len;
        let at = self.at;
        self.buf.as_mut_slice()[at - len..at].copy_from_slice(&self.header[..len]);
    }

    /// Exchanges this tensor's storage with `other`'s, without copying a byte, if both are
    /// the same tensor (name, dtype, shape: one signature, so one layout and one header);
    /// `false`, exchanging nothing, otherwise. A payload received into a buffer of the
    /// runtime's moves into place this way ([`crate::transport::inbox`]).
    pub fn swap_storage(&mut self, other: &mut Tensor) -> bool {
        if self.signature != other.signature || self.at != other.at {
            return false;
        }
        // Between operations the room in front of a payload holds its tensor's header (a
        // receive that leaves anything else there puts the header back), so the header
        // travels with the buffer and is the same on both sides.
        std::mem::swap(&mut self.buf, &mut other.buf);
        debug_assert_eq!(
            &self.buf.as_slice()[self.at - self.header_len..self.at],
            &self.header[..self.header_len]
        );
        true
    }

    /// The message a send puts on the wire: header then payload, contiguous.
    #[inline]
    pub fn wire(&self) -> &[u8] {
        &self.buf.as_slice()[self.at - self.header_len..self.at + self.nbytes()]
    }

    /// Length of the message this tensor expects to receive.
    pub fn wire_len(&self) -> usize {
        self.header_len + self.nbytes()
    }

    /// Where a receive lands: the expected message plus [`TAIL_ROOM`] bytes, so a longer
    /// message shows up as a longer count (or a truncation) instead of a silent overrun.
    #[inline]
    pub fn receive_region(&mut self) -> &mut [u8] {
        let start = self.at - self.header_len;
        let end = self.at + self.nbytes() + TAIL_ROOM;
        &mut self.buf.as_mut_slice()[start..end]
    }

    /// Where a receive of a payload alone lands: the payload plus [`TAIL_ROOM`] bytes, so
    /// that a whole message arriving instead (a header in front) shows up by its length.
    #[inline]
    pub fn payload_region(&mut self) -> &mut [u8] {
        let (at, end) = (self.at, self.at + self.nbytes() + TAIL_ROOM);
        &mut self.buf.as_mut_slice()[at..end]
    }

    /// The whole message with [`WIRE_PAD`] bytes after it, for a sender that must not send
    /// a message of one particular length (see [`crate::transport::p2p`]).
    #[inline]
    pub fn wire_padded(&self) -> &[u8] {
        &self.buf.as_slice()[self.at - self.header_len..self.at + self.nbytes() + WIRE_PAD]
    }

    /// Checks a received message of `got` bytes (possibly truncated) against this tensor.
    /// On a mismatch the payload is unspecified and the error names both sides.
    pub fn check_received(&mut self, got: usize, truncated: bool) -> Result<(), TensorError> {
        self.check_arrival(Landing::Whole, got, truncated)
            .map_err(|u| u.error)
    }

    /// Checks a message of `got` bytes that landed as `landing` says. A whole message that
    /// landed at the payload's place is moved into place when it is this tensor's; anything
    /// else is an error naming both sides, with the sender's header when one arrived.
    pub fn check_arrival(
        &mut self,
        landing: Landing,
        got: usize,
        truncated: bool,
    ) -> Result<(), Unexpected> {
        let (h, n) = (self.header_len, self.nbytes());
        let start = match landing {
            Landing::Whole => self.at - h,
            Landing::Payload => self.at,
        };
        // Fast paths: exactly the payload, or exactly our header and length.
        let whole_len = |got: usize| got == h + n || got == h + n + WIRE_PAD;
        match landing {
            Landing::Payload if !truncated && got == n => return Ok(()),
            Landing::Whole
                if !truncated
                    && whole_len(got)
                    && self.buf.as_slice()[start..self.at] == self.header[..h] =>
            {
                return Ok(())
            }
            _ => {}
        }
        let end = (start + got).min(self.buf.len());
        let result = self.judge(&self.buf.as_slice()[start..end], truncated);
        match landing {
            // A different header may have landed over ours (and beyond): put ours back.
            Landing::Whole => self.restore_header(),
            Landing::Payload if result.is_ok() => {
                let at = self.at;
                self.buf.as_mut_slice().copy_within(at + h..at + h + n, at);
            }
            Landing::Payload => {}
        }
        result
    }

    /// Whether `msg`, a whole message, is this tensor's.
    fn judge(&self, msg: &[u8], truncated: bool) -> Result<(), Unexpected> {
        let got = msg.len();
        let Some(theirs) = decode_header(msg) else {
            return Err(Unexpected {
                error: TensorError::NotATensor { got },
                header: None,
            });
        };
        let ours_name = String::from_utf8_lossy(&wire_name(&self.name)).into_owned();
        let same = theirs.dtype == Some(self.dtype)
            && theirs.shape == self.shape
            && theirs.name == ours_name
            && theirs.numel == self.numel();
        let expected_len = theirs.header_len + theirs.numel * theirs.dtype.map_or(1, DType::size);
        if same && !truncated && (got == expected_len || got == expected_len + WIRE_PAD) {
            return Ok(());
        }
        let theirs_desc = match theirs.dtype {
            Some(d) => describe(&theirs.name, d, &theirs.shape),
            None => format!("'{}' of unknown dtype", theirs.name),
        };
        Err(Unexpected {
            error: TensorError::Mismatch {
                ours: self.describe(),
                theirs: if same {
                    format!("{theirs_desc} with {got} bytes instead of {expected_len}")
                } else {
                    theirs_desc
                },
            },
            header: Some(msg[..theirs.header_len].to_vec()),
        })
    }
}

/// Where a receive put a message in the tensor's buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Landing {
    /// At the header's place: a whole message `[header | payload]` is expected.
    Whole,
    /// At the payload's place: the payload alone is expected, its header having been
    /// checked on an earlier message (see [`crate::transport::p2p`]).
    Payload,
}

/// A received message that is not the expected tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unexpected {
    pub error: TensorError,
    /// The sender's wire header, when a whole message arrived.
    pub header: Option<Vec<u8>>,
}

/// The payload length a wire header announces; `None` if `header` is not one.
pub fn header_payload_len(header: &[u8]) -> Option<usize> {
    let h = decode_header(header)?;
    Some(h.numel * h.dtype?.size())
}

#[cfg(test)]
mod tests;
