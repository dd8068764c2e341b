// What the fake CUDA libraries share (see fake_cuda.cpp): the stream queue that the fake
// cuDNN and cuBLAS put their work on, so that it runs in order with the kernels and is
// recorded, not run, while the stream is being captured into a graph.

#pragma once

#include <cstdint>
#include <cstring>
#include <functional>

// Runs `work` on `stream` now, or records it into the graph being captured on `stream`.
void fake_enqueue(void* stream, std::function<void()> work);

// A library call that allocates device memory of its own (as cuDNN and cuBLAS may), under
// TANDEM_FAKE_GPU_LIBRARIES_ALLOCATE_IN_CAPTURE=1: inside a capture of this thread begun in a
// mode other than relaxed, the allocation is refused and the capture invalidated, as CUDA
// does; returns whether it was (the call then fails).
bool fake_library_allocation_refused();

// bfloat16 bits <-> float, as the GPU converts them (round to nearest even; NaN stays NaN).
inline float fake_bf16_to_float(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float value;
    std::memcpy(&value, &wide, sizeof value);
    return value;
}

inline uint16_t fake_float_to_bf16(float value) {
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x0040u);
    uint32_t lsb = (bits >> 16) & 1u;
    return (uint16_t)((bits + 0x7fffu + lsb) >> 16);
}
