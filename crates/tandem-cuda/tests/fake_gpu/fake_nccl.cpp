// A fake NCCL (libnccl.so.2) for the fake GPU (fake_cuda.cpp). A communicator of one rank
// copies the send buffer into the receive buffer (nothing when they are the same), queued on
// the given stream.
//
// A communicator of several ranks, each a process on its own fake GPU (fake_cuda.cpp's
// TANDEM_FAKE_GPU_COUNT), meets through files in a folder named after the unique id (under
// $TMPDIR, else /tmp): at ncclCommInitRank each rank writes a file and waits, as NCCL does,
// for every other rank's, forever if one never comes. Each collective, when its stream runs
// it (at each replay of a captured graph too), writes the rank's values to a file, waits for
// every rank's, and reduces them in rank order: sums of float32, float64 and int64 (wrapping),
// maxima of int32, float32 and float64, and rank 0's values for a broadcast. Every unique id
// that ncclGetUniqueId makes is new.
//
// For tests only, a unique id starting with MIRRORED_ID makes a *mirrored* communicator of
// any size at once: its other ranks are taken to hold the same values as this one, so a sum
// of float32, float64 or int64 values is the value times the number of ranks (exact for two;
// int64 wraps as NCCL's does), a maximum is the value itself, and a broadcast copies. A real
// NCCL would wait for those ranks.

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "fake_gpu.h"

typedef int ncclResult_t;

enum { ncclSuccess = 0, ncclSystemError = 2, ncclInvalidArgument = 4 };

enum { ncclSum = 0, ncclMax = 2 };

struct UniqueId {
    char internal[128];
};

namespace {

struct Comm {
    int ranks;
    int rank;
    bool mirrored;
    // The meeting folder of a communicator of several processes; empty otherwise.
    std::string folder;
    // Collectives run so far (the next one's number).
    long long done;
    std::atomic<bool> aborted;
};

const char MIRRORED_ID[] = "tandem-fake-nccl-mirrored";
const char FILES_ID[] = "tandem-fake-nccl-files";

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

std::string file_of(const Comm* comm, const std::string& what, int rank) {
    return comm->folder + "/" + what + "-" + std::to_string(rank);
}

// Writes `bytes` to `path` whole: into a temporary file, then renamed.
void write_file(const std::string& path, const void* bytes, size_t size) {
    std::string partial = path + ".partial";
    FILE* file = std::fopen(partial.c_str(), "wb");
    if (file == nullptr) std::abort();
    if (size > 0 && std::fwrite(bytes, 1, size, file) != size) std::abort();
    std::fclose(file);
    if (std::rename(partial.c_str(), path.c_str()) != 0) std::abort();
}

// Waits until `path` exists (or the communicator is aborted: false).
bool wait_for(const Comm* comm, const std::string& path) {
    while (access(path.c_str(), F_OK) != 0) {
        if (comm->aborted.load()) return false;
        std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    return true;
}

std::vector<unsigned char> read_file(const std::string& path, size_t size) {
    std::vector<unsigned char> bytes(size);
    FILE* file = std::fopen(path.c_str(), "rb");
    if (file == nullptr) std::abort();
    if (size > 0 && std::fread(bytes.data(), 1, size, file) != size) std::abort();
    std::fclose(file);
    return bytes;
}

// Adds (or takes the larger of) `count` values of `type` from `from` into `into`.
template <typename T>
void reduce_as(void* into, const void* from, size_t count, int op) {
    T* a = static_cast<T*>(into);
    const T* b = static_cast<const T*>(from);
    for (size_t i = 0; i < count; i++) {
        if (op == ncclMax) {
            a[i] = b[i] > a[i] ? b[i] : a[i];
        } else {
            a[i] = a[i] + b[i];
        }
    }
}

void reduce(void* into, const void* from, size_t count, int type, int op) {
    switch (type) {
        case 2: reduce_as<int32_t>(into, from, count, op); break;
        case 4:
            if (op == ncclMax) {
                reduce_as<int64_t>(into, from, count, op);
            } else {
                reduce_as<uint64_t>(into, from, count, op);
            }
            break;
        case 7: reduce_as<float>(into, from, count, op); break;
        case 8: reduce_as<double>(into, from, count, op); break;
        default: std::abort();
    }
}

// One collective among the processes of `comm`: every rank's `count` values of `type` at
// `send`, reduced by `op` in rank order into `receive` (root < 0), or root's copied there.
void exchange(Comm* comm, const void* send, void* receive, size_t count, int type, int op,
              int root) {
    size_t bytes = count * type_size(type);
    long long number = comm->done++;
    std::string name = "c" + std::to_string(number);
    write_file(file_of(comm, name, comm->rank), send, bytes);
    std::vector<std::vector<unsigned char>> values;
    for (int rank = 0; rank < comm->ranks; rank++) {
        if (!wait_for(comm, file_of(comm, name, rank))) return;
        values.push_back(read_file(file_of(comm, name, rank), bytes));
    }
    if (root >= 0) {
        std::memcpy(receive, values[root].data(), bytes);
    } else {
        std::vector<unsigned char> result = values[0];
        for (int rank = 1; rank < comm->ranks; rank++) {
            reduce(result.data(), values[rank].data(), count, type, op);
        }
        std::memcpy(receive, result.data(), bytes);
    }
    // Every rank has read the previous collective's files: it wrote this one's after.
    if (number > 0) {
        std::remove(file_of(comm, "c" + std::to_string(number - 1), comm->rank).c_str());
    }
}

bool supported(int type, int op) {
    if (op == ncclMax) return type == 2 || type == 4 || type == 7 || type == 8;
    return op == ncclSum && (type == 4 || type == 7 || type == 8);
}

// The meeting folder of unique id `id`.
std::string folder_of(const UniqueId& id) {
    const char* tmp = std::getenv("TMPDIR");
    std::string name(id.internal, strnlen(id.internal, sizeof id.internal));
    return std::string(tmp != nullptr && tmp[0] != '\0' ? tmp : "/tmp") + "/" + name;
}

}  // namespace

extern "C" {

ncclResult_t ncclGetVersion(int* version) {
    *version = 23000;
    return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(UniqueId* id) {
    static std::atomic<int> made{0};
    std::memset(id->internal, 0, sizeof id->internal);
    long long now = std::chrono::steady_clock::now().time_since_epoch().count();
    std::snprintf(id->internal, sizeof id->internal, "%s-%d-%lld-%d", FILES_ID, (int)getpid(),
                  now, made++);
    return ncclSuccess;
}

ncclResult_t ncclCommInitRank(void** comm, int ranks, UniqueId id, int rank) {
    if (ranks < 1 || rank < 0 || rank >= ranks) return ncclInvalidArgument;
    bool mirrored = std::memcmp(id.internal, MIRRORED_ID, sizeof MIRRORED_ID - 1) == 0;
    bool files = std::memcmp(id.internal, FILES_ID, sizeof FILES_ID - 1) == 0;
    Comm* made = new Comm{ranks, rank, mirrored, "", 0, {false}};
    if (ranks > 1 && !mirrored) {
        // Any other id is not ours to meet on: wait for peers that never come.
        while (!files) std::this_thread::sleep_for(std::chrono::seconds(1));
        made->folder = folder_of(id);
        mkdir(made->folder.c_str(), 0700);
        write_file(file_of(made, "joined", rank), "", 0);
        for (int other = 0; other < ranks; other++) wait_for(made, file_of(made, "joined", other));
    }
    *comm = made;
    return ncclSuccess;
}

// The communicator is left allocated: a collective blocked on it sees the abort and returns.
ncclResult_t ncclCommAbort(void* comm) {
    static_cast<Comm*>(comm)->aborted.store(true);
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
    if (!supported(type, op)) return ncclInvalidArgument;
    Comm* c = static_cast<Comm*>(comm);
    if (!c->folder.empty()) {
        fake_enqueue(stream, [=] { exchange(c, send, receive, count, type, op, -1); });
        return ncclSuccess;
    }
    ncclResult_t copied = copy(send, receive, count, type, stream);
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
        default:
            fake_enqueue(stream, [=] {
                double* values = static_cast<double*>(receive);
                for (size_t i = 0; i < count; i++) values[i] *= (double)ranks;
            });
            return ncclSuccess;
    }
}

ncclResult_t ncclBroadcast(const void* send, void* receive, size_t count, int type, int root,
                           void* comm, void* stream) {
    if (root != 0 || type_size(type) == 0) return ncclInvalidArgument;
    Comm* c = static_cast<Comm*>(comm);
    if (!c->folder.empty()) {
        fake_enqueue(stream, [=] { exchange(c, send, receive, count, type, ncclSum, root); });
        return ncclSuccess;
    }
    return copy(send, receive, count, type, stream);
}

}  // extern "C"
