/*
 * chaosgpu's CUDA injection library: loaded by libcuda at cuInit through CUDA_INJECTION64_PATH,
 * so it reaches any CUDA program (not only Python ones), unmodified.
 *
 * At load (InitializeInjection) it subscribes to CUPTI's driver- and runtime-API callbacks for
 * allocations and kernel launches, writes <dir>/<key>.cuda-armed and starts one thread that looks
 * every 50 ms for <dir>/<key>.cuda-trigger ("alloc|launch COUNT ID"), where dir is
 * CHAOSGPU_INJECT_DIR and key = "<pid namespace inode>-<pid>-<start time>" (the same key as the
 * Python injector: a trigger names one process). Once triggered, the next COUNT allocations
 * (cudaMalloc, cudaMallocAsync, cuMemAlloc_v2, cuMemAllocAsync) or launches (cudaLaunchKernel,
 * cuLaunchKernel, and their Ex forms) fail: the call runs, then on exit its return value is
 * replaced by cudaErrorMemoryAllocation / CUDA_ERROR_OUT_OF_MEMORY (allocations: the memory the
 * driver gave is freed at once and the pointer cleared) or cudaErrorLaunchFailure /
 * CUDA_ERROR_LAUNCH_FAILED (launches: the kernel did run). Changing a call's parameters on entry
 * instead was tried on driver 580 with cudaMalloc: the call did not see the change.
 * Each fault that hits is appended to <dir>/<key>.cuda-events.jsonl. libcupti is opened with
 * dlopen (CHAOSGPU_CUPTI_LIBRARY, else libcupti.so, libcupti.so.13, libcupti.so.12). Without a
 * trigger nothing changes but the callbacks' cost (one atomic read per call).
 *
 * Build: gcc -shared -fPIC -O2 -I<CUDA/CUPTI include> -o chaosgpu_cuda_inject.so THIS.c -ldl
 *        -lpthread   (chaosgpu.gpu.cudainject builds it at use time).
 */
#define _GNU_SOURCE
/* Only headers that stand alone (no CUDA compiler headers needed): the driver API, CUPTI's
 * result codes and callback ids. */
#include <cuda.h>
#include <cupti_result.h>
#include <cupti_driver_cbid.h>
#include <cupti_runtime_cbid.h>

#include <ctype.h>
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* CUPTI's callback ABI (cupti_callbacks.h), declared here because that header pulls in the
 * CUDA compiler's headers, which a runtime-only install lacks. */
typedef enum { CUPTI_API_ENTER = 0, CUPTI_API_EXIT = 1 } CUpti_ApiCallbackSite;
typedef enum { CUPTI_CB_DOMAIN_DRIVER_API = 1, CUPTI_CB_DOMAIN_RUNTIME_API = 2 }
    CUpti_CallbackDomain;
typedef uint32_t CUpti_CallbackId;
typedef struct {
    CUpti_ApiCallbackSite callbackSite;
    const char *functionName;
    const void *functionParams;
    void *functionReturnValue;
    const char *symbolName;
    CUcontext context;
    uint32_t contextUid;
    uint64_t *correlationData;
    uint32_t correlationId;
} CUpti_CallbackData;
typedef struct CUpti_Subscriber_st *CUpti_SubscriberHandle;
typedef void (*CUpti_CallbackFunc)(void *, CUpti_CallbackDomain, CUpti_CallbackId, const void *);
#define CUPTIAPI

/* The runtime API's parameter blocks for the calls we change (generated_cuda_runtime_api_meta.h)
 * and the two runtime error codes we return (driver_types.h). */
typedef struct { unsigned int x, y, z; } chaosgpu_dim3;
typedef struct { void **devPtr; size_t size; } cudaMalloc_v3020_params;
typedef struct { void **devPtr; size_t size; void *hStream; } cudaMallocAsync_v11020_params;
typedef struct {
    const void *func;
    chaosgpu_dim3 gridDim;
    chaosgpu_dim3 blockDim;
    void **args;
    size_t sharedMem;
    void *stream;
} cudaLaunchKernel_v7000_params;
/* The driver API's parameter blocks for the same calls (generated_cuda_meta.h). */
typedef struct { CUdeviceptr *dptr; size_t bytesize; } cuMemAlloc_v2_params;
typedef struct { CUdeviceptr *dptr; size_t bytesize; CUstream hStream; } cuMemAllocAsync_params;
typedef struct {
    CUfunction f;
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    void **kernelParams;
    void **extra;
} cuLaunchKernel_params;
typedef int cudaError_t;
#define cudaErrorMemoryAllocation 2
#define cudaErrorLaunchFailure 719

#define EXPORT __attribute__((visibility("default")))

typedef CUptiResult (*subscribe_fn)(CUpti_SubscriberHandle *, CUpti_CallbackFunc, void *);
typedef CUptiResult (*enable_fn)(uint32_t, CUpti_SubscriberHandle, CUpti_CallbackDomain,
                                 CUpti_CallbackId);
typedef CUptiResult (*result_string_fn)(CUptiResult, const char **);

static atomic_int fail_alloc = 0;
static atomic_int fail_launch = 0;
typedef CUresult (*mem_free_fn)(CUdeviceptr);
typedef CUresult (*mem_free_async_fn)(CUdeviceptr, CUstream);
static mem_free_fn mem_free = NULL;
static mem_free_async_fn mem_free_async = NULL;
static char inject_dir[3072];
static char key[128];
static char tag[64];
static __thread int in_runtime = 0;
static __thread int pending_return = 0;
static pthread_mutex_t file_lock = PTHREAD_MUTEX_INITIALIZER;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* The process key; 0 on success. Exported for tests. */
EXPORT int chaosgpu_inject_key(char *out, size_t size) {
    char link[128];
    ssize_t n = readlink("/proc/self/ns/pid", link, sizeof(link) - 1);
    if (n <= 0) return -1;
    link[n] = 0;
    char inode[64];
    size_t j = 0;
    for (ssize_t i = 0; i < n && j < sizeof(inode) - 1; i++)
        if (isdigit((unsigned char)link[i])) inode[j++] = link[i];
    inode[j] = 0;
    FILE *stat = fopen("/proc/self/stat", "r");
    if (!stat) return -1;
    char buffer[4096];
    size_t got = fread(buffer, 1, sizeof(buffer) - 1, stat);
    fclose(stat);
    buffer[got] = 0;
    char *p = strrchr(buffer, ')');
    if (!p) return -1;
    p += 2; /* state field */
    unsigned long long start = 0;
    for (int field = 3; field <= 22 && p && *p; field++) {
        if (field == 22) { start = strtoull(p, NULL, 10); break; }
        p = strchr(p, ' ');
        if (p) p++;
    }
    snprintf(out, size, "%s-%d-%llu", inode, (int)getpid(), start);
    return 0;
}

/* Parse "alloc|launch COUNT ID"; 0 on success. Exported for tests. */
EXPORT int chaosgpu_inject_parse(const char *text, char *what, int *count, char *id) {
    char w[16] = {0}, i[64] = {0};
    int c = 0;
    if (sscanf(text, "%15s %d %63s", w, &c, i) < 2) return -1;
    if (strcmp(w, "alloc") != 0 && strcmp(w, "launch") != 0) return -2;
    if (c < 1 || c > 1000000) return -3;
    for (char *q = i; *q; q++)
        if (!isalnum((unsigned char)*q) && *q != '-' && *q != '_') return -4;
    strcpy(what, w);
    *count = c;
    strcpy(id, i[0] ? i : "noid");
    return 0;
}

static void path_for(char *out, size_t size, const char *suffix) {
    snprintf(out, size, "%s/%s.%s", inject_dir, key, suffix);
}

static void write_file(const char *suffix, const char *text) {
    char path[4096], tmp[4200];
    path_for(path, sizeof(path), suffix);
    snprintf(tmp, sizeof(tmp), "%s.tmp%d", path, (int)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f) return;
    fputs(text, f);
    fclose(f);
    rename(tmp, path);
}

static void record_hit(const char *what, const char *api, int remaining) {
    if (!inject_dir[0]) return;
    char path[4096];
    path_for(path, sizeof(path), "cuda-events.jsonl");
    pthread_mutex_lock(&file_lock);
    FILE *f = fopen(path, "a");
    if (f) {
        fprintf(f, "{\"t\": %.6f, \"fault\": \"%s\", \"api\": \"%s\", \"remaining\": %d, "
                   "\"pid\": %d, \"tag\": \"%s\"}\n", now_s(), what, api, remaining, (int)getpid(),
                tag);
        fclose(f);
    }
    pthread_mutex_unlock(&file_lock);
}

/* Take one shot from `counter`; 1 when this call must fail. */
static int take_shot(atomic_int *counter, int *remaining) {
    int value = atomic_load(counter);
    while (value > 0) {
        if (atomic_compare_exchange_weak(counter, &value, value - 1)) {
            *remaining = value - 1;
            return 1;
        }
    }
    return 0;
}

static int is_alloc(CUpti_CallbackDomain domain, CUpti_CallbackId cbid) {
    if (domain == CUPTI_CB_DOMAIN_RUNTIME_API)
        return cbid == CUPTI_RUNTIME_TRACE_CBID_cudaMalloc_v3020 ||
               cbid == CUPTI_RUNTIME_TRACE_CBID_cudaMallocAsync_v11020;
    return cbid == CUPTI_DRIVER_TRACE_CBID_cuMemAlloc_v2 ||
           cbid == CUPTI_DRIVER_TRACE_CBID_cuMemAllocAsync;
}

static int is_launch(CUpti_CallbackDomain domain, CUpti_CallbackId cbid) {
    if (domain == CUPTI_CB_DOMAIN_RUNTIME_API)
        return cbid == CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000 ||
               cbid == CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernelExC_v11060;
    return cbid == CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel ||
           cbid == CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx;
}

/* Free what a failed-on-purpose allocation got, so the fault leaks nothing; clear the pointer. */
static void release_allocation(CUpti_CallbackDomain domain, CUpti_CallbackId cbid,
                               const void *params) {
    CUdeviceptr pointer = 0;
    CUstream stream = NULL;
    int async = 0;
    if (domain == CUPTI_CB_DOMAIN_RUNTIME_API) {
        if (cbid == CUPTI_RUNTIME_TRACE_CBID_cudaMalloc_v3020) {
            void **where = ((const cudaMalloc_v3020_params *)params)->devPtr;
            if (where) { pointer = (CUdeviceptr)(uintptr_t)*where; *where = NULL; }
        } else {
            const cudaMallocAsync_v11020_params *p = params;
            if (p->devPtr) { pointer = (CUdeviceptr)(uintptr_t)*p->devPtr; *p->devPtr = NULL; }
            stream = (CUstream)p->hStream;
            async = 1;
        }
    } else if (cbid == CUPTI_DRIVER_TRACE_CBID_cuMemAlloc_v2) {
        CUdeviceptr *where = ((const cuMemAlloc_v2_params *)params)->dptr;
        if (where) { pointer = *where; *where = 0; }
    } else {
        const cuMemAllocAsync_params *p = params;
        if (p->dptr) { pointer = *p->dptr; *p->dptr = 0; }
        stream = p->hStream;
        async = 1;
    }
    if (!pointer) return;
    if (async && mem_free_async) mem_free_async(pointer, stream);
    else if (!async && mem_free) mem_free(pointer);
}

static void CUPTIAPI callback(void *userdata, CUpti_CallbackDomain domain, CUpti_CallbackId cbid,
                              const void *cbdata) {
    (void)userdata;
    const CUpti_CallbackData *data = (const CUpti_CallbackData *)cbdata;
    int alloc = is_alloc(domain, cbid), launch = is_launch(domain, cbid);
    if (!alloc && !launch) return;
    int runtime = domain == CUPTI_CB_DOMAIN_RUNTIME_API;
    if (data->callbackSite == CUPTI_API_ENTER) {
        if (!runtime && in_runtime) return; /* the driver call inside a runtime call: counted */
        if (runtime) in_runtime = 1;
        int remaining = 0;
        if (!take_shot(alloc ? &fail_alloc : &fail_launch, &remaining)) return;
        const char *what = alloc ? "alloc" : "launch";
        pending_return = alloc ? 1 : 2;
        record_hit(what, data->functionName ? data->functionName : "?", remaining);
        return;
    }
    /* CUPTI_API_EXIT */
    if (runtime) in_runtime = 0;
    else if (in_runtime) return;
    if (pending_return && data->functionReturnValue) {
        int succeeded = runtime ? *(cudaError_t *)data->functionReturnValue == 0
                                : *(CUresult *)data->functionReturnValue == CUDA_SUCCESS;
        if (pending_return == 1 && succeeded)
            release_allocation(domain, cbid, data->functionParams);
        if (runtime)
            *(cudaError_t *)data->functionReturnValue =
                pending_return == 1 ? cudaErrorMemoryAllocation : cudaErrorLaunchFailure;
        else
            *(CUresult *)data->functionReturnValue =
                pending_return == 1 ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_LAUNCH_FAILED;
        pending_return = 0;
    }
}

static void *watch(void *unused) {
    (void)unused;
    char trigger[4096];
    path_for(trigger, sizeof(trigger), "cuda-trigger");
    for (;;) {
        usleep(50000);
        FILE *f = fopen(trigger, "r");
        if (!f) continue;
        char text[256] = {0};
        size_t got = fread(text, 1, sizeof(text) - 1, f);
        fclose(f);
        unlink(trigger);
        text[got] = 0;
        char what[16] = {0}, id[64] = {0}, ack[512], suffix[128];
        int count = 0;
        int rc = chaosgpu_inject_parse(text, what, &count, id);
        if (rc == 0) {
            atomic_store(strcmp(what, "alloc") == 0 ? &fail_alloc : &fail_launch, count);
            snprintf(ack, sizeof(ack), "{\"id\": \"%s\", \"accepted\": true, \"fault\": \"%s\", "
                     "\"count\": %d, \"pid\": %d, \"t\": %.6f}\n", id, what, count,
                     (int)getpid(), now_s());
        } else {
            strcpy(id, "invalid");
            snprintf(ack, sizeof(ack), "{\"id\": \"invalid\", \"accepted\": false, \"error\": "
                     "\"bad trigger (code %d): use 'alloc|launch COUNT ID'\", \"pid\": %d}\n", rc,
                     (int)getpid());
        }
        snprintf(suffix, sizeof(suffix), "cuda-ack-%s.json", id);
        write_file(suffix, ack);
    }
    return NULL;
}

static void *open_cupti(void) {
    const char *names[] = {getenv("CHAOSGPU_CUPTI_LIBRARY"), "libcupti.so", "libcupti.so.13",
                           "libcupti.so.12"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        if (!names[i] || !names[i][0]) continue;
        void *handle = dlopen(names[i], RTLD_NOW | RTLD_GLOBAL);
        if (handle) return handle;
    }
    return NULL;
}

static void armed_file(const char *state, const char *error) {
    char text[1024];
    snprintf(text, sizeof(text), "{\"pid\": %d, \"key\": \"%s\", \"state\": \"%s\", "
             "\"error\": \"%s\", \"t\": %.6f}\n", (int)getpid(), key, state,
             error ? error : "", now_s());
    write_file("cuda-armed", text);
}

/* Called by libcuda at cuInit when CUDA_INJECTION64_PATH names this library. */
EXPORT int InitializeInjection(void) {
    const char *dir = getenv("CHAOSGPU_INJECT_DIR");
    void *driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD); /* loaded: it calls us */
    if (driver) {
        mem_free = (mem_free_fn)dlsym(driver, "cuMemFree_v2");
        mem_free_async = (mem_free_async_fn)dlsym(driver, "cuMemFreeAsync");
    }
    if (!dir || !dir[0] || strlen(dir) >= sizeof(inject_dir)) {
        fprintf(stderr, "chaosgpu cuda injector: CHAOSGPU_INJECT_DIR not set: not armed\n");
        return 1;
    }
    strcpy(inject_dir, dir);
    const char *own_tag = getenv("CHAOSGPU_TAG");
    size_t t = 0;
    for (; own_tag && own_tag[t] && t < sizeof(tag) - 1; t++)
        tag[t] = (isalnum((unsigned char)own_tag[t]) || strchr("-._", own_tag[t])) ? own_tag[t]
                                                                                 : '_';
    tag[t] = 0;
    if (chaosgpu_inject_key(key, sizeof(key)) != 0) {
        fprintf(stderr, "chaosgpu cuda injector: cannot read /proc/self: not armed\n");
        return 1;
    }
    void *cupti = open_cupti();
    if (!cupti) {
        armed_file("not armed", "libcupti could not be opened");
        return 1;
    }
    subscribe_fn subscribe = (subscribe_fn)dlsym(cupti, "cuptiSubscribe");
    enable_fn enable = (enable_fn)dlsym(cupti, "cuptiEnableCallback");
    result_string_fn result_string = (result_string_fn)dlsym(cupti, "cuptiGetResultString");
    if (!subscribe || !enable) {
        armed_file("not armed", "libcupti lacks cuptiSubscribe/cuptiEnableCallback");
        return 1;
    }
    CUpti_SubscriberHandle subscriber;
    CUptiResult result = subscribe(&subscriber, (CUpti_CallbackFunc)callback, NULL);
    if (result != CUPTI_SUCCESS) {
        const char *text = "?";
        if (result_string) result_string(result, &text);
        armed_file("not armed", text); /* e.g. another CUPTI subscriber (a profiler) is active */
        return 1;
    }
    const CUpti_CallbackId runtime_ids[] = {
        CUPTI_RUNTIME_TRACE_CBID_cudaMalloc_v3020, CUPTI_RUNTIME_TRACE_CBID_cudaMallocAsync_v11020,
        CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000,
        CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernelExC_v11060};
    const CUpti_CallbackId driver_ids[] = {
        CUPTI_DRIVER_TRACE_CBID_cuMemAlloc_v2, CUPTI_DRIVER_TRACE_CBID_cuMemAllocAsync,
        CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel, CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx};
    for (size_t i = 0; i < 4; i++) {
        enable(1, subscriber, CUPTI_CB_DOMAIN_RUNTIME_API, runtime_ids[i]);
        enable(1, subscriber, CUPTI_CB_DOMAIN_DRIVER_API, driver_ids[i]);
    }
    pthread_t thread;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&thread, &attr, watch, NULL) != 0) {
        armed_file("not armed", "pthread_create failed");
        return 1;
    }
    armed_file("armed", NULL);
    return 1;
}
