/*
 * A fake libnvidia-ml.so.1 for the plugin's tests: enough of NVML for discovery, health events
 * and the accounting pass, with GPUs that exist only here and a process list read from a file,
 * so that the real `--gpu-backend nvml` path runs against real pids.
 *
 * TESSERA_FAKE_NVML_GPUS       how many GPUs (1 to 8; default 1), each an "NVIDIA A100-SXM4-40GB"
 *                              with UUID GPU-fa4e0000-0000-4000-8000-00000000000<index>
 * TESSERA_FAKE_NVML_PROCESSES  a file of lines "<gpu index> <pid> <used bytes>", read at every
 *                              call: the processes NVML lists on each GPU
 *
 * Built by the tests with the system C compiler (support::fake_nvml); nothing here is shipped.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <unistd.h>

#define NVML_SUCCESS 0
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_TIMEOUT 10

#define MAX_GPUS 8
#define MAX_PROCESSES 4096

typedef void *nvmlDevice_t;
typedef void *nvmlEventSet_t;

typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t;

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType, eventData;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlEventData_t;

static unsigned int gpu_count(void) {
    const char *text = getenv("TESSERA_FAKE_NVML_GPUS");
    long n = text ? strtol(text, NULL, 10) : 1;
    return (n < 1 || n > MAX_GPUS) ? 1 : (unsigned int)n;
}

static int index_of(nvmlDevice_t device, unsigned int *index) {
    uintptr_t raw = (uintptr_t)device;
    if (raw < 1 || raw > gpu_count()) return 0;
    *index = (unsigned int)(raw - 1);
    return 1;
}

static int copy(char *out, unsigned int length, const char *text) {
    if (!out || strlen(text) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(out, text);
    return NVML_SUCCESS;
}

int nvmlInit_v2(void) { return NVML_SUCCESS; }
int nvmlInitWithFlags(unsigned int flags) { (void)flags; return NVML_SUCCESS; }
int nvmlShutdown(void) { return NVML_SUCCESS; }
const char *nvmlErrorString(int result) { (void)result; return "fake NVML error"; }

int nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    return copy(version, length, "580.95.05");
}

int nvmlSystemGetCudaDriverVersion_v2(int *version) {
    *version = 13000;
    return NVML_SUCCESS;
}

int nvmlSystemGetCudaDriverVersion(int *version) { return nvmlSystemGetCudaDriverVersion_v2(version); }

int nvmlDeviceGetCount_v2(unsigned int *count) {
    *count = gpu_count();
    return NVML_SUCCESS;
}

int nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (index >= gpu_count()) return NVML_ERROR_INVALID_ARGUMENT;
    *device = (nvmlDevice_t)(uintptr_t)(index + 1);
    return NVML_SUCCESS;
}

int nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    unsigned int i;
    char text[64];
    for (i = 0; i < gpu_count(); i++) {
        snprintf(text, sizeof text, "GPU-fa4e0000-0000-4000-8000-%012u", i);
        if (uuid && strcmp(uuid, text) == 0) {
            *device = (nvmlDevice_t)(uintptr_t)(i + 1);
            return NVML_SUCCESS;
        }
    }
    return 6; /* NVML_ERROR_NOT_FOUND */
}

int nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    unsigned int i;
    if (!index_of(device, &i)) return NVML_ERROR_INVALID_ARGUMENT;
    return copy(name, length, "NVIDIA A100-SXM4-40GB");
}

int nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    unsigned int i;
    char text[64];
    if (!index_of(device, &i)) return NVML_ERROR_INVALID_ARGUMENT;
    snprintf(text, sizeof text, "GPU-fa4e0000-0000-4000-8000-%012u", i);
    return copy(uuid, length, text);
}

int nvmlDeviceGetBrand(nvmlDevice_t device, int *brand) {
    unsigned int i;
    if (!index_of(device, &i)) return NVML_ERROR_INVALID_ARGUMENT;
    *brand = 2; /* Tesla */
    return NVML_SUCCESS;
}

int nvmlDeviceGetArchitecture(nvmlDevice_t device, unsigned int *arch) {
    unsigned int i;
    if (!index_of(device, &i)) return NVML_ERROR_INVALID_ARGUMENT;
    *arch = 7; /* Ampere */
    return NVML_SUCCESS;
}

int nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor) {
    unsigned int i;
    if (!index_of(device, &i)) return NVML_ERROR_INVALID_ARGUMENT;
    *major = 8;
    *minor = 0;
    return NVML_SUCCESS;
}

int nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    unsigned int i;
    if (!index_of(device, &i)) return NVML_ERROR_INVALID_ARGUMENT;
    memory->total = 40ULL << 30;
    memory->reserved = 0;
    memory->used = 0;
    memory->free = memory->total;
    return NVML_SUCCESS;
}

int nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    unsigned int i;
    if (!index_of(device, &i)) return NVML_ERROR_INVALID_ARGUMENT;
    memset(pci, 0, sizeof *pci);
    pci->bus = 0x10 + i;
    pci->pciDeviceId = 0x20B010DE;
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "0000:%02X:00.0", pci->bus);
    snprintf(pci->busId, sizeof pci->busId, "00000000:%02X:00.0", pci->bus);
    return NVML_SUCCESS;
}

int nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minor) {
    unsigned int i;
    if (!index_of(device, &i)) return NVML_ERROR_INVALID_ARGUMENT;
    *minor = i;
    return NVML_SUCCESS;
}

int nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current, unsigned int *pending) {
    (void)device; (void)current; (void)pending;
    return NVML_ERROR_NOT_SUPPORTED;
}

int nvmlDeviceGetAttributes_v2(nvmlDevice_t device, void *attributes) {
    (void)device; (void)attributes;
    return NVML_ERROR_NOT_SUPPORTED;
}

int nvmlDeviceGetNumaNodeId(nvmlDevice_t device, unsigned int *node) {
    (void)device; (void)node;
    return NVML_ERROR_NOT_SUPPORTED;
}

int nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, int *active) {
    (void)device; (void)link; (void)active;
    return NVML_ERROR_NOT_SUPPORTED;
}

int nvmlEventSetCreate(nvmlEventSet_t *set) {
    *set = (nvmlEventSet_t)(uintptr_t)0xe5e7;
    return NVML_SUCCESS;
}

int nvmlEventSetFree(nvmlEventSet_t set) { (void)set; return NVML_SUCCESS; }

int nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long types, nvmlEventSet_t set) {
    (void)device; (void)types; (void)set;
    return NVML_ERROR_NOT_SUPPORTED;
}

int nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeout_ms) {
    (void)set; (void)data;
    usleep((useconds_t)(timeout_ms > 1000 ? 1000 : timeout_ms) * 1000);
    return NVML_ERROR_TIMEOUT;
}

/* The processes of GPU `gpu` from the process file. */
static unsigned int processes_of(unsigned int gpu, nvmlProcessInfo_t *out, unsigned int room) {
    const char *path = getenv("TESSERA_FAKE_NVML_PROCESSES");
    FILE *file = path ? fopen(path, "r") : NULL;
    unsigned int n = 0, index, pid;
    unsigned long long bytes;
    if (!file) return 0;
    while (n < MAX_PROCESSES && fscanf(file, "%u %u %llu", &index, &pid, &bytes) == 3) {
        if (index != gpu) continue;
        if (out && n < room) {
            out[n].pid = pid;
            out[n].usedGpuMemory = bytes;
            out[n].gpuInstanceId = 0xFFFFFFFF;
            out[n].computeInstanceId = 0xFFFFFFFF;
        }
        n++;
    }
    fclose(file);
    return n;
}

int nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *count,
                                            nvmlProcessInfo_t *infos) {
    unsigned int i, n;
    if (!index_of(device, &i) || !count) return NVML_ERROR_INVALID_ARGUMENT;
    n = processes_of(i, NULL, 0);
    if (!infos || *count < n) {
        *count = n;
        return n ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
    }
    *count = processes_of(i, infos, *count);
    return NVML_SUCCESS;
}

int nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *count,
                                               nvmlProcessInfo_t *infos) {
    unsigned int i;
    (void)infos;
    if (!index_of(device, &i) || !count) return NVML_ERROR_INVALID_ARGUMENT;
    *count = 0;
    return NVML_SUCCESS;
}
