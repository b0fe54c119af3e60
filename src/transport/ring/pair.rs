//! A channel's two rings, agreed in its opening by both ranks.

use super::shm::{self, Mapping};
use super::{enabled, Geometry, Inbound, Made, Outbound, MAX_BYTES};
use crate::transport::comm::{sendrecv, Comm, Completion, TransportError};

/// A channel's two rings: the one it sends on and the one it receives on.
#[derive(Debug)]
pub(crate) struct Rings {
    out: Outbound,
    inb: Inbound,
}

impl Rings {
    /// See [`Outbound::put`].
    #[inline(always)]
    pub(crate) fn put(&self, bytes: &[u8]) -> bool {
        self.out.put(bytes)
    }

    /// The next message into `buf` (see [`Inbound::receive`]); `peer` and `tag` are the
    /// channel's.
    #[inline(always)]
    pub(crate) fn receive<C: Comm>(
        &self,
        c: &C,
        buf: &mut [u8],
        peer: usize,
        tag: i32,
    ) -> Result<Completion, TransportError> {
        self.inb.receive(c, buf, peer, tag)
    }
}

/// What a rank offers in a channel's opening: its host and the ring it receives on.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Offer {
    host: String,
    name: String,
}

/// Room for an offer (a host name is at most 255 bytes).
const OFFER_ROOM: usize = 512;

/// Part of a channel's opening, on both ranks (two exchanges with `peer` on `tag`): the
/// rings of a channel of `nbytes` messages, if both ranks want them (`want`) and can share
/// them; `None` on both ranks otherwise.
pub(crate) fn connect<C: Comm>(
    c: &C,
    peer: usize,
    tag: i32,
    nbytes: usize,
    want: bool,
) -> Result<Option<Rings>, TransportError> {
    let geo = Geometry::of(nbytes);
    let want = want && enabled() && nbytes > 0 && nbytes <= MAX_BYTES;
    let host = c.node_name();
    let mine = match (want, host) {
        (true, Some(host)) => shm::create(geo)
            .ok()
            .map(|(map, name)| (map, Offer { host, name })),
        _ => None,
    };
    let result = exchange(c, peer, tag, geo, mine.as_ref().map(|m| &m.1));
    if let Some((_, offer)) = &mine {
        // Mapped by the peer or not by now: the name is no longer needed.
        shm::unlink(&offer.name);
    }
    let out = result?;
    Ok(match (mine, out) {
        (Some((map, _)), Some(out)) => Some(Rings {
            out: Outbound::new(out, geo, Made::ForChannel),
            inb: Inbound::new(map, geo),
        }),
        _ => None,
    })
}

/// The two exchanges: offers, then whether each side mapped the other's; the peer's ring
/// when both did.
fn exchange<C: Comm>(
    c: &C,
    peer: usize,
    tag: i32,
    geo: Geometry,
    mine: Option<&Offer>,
) -> Result<Option<Mapping>, TransportError> {
    let ours = serde_json::to_vec(&mine).unwrap_or_default();
    let mut theirs = [0u8; OFFER_ROOM];
    let got = sendrecv(c, &ours, peer, &mut theirs, peer, tag)?;
    let theirs: Option<Offer> = match got.truncated() {
        true => None,
        false => serde_json::from_slice(&theirs[..got.count]).unwrap_or(None),
    };
    let mapped = match (mine, theirs) {
        (Some(m), Some(t)) if m.host == t.host => shm::open(&t.name, geo).ok(),
        _ => None,
    };
    let mut both = [0u8; 1];
    sendrecv(c, &[u8::from(mapped.is_some())], peer, &mut both, peer, tag)?;
    Ok(mapped.filter(|_| both[0] == 1))
}
