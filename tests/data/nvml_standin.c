/* A stand-in for the driver's libnvidia-ml.so.1 on a machine without a GPU: the C calls the
 * census makes, with NVML's signatures and return codes, for two GPUs. GPU 0 lists the
 * process in NVML_STANDIN_PID (1 GiB) as compute (_v3) and as an MPS client (only _v2 here:
 * the census falls back to it); GPU 1's name is not supported. No graphics listing at all
 * (an older driver without the function). Utilisation: GPU 0 reads 37 % busy, 12 % memory,
 * and keeps three samples (timestamps 1000, 2000, 3000 us; 10, 20, 30 %); GPU 1 refuses events.
 * An event set delivers one XID 79 event of GPU 0 once it was registered, then times out.
 * Built by tests/test_census.py with gcc. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct { unsigned int pid; unsigned long long used; unsigned int gi, ci; } process_t;
typedef struct { unsigned long long total, free, used; } memory_t;

static int initialised;

int nvmlInit_v2(void) { initialised++; return 0; }
int nvmlShutdown(void) { initialised--; return 0; }

const char *nvmlErrorString(int code) {
    switch (code) {
    case 1: return "Uninitialized";
    case 3: return "Not Supported";
    case 6: return "Not Found";
    case 7: return "Insufficient Size";
    case 10: return "Timeout";
    default: return "Unknown Error";
    }
}

int nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!initialised) return 1;
    *count = 2;
    return 0;
}

int nvmlDeviceGetHandleByIndex_v2(unsigned int index, void **handle) {
    if (!initialised) return 1;
    if (index > 1) return 2; /* NVML_ERROR_INVALID_ARGUMENT */
    *handle = (void *)(0x1000UL + index);
    return 0;
}

static int text(char *buffer, unsigned int size, const char *value) {
    if (strlen(value) + 1 > size) return 7;
    strcpy(buffer, value);
    return 0;
}

int nvmlSystemGetDriverVersion(char *buffer, unsigned int size) {
    return text(buffer, size, "580.0-standin");
}

int nvmlDeviceGetUUID(void *handle, char *buffer, unsigned int size) {
    return text(buffer, size, handle == (void *)0x1000UL ? "GPU-standin-0" : "GPU-standin-1");
}

int nvmlDeviceGetName(void *handle, char *buffer, unsigned int size) {
    if (handle != (void *)0x1000UL) return 3;
    return text(buffer, size, "Stand-in H200");
}

int nvmlDeviceGetMemoryInfo(void *handle, memory_t *memory) {
    memory->total = 143771ULL << 20;
    memory->used = handle == (void *)0x1000UL ? 1639ULL << 20 : 0;
    memory->free = memory->total - memory->used;
    return 0;
}

static int listing(void *handle, unsigned int *count, process_t *entries) {
    const char *pid = getenv("NVML_STANDIN_PID");
    unsigned int found = handle == (void *)0x1000UL && pid != NULL ? 1 : 0;
    if (*count < found) { *count = found; return 7; }
    *count = found;
    if (found) {
        entries[0].pid = (unsigned int)atoi(pid);
        entries[0].used = 1ULL << 30;
        entries[0].gi = entries[0].ci = 0xFFFFFFFF;
    }
    return 0;
}

int nvmlDeviceGetComputeRunningProcesses_v3(void *handle, unsigned int *count,
                                            process_t *entries) {
    return listing(handle, count, entries);
}

int nvmlDeviceGetMPSComputeRunningProcesses_v2(void *handle, unsigned int *count,
                                               process_t *entries) {
    return listing(handle, count, entries);
}

typedef struct { unsigned int gpu, memory; } utilization_t;
typedef struct { unsigned long long stamp; unsigned long long value; } sample_t;
typedef struct {
    void *device; unsigned long long type, data; unsigned int gi, ci;
} event_t;

int nvmlDeviceGetUtilizationRates(void *handle, utilization_t *rates) {
    if (handle != (void *)0x1000UL) return 3;
    rates->gpu = 37;
    rates->memory = 12;
    return 0;
}

int nvmlDeviceGetSamples(void *handle, int kind, unsigned long long since, int *value_type,
                         unsigned int *count, sample_t *samples) {
    unsigned int found = 0, i;
    (void)kind;
    if (handle != (void *)0x1000UL) return 3;
    for (i = 1; i <= 3; i++)
        if (i * 1000ULL > since) found++;
    if (samples == NULL) { *count = 3; return 0; } /* the room to give, as NVML says */
    if (!found) return 6;
    if (*count < found) return 7;
    *value_type = 1; /* NVML_VALUE_TYPE_UNSIGNED_INT */
    *count = 0;
    for (i = 1; i <= 3; i++) {
        if (i * 1000ULL <= since) continue;
        samples[*count].stamp = i * 1000ULL;
        samples[*count].value = 0xFFFFFFFF00000000ULL | (i * 10); /* only the low 32 bits */
        (*count)++;
    }
    return 0;
}

static int registered, delivered;

int nvmlEventSetCreate(void **set) { *set = (void *)0x2000UL; delivered = 0; return 0; }

int nvmlDeviceRegisterEvents(void *handle, unsigned long long types, void *set) {
    if (set != (void *)0x2000UL || types != 0x8ULL) return 2;
    if (handle != (void *)0x1000UL) return 3;
    registered = 1;
    return 0;
}

int nvmlEventSetWait_v2(void *set, event_t *event, unsigned int timeout_ms) {
    if (set != (void *)0x2000UL) return 2;
    if (!registered || delivered) {
        usleep((timeout_ms < 20 ? timeout_ms : 20) * 1000); /* as NVML waits, a little */
        return 10;
    }
    delivered = 1;
    event->device = (void *)0x1000UL;
    event->type = 0x8ULL;
    event->data = 79;
    event->gi = event->ci = 0xFFFFFFFF;
    return 0;
}

int nvmlEventSetFree(void *set) {
    if (set != (void *)0x2000UL) return 2;
    registered = 0;
    return 0;
}
