//! Message tags within the MPI library's bound.
//!
//! MPI only guarantees tags up to 32767 (`MPI_TAG_UB`, MPI 4.0 section 8.1.2); the real
//! bound depends on the library and its transport: OpenMPI's `pml ob1` allows 2^31-1, its
//! `pml ucx` (the default on most InfiniBand clusters) 2^23-1, MPICH 2^31-1 or less with
//! some netmods. mpiflow reads the bound when a communicator is made and builds every
//! scheme inside it: [`Tags::reserved`] gives the transport's own tags (collectives, links)
//! from the top of the range, [`Tags::kept`] the few below them that the layers above keep
//! for their own protocols (each names its own: the transport knows nothing of them), and
//! every tag a caller passes (tensor links, channels) must lie in `0..=Tags::max_user()`,
//! below those.
//!
//! `MPIFLOW_TAG_UB` lowers the bound (never raises it): the tests run whole jobs under the
//! standard's minimum with it.

/// The smallest `MPI_TAG_UB` the MPI standard allows.
pub const STANDARD_TAG_UB: i32 = 32767;

/// The environment variable that lowers the tag bound (for tests).
pub const TAG_UB_VAR: &str = "MPIFLOW_TAG_UB";

/// The transport's own tag uses, each one tag at the top of the range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reserved {
    Barrier,
    Bcast,
    Allgather,
    Ring,
    RecursiveDoubling,
    /// A point-to-point link's offer of a ring in shared memory (sender to receiver, once
    /// per link between ranks of one node).
    LinkRing,
}

impl Reserved {
    /// Every reserved use, in declaration order: the order they take tags down from the
    /// bound.
    pub const ALL: [Reserved; 6] = [
        Reserved::Barrier,
        Reserved::Bcast,
        Reserved::Allgather,
        Reserved::Ring,
        Reserved::RecursiveDoubling,
        Reserved::LinkRing,
    ];
}

/// One of the tags kept for a protocol above the transport, by its number: its user names
/// it (`const REQUESTS: Kept = Kept(0)`), and the users of one communicator keep distinct
/// numbers below [`Kept::SLOTS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kept(pub u8);

impl Kept {
    /// How many tags are kept for the layers above.
    pub const SLOTS: u8 = 8;
}

/// Tags taken from the top of the range: the transport's own and the kept ones.
const TAKEN: i32 = Reserved::ALL.len() as i32 + Kept::SLOTS as i32;

/// Tags kept below the reserved ones for callers: at least this many, or the bound is
/// refused (a caller's tags 0..1023 must fit even under the standard's minimum).
pub const MIN_USER_TAGS: i32 = 1024;

/// Errors of the tag scheme.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TagError {
    #[error(
        "MPI_TAG_UB is {ub}: mpiflow needs at least {} tags ({TAKEN} reserved and {MIN_USER_TAGS} for tensors)",
        MIN_USER_TAGS + TAKEN
    )]
    TooSmall { ub: i32 },
    #[error("tag {tag} is out of range 0..={max} (MPI_TAG_UB {ub}; the {TAKEN} tags above are mpiflow's own)")]
    OutOfRange { tag: i32, max: i32, ub: i32 },
    #[error("{TAG_UB_VAR}={0:?} is not a positive integer")]
    BadVariable(String),
}

/// The tag scheme of one communicator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tags {
    ub: i32,
}

impl Tags {
    /// The scheme under the bound `ub` (`MPI_TAG_UB`).
    pub fn new(ub: i32) -> Result<Tags, TagError> {
        if ub < MIN_USER_TAGS - 1 + TAKEN {
            return Err(TagError::TooSmall { ub });
        }
        Ok(Tags { ub })
    }

    /// The scheme under `library_ub` lowered by [`TAG_UB_VAR`] if that is set.
    pub fn with_override(library_ub: i32, var: Option<&str>) -> Result<Tags, TagError> {
        let ub = match var {
            None => library_ub,
            Some(v) => {
                let lowered = v
                    .trim()
                    .parse::<i32>()
                    .ok()
                    .filter(|n| *n > 0)
                    .ok_or_else(|| TagError::BadVariable(v.to_string()))?;
                lowered.min(library_ub)
            }
        };
        Tags::new(ub)
    }

    /// The bound this scheme lives in.
    pub fn ub(&self) -> i32 {
        self.ub
    }

    /// The highest tag a caller may use.
    pub fn max_user(&self) -> i32 {
        self.ub - TAKEN
    }

    /// The tag of one of the transport's own uses.
    pub fn reserved(&self, r: Reserved) -> i32 {
        // Declaration order is the order in ALL: each use is its position below the bound.
        self.ub - r as i32
    }

    /// The tag kept as `k` for a protocol above the transport (below the transport's own).
    pub fn kept(&self, k: Kept) -> i32 {
        assert!(
            k.0 < Kept::SLOTS,
            "kept tags are numbered below {}",
            Kept::SLOTS
        );
        self.ub - Reserved::ALL.len() as i32 - i32::from(k.0)
    }

    /// A caller's tag, checked against the range left to callers.
    pub fn check_user(&self, tag: i32) -> Result<(), TagError> {
        if (0..=self.max_user()).contains(&tag) {
            Ok(())
        } else {
            Err(TagError::OutOfRange {
                tag,
                max: self.max_user(),
                ub: self.ub,
            })
        }
    }
}

impl Default for Tags {
    /// The standard's minimum: a scheme that fits every MPI library.
    fn default() -> Self {
        Tags {
            ub: STANDARD_TAG_UB,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserved_tags_are_distinct_within_the_bound_and_above_every_user_tag() {
        for ub in [STANDARD_TAG_UB, (1 << 23) - 1, i32::MAX] {
            let t = Tags::new(ub).unwrap();
            let own = Reserved::ALL.iter().map(|r| t.reserved(*r));
            let kept = (0..Kept::SLOTS).map(|k| t.kept(Kept(k)));
            let mut seen: Vec<i32> = own.chain(kept).collect();
            assert!(
                seen.iter().all(|x| *x <= ub && *x > t.max_user()),
                "{seen:?}"
            );
            seen.sort_unstable();
            seen.dedup();
            assert_eq!(seen.len() as i32, TAKEN);
            assert!(t.check_user(t.max_user()).is_ok());
            assert!(t.check_user(0).is_ok());
            assert!(t.check_user(t.max_user() + 1).is_err());
            assert!(t.check_user(-1).is_err());
        }
    }

    #[test]
    fn the_variable_lowers_never_raises_and_bad_values_are_named() {
        assert_eq!(
            Tags::with_override(i32::MAX, Some("32767")).unwrap().ub(),
            32767
        );
        assert_eq!(
            Tags::with_override(32767, Some("99999999")).unwrap().ub(),
            32767
        );
        assert_eq!(
            Tags::with_override(5000, None).unwrap().max_user(),
            5000 - 14
        );
        let e = Tags::with_override(32767, Some("lots")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "MPIFLOW_TAG_UB=\"lots\" is not a positive integer"
        );
        let e = Tags::with_override(32767, Some("100")).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("MPI_TAG_UB is 100: mpiflow needs"),
            "{e}"
        );
        let e = Tags::new(32767).unwrap().check_user(40000).unwrap_err();
        assert_eq!(
            e.to_string(),
            "tag 40000 is out of range 0..=32753 (MPI_TAG_UB 32767; the 14 tags above are mpiflow's own)"
        );
    }
}
