// Allocates device memory 1 GiB at a time until the allocation is refused (or MAX GiB), through
// the CUDA runtime (`cudaMalloc`) or the driver API (`cuMemAlloc`), and prints one JSON line:
// how many GiB it got, and what `cudaMemGetInfo` says the device has (under MPS "total" is the
// whole GPU and only "free" reflects the limit).
//
//   mem_probe [runtime|driver] [MAX]
//
// Built by tests/gpu/run.sh with `nvcc -O2 -o mem_probe mem_probe.cu -lcuda`.
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv) {
    const char *api = argc > 1 ? argv[1] : "runtime";
    int max = argc > 2 ? atoi(argv[2]) : 256;
    const size_t gib = (size_t)1 << 30;
    int got = 0;
    const char *refused = "none";
    if (strcmp(api, "driver") == 0) {
        CUdevice dev;
        CUcontext ctx;
        if (cuInit(0) != CUDA_SUCCESS || cuDeviceGet(&dev, 0) != CUDA_SUCCESS ||
            cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS ||
            cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
            printf("{\"api\":\"driver\",\"error\":\"no CUDA context\"}\n");
            return 2;
        }
        while (got < max) {
            CUdeviceptr p;
            CUresult r = cuMemAlloc(&p, gib);
            if (r != CUDA_SUCCESS) {
                const char *name = "unknown";
                cuGetErrorName(r, &name);
                refused = name;
                break;
            }
            got++;
        }
    } else {
        if (cudaFree(0) != cudaSuccess) {
            printf("{\"api\":\"runtime\",\"error\":\"no CUDA context\"}\n");
            return 2;
        }
        while (got < max) {
            void *p;
            cudaError_t r = cudaMalloc(&p, gib);
            if (r != cudaSuccess) {
                refused = cudaGetErrorName(r);
                break;
            }
            got++;
        }
    }
    size_t free_bytes = 0, total_bytes = 0;
    cudaMemGetInfo(&free_bytes, &total_bytes);
    printf("{\"api\":\"%s\",\"allocated_gib\":%d,\"refused_with\":\"%s\",\"free\":%zu,\"total\":%zu}\n",
           api, got, refused, free_bytes, total_bytes);
    return 0;
}
