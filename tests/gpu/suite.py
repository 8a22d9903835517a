#!/usr/bin/env python3
"""Tessera's GPU acceptance suite: the steps of issue 24 on a real NVIDIA GPU.

Started by run.sh (which skips where there is no GPU). Uses only the standard library; the
workloads need PyTorch (and nvcc for mem_probe, else PyTorch's allocator is the probe).

Every step adds one row (PASS, FAIL or SKIP, with its numbers) to the table printed at the end
and written to <out>/results.md and <out>/results.json; the logs of the plugin and the fake API
server go to <out>/logs/. The whole run keeps to a time budget (--budget, 280 s): a step that
would start past it is skipped.
"""

import argparse
import json
import os
import pathlib
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid

NODE = "gpu-node"
DRIVER = "gpu.tessera.dev"
CDI_KIND = "k8s.gpu.tessera.dev/claim"
NAMESPACE = "default"
GIB = 1 << 30
REPO = pathlib.Path(__file__).resolve().parents[2]
HERE = pathlib.Path(__file__).resolve().parent


class StepError(Exception):
    """A step that cannot go on; its row says why."""


def cgroup_base():
    """Where a pod cgroup can be made: the cgroup v2 root, or a v1 hierarchy (kubelet's cgroupfs
    driver makes `kubepods/<qos>/pod<uid>` in each)."""
    root = pathlib.Path("/sys/fs/cgroup")
    if (root / "cgroup.controllers").exists():
        return root
    for hierarchy in ("pids", "memory", "cpu,cpuacct", "systemd"):
        if (root / hierarchy / "cgroup.procs").exists():
            return root / hierarchy
    raise StepError("no cgroup hierarchy under /sys/fs/cgroup to put a pod's processes in")


class Suite:
    def __init__(self, args):
        self.args = args
        self.bin = pathlib.Path(args.bin_dir).resolve()
        self.out = pathlib.Path(args.out).resolve()
        self.logs = self.out / "logs"
        self.work = pathlib.Path(args.work).resolve()
        self.start = time.monotonic()
        self.rows = []
        self.procs = []
        self.plugin = None
        self.plugin_args = None
        self.api_url = None
        self.kubeconfig = self.work / "kubeconfig"
        self.prepared = {}
        self.cgroups = []
        self.shared = None
        for d in (self.out, self.logs, self.work):
            d.mkdir(parents=True, exist_ok=True)

    # --- bookkeeping -----------------------------------------------------------------------

    def left(self):
        return self.args.budget - (time.monotonic() - self.start)

    def row(self, step, result, detail):
        self.rows.append({"step": step, "result": result, "detail": detail})
        print(f"[{time.monotonic() - self.start:6.1f}s] {result:4} {step}: {detail}", flush=True)

    def step(self, name, need_seconds, fn):
        if self.left() < need_seconds:
            self.row(name, "SKIP", f"time budget: {self.left():.0f} s left, needs ~{need_seconds} s")
            return
        try:
            result, detail = fn()
            self.row(name, result, detail)
        except StepError as e:
            self.row(name, "FAIL", str(e))
        except Exception as e:  # noqa: BLE001 (any failure is this step's row; the run goes on)
            self.row(name, "FAIL", f"{type(e).__name__}: {e}")

    def tool(self, name):
        path = self.bin / name
        if not os.access(path, os.X_OK):
            raise StepError(f"{path} is missing (build it: see docs/cdi.md, GPU acceptance suite)")
        return str(path)

    def spawn(self, argv, log, **kw):
        handle = open(self.logs / log, "ab")  # noqa: SIM115 (closed when the process goes)
        proc = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, **kw)
        self.procs.append(proc)
        return proc

    def run(self, argv, timeout, **kw):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, **kw)
        return done.returncode, done.stdout, done.stderr

    # --- the fake API server ---------------------------------------------------------------

    def api(self, method, path, body=None, missing_ok=False):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.api_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as e:
            if missing_ok and e.code == 404:
                return {}
            raise StepError(f"{method} {path}: HTTP {e.code}: {e.read()[:300]!r}") from e

    def start_apiserver(self):
        self.spawn([self.tool("tessera-fake-apiserver"), "--kubeconfig", str(self.kubeconfig)],
                   "fake-apiserver.log")
        deadline = time.monotonic() + 15
        while not self.kubeconfig.exists():
            if time.monotonic() > deadline:
                raise StepError("the fake API server wrote no kubeconfig in 15 s")
            time.sleep(0.1)
        for line in self.kubeconfig.read_text().splitlines():
            if line.strip().startswith("server:"):
                self.api_url = line.split("server:", 1)[1].strip()
        self.api("POST", "/api/v1/nodes", {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": NODE, "labels": {"kubernetes.io/hostname": NODE}}})

    def slices(self):
        return self.api("GET", "/apis/resource.k8s.io/v1/resourceslices").get("items", [])

    # --- the plugin --------------------------------------------------------------------------

    def plugin_argv(self, enforcement):
        mps_root = pathlib.Path(self.args.mps_root)
        if self.args.plumbing:
            inventory = self.work / "inventory.yaml"
            inventory.write_text(f"nodes:\n- name: {NODE}\n  mode: shared\n  gpus:\n"
                                 "  - model: h200-141g\n    count: 1\n")
            # Without enforcement nothing is verified (docs/cdi.md, "Proving isolation"): the
            # plumbing run accepts unverified isolation explicitly, as an admin of such a node would.
            backend = ["--gpu-backend", "fake", "--fake-inventory", str(inventory),
                       "--accept-unverified-isolation", "true"]
            enforcement = "none"
        else:
            backend = ["--gpu-backend", "nvml"]
        argv = [
            self.tool("tessera-kubelet-plugin"),
            "--node-name", NODE, "--driver-name", DRIVER, *backend, "--gpu-mode", "shared",
            "--kubeconfig", str(self.kubeconfig),
            "--registration-dir", str(self.work / "registry"),
            "--plugin-dir", str(self.work / "plugin"),
            "--cdi-dir", str(self.work / "cdi"),
            "--state-dir", str(self.work / "state"),
            "--enforcement", enforcement,
            "--mps-daemons", "host",
            "--mps-pipe-dir-root", str(mps_root / "mps"),
            "--mps-log-dir-root", str(self.work / "mps-log"),
            "--log-format", "json",
            "--inventory-poll-seconds", "5",
            "--accounting-interval-seconds", "2",
        ]
        if self.args.nvml_library:
            argv += ["--nvml-library", self.args.nvml_library]
        if self.args.mps_control_binary:
            argv += ["--mps-control-binary", self.args.mps_control_binary]
        if enforcement == "hami-core":
            argv += ["--hami-library-path", self.args.hami_library,
                     "--hami-cache-dir", str(mps_root / "hami")]
        argv += self.args.plugin_arg
        return argv

    def start_mps_host(self):
        """The node's MPS host (`tessera-mps host`, the chart's `tessera-mps` DaemonSet): it
        follows the plugin's checkpoint and runs the daemons outside the plugin."""
        argv = [self.tool("tessera-mps"), "host", "--state-dir", str(self.work / "state"),
                "--log-format", "json"]
        if self.args.mps_control_binary:
            argv += ["--mps-control-binary", self.args.mps_control_binary]
        self.mps_host = self.spawn(argv, "mps-host.log")

    def start_plugin(self, enforcement="mps"):
        socket = self.work / "plugin" / "dra.sock"
        if socket.exists():
            socket.unlink()
        self.plugin_args = self.plugin_argv(enforcement)
        self.plugin = self.spawn(self.plugin_args, "plugin.log")
        deadline = time.monotonic() + 30
        while not socket.exists():
            if self.plugin.poll() is not None:
                raise StepError(f"the plugin exited ({self.plugin.returncode}); see {self.logs / 'plugin.log'}")
            if time.monotonic() > deadline:
                raise StepError("the plugin served no DRA socket in 30 s")
            time.sleep(0.1)

    def stop_plugin(self, sig=signal.SIGTERM):
        if self.plugin and self.plugin.poll() is None:
            self.plugin.send_signal(sig)
            try:
                self.plugin.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.plugin.kill()
                self.plugin.wait()
        self.plugin = None

    def kubelet(self, verb, claims):
        argv = [self.tool("tessera-fake-kubelet"), verb, "--socket",
                str(self.work / "plugin" / "dra.sock")]
        argv += [f"{NAMESPACE}/{c['name']}/{c['uid']}" for c in claims]
        rc, out, err = self.run(argv, timeout=60)
        if rc != 0:
            raise StepError(f"tessera-fake-kubelet {verb}: {err.strip()[:300]}")
        return json.loads(out)

    def mps_daemons(self):
        """Control daemons serving this suite's pipe directories: processes whose program is
        nvidia-cuda-mps-control, run with `-f`, with one of our pipe directories in their
        environment (`comm` is cut to 15 characters, so the server would look the same)."""
        root = f"CUDA_MPS_PIPE_DIRECTORY={pathlib.Path(self.args.mps_root) / 'mps'}".encode()
        found = []
        for proc in pathlib.Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
                env = (proc / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if (os.path.basename(argv[0]) == b"nvidia-cuda-mps-control" and b"-f" in argv
                    and any(e.startswith(root) for e in env)):
                found.append(int(proc.name))
        return found

    # --- claims ------------------------------------------------------------------------------

    def claim(self, name, cls, memory, compute=None):
        params = {"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "GpuShare", "memory": memory}
        if compute is not None:
            params["compute"] = compute
        return {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": cls}}],
                "config": [{"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": params}}],
            }},
        }

    def pod(self, name, claim, user):
        """Pod `name` on the node, whose one container uses `claim` and runs as `user` (the
        plugin reads it to pick the claim's MPS daemon: one per GPU set and user)."""
        self.api("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}", missing_ok=True)
        return self.api("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {
                "nodeName": NODE,
                "securityContext": {"runAsUser": user},
                "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
                "containers": [{"name": "work", "image": "tessera-acceptance",
                                "resources": {"claims": [{"name": "gpu"}]}}],
            },
        })

    def allocate_and_prepare(self, claims, users=None):
        """`tessera allocate` on the published slices, the claims stored with their allocation and
        a pod each (running as `users[name]`, root by default), then prepared through the kubelet
        gRPC API. Returns name -> claim record."""
        users = users or {}
        docs = []
        for f in ("gpu.yaml", "shared-gpu.yaml", "batch-gpu.yaml"):
            docs.append((REPO / "deviceclasses" / f).read_text())
        for s in self.slices():
            # A list's items carry no apiVersion and kind; a file's objects must.
            s.setdefault("apiVersion", "resource.k8s.io/v1")
            s.setdefault("kind", "ResourceSlice")
            docs.append(json.dumps(s))
        docs += [json.dumps(c) for c in claims]
        inputs = self.work / "allocate-input.yaml"
        inputs.write_text("\n---\n".join(docs) + "\n")
        rc, out, err = self.run([self.tool("tessera"), "allocate", "-f", str(inputs),
                                 "--node", NODE, "-o", "json"], timeout=60)
        if rc != 0:
            raise StepError(f"tessera allocate exited {rc}: {err.strip()[:300]}")
        results = {r["name"]: r for r in json.loads(out)["results"]}
        refused = {n: r.get("reason") for n, r in results.items() if not r.get("allocated")}
        if refused:
            raise StepError(f"tessera allocate refused {refused}")
        records = {}
        for c in claims:
            name = c["metadata"]["name"]
            created = self.api("POST", f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims", c)
            user = users.get(name, 0)
            pod = self.pod(f"{name}-pod", name, user)
            pod_uid = pod["metadata"].get("uid") or str(uuid.uuid4())
            created["status"] = {
                "allocation": results[name]["allocation"],
                "reservedFor": [{"resource": "pods", "name": f"{name}-pod", "uid": pod_uid}],
            }
            stored = self.api("PUT", f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims/{name}/status", created)
            records[name] = {"name": name, "uid": stored["metadata"]["uid"], "pod_uid": pod_uid,
                             "user": user, "allocation": results[name]["allocation"]}
        answer = self.kubelet("prepare", list(records.values()))
        for rec in records.values():
            got = answer.get(rec["uid"], {})
            if got.get("error"):
                raise StepError(f"prepare {rec['name']}: {got['error']}")
            rec["cdi_ids"] = [i for d in got.get("devices", []) for i in d["cdiDeviceIds"]]
            self.prepared[rec["name"]] = rec
        return records

    def release(self, names):
        recs = [self.prepared.pop(n) for n in names if n in self.prepared]
        if not recs:
            return
        answer = self.kubelet("unprepare", recs)
        for rec in recs:
            self.api("DELETE", f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims/{rec['name']}")
            self.api("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/{rec['name']}-pod", missing_ok=True)
            if answer.get(rec["uid"], {}).get("error"):
                raise StepError(f"unprepare {rec['name']}: {answer[rec['uid']]['error']}")

    # --- a container as a runtime makes it from the CDI spec -------------------------------

    def container(self, rec, argv, pod_cgroup=False):
        """`argv` in the claim's container: the CDI spec's env and bind mounts in a private mount
        namespace (as a runtime applies them); with `pod_cgroup`, in a cgroup named after the
        claim's pod the way kubelet's cgroupfs driver names it; as the pod's user (`setpriv`
        after the mounts, as a runtime starts the process as `runAsUser`)."""
        uid = rec["uid"]
        spec_path = self.work / "cdi" / f"k8s.gpu.tessera.dev-claim_{uid.replace('/', '_')}.json"
        spec = json.loads(spec_path.read_text())
        wanted = {i.split("=", 1)[1] for i in rec["cdi_ids"] if i.startswith(CDI_KIND + "=")}
        edits = [spec.get("containerEdits") or {}]
        edits += [d.get("containerEdits") or {} for d in spec.get("devices", []) if d["name"] in wanted]
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("CUDA_", "NVIDIA_", "LD_PRELOAD"))}
        mounts = []
        for e in edits:
            for item in e.get("env", []):
                key, _, value = item.partition("=")
                env[key] = value
            mounts += [(m["hostPath"], m["containerPath"]) for m in e.get("mounts", [])]
        script = ["set -e"]
        if pod_cgroup:
            base = cgroup_base()
            cg = base / "kubepods" / "besteffort" / f"pod{rec['pod_uid']}" / "tessera-acceptance"
            for d in (base / "kubepods", base / "kubepods" / "besteffort", cg.parent, cg):
                if not d.exists():
                    d.mkdir()
                    self.cgroups.append(d)
                if not (d / "cgroup.procs").exists():
                    raise StepError(f"{d} is not a cgroup (no cgroup.procs)")
            script.append(f"echo $$ > {shlex.quote(str(cg / 'cgroup.procs'))}")
        for host, inside in mounts:
            q_host, q_inside = shlex.quote(host), shlex.quote(inside)
            script.append(f"if [ -d {q_host} ]; then mkdir -p {q_inside}; "
                          f"else mkdir -p \"$(dirname {q_inside})\"; touch {q_inside}; fi")
            script.append(f"mount --bind {q_host} {q_inside}")
        user = rec.get("user", 0)
        if user:
            env["HOME"] = str(self.users_dir())
            script.append(f"exec setpriv --reuid {int(user)} --regid {int(user)} --clear-groups -- \"$@\"")
        else:
            script.append('exec "$@"')
        return ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c",
                "\n".join(script), "container"] + argv, env

    def mps_pipe_dirs(self, rec):
        """The host pipe directories the claim's CDI spec binds at /tmp/nvidia-mps."""
        spec_path = self.work / "cdi" / f"k8s.gpu.tessera.dev-claim_{rec['uid'].replace('/', '_')}.json"
        spec = json.loads(spec_path.read_text())
        edits = [spec.get("containerEdits") or {}]
        edits += [d.get("containerEdits") or {} for d in spec.get("devices", [])]
        return sorted({m["hostPath"] for e in edits for m in e.get("mounts", [])
                       if m["containerPath"] == "/tmp/nvidia-mps"})

    def in_container(self, rec, argv, timeout, pod_cgroup=False):
        cmd, env = self.container(rec, argv, pod_cgroup)
        rc, out, err = self.run(cmd, timeout=timeout, env=env)
        last = out.strip().splitlines()[-1] if out.strip() else ""
        try:
            return rc, json.loads(last), err
        except json.JSONDecodeError:
            return rc, {"raw": out.strip()[-300:]}, err

    def popen_container(self, rec, argv, log, pod_cgroup=False):
        cmd, env = self.container(rec, argv, pod_cgroup)
        return self.spawn(cmd, log, env=env)

    def users_dir(self):
        """A directory every user can read and write (the HOME of a workload that is not root's):
        the workloads run from a copy there, since the repository and the scratch directories
        may sit where only root may look."""
        if self.shared is None:
            self.shared = pathlib.Path(tempfile.mkdtemp(prefix="tessera-gpu-users."))
            self.shared.chmod(0o1777)
            shutil.copy(HERE / "workloads" / "workloads.py", self.shared / "workloads.py")
            (self.shared / "workloads.py").chmod(0o644)
        return self.shared

    def workload(self, *args):
        return [sys.executable, str(self.users_dir() / "workloads.py"), *args]

    def mem_probe(self, api="runtime"):
        probe = self.out / "mem_probe"
        if os.access(probe, os.X_OK):
            return [str(probe), api]
        return self.workload("mem")

    # --- the steps ---------------------------------------------------------------------------

    def s_baseline(self):
        rc, out, err = self.run(self.workload("matmul", "--seconds", "3"), timeout=60)
        if rc != 0:
            raise StepError(f"matmul exited {rc}: {err.strip()[-300:]}")
        self.baseline = json.loads(out.strip().splitlines()[-1])["tflops"]
        return "PASS", f"bf16 matmul 8192^2 on the whole GPU, no MPS: {self.baseline} TFLOP/s"

    def s_discovery(self):
        self.start_apiserver()
        if not self.args.plumbing:
            self.start_mps_host()
        self.start_plugin()
        deadline = time.monotonic() + 30
        devices = []
        while not devices and time.monotonic() < deadline:
            devices = [d for s in self.slices() for d in s["spec"].get("devices", [])]
            time.sleep(0.5)
        if not devices:
            raise StepError("no ResourceSlice device published in 30 s")
        d = devices[0]
        attrs = {k.split("/")[-1]: next(iter(v.values())) for k, v in d.get("attributes", {}).items()}
        caps = {k.split("/")[-1]: v.get("value") for k, v in d.get("capacity", {}).items()}
        self.devices = devices
        detail = (f"{len(devices)} device(s); {d['name']}: model={attrs.get('model')} "
                  f"memory={caps.get('memory')} cc={attrs.get('cudaComputeCapability')} "
                  f"driver={attrs.get('driverVersion')} pciBusID={attrs.get('pciBusID')} "
                  f"sharing={attrs.get('sharing')}")
        ok = attrs.get("sharing") == "shared" and caps.get("memory")
        return ("PASS" if ok else "FAIL"), detail

    def s_plumbing_container(self):
        recs = self.allocate_and_prepare([
            self.claim("share-a", "shared.gpu.tessera.dev", "10Gi", 50),
            self.claim("share-b", "shared.gpu.tessera.dev", "20Gi", 30),
        ])
        self.phase1 = recs
        pod = shlex.quote("pod" + recs["share-a"]["pod_uid"])
        show = (f"if grep -q {pod} /proc/self/cgroup; then c=true; else c=false; fi; "
                'printf \'{"visible": "%s", "in_pod_cgroup": %s}\\n\' "$NVIDIA_VISIBLE_DEVICES" "$c"')
        rc, seen, err = self.in_container(recs["share-a"], ["/bin/sh", "-c", show], 30, pod_cgroup=True)
        ok = rc == 0 and seen.get("visible", "").startswith("GPU-") and seen.get("in_pod_cgroup")
        return ("PASS" if ok else "FAIL"), (
            f"claims {sorted(recs)} prepared with {recs['share-a']['cdi_ids']}; in the container "
            f"NVIDIA_VISIBLE_DEVICES={seen.get('visible')}, in the pod's cgroup: "
            f"{seen.get('in_pod_cgroup')} (exit {rc}) {err.strip()[-200:]}")

    def s_isolation_probe(self):
        values = set()
        for d in getattr(self, "devices", []):
            for k, v in d.get("attributes", {}).items():
                if k.split("/")[-1] == "isolation":
                    values.add(next(iter(v.values())))
        if not values:
            return "SKIP", "no device publishes an `isolation` attribute (item 1 not in this build)"
        return ("PASS" if values == {"verified"} else "FAIL"), f"isolation={sorted(values)}"

    def s_share_memory(self):
        recs = self.allocate_and_prepare([
            self.claim("share-a", "shared.gpu.tessera.dev", "10Gi", 50),
            self.claim("share-b", "shared.gpu.tessera.dev", "20Gi", 30),
        ])
        self.phase1 = recs
        probes = {}
        procs = {n: self.popen_container(recs[n], self.mem_probe(), f"mem-{n}.log") for n in recs}
        for n, p in procs.items():
            p.wait(timeout=90)
            text = (self.logs / f"mem-{n}.log").read_text().strip().splitlines()
            probes[n] = json.loads(text[-1]) if text else {}
        a, b = probes["share-a"].get("allocated_gib", -1), probes["share-b"].get("allocated_gib", -1)
        ok = 8 <= a <= 9 and 18 <= b <= 19
        total = probes["share-a"].get("total", 0) / GIB
        return ("PASS" if ok else "FAIL"), (
            f"both at once: 10 GiB share got {a} GiB, 20 GiB share got {b} GiB before refusal "
            f"({probes['share-a'].get('refused_with')}); cudaMemGetInfo total inside: {total:.1f} GiB")

    def s_throughput(self):
        recs = self.phase1
        rc, alone, err = self.in_container(recs["share-a"], self.workload("matmul", "--seconds", "3"), 60)
        if rc != 0:
            raise StepError(f"matmul in share-a exited {rc}: {err.strip()[-300:]}")
        pa = self.popen_container(recs["share-a"], self.workload("matmul", "--seconds", "3"), "tp-a.log")
        pb = self.popen_container(recs["share-b"], self.workload("matmul", "--seconds", "3"), "tp-b.log")
        pa.wait(timeout=60)
        pb.wait(timeout=60)
        both = [json.loads((self.logs / f).read_text().strip().splitlines()[-1])["tflops"]
                for f in ("tp-a.log", "tp-b.log")]
        base = getattr(self, "baseline", None)
        ok = base is not None and alone["tflops"] < 0.85 * base
        return ("PASS" if ok else "FAIL"), (
            f"whole GPU {base} TFLOP/s; 50 % share alone {alone['tflops']}; "
            f"50 % + 30 % side by side {both[0]} + {both[1]}")

    def s_plugin_sigkill(self):
        rec = self.phase1["share-a"]
        work = self.popen_container(rec, self.workload("hold", "--gib", "2", "--seconds", "20"), "sigkill-hold.log")
        time.sleep(5)
        before = sorted(self.mps_daemons())
        self.stop_plugin(signal.SIGKILL)
        self.start_plugin()
        again = self.kubelet("prepare", [rec])
        ids = [i for d in again.get(rec["uid"], {}).get("devices", []) for i in d["cdiDeviceIds"]]
        time.sleep(3)
        after = sorted(self.mps_daemons())
        work.wait(timeout=60)
        ok = work.returncode == 0 and ids == rec["cdi_ids"] and before and after == before
        return ("PASS" if ok else "FAIL"), (
            f"workload exit {work.returncode}; MPS control daemon pids before {before}, after "
            f"{after} (the same daemons: {after == before}); same CDI ids: {ids == rec['cdi_ids']}")

    def s_unprepare(self):
        self.release(list(self.phase1))
        deadline = time.monotonic() + 20
        while self.mps_daemons() and time.monotonic() < deadline:
            time.sleep(0.5)
        left = self.mps_daemons()
        return ("PASS" if not left else "FAIL"), f"daemons left after the last unprepare: {len(left)}"

    def s_latency(self):
        recs = self.allocate_and_prepare([
            self.claim("online", "shared.gpu.tessera.dev", "10Gi", 70),
            self.claim("batch", "batch.gpu.tessera.dev", "10Gi", 30),
        ])
        try:
            rc, alone, err = self.in_container(recs["online"], self.workload("latency", "--seconds", "3"), 60)
            if rc != 0:
                raise StepError(f"latency exited {rc}: {err.strip()[-300:]}")
            batch = self.popen_container(recs["batch"], self.workload("matmul", "--seconds", "8"), "lat-batch.log")
            time.sleep(2)
            rc, beside, err = self.in_container(recs["online"], self.workload("latency", "--seconds", "3"), 60)
            batch.wait(timeout=60)
            if rc != 0:
                raise StepError(f"latency beside batch exited {rc}: {err.strip()[-300:]}")
            ratio = beside["p50_us"] / max(alone["p50_us"], 1e-9)
            return ("PASS" if ratio <= 2.0 else "FAIL"), (
                f"online 70 % (priority 0) alone p50 {alone['p50_us']} us p99 {alone['p99_us']} us; "
                f"beside batch 30 % (priority 1) p50 {beside['p50_us']} us p99 {beside['p99_us']} us "
                f"({ratio:.2f}x)")
        finally:
            self.release(list(recs))

    def s_accounting(self):
        recs = self.allocate_and_prepare([self.claim("workers", "shared.gpu.tessera.dev", "4Gi")])
        rec = recs["workers"]
        try:
            hold = " ".join(shlex.quote(a) for a in self.workload("hold", "--gib", "3", "--seconds", "25"))
            two = (f"{hold} > {shlex.quote(str(self.logs / 'worker-1.log'))} 2>&1 & first=$!; sleep 4; "
                   f"{hold} > {shlex.quote(str(self.logs / 'worker-2.log'))} 2>&1; second=$?; "
                   f"wait $first; first=$?; echo \"{{\\\"first\\\": $first, \\\"second\\\": $second}}\"")
            rc, codes, err = self.in_container(rec, ["/bin/sh", "-c", two], 90, pod_cgroup=True)
            if rc != 0 or "first" not in codes:
                raise StepError(f"the container exited {rc}: {err.strip()[-300:]} {codes}")
            events = [e for e in self.api("GET", f"/api/v1/namespaces/{NAMESPACE}/events").get("items", [])
                      if e.get("reason") == "GpuMemoryOverBooking"]
            ok = codes["first"] == 0 and codes["second"] != 0 and len(events) >= 1
            message = events[0]["message"] if events else "no Event"
            return ("PASS" if ok else "FAIL"), (
                f"two workers of 3 GiB on a 4 GiB booking: first exit {codes['first']}, second (newest) "
                f"exit {codes['second']}; Event: {message[:220]}")
        finally:
            self.release(list(recs))

    def s_two_users(self):
        """Two share pods on one GPU, one running as root and one as uid 1000. One MPS control
        daemon serves one user at a time (a client of another user waits until the first user's
        clients are gone), so the node runs one daemon per GPU set and user: both must make
        progress at once."""
        other = 1000
        rc, _, err = self.run(["setpriv", "--reuid", str(other), "--regid", str(other),
                               "--clear-groups", "--", sys.executable, "-c", "import torch"],
                              timeout=60, env={**os.environ, "HOME": str(self.users_dir())})
        if rc != 0:
            return "SKIP", f"uid {other} cannot import PyTorch here: {err.strip()[-200:]}"
        recs = self.allocate_and_prepare([
            self.claim("as-root", "shared.gpu.tessera.dev", "10Gi", 50),
            self.claim("as-user", "shared.gpu.tessera.dev", "10Gi", 50),
        ], users={"as-root": 0, "as-user": other})
        try:
            pipes = {n: self.mps_pipe_dirs(rec) for n, rec in recs.items()}
            procs = {n: self.popen_container(recs[n], self.workload("matmul", "--seconds", "10"),
                                             f"users-{n}.log") for n in recs}
            out = {}
            for n, p in procs.items():
                try:
                    p.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
                lines = (self.logs / f"users-{n}.log").read_text().strip().splitlines()
                try:
                    out[n] = json.loads(lines[-1]) if lines else {}
                except json.JSONDecodeError:
                    out[n] = {"raw": lines[-1][-200:]}
                out[n]["exit"] = p.returncode
            a, b = out["as-root"], out["as-user"]
            overlap = 0.0
            if all(k in a and k in b for k in ("began", "ended")):
                overlap = min(a["ended"], b["ended"]) - max(a["began"], b["began"])
            own = pipes["as-root"] != pipes["as-user"]
            ok = a["exit"] == 0 and b["exit"] == 0 and overlap > 5 and own
            return ("PASS" if ok else "FAIL"), (
                f"root: exit {a['exit']}, {a.get('tflops')} TFLOP/s; uid {other}: exit {b['exit']}, "
                f"{b.get('tflops')} TFLOP/s; their 10 s loops overlapped {overlap:.1f} s; "
                f"own MPS daemons: {own} ({pipes})")
        finally:
            self.release(list(recs))

    def s_hami(self):
        if not self.args.hami_library:
            return "SKIP", "no libvgpu.so given (--hami-library)"
        self.stop_plugin()
        self.start_plugin("hami-core")
        try:
            recs = self.allocate_and_prepare([self.claim("hami", "shared.gpu.tessera.dev", "8Gi")])
            rows = []
            ok = True
            for api in ("runtime", "driver"):
                rc, probe, err = self.in_container(recs["hami"], self.mem_probe(api), 90)
                got = probe.get("allocated_gib", -1)
                ok = ok and rc == 0 and 0 <= got <= 8
                rows.append(f"{api}: {got} GiB")
            self.release(list(recs))
            return ("PASS" if ok else "FAIL"), f"8 GiB share: {', '.join(rows)} before refusal"
        finally:
            self.stop_plugin()

    # --- the run -------------------------------------------------------------------------------

    def cleanup(self):
        try:
            if self.prepared and self.plugin:
                self.release(list(self.prepared))
        except (StepError, OSError, subprocess.SubprocessError) as e:
            print(f"cleanup: unprepare failed: {e}", file=sys.stderr)
        self.stop_plugin()
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
        if self.shared is not None:
            shutil.rmtree(self.shared, ignore_errors=True)
        # The cgroup directories this run made, deepest first (a cgroup goes once it is empty).
        for d in reversed(self.cgroups):
            try:
                d.rmdir()
            except OSError as e:
                print(f"cleanup: {d}: {e}", file=sys.stderr)

    def table(self, facts):
        lines = [f"Tessera GPU acceptance suite — {facts}", "",
                 "| Step | Result | Measured |", "| --- | --- | --- |"]
        lines += [f"| {r['step']} | {r['result']} | {r['detail']} |" for r in self.rows]
        took = time.monotonic() - self.start
        lines += ["", f"{sum(r['result'] == 'PASS' for r in self.rows)} passed, "
                      f"{sum(r['result'] == 'FAIL' for r in self.rows)} failed, "
                      f"{sum(r['result'] == 'SKIP' for r in self.rows)} skipped in {took:.0f} s"]
        return "\n".join(lines)

    def main(self):
        facts = self.args.facts
        steps = [
            ("baseline throughput (no MPS)", 20, self.s_baseline),
            ("NVML discovery through the fake API server", 45, self.s_discovery),
            ("isolation probe (item 1)", 1, self.s_isolation_probe),
            ("allocate + prepare + memory limits (10 GiB and 20 GiB shares)", 60, self.s_share_memory),
            ("throughput per thread percentage", 30, self.s_throughput),
            ("plugin SIGKILL while a workload runs", 60, self.s_plugin_sigkill),
            ("unprepare stops the daemon", 25, self.s_unprepare),
            ("online latency beside batch (shipped tiers)", 40, self.s_latency),
            ("two processes over one booking (item 3)", 50, self.s_accounting),
            ("two share pods of different users on one GPU (MPS per user)", 60, self.s_two_users),
            ("HAMi-core memory limit", 60, self.s_hami),
        ]
        if self.args.plumbing:
            steps = [steps[1],
                     ("allocate + prepare + CDI env in a container (no GPU)", 30, self.s_plumbing_container),
                     steps[6]]
        try:
            for name, need, fn in steps:
                self.step(name, need, fn)
                if name.startswith("NVML discovery") and self.rows[-1]["result"] != "PASS":
                    break
        finally:
            self.cleanup()
        text = self.table(facts)
        (self.out / "results.md").write_text(text + "\n")
        (self.out / "results.json").write_text(json.dumps({"facts": facts, "rows": self.rows}, indent=2) + "\n")
        print()
        print(text)
        print(f"\nresults: {self.out / 'results.md'}; logs: {self.logs}")
        return 1 if any(r["result"] == "FAIL" for r in self.rows) else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin-dir", required=True, help="release binaries of tessera, "
                        "tessera-kubelet-plugin, tessera-mps, tessera-fake-apiserver, "
                        "tessera-fake-kubelet")
    parser.add_argument("--out", required=True, help="results and logs")
    parser.add_argument("--work", required=True, help="scratch directory")
    parser.add_argument("--mps-root", required=True, help="tmpfs directory for MPS pipes")
    parser.add_argument("--facts", default="", help="GPU, driver and CUDA, for the table")
    parser.add_argument("--budget", type=float, default=280)
    parser.add_argument("--nvml-library", default="")
    parser.add_argument("--mps-control-binary", default="")
    parser.add_argument("--hami-library", default="")
    parser.add_argument("--plumbing", action="store_true",
                        help="no GPU: the plugin on a fake inventory without enforcement; checks "
                        "the API server, allocate, kubelet gRPC and CDI steps only")
    parser.add_argument("--plugin-arg", action="append", default=[],
                        help="extra plugin flag (repeat)")
    suite = Suite(parser.parse_args())
    sys.exit(suite.main())


if __name__ == "__main__":
    main()
