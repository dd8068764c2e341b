// The last step of the data-parallel average on the device: the gradients NCCL summed over
// the ranks are divided by the world size, as the host ring finishes ReduceOp::Mean
// (tandem-dist divides the finished sum; it does not multiply by 1/world), so the rounding of
// that step is the CPU's.
//
// Launch: one thread per element.

extern "C" __global__ void divide_in_place(float* x, long long n, float divisor) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    x[i] = x[i] / divisor;
}
