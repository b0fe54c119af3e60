//! A link's offer, read at its receiver's first receive: the ring its sender made (mapped
//! here, its name unlinked) or none (the link goes by MPI).

use super::shm::{self, Mapping};
use super::*;

impl LinkRings {
    /// Reads the link's offer if it has not been read (waiting for it: its sender sends it
    /// before the link's first message) and maps the ring it offers.
    pub(super) fn resolve<C: Comm>(
        &self,
        c: &C,
        src: usize,
        tag: i32,
    ) -> Result<(), TransportError> {
        self.resolve_within(c, src, tag, None)
    }

    /// [`LinkRings::resolve`] waiting at most `within` for the offer (a timeout naming
    /// `src` after it), or as long as an MPI receive would (`None`).
    pub(super) fn resolve_within<C: Comm>(
        &self,
        c: &C,
        src: usize,
        tag: i32,
        within: Option<std::time::Duration>,
    ) -> Result<(), TransportError> {
        let key = link_key(src, tag);
        if !matches!(self.receiving.borrow()[&key].state, State::Unknown) {
            return Ok(());
        }
        let offered = self.offer(c, src, tag, within)?;
        let state = match offered.filter(|_| enabled()) {
            Some(o) => match shm::open(&o.name, Geometry::of(o.nbytes)) {
                Ok(map) => {
                    // Mapped: the name can go now (its sender unlinks it too, once it sees
                    // the ring in use, or when its communicator goes).
                    shm::unlink(&o.name);
                    attach(map, Geometry::of(o.nbytes))
                }
                Err(_) => State::Mpi,
            },
            None => State::Mpi,
        };
        self.receiving
            .borrow_mut()
            .get_mut(&key)
            .expect("entry made")
            .state = state;
        Ok(())
    }

    /// The offer of the link from `src` on `tag`: offers of other links read on the way
    /// are kept for theirs.
    fn offer<C: Comm>(
        &self,
        c: &C,
        src: usize,
        tag: i32,
        within: Option<std::time::Duration>,
    ) -> Result<Option<Offered>, TransportError> {
        let key = link_key(src, tag);
        let offers_tag = c.tags().reserved(Reserved::LinkRing);
        let mut buf = Vec::new();
        let mut waiting = Waiting::new();
        let since = std::time::Instant::now();
        loop {
            if let Some(limit) = within.filter(|l| since.elapsed() > *l) {
                return Err(TransportError::Timeout {
                    rank: c.rank(),
                    peer: src,
                    tag,
                    secs: limit.as_secs(),
                });
            }
            if let Some(o) = self.offers.borrow_mut().remove(&key) {
                return Ok(o);
            }
            if c.try_receive_into(src, offers_tag, OFFER_WITHIN, &mut buf)?
                .is_some()
            {
                let offer: Offer =
                    serde_json::from_slice(&buf).map_err(|_| TransportError::BadOffer {
                        rank: c.rank(),
                        peer: src,
                    })?;
                self.offers
                    .borrow_mut()
                    .insert(link_key(src, offer.tag), offer.ring);
                continue;
            }
            waiting.idle(c, src, tag)?;
        }
    }
}

/// How long an offer's transfer may take once it started to arrive (it is a few dozen
/// bytes: at once).
const OFFER_WITHIN: std::time::Duration = std::time::Duration::from_secs(60);

/// The receiving side of a ring the receiver has mapped: it says so in the ring.
fn attach(map: Mapping, geo: Geometry) -> State {
    let inb = Inbound::new(map, geo);
    inb.attach();
    State::Ring(inb)
}
