// A fake NCCL (libnccl.so.2) for the fake GPU (fake_cuda.cpp), for communicators of one rank,
// the only kind one GPU allows: the sum and the broadcast of one rank copy the send buffer
// into the receive buffer (nothing when they are the same), queued on the given stream. A
// communicator of more ranks waits in ncclCommInitRank for peers that never come, as NCCL
// does when a rank is missing, until the process ends.
//
// For tests only, a unique id starting with MIRRORED_ID makes a *mirrored* communicator of
// any size at once: its other ranks are taken to hold the same values as this one, so a sum
// of float32, float64 or int64 values is the value times the number of ranks (exact for two;
// int64 wraps as NCCL's does), a maximum (of any type) is the value itself, and a broadcast
// copies. A real NCCL would wait for those ranks.

#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>

#include "fake_gpu.h"

typedef int ncclResult_t;

enum { ncclSuccess = 0, ncclInvalidArgument = 4 };

enum { ncclSum = 0, ncclMax = 2 };

struct UniqueId {
    char internal[128];
};

namespace {

struct Comm {
    int ranks;
    bool mirrored;
};

const char MIRRORED_ID[] = "tandem-fake-nccl-mirrored";

size_t type_size(int type) {
    switch (type) {
        case 0: case 1: return 1;           // int8, uint8
        case 2: case 3: return 4;           // int32, uint32
        case 4: case 5: return 8;           // int64, uint64
        case 6: case 9: return 2;           // float16, bfloat16
        case 7: return 4;                   // float32
        case 8: return 8;                   // float64
        default: return 0;
    }
}

ncclResult_t copy(const void* send, void* receive, size_t count, int type, void* stream) {
    size_t size = type_size(type);
    if (size == 0) return ncclInvalidArgument;
    if (send != receive) {
        fake_enqueue(stream, [=] { std::memmove(receive, send, count * size); });
    }
    return ncclSuccess;
}

}  // namespace

extern "C" {

ncclResult_t ncclGetVersion(int* version) {
    *version = 23000;
    return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(UniqueId* id) {
    for (int i = 0; i < 128; i++) id->internal[i] = (char)(i * 7 + 1);
    return ncclSuccess;
}

ncclResult_t ncclCommInitRank(void** comm, int ranks, UniqueId id, int rank) {
    if (ranks < 1 || rank < 0 || rank >= ranks) return ncclInvalidArgument;
    bool mirrored = std::memcmp(id.internal, MIRRORED_ID, sizeof MIRRORED_ID - 1) == 0;
    while (ranks > 1 && !mirrored) std::this_thread::sleep_for(std::chrono::seconds(1));
    *comm = new Comm{ranks, mirrored};
    return ncclSuccess;
}

ncclResult_t ncclCommAbort(void* comm) {
    delete static_cast<Comm*>(comm);
    return ncclSuccess;
}

ncclResult_t ncclCommDestroy(void* comm) { return ncclCommAbort(comm); }

ncclResult_t ncclCommGetAsyncError(void*, ncclResult_t* status) {
    *status = ncclSuccess;
    return ncclSuccess;
}

ncclResult_t ncclGroupStart() { return ncclSuccess; }
ncclResult_t ncclGroupEnd() { return ncclSuccess; }

ncclResult_t ncclAllReduce(const void* send, void* receive, size_t count, int type, int op,
                           void* comm, void* stream) {
    if (op != ncclSum && op != ncclMax) return ncclInvalidArgument;
    ncclResult_t copied = copy(send, receive, count, type, stream);
    const Comm* c = static_cast<const Comm*>(comm);
    if (copied != ncclSuccess || c->ranks == 1 || op == ncclMax) return copied;
    int ranks = c->ranks;
    switch (type) {
        case 4:
            fake_enqueue(stream, [=] {
                uint64_t* values = static_cast<uint64_t*>(receive);
                for (size_t i = 0; i < count; i++) values[i] *= (uint64_t)ranks;
            });
            return ncclSuccess;
        case 7:
            fake_enqueue(stream, [=] {
                float* values = static_cast<float*>(receive);
                for (size_t i = 0; i < count; i++) values[i] *= (float)ranks;
            });
            return ncclSuccess;
        case 8:
            fake_enqueue(stream, [=] {
                double* values = static_cast<double*>(receive);
                for (size_t i = 0; i < count; i++) values[i] *= (double)ranks;
            });
            return ncclSuccess;
        default:
            return ncclInvalidArgument;
    }
}

ncclResult_t ncclBroadcast(const void* send, void* receive, size_t count, int type, int root,
                           void*, void* stream) {
    if (root != 0) return ncclInvalidArgument;
    return copy(send, receive, count, type, stream);
}

}  // extern "C"
