/*
 * cuda_nccl.cu — all-reduce across distinct GPUs through NCCL.
 *
 * NCCL is loaded with dlopen the first time a collective spans two GPUs, so
 * neither building nor loading the CUDA backend needs it. Search order: the
 * file named by CTRAINSTATE_NCCL_LIB (the Python layer sets it to the
 * nvidia-nccl-cu13 wheel's library when that is installed and the variable is
 * not), then libnccl.so.2 on the loader's path, under $NCCL_HOME/lib, and in
 * the CUDA toolkit ($CUDA_HOME/lib64, $CUDA_HOME/lib, /usr/local/cuda/lib64).
 * Only the ABI below is used (stable across NCCL 2.x), so no nccl.h is needed.
 *
 * A group of logical devices (one mesh-axis group) is reduced in three steps:
 * the logical devices of each GPU are summed by the device-copy kernel into all
 * of them (cuda_ops.cu); one rank per GPU — the group's first logical device on
 * it — then all-reduces in place through NCCL, one communicator per distinct
 * ordered set of GPUs, created once with ncclCommInitAll and cached (NCCL
 * refuses two ranks on one GPU, hence the first step); each GPU's other logical
 * devices then copy their rank's result. The host waits for the group's streams
 * before and after, like the single-GPU path.
 *
 * Across processes (ct_cuda_allreduce_ranks): a communicator per ncclUniqueId, which the
 * process holding the group's first GPU makes (ct_cuda_nccl_unique_id) and the Python layer
 * broadcasts through the MPI engine; each process creates its ranks with ncclCommInitRank
 * (grouped when it holds several) the first time, and caches them. A collective then runs as
 * above: each GPU's logical devices combined first, one rank per GPU through NCCL, the result
 * copied back to the GPU's other logical devices. ncclCommInitRank and ncclGetUniqueId are
 * looked up only then: an NCCL without them still serves the collectives within a process.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <mutex>
#include <vector>

#include "cuda_common.cuh"

extern "C" {
#include "../../core/ct_ops.h" /* CT_RED_* */
}

/* --- the NCCL ABI used here ------------------------------------------------------------------ */
typedef struct ncclComm *ncclComm_t;
typedef int ncclResult_t; /* ncclSuccess = 0 */
typedef struct {
    char internal[CT_NCCL_ID_BYTES]; /* ncclUniqueId: passed by value to ncclCommInitRank */
} ncclUniqueIdBytes;
enum { CT_NCCL_FLOAT32 = 7, CT_NCCL_SUM = 0, CT_NCCL_MAX = 2 }; /* nccl.h: ncclFloat32, ncclSum, ncclMax */

struct nccl_api {
    ncclResult_t (*CommInitAll)(ncclComm_t *comms, int ndev, const int *devlist);
    ncclResult_t (*AllReduce)(const void *send, void *recv, size_t count, int dtype, int op,
                              ncclComm_t comm, cudaStream_t stream);
    ncclResult_t (*GroupStart)(void);
    ncclResult_t (*GroupEnd)(void);
    const char *(*GetErrorString)(ncclResult_t r);
    ncclResult_t (*GetVersion)(int *version);
    ncclResult_t (*CommAbort)(ncclComm_t comm); /* optional */
    /* across processes (optional: ct_cuda_allreduce_ranks says which is missing) */
    ncclResult_t (*GetUniqueId)(void *id);
    ncclResult_t (*CommInitRank)(ncclComm_t *comm, int nranks, ncclUniqueIdBytes id, int rank);
};

static std::mutex g_nccl_mu;
static nccl_api g_nccl;
static int g_nccl_state = 0; /* 0 not tried, 1 loaded, -1 failed (g_nccl_why says why) */
static char g_nccl_why[1024];

static void *try_open(const char *path, char *tried, size_t cap) {
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (h == NULL) {
        size_t len = strlen(tried);
        snprintf(tried + len, cap - len, "%s%s", len ? ", " : "", path);
    }
    return h;
}

/* Load NCCL once; false with g_nccl_why set when it cannot be. */
static bool nccl_try_load(const nccl_api **out) {
    std::lock_guard<std::mutex> lock(g_nccl_mu);
    if (g_nccl_state == 0) {
        char tried[768] = "";
        char path[512];
        void *h = NULL;
        const char *e = getenv("CTRAINSTATE_NCCL_LIB");
        if (e != NULL && *e) h = try_open(e, tried, sizeof tried);
        if (h == NULL) h = try_open("libnccl.so.2", tried, sizeof tried);
        const char *homes[] = {getenv("NCCL_HOME"), getenv("CUDA_HOME"), "/usr/local/cuda"};
        const char *subs[] = {"lib", "lib64"};
        for (int i = 0; h == NULL && i < 3; i++)
            for (int j = 0; h == NULL && j < 2 && homes[i] != NULL; j++) {
                snprintf(path, sizeof path, "%s/%s/libnccl.so.2", homes[i], subs[j]);
                h = try_open(path, tried, sizeof tried);
            }
        if (h == NULL) {
            snprintf(g_nccl_why, sizeof g_nccl_why, "NCCL not found (tried %s); install "
                     "nvidia-nccl-cu13 or set CTRAINSTATE_NCCL_LIB to libnccl.so.2", tried);
            g_nccl_state = -1;
        } else {
            nccl_api a;
            *(void **)&a.CommInitAll = dlsym(h, "ncclCommInitAll");
            *(void **)&a.AllReduce = dlsym(h, "ncclAllReduce");
            *(void **)&a.GroupStart = dlsym(h, "ncclGroupStart");
            *(void **)&a.GroupEnd = dlsym(h, "ncclGroupEnd");
            *(void **)&a.GetErrorString = dlsym(h, "ncclGetErrorString");
            *(void **)&a.GetVersion = dlsym(h, "ncclGetVersion");
            *(void **)&a.CommAbort = dlsym(h, "ncclCommAbort");
            *(void **)&a.GetUniqueId = dlsym(h, "ncclGetUniqueId");
            *(void **)&a.CommInitRank = dlsym(h, "ncclCommInitRank");
            if (!a.CommInitAll || !a.AllReduce || !a.GroupStart || !a.GroupEnd ||
                !a.GetErrorString || !a.GetVersion) {
                snprintf(g_nccl_why, sizeof g_nccl_why,
                         "the NCCL library found lacks ncclCommInitAll/ncclAllReduce/ncclGroup*");
                g_nccl_state = -1;
            } else {
                g_nccl = a;
                g_nccl_state = 1;
            }
        }
    }
    if (g_nccl_state < 0) return false;
    *out = &g_nccl;
    return true;
}

static ct_status nccl_load(const nccl_api **out) {
    if (!nccl_try_load(out))
        return ct_cuda_core->set_error(CT_EDEVICE, "all-reduce across GPUs: %s", g_nccl_why);
    return CT_OK;
}

#define CT_NCCL_TRY(api, call)                                                             \
    do {                                                                                   \
        ncclResult_t ct_nccl_r_ = (call);                                                  \
        if (ct_nccl_r_ != 0)                                                               \
            return ct_cuda_core->set_error(CT_EDEVICE, "NCCL error in %s at %s:%d: %s",    \
                                           #call, __FILE__, __LINE__,                      \
                                           (api)->GetErrorString(ct_nccl_r_));             \
    } while (0)

/* --- communicators: one per ordered set of GPUs ------------------------------------------------ */

struct comm_entry {
    std::vector<int> gpus;
    std::vector<ncclComm_t> comms;
};
static std::mutex g_comm_mu;
static std::vector<comm_entry> g_comms;

static ct_status comms_for(const nccl_api *api, const std::vector<int> &gpus,
                           const ncclComm_t **out) {
    std::lock_guard<std::mutex> lock(g_comm_mu);
    for (const comm_entry &c : g_comms)
        if (c.gpus == gpus) {
            *out = c.comms.data();
            return CT_OK;
        }
    comm_entry c;
    c.gpus = gpus;
    c.comms.assign(gpus.size(), nullptr);
    CT_NCCL_TRY(api, api->CommInitAll(c.comms.data(), (int)gpus.size(), gpus.data()));
    g_comms.push_back(c);
    *out = g_comms.back().comms.data();
    return CT_OK;
}

/* After a collective failed half-posted, its communicators may wait for ranks that never
 * came: abort them and forget them (the next collective on these GPUs creates new ones). */
static void drop_comms(const nccl_api *api, const std::vector<int> &gpus) {
    std::lock_guard<std::mutex> lock(g_comm_mu);
    for (size_t i = 0; i < g_comms.size(); i++)
        if (g_comms[i].gpus == gpus) {
            if (api->CommAbort != NULL)
                for (ncclComm_t c : g_comms[i].comms) api->CommAbort(c);
            g_comms.erase(g_comms.begin() + (long)i);
            return;
        }
}

/* Collectives are posted one at a time: NCCL communicators are not safe to use from two
 * threads at once, and every rank must see the collectives in the same order. */
static std::mutex g_post_mu;

/* cuda_ops.cu: the single-GPU all-reduce (a device-copy kernel). */
extern "C" ct_status ct_cuda_allreduce_local(ct_device **devs, float **bufs, int nbufs,
                                            int64_t count, int op);

/* The first step of both NCCL all-reduces: the blocks of each GPU (members[r]: their
 * positions in devs / bufs) combined on it by the single-GPU all-reduce, or, for a GPU with one
 * block, its stream waited for; either way every member's queued work is done after it. */
static ct_status combine_within_gpus(ct_device **devs, float **bufs,
                                     const std::vector<std::vector<int>> &members, int64_t count,
                                     int op) {
    for (const std::vector<int> &m : members) {
        std::vector<ct_device *> d;
        std::vector<float *> b;
        for (int j : m) {
            d.push_back(devs[j]);
            b.push_back(bufs[j]);
        }
        if (d.size() > 1)
            CT_TRY(ct_cuda_allreduce_local(d.data(), b.data(), (int)d.size(), count, op));
        else {
            CT_CUDA_TRY(cudaSetDevice(d[0]->ordinal));
            CT_CUDA_TRY(cudaStreamSynchronize(ct_cuda_stream(d[0])));
        }
    }
    return CT_OK;
}

/* The last step of both NCCL all-reduces: each GPU's other blocks (members[r], leader[r] the
 * block NCCL reduced into) take the leader's result, then every GPU's stream is waited for. */
static ct_status spread_from_leaders(ct_device **devs, float **bufs,
                                     const std::vector<int> &leader,
                                     const std::vector<std::vector<int>> &members, int64_t count) {
    for (size_t r = 0; r < leader.size(); r++) {
        ct_device *d = devs[leader[r]];
        CT_CUDA_TRY(cudaSetDevice(d->ordinal));
        for (int j : members[r])
            if (j != leader[r])
                CT_CUDA_TRY(cudaMemcpyAsync(bufs[j], bufs[leader[r]], (size_t)count * sizeof(float),
                                            cudaMemcpyDeviceToDevice, ct_cuda_stream(d)));
    }
    for (size_t r = 0; r < leader.size(); r++) {
        ct_device *d = devs[leader[r]];
        CT_CUDA_TRY(cudaSetDevice(d->ordinal));
        CT_CUDA_TRY(cudaStreamSynchronize(ct_cuda_stream(d)));
    }
    return CT_OK;
}

/* One rank's in-place float32 all-reduce posted on its GPU's stream, inside the caller's
 * group; `rank` >= 0 names the rank across processes in the error. */
static ct_status post_rank(const nccl_api *api, ct_device *d, float *buf, int64_t count, int op,
                           ncclComm_t comm, int rank) {
    cudaError_t e = cudaSetDevice(d->ordinal);
    if (e != cudaSuccess)
        return ct_cuda_core->set_error(CT_EDEVICE, "cudaSetDevice(%d): %s", d->ordinal,
                                       cudaGetErrorString(e));
    ncclResult_t nr = api->AllReduce(buf, buf, (size_t)count, CT_NCCL_FLOAT32,
                                     op == CT_RED_MAX ? CT_NCCL_MAX : CT_NCCL_SUM, comm,
                                     ct_cuda_stream(d));
    if (nr == 0) return CT_OK;
    if (rank >= 0)
        return ct_cuda_core->set_error(CT_EDEVICE, "ncclAllReduce across processes (rank %d, GPU "
                                       "%d): %s", rank, d->ordinal, api->GetErrorString(nr));
    return ct_cuda_core->set_error(CT_EDEVICE, "ncclAllReduce on GPU %d: %s", d->ordinal,
                                   api->GetErrorString(nr));
}

extern "C" ct_status ct_cuda_allreduce_nccl(ct_device **devs, float **bufs, int nbufs,
                                           int64_t count, int op) {
    const nccl_api *api = NULL;
    CT_TRY(nccl_load(&api));
    /* GPUs in order of first appearance; rank r's leader is the first device on gpus[r] */
    std::vector<int> gpus, leader;
    std::vector<std::vector<int>> members;
    for (int j = 0; j < nbufs; j++) {
        size_t r = 0;
        while (r < gpus.size() && gpus[r] != devs[j]->ordinal) r++;
        if (r == gpus.size()) {
            gpus.push_back(devs[j]->ordinal);
            leader.push_back(j);
            members.emplace_back();
        }
        members[r].push_back(j);
    }
    /* 1. within each GPU (this waits for every member's stream) */
    CT_TRY(combine_within_gpus(devs, bufs, members, count, op));
    /* 2. across GPUs: one rank per GPU, in place */
    std::lock_guard<std::mutex> post(g_post_mu);
    const ncclComm_t *comms = NULL;
    CT_TRY(comms_for(api, gpus, &comms));
    for (size_t r = 0; r < gpus.size(); r++) /* fail before anything is posted */
        CT_CUDA_TRY(cudaSetDevice(gpus[r]));
    CT_NCCL_TRY(api, api->GroupStart());
    ct_status st = CT_OK;
    size_t posted = 0;
    for (size_t r = 0; r < gpus.size() && st == CT_OK; r++) {
        st = post_rank(api, devs[leader[r]], bufs[leader[r]], count, op, comms[r], -1);
        if (st == CT_OK) posted++;
    }
    ncclResult_t ge = api->GroupEnd(); /* always close the group */
    if (st != CT_OK || ge != 0) {
        if (posted > 0) drop_comms(api, gpus); /* some ranks wait for the others: abort them */
        if (st != CT_OK) return st;
        return ct_cuda_core->set_error(CT_EDEVICE, "ncclGroupEnd: %s", api->GetErrorString(ge));
    }
    /* 3. each GPU's other logical devices take their rank's result */
    return spread_from_leaders(devs, bufs, leader, members, count);
}

/* --- across processes ------------------------------------------------------------------------- */

static ct_status nccl_load_procs(const nccl_api **out, const char *what) {
    if (!nccl_try_load(out))
        return ct_cuda_core->set_error(CT_EDEVICE, "%s: %s", what, g_nccl_why);
    const char *miss = (*out)->GetUniqueId == NULL    ? "ncclGetUniqueId"
                       : (*out)->CommInitRank == NULL ? "ncclCommInitRank"
                                                      : NULL;
    if (miss != NULL)
        return ct_cuda_core->set_error(CT_EDEVICE, "%s: the NCCL library loaded lacks %s (needed "
                                       "for communicators across processes; set "
                                       "CTRAINSTATE_NO_NCCL=1 to reduce through the host)", what,
                                       miss);
    return CT_OK;
}

extern "C" ct_status ct_cuda_nccl_unique_id(ct_device *dev, unsigned char *id) {
    (void)dev;
    const nccl_api *api = NULL;
    CT_TRY(nccl_load_procs(&api, "NCCL across processes"));
    CT_NCCL_TRY(api, api->GetUniqueId(id));
    return CT_OK;
}

/* This process's ranks of the communicator of one unique id. */
struct proc_comm {
    std::vector<unsigned char> id;
    std::vector<int> ranks, gpus;
    std::vector<ncclComm_t> comms;
};
static std::vector<proc_comm> g_proc_comms;

static ct_status proc_comms_for(const nccl_api *api, const unsigned char *id, int nranks,
                                const std::vector<int> &ranks, const std::vector<int> &gpus,
                                const ncclComm_t **out) {
    std::lock_guard<std::mutex> lock(g_comm_mu);
    for (const proc_comm &c : g_proc_comms)
        if (memcmp(c.id.data(), id, CT_NCCL_ID_BYTES) == 0) {
            if (c.ranks != ranks)
                return ct_cuda_core->set_error(CT_EINVAL, "NCCL across processes: a communicator "
                                               "used with other ranks than it was made with");
            *out = c.comms.data();
            return CT_OK;
        }
    proc_comm c;
    c.id.assign(id, id + CT_NCCL_ID_BYTES);
    c.ranks = ranks;
    c.gpus = gpus;
    c.comms.assign(ranks.size(), nullptr);
    ncclUniqueIdBytes uid;
    memcpy(uid.internal, id, CT_NCCL_ID_BYTES);
    /* several ranks in this process: created together (each waits for all the others) */
    CT_NCCL_TRY(api, api->GroupStart());
    ncclResult_t first = 0;
    for (size_t r = 0; r < ranks.size(); r++) {
        cudaError_t e = cudaSetDevice(gpus[r]);
        if (e != cudaSuccess) {
            api->GroupEnd();
            return ct_cuda_core->set_error(CT_EDEVICE, "cudaSetDevice(%d): %s", gpus[r],
                                           cudaGetErrorString(e));
        }
        ncclResult_t nr = api->CommInitRank(&c.comms[r], nranks, uid, ranks[r]);
        if (nr != 0 && first == 0) first = nr;
    }
    ncclResult_t ge = api->GroupEnd();
    if (first != 0 || ge != 0)
        return ct_cuda_core->set_error(CT_EDEVICE, "ncclCommInitRank (%d ranks, this process's: "
                                       "%zu): %s", nranks, ranks.size(),
                                       api->GetErrorString(first != 0 ? first : ge));
    g_proc_comms.push_back(c);
    *out = g_proc_comms.back().comms.data();
    return CT_OK;
}

extern "C" ct_status ct_cuda_allreduce_ranks(ct_device **devs, float **bufs, int nbufs,
                                             int64_t count, int op, const unsigned char *id,
                                             int nranks, const int *ranks) {
    const nccl_api *api = NULL;
    CT_TRY(nccl_load_procs(&api, "all-reduce across processes"));
    if (nbufs < 1 || nranks < 1) return ct_cuda_core->set_error(CT_EINVAL, "all-reduce across "
                                                                "processes: no ranks");
    /* this process's ranks in order of first appearance; the first device of each leads */
    std::vector<int> myranks, gpus, leader;
    std::vector<std::vector<int>> members;
    for (int j = 0; j < nbufs; j++) {
        if (ranks[j] < 0 || ranks[j] >= nranks)
            return ct_cuda_core->set_error(CT_EINVAL, "all-reduce across processes: rank %d of %d",
                                           ranks[j], nranks);
        size_t r = 0;
        while (r < myranks.size() && myranks[r] != ranks[j]) r++;
        if (r == myranks.size()) {
            for (size_t q = 0; q < gpus.size(); q++)
                if (gpus[q] == devs[j]->ordinal)
                    return ct_cuda_core->set_error(CT_EINVAL, "all-reduce across processes: "
                                                   "ranks %d and %d on one GPU (%d)", myranks[q],
                                                   ranks[j], gpus[q]);
            myranks.push_back(ranks[j]);
            gpus.push_back(devs[j]->ordinal);
            leader.push_back(j);
            members.emplace_back();
        } else if (gpus[r] != devs[j]->ordinal) {
            return ct_cuda_core->set_error(CT_EINVAL, "all-reduce across processes: rank %d given "
                                           "buffers on GPUs %d and %d", ranks[j], gpus[r],
                                           devs[j]->ordinal);
        }
        members[r].push_back(j);
    }
    /* 1. within each GPU (this waits for every member's stream) */
    CT_TRY(combine_within_gpus(devs, bufs, members, count, op));
    /* 2. across processes: this process's ranks, in place (grouped: each rank waits for all) */
    std::lock_guard<std::mutex> post(g_post_mu);
    const ncclComm_t *comms = NULL;
    CT_TRY(proc_comms_for(api, id, nranks, myranks, gpus, &comms));
    CT_NCCL_TRY(api, api->GroupStart());
    ct_status st = CT_OK;
    for (size_t r = 0; r < myranks.size() && st == CT_OK; r++)
        st = post_rank(api, devs[leader[r]], bufs[leader[r]], count, op, comms[r], myranks[r]);
    ncclResult_t ge = api->GroupEnd();
    if (st != CT_OK) return st;
    if (ge != 0)
        return ct_cuda_core->set_error(CT_EDEVICE, "ncclGroupEnd: %s", api->GetErrorString(ge));
    /* 3. each GPU's other logical devices take their rank's result */
    return spread_from_leaders(devs, bufs, leader, members, count);
}

/* NCCL's version code (22809 for 2.28.9), or 0 with the reason in why; needs no GPU (tests). */
extern "C" __attribute__((visibility("default"))) int ct_cuda_nccl_version(char *why, int cap) {
    const nccl_api *api = NULL;
    if (!nccl_try_load(&api)) {
        if (why != NULL && cap > 0) snprintf(why, (size_t)cap, "%s", g_nccl_why);
        return 0;
    }
    int v = 0;
    api->GetVersion(&v);
    return v;
}
