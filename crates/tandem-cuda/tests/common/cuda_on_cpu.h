// The few pieces of CUDA C that our kernel files use, defined for an ordinary C++ compiler, so
// that tests/kernels_on_cpu.rs can run the same kernel sources on the CPU (see cpu_rig.rs).
//
// A launch runs one block at a time. Within a block every CUDA thread is an OS thread of a team
// of blockDim threads, so __syncthreads() is a real barrier and __shared__ arrays (function
// statics) are shared by the block; the team meets at a barrier after each block before the
// next one starts. Launches are serialized by the Rust side, so statics never serve two blocks
// at once. Floating point follows IEEE-754 as on the GPU: the library is compiled with
// -ffp-contract=off, as NVRTC compiles with --fmad=false. Only exp/log/sqrt-like library calls
// may differ from the GPU's by an ulp, which the tests' tolerances allow.

#pragma once

#include <math.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static

using std::max;
using std::min;

struct uint3 {
    unsigned int x, y, z;
};
struct dim3 {
    unsigned int x, y, z;
};

static thread_local uint3 threadIdx;
static thread_local uint3 blockIdx;
static thread_local dim3 blockDim;
static thread_local dim3 gridDim;

inline unsigned int __float_as_uint(float value) {
    unsigned int bits;
    std::memcpy(&bits, &value, sizeof bits);
    return bits;
}
inline int __float_as_int(float value) { return (int)__float_as_uint(value); }
inline float __uint_as_float(unsigned int bits) {
    float value;
    std::memcpy(&value, &bits, sizeof value);
    return value;
}
inline float __int_as_float(int bits) { return __uint_as_float((unsigned int)bits); }

inline int atomicMin(int* address, int value) {
    int old = __atomic_load_n(address, __ATOMIC_SEQ_CST);
    while (value < old &&
           !__atomic_compare_exchange_n(address, &old, value, false, __ATOMIC_SEQ_CST,
                                        __ATOMIC_SEQ_CST)) {
    }
    return old;
}

// A barrier for a fixed number of threads that gives up after a bound: a thread that leaves a
// kernel before a __syncthreads() its block still reaches (undefined in CUDA) would otherwise
// hang the test forever.
class TeamBarrier {
  public:
    explicit TeamBarrier(unsigned int threads) : threads_(threads) {}

    void wait() {
        std::unique_lock<std::mutex> lock(mutex_);
        unsigned long long generation = generation_;
        if (++arrived_ == threads_) {
            arrived_ = 0;
            generation_++;
            changed_.notify_all();
            return;
        }
        bool released = changed_.wait_for(lock, std::chrono::seconds(30),
                                          [&] { return generation_ != generation; });
        if (!released) {
            std::fprintf(stderr,
                         "cuda_on_cpu: a block's threads did not all reach __syncthreads() within "
                         "30 s (a thread returned early?)\n");
            std::abort();
        }
    }

  private:
    std::mutex mutex_;
    std::condition_variable changed_;
    unsigned int threads_;
    unsigned int arrived_ = 0;
    unsigned long long generation_ = 0;
};

static thread_local TeamBarrier* block_barrier = nullptr;

inline void __syncthreads() { block_barrier->wait(); }

// Calls `kernel` with the values that `params` point to, as cuLaunchKernel's kernelParams.
template <typename... Params, std::size_t... I>
void call_with_params(void (*kernel)(Params...), void** params, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_cv_t<std::remove_reference_t<Params>>*>(params[I])...);
}

// Runs `kernel` over grid x block, blocks one after another, each block's threads at once.
template <typename... Params>
void emulate_launch(void (*kernel)(Params...), const unsigned int* grid,
                    const unsigned int* block, void** params) {
    dim3 grid_dim{grid[0], grid[1], grid[2]};
    dim3 block_dim{block[0], block[1], block[2]};
    unsigned int team = block_dim.x * block_dim.y * block_dim.z;
    TeamBarrier barrier(team);
    TeamBarrier between_blocks(team);
    auto run = [&](unsigned int rank) {
        block_barrier = &barrier;
        gridDim = grid_dim;
        blockDim = block_dim;
        threadIdx = uint3{rank % block_dim.x, rank / block_dim.x % block_dim.y,
                          rank / (block_dim.x * block_dim.y)};
        for (unsigned int z = 0; z < grid_dim.z; z++) {
            for (unsigned int y = 0; y < grid_dim.y; y++) {
                for (unsigned int x = 0; x < grid_dim.x; x++) {
                    blockIdx = uint3{x, y, z};
                    call_with_params(kernel, params, std::index_sequence_for<Params...>{});
                    between_blocks.wait();
                }
            }
        }
        block_barrier = nullptr;
    };
    std::vector<std::thread> threads;
    threads.reserve(team);
    for (unsigned int rank = 1; rank < team; rank++) threads.emplace_back(run, rank);
    run(0);
    for (auto& thread : threads) thread.join();
}

template <typename T>
constexpr bool unknown_parameter_type = false;

// A kernel parameter's kind, as tandem_cuda::ptx_params reads it from PTX: 'l' a pointer or a
// 64-bit integer, 'i' a 32-bit integer, 'f' float, 'd' double.
template <typename T>
constexpr char param_kind() {
    using Value = std::remove_cv_t<T>;
    if constexpr (std::is_pointer_v<Value> || (std::is_integral_v<Value> && sizeof(Value) == 8)) {
        return 'l';
    } else if constexpr (std::is_integral_v<Value> && sizeof(Value) == 4) {
        return 'i';
    } else if constexpr (std::is_same_v<Value, float>) {
        return 'f';
    } else if constexpr (std::is_same_v<Value, double>) {
        return 'd';
    } else {
        static_assert(unknown_parameter_type<Value>, "a kernel parameter type of no known kind");
        return '?';
    }
}

// The kinds of `kernel`'s parameters, one character each.
template <typename... Params>
const char* param_kinds(void (*)(Params...)) {
    static const char kinds[] = {param_kind<Params>()..., '\0'};
    return kinds;
}

// Exports kernel NAME's launch as `emulate_NAME(grid[3], block[3], params)` and its parameter
// kinds as `emulate_params_NAME()`.
#define EXPORT_LAUNCH(NAME)                                                             \
    extern "C" void emulate_##NAME(const unsigned int* grid, const unsigned int* block, \
                                   void** params) {                                     \
        emulate_launch(NAME, grid, block, params);                                      \
    }                                                                                   \
    extern "C" const char* emulate_params_##NAME() { return param_kinds(NAME); }
