//! Values a user picks by name (on the command line, in a job script): each such enum
//! lists its names with one line of help, so a front end (the `mpiflow` command) offers
//! them without the library depending on an argument parser.

/// An enum whose values have names users type.
pub trait Named: Copy + PartialEq + Sized + 'static {
    /// Every value, its name, and a line of help (empty when the name says it all).
    const NAMES: &'static [(Self, &'static str, &'static str)];

    /// This value's name.
    fn name(self) -> &'static str {
        Self::NAMES
            .iter()
            .find(|(v, ..)| *v == self)
            .map_or("?", |(_, n, _)| n)
    }

    /// The value named `name`, if any.
    fn from_name(name: &str) -> Option<Self> {
        Self::NAMES
            .iter()
            .find(|(_, n, _)| *n == name)
            .map(|(v, ..)| *v)
    }
}

#[cfg(test)]
mod tests {
    use super::Named;

    /// Every named enum of the library: names unique, each value once, round trips.
    fn check<T: Named + std::fmt::Debug>() {
        for (i, (v, n, _)) in T::NAMES.iter().enumerate() {
            assert_eq!(T::from_name(n), Some(*v), "{n}");
            assert_eq!(v.name(), *n);
            for (w, m, _) in &T::NAMES[i + 1..] {
                assert!(n != m && v != w, "{n} listed twice");
            }
        }
    }

    #[test]
    fn every_name_round_trips() {
        check::<crate::topology::Policy>();
        check::<crate::transport::Algorithm>();
        check::<crate::cluster::Source>();
        check::<crate::cluster::Placement>();
        check::<crate::cluster::hostfile::MapBy>();
        check::<crate::train::ps::PsTransport>();
        check::<crate::bench::osu::Path>();
        check::<crate::bench::osu::ShmStores>();
        check::<crate::bench::osu::Element>();
        check::<crate::train::optim::OptimizerKind>();
        check::<crate::train::ps::placement::Strategy>();
        check::<crate::transport::stack::RdmaStack>();
        check::<crate::pipeline::Schedule>();
        check::<crate::pipeline::Balance>();
    }
}
