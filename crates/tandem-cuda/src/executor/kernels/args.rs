//! What a kernel launch passes: typed device pointers ([`Ptr`], [`ActPtr`]) and numbers on
//! the Rust side, each turned into one untyped [`Arg`] of a known [`ArgKind`] for the driver.

use std::fmt;
use std::marker::PhantomData;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use crate::executor::memory::Activations;
use crate::ptx_params::ParamKind;

/// A device pointer to elements of `T` (the address 0 is null).
pub struct Ptr<T> {
    address: u64,
    element: PhantomData<fn() -> T>,
}

impl<T> Clone for Ptr<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Ptr<T> {}

impl<T> fmt::Debug for Ptr<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Ptr({:#x})", self.address)
    }
}

impl<T> Ptr<T> {
    /// The null pointer, for a parameter the kernel does not read.
    pub const NULL: Self = Ptr::from_address(0);

    /// The `T`s at device address `address`.
    pub const fn from_address(address: u64) -> Self {
        Ptr {
            address,
            element: PhantomData,
        }
    }

    /// The first element of `slice`.
    pub fn of(slice: &CudaSlice<T>, stream: &CudaStream) -> Self {
        let (address, _record) = slice.device_ptr(stream);
        Ptr::from_address(address)
    }

    /// Element `offset` onwards.
    pub fn at(self, offset: usize) -> Self {
        Ptr::from_address(self.address + (offset * std::mem::size_of::<T>()) as u64)
    }

    /// The device address.
    pub fn address(self) -> u64 {
        self.address
    }
}

/// A device pointer to activations (`Act*` of a kernel with a bfloat16 twin): float32 or
/// bfloat16 ones, which choose the entry point a launch takes. A null one has no element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ActPtr {
    address: u64,
    kind: Option<Activations>,
}

impl ActPtr {
    /// The null pointer, for a parameter the kernel does not read.
    pub const NULL: Self = ActPtr {
        address: 0,
        kind: None,
    };

    /// Activations of `kind` at `address`.
    pub fn new(address: u64, kind: Activations) -> Self {
        ActPtr {
            address,
            kind: Some(kind),
        }
    }

    /// Float32 activations.
    pub fn f32(values: Ptr<f32>) -> Self {
        ActPtr::new(values.address(), Activations::F32)
    }

    /// `Some(self)` when it is not null.
    pub fn non_null(self) -> Option<Self> {
        (self.address != 0).then_some(self)
    }

    /// The device address.
    pub fn address(self) -> u64 {
        self.address
    }
}

/// One kernel argument, by value (device pointers as their addresses; a null pointer is 0).
#[derive(Clone, Copy, Debug)]
pub enum Arg {
    /// A device pointer.
    Ptr(u64),
    /// `int`.
    I32(i32),
    /// `long long`.
    I64(i64),
    /// `unsigned long long`.
    U64(u64),
    /// `float`.
    F32(f32),
    /// `double`.
    F64(f64),
}

impl Arg {
    /// The kind of parameter this argument fills.
    pub fn kind(&self) -> ArgKind {
        match self {
            Arg::Ptr(_) => ArgKind::Ptr,
            Arg::I32(_) => ArgKind::I32,
            Arg::I64(_) => ArgKind::I64,
            Arg::U64(_) => ArgKind::U64,
            Arg::F32(_) => ArgKind::F32,
            Arg::F64(_) => ArgKind::F64,
        }
    }
}

/// The C type class of one kernel parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArgKind {
    /// A pointer.
    Ptr,
    /// `int`.
    I32,
    /// `long long`.
    I64,
    /// `unsigned long long`.
    U64,
    /// `float`.
    F32,
    /// `double`.
    F64,
}

impl ArgKind {
    /// The PTX parameter type this kind compiles to.
    pub fn ptx(self) -> ParamKind {
        match self {
            ArgKind::Ptr | ArgKind::I64 | ArgKind::U64 => ParamKind::Int64,
            ArgKind::I32 => ParamKind::Int32,
            ArgKind::F32 => ParamKind::Float32,
            ArgKind::F64 => ParamKind::Float64,
        }
    }
}

impl fmt::Display for ArgKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ArgKind::Ptr => "pointer",
            ArgKind::I32 => "int",
            ArgKind::I64 => "long long",
            ArgKind::U64 => "unsigned long long",
            ArgKind::F32 => "float",
            ArgKind::F64 => "double",
        })
    }
}

/// A Rust type that fills one kernel parameter of kind [`KernelArg::KIND`].
pub trait KernelArg: Copy {
    /// The parameter's kind.
    const KIND: ArgKind;
    /// The value as the driver takes it.
    fn arg(self) -> Arg;
    /// The activations it points to, for the choice of a kernel's twin (`None`: not an
    /// activation pointer, or null).
    fn activations(self) -> Option<Activations> {
        None
    }
}

impl<T> KernelArg for Ptr<T> {
    const KIND: ArgKind = ArgKind::Ptr;
    fn arg(self) -> Arg {
        Arg::Ptr(self.address)
    }
}

impl KernelArg for ActPtr {
    const KIND: ArgKind = ArgKind::Ptr;
    fn arg(self) -> Arg {
        Arg::Ptr(self.address)
    }
    fn activations(self) -> Option<Activations> {
        self.non_null().and_then(|pointer| pointer.kind)
    }
}

/// [`KernelArg`] for the numbers, each as its own [`Arg`] variant.
macro_rules! number_args {
    ($($type:ty => $variant:ident),* $(,)?) => {$(
        impl KernelArg for $type {
            const KIND: ArgKind = ArgKind::$variant;
            fn arg(self) -> Arg {
                Arg::$variant(self)
            }
        }
    )*};
}

number_args!(i32 => I32, i64 => I64, u64 => U64, f32 => F32, f64 => F64);

/// A list of kinds as `(pointer, int)`, for errors.
pub fn describe(kinds: &[ArgKind]) -> String {
    let names: Vec<String> = kinds.iter().map(ToString::to_string).collect();
    format!("({})", names.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pointer_steps_by_its_element() {
        let floats = Ptr::<f32>::from_address(0x1000);
        assert_eq!(floats.at(3).address(), 0x100c);
        assert_eq!(Ptr::<f64>::from_address(0x1000).at(3).address(), 0x1018);
        assert_eq!(Ptr::<u16>::from_address(0x1000).at(3).address(), 0x1006);
        assert_eq!(Ptr::<f32>::NULL.address(), 0);
    }

    #[test]
    fn only_non_null_activation_pointers_name_their_element_type() {
        let bf16 = ActPtr::new(0x2000, Activations::Bf16);
        assert_eq!(bf16.activations(), Some(Activations::Bf16));
        assert_eq!(ActPtr::NULL.activations(), None);
        assert_eq!(ActPtr::new(0, Activations::Bf16).activations(), None);
        assert_eq!(
            ActPtr::f32(Ptr::from_address(8)).activations(),
            Some(Activations::F32)
        );
        assert_eq!(Ptr::<f32>::from_address(8).activations(), None);
    }

    #[test]
    fn each_number_fills_its_own_kind() {
        assert_eq!(3i32.arg().kind(), ArgKind::I32);
        assert_eq!(3i64.arg().kind(), ArgKind::I64);
        assert_eq!(3u64.arg().kind(), ArgKind::U64);
        assert_eq!(1.5f32.arg().kind(), ArgKind::F32);
        assert_eq!(1.5f64.arg().kind(), ArgKind::F64);
        assert_eq!(<Ptr<u8> as KernelArg>::KIND, ArgKind::Ptr);
        assert_eq!(ArgKind::U64.ptx(), ParamKind::Int64);
        assert_eq!(describe(&[ArgKind::Ptr, ArgKind::I32]), "(pointer, int)");
    }
}
