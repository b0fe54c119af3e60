//! A ps task's parameter memory: its shards end to end in one buffer, after room for a
//! reply's header, so that a pull is answered from this memory as it is (the header framed
//! in front, [`super::protocol::frame_before`]), without copying the parameters into a
//! message; and the one buffer where a synchronous step's gradients are summed.

use super::protocol::{frame_before, Reply};
use crate::tensor::AlignedBuf;

/// Bytes before the parameters for a reply's header (`Reply::Params` takes about 40).
const ROOM: usize = 256;

/// The parameters of a ps's shards, end to end, behind [`ROOM`] bytes of header room.
pub(super) struct Store {
    buf: AlignedBuf,
    /// Where each shard starts, in floats; the last entry is the total.
    offsets: Vec<usize>,
}

impl Store {
    /// Zeroed parameters for shards of these lengths.
    pub(super) fn new(lens: impl IntoIterator<Item = usize>) -> Store {
        let mut offsets = vec![0];
        for len in lens {
            offsets.push(offsets.last().copied().unwrap_or(0) + len);
        }
        let total = offsets.last().copied().unwrap_or(0);
        Store {
            buf: AlignedBuf::zeroed(ROOM + 4 * total),
            offsets,
        }
    }

    /// Floats of all shards.
    pub(super) fn len(&self) -> usize {
        self.offsets.last().copied().unwrap_or(0)
    }

    /// Every shard's parameters, end to end.
    pub(super) fn all(&self) -> &[f32] {
        // SAFETY: the buffer holds ROOM + 4 * len initialised bytes and is 64-byte aligned,
        // so the floats at ROOM (a multiple of 4) are aligned; every bit pattern is an f32.
        unsafe { std::slice::from_raw_parts(self.buf.as_ptr().add(ROOM).cast(), self.len()) }
    }

    /// [`Store::all`], writable.
    pub(super) fn all_mut(&mut self) -> &mut [f32] {
        let len = self.len();
        // SAFETY: as in `all`, and `&mut self` gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.buf.as_mut_ptr().add(ROOM).cast(), len) }
    }

    /// The range of shard `i` in [`Store::all`].
    pub(super) fn range(&self, i: usize) -> std::ops::Range<usize> {
        self.offsets[i]..self.offsets[i + 1]
    }

    /// Each shard's parameters.
    pub(super) fn shards(&self) -> Vec<&[f32]> {
        let all = self.all();
        (0..self.offsets.len() - 1)
            .map(|i| &all[self.range(i)])
            .collect()
    }

    /// Frames `header` in front of the parameters; the message is then [`Store::message`]
    /// until the parameters or the header change.
    pub(super) fn frame(&mut self, header: &Reply) -> Framed {
        let start = frame_before(header, &mut self.buf.as_mut_slice()[..ROOM])
            .expect("a params header fits its room");
        Framed {
            start,
            end: ROOM + 4 * self.len(),
        }
    }

    /// The bytes of a framed message.
    pub(super) fn message(&self, f: Framed) -> &[u8] {
        &self.buf.as_slice()[f.start..f.end]
    }
}

/// Where [`Store::frame`] put a message.
#[derive(Debug, Clone, Copy)]
pub(super) struct Framed {
    start: usize,
    end: usize,
}

#[cfg(test)]
mod tests {
    use super::super::protocol::decode;
    use super::*;

    #[test]
    fn shards_lie_end_to_end_and_pulls_are_framed_in_place() {
        let mut s = Store::new([3, 2]);
        assert_eq!(s.len(), 5);
        s.all_mut().copy_from_slice(&[1., 2., 3., 4., 5.]);
        assert_eq!(s.shards(), [&[1., 2., 3.][..], &[4., 5.][..]]);
        assert_eq!(s.range(1), 3..5);
        let header = Reply::Params {
            step: 9,
            loss: None,
        };
        let f = s.frame(&header);
        let (back, payload) = decode::<Reply>(s.message(f)).unwrap();
        assert_eq!(back, header);
        assert_eq!(payload, [1., 2., 3., 4., 5.]);
        assert_eq!(Store::new([]).shards().len(), 0);
    }
}
