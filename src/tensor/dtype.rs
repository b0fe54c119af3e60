//! Element types a tensor can hold, and the arithmetic collectives need on them.

use std::fmt;

/// The dtype of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F64,
    I32,
    I64,
    U8,
}

impl DType {
    pub const ALL: [DType; 5] = [DType::F32, DType::F64, DType::I32, DType::I64, DType::U8];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::U8 => 1,
        }
    }

    /// The code used on the wire.
    pub fn code(self) -> u8 {
        match self {
            DType::F32 => 1,
            DType::F64 => 2,
            DType::I32 => 3,
            DType::I64 => 4,
            DType::U8 => 5,
        }
    }

    pub fn from_code(code: u8) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.code() == code)
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A Rust type that is a tensor element.
pub trait Element: Copy + Default + PartialOrd + Send + Sync + fmt::Debug + 'static {
    const DTYPE: DType;
    fn add(self, other: Self) -> Self;
    /// `self / n`; integer dtypes truncate, as TensorFlow's integer division does.
    fn div_count(self, n: usize) -> Self;
}

macro_rules! element {
    ($t:ty, $d:expr, float) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            #[inline]
            fn add(self, other: Self) -> Self {
                self + other
            }
            #[inline]
            fn div_count(self, n: usize) -> Self {
                self / n as $t
            }
        }
    };
    ($t:ty, $d:expr, int) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            #[inline]
            fn add(self, other: Self) -> Self {
                self.wrapping_add(other)
            }
            #[inline]
            fn div_count(self, n: usize) -> Self {
                self / n as $t
            }
        }
    };
}

element!(f32, DType::F32, float);
element!(f64, DType::F64, float);
element!(i32, DType::I32, int);
element!(i64, DType::I64, int);
element!(u8, DType::U8, int);
