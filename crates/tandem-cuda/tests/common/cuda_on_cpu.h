// The few pieces of CUDA C that our kernel files use, defined for an ordinary C++ compiler, so
// that the fake GPU (tests/fake_gpu) runs the same kernel sources on the CPU.
//
// A launch runs one block at a time, the last block first (a kernel counting on the blocks'
// order fails here as it could on a GPU). A kernel that declares __shared__ memory runs each
// block as a team of blockDim fibers, so __syncthreads() is a real barrier and __shared__
// arrays (function statics) are shared by the block. Any other kernel runs its threads one after
// another. Launches are serialized by the fake driver, so statics never serve two blocks at
// once. Floating point follows IEEE-754 as on the GPU: the library is compiled with
// -ffp-contract=off, as NVRTC compiles with --fmad=false. Only exp/log/sqrt-like library calls
// may differ from the GPU's by an ulp, which the tests' tolerances allow.


#include <math.h>
#include <ucontext.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
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
inline long long __double_as_longlong(double value) {
    long long bits;
    std::memcpy(&bits, &value, sizeof bits);
    return bits;
}
inline double __longlong_as_double(long long bits) {
    double value;
    std::memcpy(&value, &bits, sizeof value);
    return value;
}

inline unsigned int atomicAdd(unsigned int* address, unsigned int value) {
    return __atomic_fetch_add(address, value, __ATOMIC_SEQ_CST);
}

inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

// A load that bypasses the GPU's L1; host memory has none.
template <typename T>
inline T __ldcg(const T* address) {
    return *address;
}

inline int atomicMin(int* address, int value) {
    int old = __atomic_load_n(address, __ATOMIC_SEQ_CST);
    while (value < old &&
           !__atomic_compare_exchange_n(address, &old, value, false, __ATOMIC_SEQ_CST,
                                        __ATOMIC_SEQ_CST)) {
    }
    return old;
}

// The threads of a team run as fibers of the launching thread: each has its own stack, and
// __syncthreads() switches back to the launch, which resumes every fiber once all of them have
// reached the barrier (or ended). No OS thread is made, and nothing runs in parallel.
struct Fiber {
    ucontext_t context;
    std::vector<char> stack;
    uint3 thread_index;
    bool done;
};

static thread_local ucontext_t* team_scheduler = nullptr;
static thread_local Fiber* running_fiber = nullptr;
static thread_local std::function<void()>* team_body = nullptr;

inline void __syncthreads() {
    if (running_fiber == nullptr) {
        std::fprintf(stderr,
                     "cuda_on_cpu: __syncthreads() in a kernel run without a team of threads "
                     "(kernels that declare no __shared__ memory run their threads one by one)\n");
        std::abort();
    }
    swapcontext(&running_fiber->context, team_scheduler);
}

inline void fiber_main() {
    (*team_body)();
    running_fiber->done = true;
}

// Runs one block of `threads` as fibers, round after round, until every fiber has ended.
inline void run_team(std::vector<Fiber>& fibers, std::function<void()>& body) {
    ucontext_t scheduler;
    team_scheduler = &scheduler;
    team_body = &body;
    for (Fiber& fiber : fibers) {
        getcontext(&fiber.context);
        fiber.context.uc_stack.ss_sp = fiber.stack.data();
        fiber.context.uc_stack.ss_size = fiber.stack.size();
        fiber.context.uc_link = &scheduler;
        fiber.done = false;
        makecontext(&fiber.context, fiber_main, 0);
    }
    for (bool any_running = true; any_running;) {
        any_running = false;
        for (Fiber& fiber : fibers) {
            if (fiber.done) continue;
            running_fiber = &fiber;
            threadIdx = fiber.thread_index;
            swapcontext(&scheduler, &fiber.context);
            any_running = any_running || !fiber.done;
        }
    }
    running_fiber = nullptr;
    team_scheduler = nullptr;
    team_body = nullptr;
}

// Calls `kernel` with the values that `params` point to, as cuLaunchKernel's kernelParams.
template <typename... Params, std::size_t... I>
void call_with_params(void (*kernel)(Params...), void** params, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_cv_t<std::remove_reference_t<Params>>*>(params[I])...);
}

// Runs `kernel` over grid x block, blocks one after another, the last first. With TEAM, each
// block's threads run as fibers that __syncthreads() holds together; without, one after
// another on the calling thread (for kernels that share nothing within a block: far faster).
// The index within a block of `block` of the thread numbered `rank` (x fastest).
inline uint3 thread_index(unsigned int rank, dim3 block) {
    return uint3{rank % block.x, rank / block.x % block.y, rank / (block.x * block.y)};
}

template <bool TEAM, typename... Params>
void emulate_launch(void (*kernel)(Params...), const unsigned int* grid,
                    const unsigned int* block, void** params) {
    dim3 grid_dim{grid[0], grid[1], grid[2]};
    dim3 block_dim{block[0], block[1], block[2]};
    unsigned int team = block_dim.x * block_dim.y * block_dim.z;
    std::vector<Fiber> fibers(TEAM ? team : 0);
    for (unsigned int rank = 0; rank < fibers.size(); rank++) {
        fibers[rank].stack.resize(64 * 1024);
        fibers[rank].thread_index = thread_index(rank, block_dim);
    }
    std::function<void()> body = [&] {
        call_with_params(kernel, params, std::index_sequence_for<Params...>{});
    };
    gridDim = grid_dim;
    blockDim = block_dim;
    for (unsigned int z = grid_dim.z; z-- > 0;)
        for (unsigned int y = grid_dim.y; y-- > 0;)
            for (unsigned int x = grid_dim.x; x-- > 0;) {
                blockIdx = uint3{x, y, z};
                if constexpr (TEAM) {
                    run_team(fibers, body);
                } else {
                    for (unsigned int rank = 0; rank < team; rank++) {
                        threadIdx = thread_index(rank, block_dim);
                        call_with_params(kernel, params, std::index_sequence_for<Params...>{});
                    }
                }
            }
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

// Exports kernel NAME's launch as `emulate_NAME(grid[3], block[3], params)` (TEAM: 1 when
// its threads share memory and meet at barriers) and its parameter kinds as
// `emulate_params_NAME()`.
#define EXPORT_LAUNCH(NAME, TEAM)                                                       \
    extern "C" void emulate_##NAME(const unsigned int* grid, const unsigned int* block, \
                                   void** params) {                                     \
        emulate_launch<TEAM>(NAME, grid, block, params);                                \
    }                                                                                   \
    extern "C" const char* emulate_params_##NAME() { return param_kinds(NAME); }
