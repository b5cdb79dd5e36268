#!/usr/bin/env python3
"""Offline checks of the Helm chart's rendered manifests (called by deploy/scripts/check.sh).

  validate FILE...            every document against the pinned Kubernetes schema (strict), CRDs against
                              the pinned schemas in deploy/helm/schemas; an unknown kind fails.
  check-config FILE...        every tandem role container's command, with its environment resolved as the
                              kubelet would (ConfigMaps, fieldRefs, $(VAR) expansion from the variables
                              defined before), run with --check-config; `tandem verify` init containers must
                              parse their arguments. A LeaderWorkerSet is checked as one group's leader
                              (worker-index 0) and its rank 1, and each rank's --ep / TANDEM_EP must name
                              its rank, the group size and its group leader's DNS name and ep port.
                              Secret volumes (TLS) are mounted as a test CA's ca.crt, tls.crt and tls.key.
  boot [--set K=V]...         renders the CPU/tiny values (plus --set values, e.g. tls.enabled) with free
                              ports, starts the rendered commands as local processes (etcd, router, prefill,
                              decode; Service names and the pod IP mapped to loopback, volumes to temporary
                              directories, Secrets to the test CA's files), serves one request, then SIGTERMs
                              the decode worker, which must drain and exit 0 within its grace period while
                              the router stops reporting ready.
"""

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
DEPLOY = os.path.dirname(HERE)
CHART = os.path.join(DEPLOY, "helm", "tandem")
CRD_SCHEMAS = os.path.join(DEPLOY, "helm", "schemas")
K8S_VERSION = "1.33.0"
ROLES = ("router", "prefill-worker", "decode-worker")
POD_IP = "127.0.0.1"
# Clap exits with 2 on a usage error (unknown flag, bad value); 1 is a run-time failure.
CLAP_USAGE_ERROR = 2


class StrictLoader(yaml.SafeLoader):
    """Refuses a mapping with a repeated key, which PyYAML would silently collapse and the API server's
    strict decoding refuses."""


def _mapping(loader, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def load_docs(paths):
    docs = []
    for p in paths:
        with open(p) as f:
            for d in yaml.load_all(f, Loader=StrictLoader):
                if d:
                    docs.append((p, d))
    return docs


def name_of(d):
    return f"{d['kind']}/{d['metadata']['name']}"


# ---------------------------------------------------------------------------------------------- validate
def crd_validator(kind, api_version):
    import jsonschema
    import kubernetes_validate
    from referencing import Registry, Resource

    group = api_version.split("/")[0].split(".")[0]
    path = os.path.join(CRD_SCHEMAS, f"{kind.lower()}-{group}-{api_version.split('/')[-1]}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        schema = json.load(f)
    defs_path = os.path.join(
        os.path.dirname(kubernetes_validate.__file__),
        "kubernetes-json-schema",
        f"v{K8S_VERSION}-local-strict",
        "_definitions.json",
    )
    with open(defs_path) as f:
        defs = json.load(f)
    registry = Registry().with_resources(
        [(schema["$id"], Resource.from_contents(schema)), (defs["$id"], Resource.from_contents(defs))]
    )
    return jsonschema.Draft202012Validator(schema, registry=registry)


def cmd_validate(args):
    import kubernetes_validate.utils as kv

    failures = 0
    counts = {}
    for path, d in load_docs(args.files):
        what = f"{path}: {name_of(d)}"
        try:
            kv.validate(d, K8S_VERSION, strict=True)
        except kv.SchemaNotFoundError:
            v = crd_validator(d["kind"], d["apiVersion"])
            if v is None:
                print(f"FAIL {what}: no pinned schema for {d['apiVersion']} {d['kind']}")
                failures += 1
                continue
            errors = sorted(v.iter_errors(d), key=lambda e: list(e.absolute_path))
            if errors:
                for e in errors:
                    print(f"FAIL {what}: {'/'.join(map(str, e.absolute_path))}: {e.message}")
                failures += 1
                continue
        except kv.ValidationError as e:
            print(f"FAIL {what}: {'/'.join(map(str, e.absolute_path))}: {e.message}")
            failures += 1
            continue
        counts[d["kind"]] = counts.get(d["kind"], 0) + 1
    print(f"validate: Kubernetes {K8S_VERSION} (strict) + pinned CRD schemas: "
          + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + f"; {failures} failed")
    return 1 if failures else 0


# ------------------------------------------------------------------------------ pods and their environment
# The labels the LeaderWorkerSet controller puts on its pods.
LWS_GROUP_INDEX = "leaderworkerset.sigs.k8s.io/group-index"
LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"


class PodTemplate:
    """One pod a workload would create: a sample name and labels (what fieldRefs read), and its spec."""

    def __init__(self, workload, name, template, extra_labels=None):
        self.workload = workload
        self.name = name
        self.spec = template["spec"]
        self.labels = dict(template.get("metadata", {}).get("labels", {}))
        self.labels.update(extra_labels or {})


def pod_templates(docs):
    """Every pod template (Deployments, StatefulSets, LeaderWorkerSets) as PodTemplates. A LeaderWorkerSet
    gives one group's leader (worker 0, from leaderTemplate or else workerTemplate) and its worker 1, with
    the labels the LWS controller sets, so that both sides of an expert-parallel group are checked: group 1
    where there are several (a group index written as 0 then shows), else group 0."""
    out = []
    for _, d in docs:
        kind, name = d["kind"], d["metadata"]["name"]
        if kind == "Deployment":
            out.append(PodTemplate(d, f"{name}-5d8f7c9b4-x2x7q", d["spec"]["template"]))
        elif kind == "StatefulSet":
            out.append(PodTemplate(d, f"{name}-0", d["spec"]["template"]))
        elif kind == "LeaderWorkerSet":
            lwt = d["spec"]["leaderWorkerTemplate"]
            group = 1 if d["spec"].get("replicas", 1) > 1 else 0
            lws = {"leaderworkerset.sigs.k8s.io/name": name, LWS_GROUP_INDEX: str(group)}
            out.append(PodTemplate(d, f"{name}-{group}", lwt.get("leaderTemplate", lwt["workerTemplate"]),
                                   {**lws, LWS_WORKER_INDEX: "0"}))
            if lwt.get("size", 1) > 1:
                out.append(PodTemplate(d, f"{name}-{group}-1", lwt["workerTemplate"], {**lws, LWS_WORKER_INDEX: "1"}))
    return out


VAR_REF = re.compile(r"\$(\$|\(([A-Za-z_][A-Za-z0-9_]*)\))")


def expand(s, env):
    """The kubelet's $(VAR) expansion: a variable defined so far is replaced, an undefined one kept as
    written, and $$ is an escaped $ ($$(VAR) stays $(VAR))."""
    return VAR_REF.sub(lambda m: "$" if m.group(1) == "$" else env.get(m.group(2), m.group(0)), s)


def container_env(container, pod, config_maps):
    """The container's environment as the kubelet builds it: envFrom first, then env in order, each value
    expanded from the variables defined before it; fieldRefs read the sample pod's name, IP and labels (a
    missing label reads as "", as in Kubernetes)."""
    env = {}
    for src in container.get("envFrom", []):
        ref = src.get("configMapRef")
        if ref is None:
            raise SystemExit(f"unsupported envFrom {src} in {container['name']}")
        if ref["name"] not in config_maps:
            raise SystemExit(f"container {container['name']}: envFrom ConfigMap {ref['name']} is not rendered")
        env.update({src.get("prefix", "") + k: v for k, v in config_maps[ref["name"]].items()})
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(str(e["value"]), env)
        elif "valueFrom" in e:
            vf = e["valueFrom"]
            if "fieldRef" in vf:
                field = vf["fieldRef"]["fieldPath"]
                label = re.fullmatch(r"metadata\.labels\['([^']+)'\]", field)
                if field == "metadata.name":
                    env[e["name"]] = pod.name
                elif field == "status.podIP":
                    env[e["name"]] = POD_IP
                elif label:
                    env[e["name"]] = pod.labels.get(label.group(1), "")
                else:
                    raise SystemExit(f"unsupported fieldRef {field}")
            elif "secretKeyRef" in vf:
                env[e["name"]] = "secret-" + vf["secretKeyRef"]["key"]
            else:
                raise SystemExit(f"unsupported valueFrom {vf}")
    return env


def container_argv(container, env):
    """command + args, each expanded from the container's environment (kubelet rules)."""
    argv = list(container.get("command", [])) + list(container.get("args", []))
    return [expand(str(a), env) for a in argv]


def config_maps(docs):
    return {d["metadata"]["name"]: d.get("data", {}) for _, d in docs if d["kind"] == "ConfigMap"}


# --------------------------------------------------------------------------------------------- test PKI
def make_test_pki(root):
    """A throwaway CA and one certificate it signs, as a TLS Secret's files (ca.crt, tls.crt, tls.key): for
    server and client use, naming tandem-worker (the chart's default tls.serverName), localhost and
    127.0.0.1. Returns the directory."""
    d = os.path.join(root, "test-pki")
    os.makedirs(d)
    work = tempfile.mkdtemp(prefix="pki-", dir=root)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def openssl(*args):
        run = subprocess.run(["openssl", *args], cwd=work, capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"openssl {' '.join(args)}: {run.stderr.strip()}")

    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=chart check CA",
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    openssl("req", *ec, "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=tandem")
    with open(os.path.join(work, "ext.cnf"), "w") as f:
        f.write("subjectAltName=DNS:tandem-worker,DNS:localhost,IP:127.0.0.1\n"
                "extendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n"
                "keyUsage=critical,digitalSignature\n")
    openssl("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "tls.crt", "-days", "2", "-extfile", "ext.cnf")
    for name in ("ca.crt", "tls.crt", "tls.key"):
        shutil.copy(os.path.join(work, name), d)
    shutil.rmtree(work)
    return d


def secret_volumes(spec):
    return {v["name"] for v in spec.get("volumes", []) if "secret" in v}


def path_mapper(mounts):
    """Replaces each mount path (longest first) at the start of a path in a string with its local dir."""
    mounts = sorted(mounts, key=lambda m: len(m[0]), reverse=True)

    def map_str(s):
        for mp, local in mounts:
            s = re.sub(rf"(?<![\w/]){re.escape(mp)}(?=/|$|[^\w/])", lambda _m, local=local: local, s)
        return s

    return map_str


def base_env(extra):
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp")}
    env.update(extra)
    return env


# ------------------------------------------------------------------------------------------- check-config
def ep_group_problem(pod, container, argv, env):
    """For a rank of a LeaderWorkerSet: what is wrong with its expert-parallel group spec, or None. The
    spec (--ep or TANDEM_EP, resolved) must be RANK/WORLD@HOST:PORT with RANK the pod's worker index, WORLD
    the LWS size, HOST the group leader's DNS name under the LWS's headless Service (subdomainPolicy
    Shared: <lws>-<group>.<lws>.<namespace>.svc.<domain>) and PORT the container's "ep" port. tandem's
    --check-config checks the spec's syntax and values; this checks that it names this pod's group."""
    lws = pod.workload
    name, lwt = lws["metadata"]["name"], lws["spec"]["leaderWorkerTemplate"]
    size = lwt.get("size", 1)
    if size <= 1:
        return None
    policy = (lws["spec"].get("networkConfig") or {}).get("subdomainPolicy", "Shared")
    if policy != "Shared":
        return f"networkConfig.subdomainPolicy {policy}: the leader address assumes Shared"
    spec = argv[argv.index("--ep") + 1] if "--ep" in argv[:-1] else env.get("TANDEM_EP")
    if spec is None:
        return f"a rank of a group of {size} without --ep / TANDEM_EP"
    ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    group, rank = pod.labels[LWS_GROUP_INDEX], pod.labels[LWS_WORKER_INDEX]
    want = re.compile(rf"{rank}/{size}@{re.escape(name)}-{group}\.{re.escape(name)}\.[a-z0-9-]+\.svc\.[a-z0-9.-]+:{ports.get('ep')}")
    if "ep" not in ports or not want.fullmatch(spec):
        return (f"expert-parallel spec {spec!r}; expected {rank}/{size}@{name}-{group}.{name}.<namespace>.svc.<domain>:"
                f"<the container's ep port: {ports.get('ep')}>")
    return None


def cmd_check_config(args):
    failures = checked = 0
    root = tempfile.mkdtemp(prefix="tandem-check-config-")
    pki = make_test_pki(root)
    for path in args.files:
        docs = load_docs([path])
        cms = config_maps(docs)
        for pod in pod_templates(docs):
            workload, spec = pod.workload, pod.spec
            secrets = secret_volumes(spec)
            for kind, containers in (("init", spec.get("initContainers", [])), ("main", spec["containers"])):
                for c in containers:
                    # The TLS Secrets, as the test CA's files: --check-config reads and checks them.
                    m = path_mapper([(v["mountPath"], pki) for v in c.get("volumeMounts", []) if v["name"] in secrets])
                    resolved = {k: m(v) for k, v in container_env(c, pod, cms).items()}
                    argv = [m(a) for a in container_argv(c, resolved)]
                    if not argv or argv[0] != "tandem":
                        continue
                    env = base_env(resolved)
                    what = f"{os.path.basename(path)}: {name_of(workload)} pod {pod.name} {kind} container {c['name']}"
                    if argv[1] in ROLES:
                        problem = (ep_group_problem(pod, c, argv, resolved)
                                   if workload["kind"] == "LeaderWorkerSet" and argv[1] != "router" else None)
                        if problem:
                            print(f"FAIL {what}: {problem}")
                            failures += 1
                            continue
                        run = subprocess.run([args.tandem] + argv[1:] + ["--check-config"], env=env,
                                             capture_output=True, text=True, timeout=60)
                        ok = run.returncode == 0 and '"config-ok"' in run.stdout
                    elif argv[1] == "verify":
                        # No check mode: the arguments must parse (the model is absent here).
                        run = subprocess.run([args.tandem] + argv[1:], env=env, capture_output=True, text=True,
                                             timeout=60)
                        ok = run.returncode != CLAP_USAGE_ERROR
                    elif argv[1] == "gen-tiny":
                        run = subprocess.run([args.tandem, "gen-tiny", "--help"], env=env, capture_output=True,
                                             text=True, timeout=60)
                        ok = run.returncode == 0 and len(argv) == 3
                    else:
                        print(f"FAIL {what}: unknown tandem subcommand {argv[1]!r}")
                        failures += 1
                        continue
                    checked += 1
                    if not ok:
                        failures += 1
                        print(f"FAIL {what}: {' '.join(argv)}\n  rc={run.returncode} {run.stderr.strip()}")
    shutil.rmtree(root, ignore_errors=True)
    print(f"check-config: {checked} tandem commands checked, {failures} failed")
    return 1 if failures else 0


# --------------------------------------------------------------------------------------------------- boot
def free_ports(n):
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Pod:
    """One rendered pod run as local processes: init containers in order, then the main containers."""

    def __init__(self, template, cms, services, namespace, root, binaries, pki):
        self.pki = pki
        self.template = template
        self.name = template.name
        self.workload = template.workload
        self.spec = template.spec
        self.cms = cms
        self.dir = os.path.join(root, self.name)
        self.binaries = binaries
        os.makedirs(self.dir)
        self.procs = []
        hosts = sorted(services, key=len, reverse=True)
        alt = "|".join(re.escape(h) for h in hosts)
        ns = re.escape(namespace)
        self.host_re = re.compile(
            rf"(?<![\w.-])(?:[a-z0-9-]+\.)*(?:{alt})(?:\.{ns}(?:\.svc(?:\.cluster\.local)?)?)?(?=:\d)")

    def mapper(self, container):
        mounts = []
        secrets = secret_volumes(self.spec)
        for m in container.get("volumeMounts", []):
            if m["mountPath"] == "/dev/shm":
                continue
            local = os.path.join(self.dir, "volumes", m["name"])
            if m["name"] in secrets and not os.path.exists(local):
                shutil.copytree(self.pki, local)
            os.makedirs(local, exist_ok=True)
            mounts.append((m["mountPath"], local))
        paths = path_mapper(mounts)

        def map_str(s):
            return paths(self.host_re.sub("127.0.0.1", s))

        return map_str

    def command(self, container):
        env = container_env(container, self.template, self.cms)
        m = self.mapper(container)
        env = {k: m(v) for k, v in env.items()}
        argv = [m(a) for a in container_argv(container, env)]
        if argv[0] not in self.binaries:
            raise SystemExit(f"{self.name}/{container['name']}: no local binary for {argv[0]!r}")
        return [self.binaries[argv[0]]] + argv[1:], base_env(env)

    def start(self):
        for c in self.spec.get("initContainers", []):
            argv, env = self.command(c)
            log = os.path.join(self.dir, f"{c['name']}.log")
            with open(log, "w") as out:
                rc = subprocess.run(argv, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=120).returncode
            if rc != 0:
                raise SystemExit(f"{self.name}: init container {c['name']} failed (rc {rc}):\n{tail(log)}")
            print(f"boot: {self.name}: init container {c['name']} done")
        for c in self.spec["containers"]:
            argv, env = self.command(c)
            log = open(os.path.join(self.dir, f"{c['name']}.log"), "w")
            self.procs.append((c["name"], subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                           start_new_session=True), log.name))
            print(f"boot: {self.name}: started {' '.join(argv[:2])}")

    def check_alive(self):
        for name, p, log in self.procs:
            if p.poll() is not None:
                raise SystemExit(f"{self.name}/{name} exited with {p.returncode}:\n{tail(log)}")

    def stop(self):
        for _, p, _ in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for _, p, _ in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def tail(path, n=30):
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-n:])


def http(url, body=None, timeout=5):
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read().decode()


def wait_http(url, pods, deadline, what):
    while time.time() < deadline:
        for p in pods:
            p.check_alive()
        try:
            if http(url, timeout=2)[0] == 200:
                return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.3)
    raise SystemExit(f"boot: {what} not ready at {url} in time")


def drain_decode(pod, http_port):
    """SIGTERM as the kubelet sends it: the worker must drain, deregister and exit 0 within the pod's
    terminationGracePeriodSeconds, and the router must stop reporting ready (no decode worker left)."""
    grace = pod.spec["terminationGracePeriodSeconds"]
    name, proc, log = pod.procs[0]
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"boot: {pod.name}/{name} still running {grace} s after SIGTERM:\n{tail(log)}")
    if rc != 0:
        raise SystemExit(f"boot: {pod.name}/{name} exited with {rc} after SIGTERM:\n{tail(log)}")
    deadline = time.time() + 15
    while time.time() < deadline:
        try:
            http(f"http://127.0.0.1:{http_port}/ready", timeout=2)
        except urllib.error.HTTPError as e:
            if e.code == 503:
                print(f"boot: decode worker drained and exited 0 in {time.time() - t0:.1f} s (grace {grace} s); "
                      "the router reports not ready")
                return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise SystemExit("boot: the router still reports ready after the only decode worker left")


def cmd_boot(args):
    start = time.time()
    (http_port, grpc_port, p_grpc, p_kv, p_metrics, d_grpc, d_kv, d_metrics, etcd_client,
     etcd_peer) = free_ports(10)
    namespace = "tandem-boot"
    sets = {
        "router.service.httpPort": http_port, "router.service.grpcPort": grpc_port,
        "prefill.ports.grpc": p_grpc, "prefill.ports.kv": p_kv, "prefill.ports.metrics": p_metrics,
        "decode.ports.grpc": d_grpc, "decode.ports.kv": d_kv, "decode.ports.metrics": d_metrics,
        "etcd.clientPort": etcd_client, "etcd.peerPort": etcd_peer,
    }
    render = subprocess.run(
        [args.helm, "template", "boot", CHART, "--namespace", namespace, "-f", args.values]
        + ["--set", ",".join(f"{k}={v}" for k, v in sets.items())]
        + [a for kv in args.set for a in ("--set", kv)],
        capture_output=True, text=True, check=True).stdout
    root = tempfile.mkdtemp(prefix="tandem-boot-")
    pki = make_test_pki(root)
    rendered = os.path.join(root, "rendered.yaml")
    with open(rendered, "w") as f:
        f.write(render)
    docs = load_docs([rendered])
    cms = config_maps(docs)
    services = [d["metadata"]["name"] for _, d in docs if d["kind"] == "Service"]
    binaries = {"tandem": os.path.abspath(args.tandem), "etcd": shutil.which("etcd") or "etcd"}
    by_component = {}
    for template in pod_templates(docs):
        workload = template.workload
        comp = workload["metadata"]["labels"]["app.kubernetes.io/component"]
        if workload["kind"] == "LeaderWorkerSet":
            raise SystemExit(f"boot: {name_of(workload)}: expert-parallel pools run on GPUs, not in the CPU boot test")
        if workload["spec"].get("replicas", 1) != 1:
            raise SystemExit(f"boot: {name_of(workload)} has {workload['spec']['replicas']} replicas; expected 1")
        by_component[comp] = Pod(template, cms, services, namespace, root, binaries, pki)
    missing = {"etcd", "router", "prefill", "decode"} - set(by_component)
    if missing:
        raise SystemExit(f"boot: the rendered values lack {sorted(missing)}")
    pods = list(by_component.values())
    ok = False
    try:
        by_component["etcd"].start()
        wait_http(f"http://127.0.0.1:{etcd_client}/health", pods[:1], time.time() + 20, "etcd")
        for c in ("prefill", "decode", "router"):
            by_component[c].start()
        wait_http(f"http://127.0.0.1:{http_port}/ready", pods, time.time() + 90, "the router")
        status, body = http(f"http://127.0.0.1:{http_port}/v1/chat/completions",
                            {"model": "tandem-tiny", "messages": [{"role": "user", "content": "Hello!"}],
                             "max_tokens": 8, "temperature": 0}, timeout=60)
        reply = json.loads(body)
        text = reply["choices"][0]["message"]["content"]
        tokens = reply["usage"]["completion_tokens"]
        if status != 200 or tokens < 1:
            raise SystemExit(f"boot: unexpected answer {status} {body}")
        print(f"boot: served one request through the rendered cluster{' (' + ', '.join(args.set) + ')' if args.set else ''}: "
              f"{tokens} tokens {text!r} ({time.time() - start:.1f} s from render)")
        if "tls.enabled=true" in args.set:
            # The request went over mutual TLS: each worker says so when it starts serving.
            for c in ("prefill", "decode"):
                _, _, log = by_component[c].procs[0]
                with open(log, errors="replace") as f:
                    if "gRPC over TLS client_certificates=true" not in f.read():
                        raise SystemExit(f"boot: {c} worker did not serve mutual TLS:\n{tail(log)}")
            print("boot: both workers served mutual TLS")
        drain_decode(by_component["decode"], http_port)
        ok = True
    finally:
        for p in reversed(pods):
            p.stop()
        if ok:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"boot: logs kept in {root}")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("validate")
    v.add_argument("files", nargs="+")
    c = sub.add_parser("check-config")
    c.add_argument("--tandem", required=True)
    c.add_argument("files", nargs="+")
    b = sub.add_parser("boot")
    b.add_argument("--helm", required=True)
    b.add_argument("--tandem", required=True)
    b.add_argument("--values", default=os.path.join(DEPLOY, "helm", "values", "cpu-tiny.yaml"))
    b.add_argument("--set", action="append", default=[], help="extra values (helm --set), e.g. tls.enabled=true")
    a = ap.parse_args()
    try:
        return {"validate": cmd_validate, "check-config": cmd_check_config, "boot": cmd_boot}[a.cmd](a)
    except yaml.YAMLError as e:
        print(f"FAIL: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
