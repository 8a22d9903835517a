#!/usr/bin/env python3
"""Writes the input of the `tessera allocate` memory and time benchmark (docs/hostile-input.md).

Usage: scripts/bench-allocate-input.py SLICES DEVICES_PER_SLICE > input.yaml

One DeviceClass, SLICES ResourceSlices of DEVICES_PER_SLICE whole GPUs each (one pool per node,
eight attributes and two capacities per device, as Tessera publishes them) and one claim for
one GPU. Run it with: /usr/bin/time -v target/release/tessera allocate -f input.yaml -o json
"""
import sys

slices, per = int(sys.argv[1]), int(sys.argv[2])
out = sys.stdout
out.write("""apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata: {name: gpu.tessera.dev}
spec:
  selectors: [{cel: {expression: 'device.driver == "gpu.tessera.dev" && device.attributes["gpu.tessera.dev"].type == "gpu"'}}]
""")
for s in range(slices):
    out.write(f"""---
apiVersion: resource.k8s.io/v1
kind: ResourceSlice
metadata: {{name: node-{s}-gpus}}
spec:
  driver: gpu.tessera.dev
  nodeName: node-{s}
  pool: {{name: node-{s}, generation: 1, resourceSliceCount: 1}}
  devices:
""")
    for d in range(per):
        out.write(f"""  - name: gpu-{d}
    attributes:
      type: {{string: gpu}}
      uuid: {{string: GPU-{s:08d}-{d:04d}-0000-0000-000000000000}}
      index: {{int: {d}}}
      model: {{string: a100-80g}}
      productName: {{string: NVIDIA A100-SXM4-80GB}}
      sharing: {{string: exclusive}}
      nvlinkDomain: {{int: {d // 8}}}
      driverVersion: {{version: 550.54.15}}
    capacity:
      memory: {{value: 80Gi}}
      compute: {{value: '100'}}
""")
out.write("""---
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: one-gpu, namespace: default}
spec:
  devices:
    requests: [{name: gpu, exactly: {deviceClassName: gpu.tessera.dev}}]
""")
