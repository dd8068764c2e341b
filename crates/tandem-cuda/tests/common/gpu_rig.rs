//! GPU 0 for the kernel checks: every kernel compiled and loaded as the executor loads them
//! ([`Kernels`]), launched by name with arguments checked against each kernel's signature,
//! and buffers by address.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, LaunchConfig};
use tandem_cuda::executor::kernels::{Arg, Kernels};
use tandem_cuda::Library;

use super::kernel_checks::{bytes_of, values_of, Buffer, Plain};

/// GPU 0's default stream, the loaded kernels, and the buffers made so far (freed with it).
pub struct GpuRig {
    stream: Arc<CudaStream>,
    kernels: Kernels,
    buffers: HashMap<u64, CudaSlice<u8>>,
}

impl GpuRig {
    /// The GPU, or `None` (after printing why) when there is none to test on.
    pub fn open(test: &str) -> Option<GpuRig> {
        // Under TANDEM_REQUIRE_GPU=1 a missing NVRTC fails the test, as a missing GPU does.
        if !tandem_cuda::test_gpu_available(test, &[Library::Nvrtc]) {
            return None;
        }
        let probe = tandem_cuda::Probe::process();
        let context = cudarc::driver::CudaContext::new(0).expect("cannot open GPU 0");
        let compiler = super::compiler_for(probe, &context);
        let kernels = Kernels::load(&context, &compiler).unwrap_or_else(|e| panic!("{e}"));
        Some(GpuRig {
            stream: context.default_stream(),
            kernels,
            buffers: HashMap::new(),
        })
    }
}

impl GpuRig {
    /// A new buffer holding `bytes`, and its address.
    fn upload_bytes(&mut self, bytes: &[u8]) -> u64 {
        let slice = if bytes.is_empty() {
            self.stream.alloc_zeros::<u8>(1)
        } else {
            self.stream.clone_htod(bytes)
        }
        .expect("upload");
        let address = {
            let (address, _record) = slice.device_ptr(&self.stream);
            address
        };
        self.buffers.insert(address, slice);
        address
    }

    /// The `len` bytes at `address` (a buffer of this rig).
    fn download_bytes(&mut self, address: u64, len: usize) -> Vec<u8> {
        let slice = &self.buffers[&address];
        let mut bytes = vec![0u8; len];
        self.stream
            .memcpy_dtoh(&slice.slice(..len), &mut bytes)
            .expect("download");
        self.stream.synchronize().expect("download");
        bytes
    }

    /// Runs kernel `name` over `config` with `args` and waits for it; panics with the
    /// kernel's name when the arguments do not fit its parameters or the launch fails.
    pub fn launch(&mut self, name: &'static str, config: LaunchConfig, args: &[Arg]) {
        // SAFETY: every pointer is a buffer of this rig, sized by the check for this launch,
        // and the rig keeps its buffers until it is dropped, after the synchronize below.
        unsafe {
            self.kernels
                .launch_untyped(&self.stream, name, config, args)
        }
        .unwrap_or_else(|e| panic!("{name}: {e}"));
        self.stream
            .synchronize()
            .unwrap_or_else(|e| panic!("{name}: {e:?}"));
    }

    /// A new buffer holding `values`.
    pub fn upload<T: Plain>(&mut self, values: &[T]) -> Buffer<T> {
        let address = self.upload_bytes(bytes_of(values));
        Buffer::new(address, values.len())
    }

    /// A new buffer of `len` zeros.
    pub fn zeros<T: Plain>(&mut self, len: usize) -> Buffer<T> {
        self.upload(&vec![T::default(); len])
    }

    /// The values of `buffer`.
    pub fn download<T: Plain>(&mut self, buffer: &Buffer<T>) -> Vec<T> {
        values_of(&self.download_bytes(buffer.address(), buffer.byte_len()))
    }
}
