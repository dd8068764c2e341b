// A fake CUDA driver (libcuda.so.1) for tests on machines without a GPU: one "GPU" whose
// memory is host memory and whose kernels are our kernel files compiled for the CPU with
// tests/common/cuda_on_cpu.h (one library per file in $TANDEM_FAKE_GPU_KERNELS, exporting
// emulate_NAME and emulate_params_NAME). With the fake cuDNN and cuBLAS beside it, the GPU
// executor runs unchanged through cudarc, so its host logic (buffers, offsets, launch
// arguments, the order of work, graph capture and replay) is tested against the CPU engine.
//
// Work runs when it is queued, in the order queued, so every stream is always idle and every
// event complete. While a stream is being captured, its work is recorded instead (kernel
// arguments copied at the launch, as CUDA does) and runs at each launch of the graph. As in
// CUDA, another stream that waits on an event recorded inside the capture joins it (its work
// is recorded into the same graph, in the order queued), and must be joined back (the
// capturing stream waiting on an event recorded after its last work) before the capture
// ends, else the capture fails with CUDA_ERROR_STREAM_CAPTURE_UNJOINED. The capture's
// isolation is CUDA's too: a capturing stream may not wait on an event recorded outside its
// capture (CUDA_ERROR_STREAM_CAPTURE_ISOLATION) or in another one (..._MERGE), and an event
// last recorded inside a capture may not be queried, synchronized or waited on outside it
// (CUDA_ERROR_CAPTURED_EVENT). Inside a capture, a copy to or from pageable host memory and
// a stream-ordered allocation or free on a capturing stream fail, and while a capture begun in
// global or thread-local mode is open, its thread's synchronous copies, memsets, allocations,
// frees and context synchronization fail (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED): CUDA
// refuses the first and the last, and records an allocation as a graph memory node that a
// second launch refuses while unfreed; none belongs in a captured step.
// Copies to or from page-locked host memory (cuMemHostAlloc) are asynchronous, as on a GPU:
// such a copy is held back until its stream is synchronized (or queried, or an event
// synchronized or waited on, or the context synchronized), or until more work is queued on
// its stream; until then the host sees the old values of a copy's target and may still
// change its source. So a host read that misses its synchronize reads stale values, and a
// host write to a copy's source before the copy is done reaches the device.
// Only what cudarc and the executor call is here; any other entry point is missing, and
// cudarc's panic names it.

#include <algorithm>
#include <dirent.h>
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "fake_gpu.h"

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_ILLEGAL_STATE = 401,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901,
    CUDA_ERROR_STREAM_CAPTURE_MERGE = 902,
    CUDA_ERROR_STREAM_CAPTURE_UNJOINED = 904,
    CUDA_ERROR_STREAM_CAPTURE_ISOLATION = 905,
    CUDA_ERROR_CAPTURED_EVENT = 907,
    CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD = 908,
};

// CUstreamCaptureMode's relaxed mode (global is 0, thread-local 1).
const int CU_STREAM_CAPTURE_MODE_RELAXED = 2;

namespace {

// 80 GiB, or TANDEM_FAKE_GPU_MEMORY_MB (for tests of what does not fit).
unsigned long long total_memory() {
    static const unsigned long long total = [] {
        const char* megabytes = std::getenv("TANDEM_FAKE_GPU_MEMORY_MB");
        return megabytes ? std::strtoull(megabytes, nullptr, 10) << 20 : 80ull << 30;
    }();
    return total;
}

struct Context {
    int device = 0;
};
Context the_context;

struct Stream {
    // The capture recording this stream's work: its own while it is capturing, that of the
    // capturing stream it joined through an event, or none.
    Stream* capture = nullptr;
    // The capturing stream's: the recorded work and the streams that joined.
    std::vector<std::function<void()>> captured;
    std::vector<Stream*> joined;
    // A joined stream's: its joins and works so far, and that count when the capturing
    // stream last waited on an event recorded on it.
    size_t recorded = 0;
    size_t rejoined = 0;
    // Copies between the device and page-locked host memory, not done yet (in queue order).
    std::vector<std::function<void()>> held_back;
    // The capturing stream's: whether its capture began in a mode other than relaxed, and
    // whether a refused call invalidated it.
    bool strict = false;
    bool invalidated = false;
};

struct Graph {
    std::vector<std::function<void()>> work;
};

struct Event {
    bool ever_recorded = false;
    // Where, in which capture and when it was last recorded, when that was inside a capture.
    Stream* stream = nullptr;
    Stream* capture = nullptr;
    size_t recorded = 0;
};

typedef void (*EmulatedLaunch)(const unsigned int*, const unsigned int*, void**);
typedef const char* (*EmulatedParams)();

struct Function {
    EmulatedLaunch launch;
    std::string kinds;
    std::string name;
};

struct Module {
    int unused = 0;
};

std::mutex state_mutex;
// Captures begun on this thread in a mode other than relaxed (CUDA's global and thread-local
// modes): while one is open, this thread's "potentially unsafe" calls (synchronous copies,
// memsets, allocations and frees, context synchronization) fail as CUDA's do.
thread_local int strict_captures_here = 0;
// Those captures' streams.
thread_local std::vector<Stream*> strict_streams_here;
std::map<CUdeviceptr, size_t> allocations;
size_t allocated_bytes = 0;
// The page-locked host allocations (start, bytes) and the streams that exist.
std::map<uintptr_t, size_t> pinned_allocations;
std::vector<Stream*> live_streams;
thread_local void* current_context = nullptr;

// The kernel libraries, opened once.
std::vector<void*>& kernel_libraries() {
    static std::vector<void*>* libraries = [] {
        auto* opened = new std::vector<void*>();
        const char* folder = std::getenv("TANDEM_FAKE_GPU_KERNELS");
        if (folder == nullptr) {
            std::fprintf(stderr, "fake libcuda: TANDEM_FAKE_GPU_KERNELS is not set\n");
            return opened;
        }
        DIR* dir = opendir(folder);
        if (dir == nullptr) {
            std::fprintf(stderr, "fake libcuda: cannot open %s\n", folder);
            return opened;
        }
        while (dirent* entry = readdir(dir)) {
            std::string name = entry->d_name;
            if (name.size() < 4 || name.compare(name.size() - 3, 3, ".so") != 0) continue;
            std::string path = std::string(folder) + "/" + name;
            void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
            if (handle == nullptr) {
                std::fprintf(stderr, "fake libcuda: %s\n", dlerror());
                continue;
            }
            opened->push_back(handle);
        }
        closedir(dir);
        return opened;
    }();
    return *libraries;
}

size_t param_size(char kind) { return kind == 'i' || kind == 'f' ? 4 : 8; }

// Whether [pointer, pointer + bytes) lies in one page-locked host allocation.
bool is_pinned(const void* pointer, size_t bytes) {
    std::lock_guard<std::mutex> lock(state_mutex);
    auto start = (uintptr_t)pointer;
    auto found = pinned_allocations.upper_bound(start);
    if (found == pinned_allocations.begin()) return false;
    --found;
    return start + bytes <= found->first + found->second;
}

// Does the copies held back on `stream`.
void finish_held_back(Stream* stream) {
    std::vector<std::function<void()>> copies;
    copies.swap(stream->held_back);
    for (auto& copy : copies) copy();
}

// Does the copies held back on every stream (a context-wide synchronization).
void finish_all_held_back() {
    for (Stream* stream : live_streams) finish_held_back(stream);
}

void run_or_record(void* stream, std::function<void()> work) {
    auto* target = static_cast<Stream*>(stream);
    if (target != nullptr && target->capture != nullptr) {
        target->capture->captured.push_back(std::move(work));
        target->recorded++;
    } else {
        // The legacy default stream orders itself after every other stream.
        if (target == nullptr) {
            finish_all_held_back();
        } else {
            finish_held_back(target);
        }
        work();
    }
}

// Queues a copy to or from page-locked memory: recorded in a capture, else held back.
void hold_back_or_record(void* stream, std::function<void()> copy) {
    auto* target = static_cast<Stream*>(stream);
    if (target == nullptr || target->capture != nullptr) {
        run_or_record(stream, std::move(copy));
    } else {
        target->held_back.push_back(std::move(copy));
    }
}

}  // namespace

void fake_enqueue(void* stream, std::function<void()> work) {
    run_or_record(stream, std::move(work));
}

bool fake_library_allocation_refused() {
    if (!std::getenv("TANDEM_FAKE_GPU_LIBRARIES_ALLOCATE_IN_CAPTURE") || strict_captures_here == 0)
        return false;
    for (Stream* stream : strict_streams_here) stream->invalidated = true;
    return true;
}

extern "C" {

// ----- Initialization, versions, devices, contexts -----

CUresult cuInit(unsigned int) { return CUDA_SUCCESS; }

// The driver's private tables, which NVRTC asks for when a libcuda is loaded: none here.
CUresult cuGetExportTable(const void** table, const void*) {
    *table = nullptr;
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult cuDriverGetVersion(int* version) {
    *version = 13000;
    return CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult error, const char** name) {
    static thread_local std::string text;
    text = "CUDA_ERROR_" + std::to_string(error) + " (fake libcuda)";
    *name = text.c_str();
    return CUDA_SUCCESS;
}

CUresult cuGetErrorString(CUresult error, const char** name) { return cuGetErrorName(error, name); }

// The number of fake GPUs: TANDEM_FAKE_GPU_COUNT (1 to 8), else 1. They are all the same
// host memory; a process uses one (a job of several processes under the fake NCCL, each on
// its own GPU).
static int device_count() {
    const char* count = std::getenv("TANDEM_FAKE_GPU_COUNT");
    int value = count != nullptr ? std::atoi(count) : 1;
    return value >= 1 && value <= 8 ? value : 1;
}

CUresult cuDeviceGetCount(int* count) {
    *count = device_count();
    return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice* device, int ordinal) {
    if (ordinal < 0 || ordinal >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetName(char* name, int length, CUdevice) {
    std::snprintf(name, (size_t)length, "Tandem fake GPU (the CPU)");
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetUuid(unsigned char* uuid, CUdevice device) {
    for (int i = 0; i < 16; i++) uuid[i] = (unsigned char)(0xf0 + i);
    uuid[15] = (unsigned char)(uuid[15] + device);
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetUuid_v2(unsigned char* uuid, CUdevice device) {
    return cuDeviceGetUuid(uuid, device);
}

CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice) {
    *bytes = total_memory();
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetAttribute(int* value, int attribute, CUdevice) {
    switch (attribute) {
        case 1: *value = 1024; break;   // max threads per block
        case 16: *value = 132; break;   // multiprocessors
        case 75: *value = 9; break;     // compute capability major
        case 76: *value = 0; break;     // minor
        case 115: *value = 0; break;    // memory pools supported: no, plain allocations
        default: *value = 0; break;
    }
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(void** context, CUdevice) {
    *context = &the_context;
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice) { return CUDA_SUCCESS; }

CUresult cuCtxSetCurrent(void* context) {
    current_context = context;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(void** context) {
    *context = current_context;
    return CUDA_SUCCESS;
}

CUresult cuCtxSynchronize() {
    if (strict_captures_here > 0) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    finish_all_held_back();
    return CUDA_SUCCESS;
}

CUresult cuCtxSetFlags(unsigned int) { return CUDA_SUCCESS; }

CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total_bytes) {
    std::lock_guard<std::mutex> lock(state_mutex);
    *total_bytes = total_memory();
    *free_bytes = allocated_bytes < *total_bytes ? *total_bytes - allocated_bytes : 0;
    return CUDA_SUCCESS;
}

// ----- Streams, events, graphs -----

CUresult cuStreamCreate(void** stream, unsigned int) {
    auto* created = new Stream();
    live_streams.push_back(created);
    *stream = created;
    return CUDA_SUCCESS;
}

CUresult cuStreamCreateWithPriority(void** stream, unsigned int flags, int) {
    return cuStreamCreate(stream, flags);
}

CUresult cuStreamDestroy_v2(void* stream) {
    auto* destroyed = static_cast<Stream*>(stream);
    // As CUDA, a destroyed stream's queued work still completes.
    finish_held_back(destroyed);
    for (size_t i = 0; i < live_streams.size(); i++) {
        if (live_streams[i] == destroyed) {
            live_streams.erase(live_streams.begin() + (long)i);
            break;
        }
    }
    delete destroyed;
    return CUDA_SUCCESS;
}

CUresult cuStreamSynchronize(void* stream) {
    auto* target = static_cast<Stream*>(stream);
    // Synchronizing a capturing stream is illegal in CUDA, and invalidates the capture.
    if (target != nullptr && target->capture != nullptr) {
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    }
    if (target == nullptr) {
        finish_all_held_back();
    } else {
        finish_held_back(target);
    }
    return CUDA_SUCCESS;
}

// A stream reports idle only once its work is done, so a query completes the held-back copies.
CUresult cuStreamQuery(void* stream) {
    auto* target = static_cast<Stream*>(stream);
    if (target == nullptr) {
        finish_all_held_back();
    } else {
        finish_held_back(target);
    }
    return CUDA_SUCCESS;
}

CUresult cuStreamWaitEvent(void* stream, void* event, unsigned int) {
    auto* waiter = static_cast<Stream*>(stream);
    auto* recorded = static_cast<Event*>(event);
    if (recorded == nullptr || !recorded->ever_recorded) return CUDA_SUCCESS;  // no work
    // The waiter's later work sees everything before the event (here: all work so far).
    finish_all_held_back();
    Stream* capture = recorded->capture;
    // Whether the capture it was recorded in is still going.
    bool live = capture != nullptr && recorded->stream->capture == capture;
    if (capture != nullptr && !live) return CUDA_ERROR_CAPTURED_EVENT;
    if (waiter == nullptr || waiter->capture == nullptr) {
        if (capture == nullptr) return CUDA_SUCCESS;
        if (waiter == nullptr) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
        // A fork: the waiter joins the capture, and must be joined back before it ends.
        waiter->capture = capture;
        capture->joined.push_back(waiter);
        waiter->recorded = 1;
        waiter->rejoined = 0;
        return CUDA_SUCCESS;
    }
    if (capture == nullptr) return CUDA_ERROR_STREAM_CAPTURE_ISOLATION;
    if (waiter->capture != capture) return CUDA_ERROR_STREAM_CAPTURE_MERGE;
    if (waiter == capture && recorded->stream != waiter) {
        Stream* forked = recorded->stream;
        if (recorded->recorded > forked->rejoined) forked->rejoined = recorded->recorded;
    }
    return CUDA_SUCCESS;
}

CUresult cuStreamBeginCapture_v2(void* stream, int mode) {
    auto* target = static_cast<Stream*>(stream);
    if (target == nullptr) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    if (target->capture != nullptr) return CUDA_ERROR_ILLEGAL_STATE;
    // Work queued before the capture is not part of it.
    finish_held_back(target);
    target->capture = target;
    target->strict = mode != CU_STREAM_CAPTURE_MODE_RELAXED;
    target->invalidated = false;
    if (target->strict) {
        strict_captures_here++;
        strict_streams_here.push_back(target);
    }
    target->captured.clear();
    target->joined.clear();
    return CUDA_SUCCESS;
}

CUresult cuStreamEndCapture(void* stream, void** graph) {
    auto* target = static_cast<Stream*>(stream);
    if (target == nullptr || target->capture != target) return CUDA_ERROR_ILLEGAL_STATE;
    bool unjoined = false;
    for (Stream* forked : target->joined) {
        unjoined = unjoined || forked->recorded != forked->rejoined;
        forked->capture = nullptr;
    }
    target->joined.clear();
    target->capture = nullptr;
    if (target->strict) {
        strict_captures_here--;
        strict_streams_here.erase(
            std::remove(strict_streams_here.begin(), strict_streams_here.end(), target),
            strict_streams_here.end());
    }
    target->strict = false;
    if (unjoined || target->invalidated) {
        target->captured.clear();
        *graph = nullptr;
        return target->invalidated ? CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
                                   : CUDA_ERROR_STREAM_CAPTURE_UNJOINED;
    }
    auto* captured = new Graph();
    captured->work.swap(target->captured);
    *graph = captured;
    return CUDA_SUCCESS;
}

CUresult cuStreamIsCapturing(void* stream, int* status) {
    auto* target = static_cast<Stream*>(stream);
    *status = target != nullptr && target->capture != nullptr ? 1 : 0;
    return CUDA_SUCCESS;
}

CUresult cuGraphInstantiateWithFlags(void** exec, void* graph, unsigned long long) {
    *exec = new Graph(*static_cast<Graph*>(graph));
    return CUDA_SUCCESS;
}

CUresult cuGraphLaunch(void* exec, void* stream) {
    auto* graph = static_cast<Graph*>(exec);
    for (auto& work : graph->work) run_or_record(stream, work);
    return CUDA_SUCCESS;
}

CUresult cuGraphUpload(void*, void*) { return CUDA_SUCCESS; }

CUresult cuGraphExecDestroy(void* exec) {
    delete static_cast<Graph*>(exec);
    return CUDA_SUCCESS;
}

CUresult cuGraphDestroy(void* graph) {
    delete static_cast<Graph*>(graph);
    return CUDA_SUCCESS;
}

CUresult cuEventCreate(void** event, unsigned int) {
    *event = new Event();
    return CUDA_SUCCESS;
}

CUresult cuEventDestroy_v2(void* event) {
    delete static_cast<Event*>(event);
    return CUDA_SUCCESS;
}

CUresult cuEventRecord(void* event, void* stream) {
    auto* target = static_cast<Event*>(event);
    auto* on = static_cast<Stream*>(stream);
    bool captured = on != nullptr && on->capture != nullptr;
    target->ever_recorded = true;
    target->stream = captured ? on : nullptr;
    target->capture = captured ? on->capture : nullptr;
    target->recorded = captured ? on->recorded : 0;
    return CUDA_SUCCESS;
}

// An event reports complete once the work before it is done (here: all work so far); one
// never recorded is complete at once, and waits for nothing.
CUresult cuEventQuery(void* event) {
    auto* target = static_cast<Event*>(event);
    if (target->capture != nullptr) return CUDA_ERROR_CAPTURED_EVENT;
    if (target->ever_recorded) finish_all_held_back();
    return CUDA_SUCCESS;
}

CUresult cuEventSynchronize(void* event) { return cuEventQuery(event); }

CUresult cuEventElapsedTime(float* milliseconds, void*, void*) {
    *milliseconds = 0.0f;
    return CUDA_SUCCESS;
}

// ----- Memory -----

// Device memory of `bytes` (rounded up to 256), filled with garbage.
CUresult allocate(CUdeviceptr* pointer, size_t bytes) {
    size_t rounded = (bytes + 255) / 256 * 256;
    if (rounded == 0) rounded = 256;
    void* memory = std::aligned_alloc(256, rounded);
    if (memory == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
    // Fresh device memory holds garbage: a kernel that reads memory nobody wrote shows.
    std::memset(memory, 0xA5, rounded);
    std::lock_guard<std::mutex> lock(state_mutex);
    *pointer = (CUdeviceptr)memory;
    allocations[*pointer] = rounded;
    allocated_bytes += rounded;
    return CUDA_SUCCESS;
}

CUresult cuMemAlloc_v2(CUdeviceptr* pointer, size_t bytes) {
    if (strict_captures_here > 0) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    return allocate(pointer, bytes);
}

// Frees an allocation of `allocate`.
CUresult release(CUdeviceptr pointer) {
    std::lock_guard<std::mutex> lock(state_mutex);
    auto found = allocations.find(pointer);
    if (found == allocations.end()) return CUDA_ERROR_INVALID_VALUE;
    allocated_bytes -= found->second;
    allocations.erase(found);
    std::free((void*)pointer);
    return CUDA_SUCCESS;
}

CUresult cuMemFree_v2(CUdeviceptr pointer) {
    if (strict_captures_here > 0) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    return release(pointer);
}

CUresult cuMemHostAlloc(void** pointer, size_t bytes, unsigned int) {
    if (strict_captures_here > 0) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    size_t rounded = (bytes + 63) / 64 * 64;
    if (rounded == 0) rounded = 64;
    void* memory = std::aligned_alloc(64, rounded);
    if (memory == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
    std::memset(memory, 0x5A, rounded);
    std::lock_guard<std::mutex> lock(state_mutex);
    pinned_allocations[(uintptr_t)memory] = rounded;
    *pointer = memory;
    return CUDA_SUCCESS;
}

CUresult cuMemFreeHost(void* pointer) {
    if (strict_captures_here > 0) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    finish_all_held_back();
    std::lock_guard<std::mutex> lock(state_mutex);
    auto found = pinned_allocations.find((uintptr_t)pointer);
    if (found == pinned_allocations.end()) return CUDA_ERROR_INVALID_VALUE;
    pinned_allocations.erase(found);
    std::free(pointer);
    return CUDA_SUCCESS;
}

// Whether work queued on `stream` now would be recorded into a capture.
bool in_capture(void* stream) {
    return stream != nullptr && static_cast<Stream*>(stream)->capture != nullptr;
}

// Inside a capture CUDA records a stream-ordered allocation as a graph memory node, which a
// second launch refuses while the first's allocation is unfreed; the executor must allocate
// nothing inside a captured step, so the fake refuses it outright.
CUresult cuMemAllocAsync(CUdeviceptr* pointer, size_t bytes, void* stream) {
    if (in_capture(stream)) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    return allocate(pointer, bytes);
}

CUresult cuMemFreeAsync(CUdeviceptr pointer, void* stream) {
    if (in_capture(stream)) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    return release(pointer);
}

CUresult cuMemsetD8Async(CUdeviceptr pointer, unsigned char value, size_t count, void* stream) {
    fake_enqueue(stream, [=] { std::memset((void*)pointer, value, count); });
    return CUDA_SUCCESS;
}

CUresult cuMemsetD8_v2(CUdeviceptr pointer, unsigned char value, size_t count) {
    if (strict_captures_here > 0) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    finish_all_held_back();
    std::memset((void*)pointer, value, count);
    return CUDA_SUCCESS;
}

CUresult cuMemsetD32Async(CUdeviceptr pointer, unsigned int value, size_t count, void* stream) {
    fake_enqueue(stream, [=] {
        auto* words = (unsigned int*)pointer;
        for (size_t i = 0; i < count; i++) words[i] = value;
    });
    return CUDA_SUCCESS;
}

// Queues `copy` between the device and `bytes` of host memory at `host` on `stream`: with
// page-locked memory held back until the stream is synchronized (or recorded by a capture);
// with pageable memory in order, and refused by a capture.
static CUresult copy_with_host(const void* host, size_t bytes, void* stream,
                               std::function<void()> copy) {
    if (is_pinned(host, bytes)) {
        hold_back_or_record(stream, copy);
    } else if (in_capture(stream)) {
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    } else {
        fake_enqueue(stream, copy);
    }
    return CUDA_SUCCESS;
}

// From pageable memory the source is read before the call returns (the driver stages it);
// from page-locked memory, when the copy is done. A capture may record copies from
// page-locked memory only ("operation not permitted when stream is capturing" otherwise).
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr target, const void* source, size_t bytes, void* stream) {
    return copy_with_host(source, bytes, stream,
                          [=] { std::memcpy((void*)target, source, bytes); });
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr target, const void* source, size_t bytes) {
    if (strict_captures_here > 0) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    finish_all_held_back();
    std::memcpy((void*)target, source, bytes);
    return CUDA_SUCCESS;
}

// Into pageable memory the copy is done when the call returns; into page-locked memory, only
// once the stream is synchronized. A capture may record copies to page-locked memory only.
CUresult cuMemcpyDtoHAsync_v2(void* target, CUdeviceptr source, size_t bytes, void* stream) {
    return copy_with_host(target, bytes, stream,
                          [=] { std::memcpy(target, (const void*)source, bytes); });
}

CUresult cuMemcpyDtoH_v2(void* target, CUdeviceptr source, size_t bytes) {
    if (strict_captures_here > 0) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    finish_all_held_back();
    std::memcpy(target, (const void*)source, bytes);
    return CUDA_SUCCESS;
}

CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr target, CUdeviceptr source, size_t bytes, void* stream) {
    fake_enqueue(stream, [=] { std::memmove((void*)target, (const void*)source, bytes); });
    return CUDA_SUCCESS;
}

CUresult cuMemcpyDtoD_v2(CUdeviceptr target, CUdeviceptr source, size_t bytes) {
    if (strict_captures_here > 0) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    finish_all_held_back();
    std::memmove((void*)target, (const void*)source, bytes);
    return CUDA_SUCCESS;
}

// ----- Modules and kernels -----

CUresult cuModuleLoadData(void** module, const void*) {
    *module = new Module();
    return CUDA_SUCCESS;
}

CUresult cuModuleUnload(void* module) {
    delete static_cast<Module*>(module);
    return CUDA_SUCCESS;
}

CUresult cuModuleGetFunction(void** function, void*, const char* name) {
    std::string launch_name = std::string("emulate_") + name;
    std::string params_name = std::string("emulate_params_") + name;
    for (void* library : kernel_libraries()) {
        auto launch = (EmulatedLaunch)dlsym(library, launch_name.c_str());
        auto params = (EmulatedParams)dlsym(library, params_name.c_str());
        if (launch != nullptr && params != nullptr) {
            *function = new Function{launch, params(), name};
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_NOT_FOUND;
}

CUresult cuFuncGetAttribute(int* value, int, void*) {
    *value = 0;
    return CUDA_SUCCESS;
}

CUresult cuLaunchKernel(void* function, unsigned int grid_x, unsigned int grid_y,
                        unsigned int grid_z, unsigned int block_x, unsigned int block_y,
                        unsigned int block_z, unsigned int, void* stream, void** params,
                        void** extra) {
    auto* kernel = static_cast<Function*>(function);
    if (kernel == nullptr || extra != nullptr) return CUDA_ERROR_INVALID_VALUE;
    if ((unsigned long long)block_x * block_y * block_z > 1024) return CUDA_ERROR_INVALID_VALUE;
    // The argument values, copied now (a captured launch replays with these values).
    std::vector<uint64_t> values(kernel->kinds.size(), 0);
    for (size_t i = 0; i < kernel->kinds.size(); i++) {
        std::memcpy(&values[i], params[i], param_size(kernel->kinds[i]));
    }
    unsigned int grid[3] = {grid_x, grid_y, grid_z};
    unsigned int block[3] = {block_x, block_y, block_z};
    EmulatedLaunch launch = kernel->launch;
    fake_enqueue(stream, [=]() mutable {
        std::vector<void*> pointers(values.size());
        for (size_t i = 0; i < values.size(); i++) pointers[i] = &values[i];
        // One launch at a time: a block's __shared__ arrays are statics of its library.
        static std::mutex one_launch_at_a_time;
        std::lock_guard<std::mutex> turn(one_launch_at_a_time);
        launch(grid, block, pointers.data());
    });
    return CUDA_SUCCESS;
}

}  // extern "C"
