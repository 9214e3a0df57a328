/*
 * Stand-in for NVIDIA's libnvidia-ml.so.1, for tests on machines without a GPU.
 *
 * The real library needs the NVIDIA kernel driver. FreeRide reaches NVML only
 * through the unmodified `pynvml` module (nvidia-ml-py), which loads
 * "libnvidia-ml.so.1" with ctypes; built as that file name and found through
 * LD_LIBRARY_PATH, this library exercises the real ctypes path, struct layouts
 * and error codes. It implements only the calls FreeRide makes.
 *
 * Configuration (environment, read on every call):
 *   FAKE_NVML_DEVICES    "total:used;total:used" in bytes, one entry per device
 *                        (default: one device, 80 GiB total, 1 GiB used)
 *   FAKE_NVML_PROCS      compute processes "dev:pid:bytes,..." ("na" = not available)
 *   FAKE_NVML_MPS_PROCS  MPS client processes, same format
 *   FAKE_NVML_FAIL_FILE  while this file exists, memory and process queries
 *                        fail with NVML_ERROR_UNKNOWN (a transient error)
 *   FAKE_NVML_INIT_ERROR nvmlInit fails with this return code
 *   FAKE_NVML_TRACE      append the name of every process-list call to this file
 * Build with -DFAKE_NVML_NO_V3 to imitate a driver without the _v3 process calls.
 *
 * Process calls follow the real contract: with *count smaller than the number of
 * processes they set *count and return NVML_ERROR_INSUFFICIENT_SIZE (SUCCESS when
 * there are none).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int nvmlReturn_t;
typedef struct nvmlDevice_st *nvmlDevice_t;
typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t;

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_UNKNOWN = 999,
};
#define MAX_ITEMS 64
#define GIB (1ULL << 30)

static int initialized;

static int failing(void) {
    const char *path = getenv("FAKE_NVML_FAIL_FILE");
    return path && access(path, F_OK) == 0;
}

/* Parses FAKE_NVML_DEVICES into totals/used; returns the device count. */
static unsigned devices(unsigned long long *total, unsigned long long *used) {
    const char *spec = getenv("FAKE_NVML_DEVICES");
    if (!spec || !*spec) {
        total[0] = 80 * GIB;
        used[0] = GIB;
        return 1;
    }
    unsigned n = 0;
    const char *p = spec;
    while (*p && n < MAX_ITEMS) {
        char *end;
        total[n] = strtoull(p, &end, 10);
        used[n] = (*end == ':') ? strtoull(end + 1, &end, 10) : 0;
        n++;
        p = (*end == ';') ? end + 1 : end + strlen(end);
    }
    return n;
}

static int device_index(nvmlDevice_t device, unsigned *index) {
    unsigned long long total[MAX_ITEMS], used[MAX_ITEMS];
    intptr_t i = (intptr_t)device - 1;
    if (i < 0 || (unsigned)i >= devices(total, used)) return 0;
    *index = (unsigned)i;
    return 1;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    const char *err = getenv("FAKE_NVML_INIT_ERROR");
    if (err && *err) return atoi(err);
    initialized++;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    initialized--;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    (void)result;
    return "fake NVML error";
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    unsigned long long total[MAX_ITEMS], used[MAX_ITEMS];
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    *count = devices(total, used);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    unsigned long long total[MAX_ITEMS], used[MAX_ITEMS];
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    if (index >= devices(total, used)) return NVML_ERROR_INVALID_ARGUMENT;
    *device = (nvmlDevice_t)(intptr_t)(index + 1);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    unsigned index;
    if (!device_index(device, &index)) return NVML_ERROR_INVALID_ARGUMENT;
    snprintf(uuid, length, "GPU-fake-%04u", index);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    unsigned long long total[MAX_ITEMS], used[MAX_ITEMS];
    unsigned index;
    if (!device_index(device, &index)) return NVML_ERROR_INVALID_ARGUMENT;
    if (failing()) return NVML_ERROR_UNKNOWN;
    devices(total, used);
    memory->total = total[index];
    memory->used = used[index];
    memory->free = total[index] - used[index];
    return NVML_SUCCESS;
}

static void trace(const char *name) {
    const char *path = getenv("FAKE_NVML_TRACE");
    FILE *f = path ? fopen(path, "a") : NULL;
    if (f) {
        fprintf(f, "%s\n", name);
        fclose(f);
    }
}

static nvmlReturn_t process_list(const char *var, nvmlDevice_t device, unsigned int *count,
                                 nvmlProcessInfo_t *infos) {
    nvmlProcessInfo_t found[MAX_ITEMS];
    unsigned index, n = 0;
    if (!device_index(device, &index)) return NVML_ERROR_INVALID_ARGUMENT;
    if (failing()) return NVML_ERROR_UNKNOWN;
    const char *p = getenv(var);
    while (p && *p && n < MAX_ITEMS) {
        char *end;
        unsigned dev = (unsigned)strtoul(p, &end, 10);
        unsigned pid = (unsigned)strtoul(end + 1, &end, 10);
        unsigned long long bytes =
            strncmp(end + 1, "na", 2) == 0 ? ~0ULL : strtoull(end + 1, &end, 10);
        if (dev == index) {
            found[n].pid = pid;
            found[n].usedGpuMemory = bytes;
            found[n].gpuInstanceId = found[n].computeInstanceId = ~0U;
            n++;
        }
        end = strchr(end, ',');
        p = end ? end + 1 : NULL;
    }
    if (*count < n) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    memcpy(infos, found, n * sizeof(found[0]));
    *count = n;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t d, unsigned int *c, nvmlProcessInfo_t *i) {
    trace(__func__);
    return process_list("FAKE_NVML_PROCS", d, c, i);
}

nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v2(nvmlDevice_t d, unsigned int *c, nvmlProcessInfo_t *i) {
    trace(__func__);
    return process_list("FAKE_NVML_MPS_PROCS", d, c, i);
}

#ifndef FAKE_NVML_NO_V3
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *c, nvmlProcessInfo_t *i) {
    trace(__func__);
    return process_list("FAKE_NVML_PROCS", d, c, i);
}

nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *c, nvmlProcessInfo_t *i) {
    trace(__func__);
    return process_list("FAKE_NVML_MPS_PROCS", d, c, i);
}
#endif
