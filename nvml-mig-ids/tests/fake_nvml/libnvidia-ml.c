/*
 * A stand-in for libnvidia-ml.so.1 with NVML's C ABI for the few calls the test makes:
 * init and shutdown, a device handle by index, and a MIG device's GPU and compute instance
 * ids. Device 0 is a MIG device (GPU instance 3, compute instance 1); device 1 is a whole
 * GPU, for which NVML answers NVML_ERROR_NOT_SUPPORTED. Built without the two id calls
 * (-DWITHOUT_INSTANCE_IDS), it is a driver too old to export them.
 */
#include <stddef.h>

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
};

struct nvmlDevice_st {
    int is_mig;
    unsigned int gpu_instance;
    unsigned int compute_instance;
};
typedef struct nvmlDevice_st *nvmlDevice_t;

static struct nvmlDevice_st devices[2] = {{1, 3, 1}, {0, 0, 0}};

nvmlReturn_t nvmlInit_v2(void) { return NVML_SUCCESS; }
nvmlReturn_t nvmlInitWithFlags(unsigned int flags) { (void)flags; return NVML_SUCCESS; }
nvmlReturn_t nvmlShutdown(void) { return NVML_SUCCESS; }

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (index >= 2 || device == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    *device = &devices[index];
    return NVML_SUCCESS;
}

#ifndef WITHOUT_INSTANCE_IDS
nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id) {
    if (device == NULL || id == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (!device->is_mig) {
        return NVML_ERROR_NOT_SUPPORTED;
    }
    *id = device->gpu_instance;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id) {
    if (device == NULL || id == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (!device->is_mig) {
        return NVML_ERROR_NOT_SUPPORTED;
    }
    *id = device->compute_instance;
    return NVML_SUCCESS;
}
#endif
