"""Kubernetes manifests from the same deployment YAML as ``stack.launch.sglang``.

``render_k8s(config) -> dict[filename, yaml_text]``, ``write_k8s(config, outdir)`` (the manifests
and ``create-secrets.sh``, which makes the Secrets they read).

What is rendered (namespace from ``launch.k8s.namespace``, default ``smetric``):

- ``00-namespace.yaml``       Namespace
- ``10-config.yaml``          ConfigMap ``smetric-router-config``: the router's resolved config
                              (the same worker lists as the per-node launch, with Service DNS names)
- ``20-mooncake-master.yaml`` Deployment + Service (when a master is launched)
- ``21-redis.yaml``           Deployment + Service (when ``launch.redis`` is set), with a password
                              (``requirepass``) from the Secret, always: it listens on the pod network
- ``12-lmcache-config.yaml``  (``launch.kv_tier: lmcache``) ConfigMap: the workers' LMCache config;
                              each worker pod then has an ``lmcache-server`` sidecar container
- ``22-lmcache-controller.yaml`` Deployment + Service ``lmcache-controller`` (kv_tier lmcache)
- ``30-prefill.yaml``         headless Service + StatefulSet ``prefill`` (replicas = count; each
                              pod ``tp`` GPUs; stable names prefill-0.prefill.<ns>.svc) + PodDisruptionBudget
- ``31-decode.yaml``          headless Service + StatefulSet ``decode`` + PodDisruptionBudget
- ``40-router.yaml``          Deployment + Service ``smetric-router`` (``router.port``), a headless
                              Service ``smetric-router-pods`` (one DNS record per replica, for
                              Prometheus: deploy/prometheus/prometheus-k8s.yaml) + PodDisruptionBudget

Secrets (never a value in a manifest; ``create-secrets.sh`` makes them): ``launch.k8s.secret``
(default ``smetric-keys``) holds one key per env var: the admin token (``router.admin_token_env``,
optional: without it the admin API refuses everyone), the Redis password (``launch.redis.password_env``)
and the workers' keys (``launch.sglang.api_key_env`` / ``admin_api_key_env``). With client keys on
(``router.auth.keys_file`` or ``keys_env``), ``launch.k8s.keys_secret`` (default
``smetric-client-keys``) holds the keys file as ``keys.yaml``, mounted into the router, which reads
it at start and on ``POST /admin/auth/reload`` (the kubelet refreshes the mounted file when the
Secret changes).

Probes fit SGLang's ``/health``, which generates a token and never answers in under 1 s (its own
verdict, 503, after 20 s): readiness every 10 s with a 5 s timeout (the router's own
``health_timeout_s``), a startup probe that allows ``launch.ready_timeout_s`` (default 900 s) for
the weights to load, and a liveness probe with a 25 s timeout, 5 failures in a row. Every container
requests CPU and memory (``launch.k8s.resources.<component>`` replaces the defaults:
:data:`RESOURCES`; a worker's memory request adds its Mooncake segment and HiCache host pool when
the config gives their sizes). The router's preStop waits ``launch.k8s.router_prestop_s`` (15 s)
so that load balancers stop sending before it gets SIGTERM; on SIGTERM the router drains (its
``/health`` 503, new requests refused with the overload answer, what it holds finished:
stack/prefill_router/drain.py), and the pod's termination grace covers the preStop and the
drain's deadline (``launch.k8s.router_termination_grace_s``, default: the preStop plus
:func:`~stack.launch.router_spec.drain_grace_s`).

The SGLang argument lists are exactly those of the per-node launch for instance 0 of each pool
(so tests/integration/test_sglang_args.py covers them), except: each pod has its own IP, so every pod uses
the pool's base ports; ``--host 0.0.0.0``; ``SGLANG_HOST_IP`` / ``MOONCAKE_LOCAL_HOSTNAME`` come
from the pod IP; GPUs come from ``nvidia.com/gpu`` limits (no CUDA_VISIBLE_DEVICES). NICs: a pod
cannot know which physical GPUs it got, so no fixed GPU -> NIC list can be right (the old
``launch.k8s.ib_devices`` gave every TP1 pod the first NIC; it is refused now). With an RDMA device
plugin, ``launch.k8s.rdma_resource`` (e.g. ``rdma/hca``, or an SR-IOV per-NIC resource) is
requested ``launch.k8s.rdma_per_pod`` times (default ``tp``: one NIC per GPU, as on bare metal),
and Mooncake uses the RDMA devices the plugin put in the pod. ``host_network: true`` is only
accepted when one pod fills a node's GPUs (``tp`` = GPUs per node), since every pod of a pool
listens on the same ports.

``launch.k8s`` keys: namespace, image (SGLang, default lmsysorg/sglang:v0.5.23-cu130),
router_image (deploy/image/Containerfile), model_host_path (hostPath mounted at the model's
directory) or model_pvc, rdma_resource, rdma_per_pod, host_network, shm_size (default 32Gi),
node_selector (per pool or global), service_type (router Service, default ClusterIP), python
(default python3 in the image), secret, keys_secret, redis_tls_secret (with ``launch.redis.tls``:
a ``kubernetes.io/tls`` Secret with ``ca.crt``), resources, router_prestop_s,
router_termination_grace_s (120).
"""

from __future__ import annotations

import copy
import math
import re
import shlex
from pathlib import Path
from typing import Any

from stack.launch import replicas
from stack.launch.lmcache_tier import kv_tier, lmcache_settings
from stack.launch.router_spec import drain_grace_s
from stack.launch.sglang import resolved_config, sglang_process_specs
from stack.launch.sglang_config import LaunchConfigError, as_dict, pool_settings, sglang_launch
from stack.launch.spec import READY_TIMEOUT_S

DEFAULT_IMAGE = "lmsysorg/sglang:v0.5.23-cu130"
DEFAULT_ROUTER_IMAGE = "smetric/stack:latest"
CONFIG_MOUNT = "/etc/smetric"
#: where the client keys file (the keys Secret) is mounted in the router
KEYS_MOUNT = "/etc/smetric-keys"
#: where the Redis TLS Secret is mounted (``tls.crt``, ``tls.key``, ``ca.crt``)
REDIS_TLS_MOUNT = "/etc/smetric-redis-tls"
#: the Secret with the client keys file, as ``keys.yaml`` (``launch.k8s.keys_secret``)
DEFAULT_KEYS_SECRET = "smetric-client-keys"
#: default requests (and limits) per component; ``launch.k8s.resources.<component>`` replaces
#: them. A GPU worker's are per GPU of the pod, and its memory request adds the Mooncake segment
#: and the HiCache host pool when the config sizes them (:func:`_worker_resources`).
RESOURCES: dict[str, dict[str, dict[str, str]]] = {
    "prefill": {"requests": {"cpu": "4", "memory": "16Gi"}},
    "decode": {"requests": {"cpu": "4", "memory": "16Gi"}},
    "router": {"requests": {"cpu": "2", "memory": "2Gi"}, "limits": {"memory": "8Gi"}},
    "mooncake-master": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "4Gi"}},
    "redis": {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
    "lmcache-controller": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "4Gi"}},
    "lmcache-server": {"requests": {"cpu": "2", "memory": "4Gi"}},
}
#: real SGLang's /health answers in 1 s at best and gives its own 503 after 20 s: readiness times
#: out as the router's health check does (router.health_timeout_s, 5 s), liveness after SGLang's
#: own verdict (25 s), 5 misses in a row
WORKER_READY_TIMEOUT_S = 5
WORKER_LIVE_TIMEOUT_S = 25


def _k8s_view(cfg: dict[str, Any]) -> dict[str, Any]:
    """The same config squeezed onto one virtual node per pool (a pod's view of ports)."""
    c = copy.deepcopy(cfg)
    launch = c["launch"]
    k = launch.get("k8s") or {}
    # which NIC sits next to a pod's GPU is the device plugin's business: leave
    # --disaggregation-ib-device / MOONCAKE_DEVICE out (Mooncake uses the pod's RDMA devices)
    if k.get("ib_devices"):
        raise LaunchConfigError(
            "launch.k8s.ib_devices: removed. A pod cannot know which physical GPUs it got, so a fixed "
            "GPU -> NIC list gave every TP1 pod the same NIC. Set launch.k8s.rdma_resource to your RDMA "
            "device plugin's resource (one per NIC, e.g. an SR-IOV RDMA resource, or rdma/hca): each pod "
            "requests launch.k8s.rdma_per_pod of it (default: one per GPU) and Mooncake uses the devices "
            "the plugin puts in the pod"
        )
    ib: list[str] = []
    launch["python"] = k.get("python", "python3")
    launch["bind_host"] = "0.0.0.0"
    launch["run_dir"] = CONFIG_MOUNT
    launch["nodes"] = []
    for role in ("prefill", "decode"):
        pool = dict(launch.get(role) or {})
        tp = int(pool.get("tp", 1))
        launch["nodes"].append({"name": f"{role}-pod", "host": f"{role}-pod", "gpus": tp, "ib_devices": ib})
        pool["nodes"] = [f"{role}-pod"]
        pool["count"] = 1 if int(pool.get("count", 1)) > 0 else 0
        launch[role] = pool
    m = launch.get("mooncake_master")
    if isinstance(m, dict):
        m = dict(m)
        m["node"] = "prefill-pod"
        launch["mooncake_master"] = m
    if isinstance(launch.get("redis"), dict):
        launch["redis"] = {**launch["redis"], "node": "prefill-pod"}
        if launch["redis"].get("tls"):  # the TLS Secret's files, where the pods mount it
            launch["redis"]["tls"] = _redis_tls_files()
    lm = launch.get("lmcache")
    if isinstance(lm, dict) and isinstance(lm.get("controller"), dict):
        launch["lmcache"] = {**lm, "controller": {**lm["controller"], "node": "prefill-pod"}}
    if launch.get("router") is not False:
        launch["router"] = {**(launch.get("router") or {}), "node": "prefill-pod"}
    return c


def _redis_tls_files() -> dict[str, str]:
    """The Redis TLS Secret's files (``kubernetes.io/tls`` keys plus ``ca.crt``) where it is mounted."""
    return {
        "cert_file": f"{REDIS_TLS_MOUNT}/tls.crt",
        "key_file": f"{REDIS_TLS_MOUNT}/tls.key",
        "ca_file": f"{REDIS_TLS_MOUNT}/ca.crt",
    }


def _redis_tls_volume(cfg: dict[str, Any]) -> tuple[dict, dict]:
    """(volume, mount) of ``launch.k8s.redis_tls_secret`` (default ``smetric-redis-tls``)."""
    name = str((cfg["launch"].get("k8s") or {}).get("redis_tls_secret", "smetric-redis-tls"))
    vol = {"name": "redis-tls", "secret": {"secretName": name, "defaultMode": 0o440}}
    return vol, {"name": "redis-tls", "mountPath": REDIS_TLS_MOUNT, "readOnly": True}


def _ns(cfg: dict[str, Any]) -> str:
    return str((cfg["launch"].get("k8s") or {}).get("namespace", "smetric"))


def _dump(docs: list[dict]) -> str:
    import yaml

    class _Dumper(yaml.SafeDumper):
        pass

    def _str(dumper, data):  # multi-line strings (the ConfigMap's file) as literal blocks
        style = "|" if "\n" in data else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)

    _Dumper.add_representer(str, _str)
    return "".join("---\n" + yaml.dump(d, Dumper=_Dumper, sort_keys=False, width=120) for d in docs)


def _labels(component: str) -> dict[str, str]:
    return {"app.kubernetes.io/part-of": "smetric", "app.kubernetes.io/component": component}


def _service(
    name: str,
    ns: str,
    component: str,
    ports: dict[str, int],
    headless: bool = False,
    type_: str | None = None,
) -> dict:
    spec: dict[str, Any] = {
        "selector": _labels(component),
        "ports": [{"name": n, "port": p, "targetPort": p} for n, p in ports.items()],
    }
    if headless:
        spec["clusterIP"] = "None"
        spec["publishNotReadyAddresses"] = True
    if type_:
        spec["type"] = type_
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": ns, "labels": _labels(component)},
        "spec": spec,
    }


#: the Secret holding the env vars a process lists in ``secret_env`` (the workers' API keys),
#: one key per variable (``launch.k8s.secret``)
DEFAULT_SECRET = "smetric-keys"


def _secret_name(cfg: dict[str, Any]) -> str:
    return str((cfg["launch"].get("k8s") or {}).get("secret", DEFAULT_SECRET))


def _secret_ref(cfg: dict[str, Any], var: str, optional: bool = False) -> dict:
    """An env entry of ``var`` from the Secret's key ``var``."""
    ref: dict[str, Any] = {"name": _secret_name(cfg), "key": var}
    if optional:
        ref["optional"] = True
    return {"name": var, "valueFrom": {"secretKeyRef": ref}}


def _secret_env(cfg: dict[str, Any], spec) -> list[dict]:
    """Env entries of ``spec.secret_env`` from the Secret (never a value in the manifest);
    Kubernetes then expands the ``$(NAME)`` in the container's args."""
    return [_secret_ref(cfg, n) for n in getattr(spec, "secret_env", [])]


def _pod_env(env: dict[str, str], pod_ip_keys: tuple[str, ...] = ()) -> list[dict]:
    out = []
    for k, v in env.items():
        if k in pod_ip_keys:
            out.append({"name": k, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
        elif k == "CUDA_VISIBLE_DEVICES":
            continue  # the device plugin assigns GPUs
        else:
            out.append({"name": k, "value": v})
    return out


def _probe(
    path: str, port: int, initial: int = 0, period: int = 10, failures: int = 3, timeout: int = 5
) -> dict:
    """An HTTP GET probe; ``timeout`` seconds per try (Kubernetes' default, 1 s, is what real
    SGLang's /health takes at best)."""
    return {
        "httpGet": {"path": path, "port": port},
        "initialDelaySeconds": initial,
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def _tcp_probe(port: int, period: int = 5, timeout: int = 2, failures: int = 3) -> dict:
    return {
        "tcpSocket": {"port": port},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def _resources(cfg: dict[str, Any], component: str) -> dict[str, dict[str, Any]]:
    """Requests and limits of ``component``: ``launch.k8s.resources.<component>`` or :data:`RESOURCES`."""
    given = ((cfg["launch"].get("k8s") or {}).get("resources") or {}).get(component)
    if given is not None and not (isinstance(given, dict) and set(given) <= {"requests", "limits"}):
        raise LaunchConfigError(f"launch.k8s.resources.{component}: a mapping of requests and limits")
    return copy.deepcopy(given if given is not None else RESOURCES[component])


_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*(gb)?$", re.I)


def _gib(size: Any) -> float:
    """GiB of a size as the launcher takes it (bytes, or ``<n>gb``); 0 when unset."""
    m = _SIZE.match(str(size or "").strip())
    if not m:
        return 0.0
    return float(m.group(1)) / (1.0 if m.group(2) else 2.0**30)


def _worker_resources(
    cfg: dict[str, Any], role: str, tp: int, env: dict[str, str]
) -> dict[str, dict[str, Any]]:
    """A GPU worker's requests: ``launch.k8s.resources.<role>`` as given, else :data:`RESOURCES`'
    per GPU plus the host memory the config sizes (its Mooncake segment, its HiCache host pool's
    ``size_gb``; a pool sized by ``ratio`` only is not counted: give the figure in resources)."""
    if role in ((cfg["launch"].get("k8s") or {}).get("resources") or {}):
        return _resources(cfg, role)
    res = _resources(cfg, role)
    hicache = pool_settings(cfg["launch"], role).get("hicache") or {}
    extra = _gib(env.get("MOONCAKE_GLOBAL_SEGMENT_SIZE")) + float(hicache.get("size_gb") or 0)
    req = res["requests"]
    req["cpu"] = str(int(req["cpu"]) * tp)
    req["memory"] = f"{int(req['memory'].removesuffix('Gi')) * tp + math.ceil(extra)}Gi"
    return res


def _pdb(name: str, ns: str, component: str) -> dict:
    """At most one pod of ``component`` down at a time by a voluntary disruption (a node drain)."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "namespace": ns, "labels": _labels(component)},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _labels(component)}},
    }


def _model_volume(cfg: dict[str, Any]) -> tuple[list[dict], list[dict]]:
    k = cfg["launch"].get("k8s") or {}
    model_path = cfg["launch"].get("model_path") or (cfg.get("model") or {}).get("path")
    if not model_path:
        raise LaunchConfigError("launch.model_path (or model.path) is needed for the model volume")
    mount_dir = str(Path(model_path).parent) if k.get("model_host_path") else str(model_path)
    if k.get("model_pvc"):
        vol = {"name": "models", "persistentVolumeClaim": {"claimName": k["model_pvc"], "readOnly": True}}
        mount_dir = str(Path(model_path).parent)
    else:
        vol = {
            "name": "models",
            "hostPath": {
                "path": str(k.get("model_host_path") or Path(model_path).parent),
                "type": "Directory",
            },
        }
    shm = {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": str(k.get("shm_size", "32Gi"))}}
    mounts = [
        {"name": "models", "mountPath": mount_dir, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    return [vol, shm], mounts


def _worker_statefulset(
    cfg: dict[str, Any], kcfg: dict[str, Any], role: str, spec, count: int, tp: int
) -> list[dict]:
    ns = _ns(cfg)
    pool = pool_settings(cfg["launch"], role)
    ports = {"http": int(pool["port"])}
    if role == "prefill":
        ports["bootstrap"] = int(pool["bootstrap_port"])
    if pool.get("kv_events_port") is not None:
        ports["kv-events"] = int(pool["kv_events_port"])
    vols, mounts = _model_volume(cfg)
    k = cfg["launch"].get("k8s") or {}
    if k.get("host_network") and tp < int(k.get("gpus_per_node", 8)):
        raise LaunchConfigError(
            f"launch.k8s.host_network: {role} pods (tp={tp}) would share a node and clash on ports "
            f"{sorted(ports.values())}; use the pod network (with an RDMA device plugin) or tp = GPUs per node"
        )
    resources = _worker_resources(cfg, role, tp, spec.env)
    limits = resources.setdefault("limits", {})
    limits["nvidia.com/gpu"] = tp
    if k.get("rdma_resource"):  # one NIC per GPU unless told otherwise: the plugin picks which
        limits[str(k["rdma_resource"])] = int(k.get("rdma_per_pod", tp))
    # the startup probe allows the weights' load (launch.ready_timeout_s); then readiness and
    # liveness as SGLang's /health allows (WORKER_READY_TIMEOUT_S, WORKER_LIVE_TIMEOUT_S)
    ready_s = float(cfg["launch"].get("ready_timeout_s") or READY_TIMEOUT_S["sglang"])
    container = {
        "name": "sglang",
        "image": str(k.get("image", DEFAULT_IMAGE)),
        "command": spec.argv[:1],
        "args": spec.argv[1:],
        "env": _pod_env(spec.env, ("SGLANG_HOST_IP", "MOONCAKE_LOCAL_HOSTNAME")) + _secret_env(cfg, spec),
        "ports": [{"name": n, "containerPort": p} for n, p in ports.items()],
        "resources": resources,
        "volumeMounts": mounts,
        "startupProbe": _probe(
            "/health", ports["http"], 10, 10, math.ceil(ready_s / 10), WORKER_READY_TIMEOUT_S
        ),
        "readinessProbe": _probe("/health", ports["http"], 0, 10, 3, WORKER_READY_TIMEOUT_S),
        "livenessProbe": _probe("/health", ports["http"], 0, 30, 5, WORKER_LIVE_TIMEOUT_S),
    }
    if k.get("rdma_resource") or k.get("host_network"):
        container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    pod: dict[str, Any] = {"containers": [container], "volumes": vols}
    if k.get("host_network"):
        pod["hostNetwork"] = True
        pod["dnsPolicy"] = "ClusterFirstWithHostNet"
    sel = k.get("node_selector") or {}
    sel = (
        sel.get(role, sel)
        if isinstance(sel.get(role), dict)
        else {kk: vv for kk, vv in sel.items() if not isinstance(vv, dict)}
    )
    if sel:
        pod["nodeSelector"] = sel
    sts = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": role, "namespace": ns, "labels": _labels(role)},
        "spec": {
            "serviceName": role,
            "replicas": count,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": _labels(role)},
            "template": {"metadata": {"labels": _labels(role)}, "spec": pod},
        },
    }
    return [_service(role, ns, role, ports, headless=True), sts, _pdb(role, ns, role)]


def _simple_deployment(
    cfg,
    name: str,
    component: str,
    spec,
    ports: dict[str, int],
    image: str,
    extra_pod: dict | None = None,
    extra_container: dict | None = None,
) -> dict:
    ns = _ns(cfg)
    container = {
        "name": name,
        "image": image,
        "command": spec.argv[:1],
        "args": spec.argv[1:],
        "env": _pod_env(spec.env) + _secret_env(cfg, spec),
        "ports": [{"name": n, "containerPort": p} for n, p in ports.items()],
        "resources": _resources(cfg, component),
        **(extra_container or {}),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": ns, "labels": _labels(component)},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": _labels(component)},
            "template": {
                "metadata": {"labels": _labels(component)},
                "spec": {"containers": [container], **(extra_pod or {})},
            },
        },
    }


def k8s_router_config(config: Any) -> dict[str, Any]:
    """The router's resolved config with in-cluster DNS names for every worker."""
    cfg = copy.deepcopy(as_dict(config))
    launch = sglang_launch(cfg)
    ns = _ns(cfg)
    # resolve on the real nodes (validates placement), then rewrite addresses
    out = resolved_config(cfg)
    pp = pool_settings(launch, "prefill")
    dp = pool_settings(launch, "decode")
    out["prefill"] = []
    for i in range(int(pp["count"])):
        host = f"prefill-{i}.prefill.{ns}.svc.cluster.local"
        w = {
            "url": f"http://{host}:{pp['port']}",
            "bootstrap_port": int(pp["bootstrap_port"]),
            "name": f"prefill-{i}",
        }
        if pp.get("kv_events_port") is not None:
            w["kv_events"] = f"tcp://{host}:{pp['kv_events_port']}"
            w["kv_topic"] = pp["kv_events_topic"]
        out["prefill"].append(w)
    out["decode"] = [
        {"url": f"http://decode-{i}.decode.{ns}.svc.cluster.local:{dp['port']}", "name": f"decode-{i}"}
        for i in range(int(dp["count"]))
    ]
    m = launch.get("mooncake_master")
    if out.get("mooncake"):
        mm = m if isinstance(m, dict) else {}
        out["mooncake"] = {
            **out["mooncake"],
            "master": f"mooncake-master.{ns}.svc.cluster.local:{mm.get('rpc_port', 50051)}",
        }
        if mm.get("http_metadata_port", 8080):
            out["mooncake"]["metadata_url"] = (
                f"http://mooncake-master.{ns}.svc.cluster.local:{mm.get('http_metadata_port', 8080)}/metadata"
            )
    out["router"] = {**(out.get("router") or {}), "host": "0.0.0.0"}
    if out["router"].get("lmcache_controller_url"):
        c = lmcache_settings(launch)["controller"]
        out["router"]["lmcache_controller_url"] = (
            f"http://lmcache-controller.{ns}.svc.cluster.local:{int(c['port'])}"
        )
    redis = launch.get("redis")
    if redis:  # on the pod network: always a password, from the Secret
        tls = _redis_tls_files() if replicas.redis_tls(redis) else None
        port = int(redis.get("port", 6379))
        out["router"]["redis_url"] = replicas.redis_url(f"redis.{ns}.svc.cluster.local", port, tls)
        out["router"]["redis_password_env"] = replicas.redis_password_env(redis, loopback=False)
    auth = dict(out["router"].get("auth") or {})
    if auth.get("keys_file") or auth.get("keys_env"):  # client keys: the keys Secret's file
        auth.pop("keys_env", None)
        auth["keys_file"] = f"{KEYS_MOUNT}/keys.yaml"
        out["router"]["auth"] = auth
    out.pop("launch", None)
    return out


def render_k8s(config: Any) -> dict[str, str]:
    """File name -> multi-document YAML text."""
    import yaml

    cfg = as_dict(config)
    launch = sglang_launch(cfg)
    if launch.get("device", "cuda") == "cpu":
        raise LaunchConfigError(
            "launch.device: cpu is the local test tier; Kubernetes manifests are for GPU pools"
        )
    ns = _ns(cfg)
    k = launch.get("k8s") or {}
    view = _k8s_view(cfg)
    specs = {s.role: s for s in sglang_process_specs(view)}
    files: dict[str, str] = {}
    files["00-namespace.yaml"] = _dump(
        [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "labels": _labels("namespace")}}]
    )
    rcfg = k8s_router_config(cfg)
    files["10-config.yaml"] = _dump(
        [
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": "smetric-router-config", "namespace": ns, "labels": _labels("router")},
                "data": {"router-config.yaml": yaml.safe_dump(rcfg, sort_keys=False, width=200)},
            }
        ]
    )
    master_addr = None
    if "mooncake_master" in specs:
        s = specs["mooncake_master"]
        m = view["launch"]["mooncake_master"]
        ports = {"rpc": int(m.get("rpc_port", 50051)), "metrics": int(m.get("metrics_port", 9003))}
        if m.get("http_metadata_port", 8080):
            ports["metadata"] = int(m.get("http_metadata_port", 8080))
        s.argv = [a.replace("--rpc_address=127.0.0.1", "--rpc_address=0.0.0.0") for a in s.argv]
        dep = _simple_deployment(
            cfg,
            "mooncake-master",
            "mooncake-master",
            s,
            ports,
            str(k.get("mooncake_image", k.get("image", DEFAULT_IMAGE))),
            extra_container={
                "readinessProbe": _tcp_probe(ports["rpc"]),
                "livenessProbe": _probe("/metrics", ports["metrics"], 10, 10, 6, 5),
            },
        )
        files["20-mooncake-master.yaml"] = _dump(
            [_service("mooncake-master", ns, "mooncake-master", ports), dep]
        )
        master_addr = f"mooncake-master.{ns}.svc.cluster.local:{ports['rpc']}"
    if "redis" in specs:
        s = specs["redis"]
        port = int(view["launch"]["redis"].get("port", 6379))
        s.argv = [a if a not in ("127.0.0.1",) else "0.0.0.0" for a in s.argv]
        extra_pod, mounts = {}, {}
        if replicas.redis_tls(view["launch"]["redis"]):
            vol, mount = _redis_tls_volume(cfg)
            extra_pod, mounts = {"volumes": [vol]}, {"volumeMounts": [mount]}
        dep = _simple_deployment(
            cfg,
            "redis",
            "redis",
            s,
            {"redis": port},
            str(k.get("redis_image", "redis:7")),
            extra_pod=extra_pod,
            extra_container={
                "readinessProbe": _tcp_probe(port),
                "livenessProbe": _tcp_probe(port, period=10, failures=6),
                **mounts,
            },
        )
        files["21-redis.yaml"] = _dump([_service("redis", ns, "redis", {"redis": port}), dep])
    lm = kv_tier(launch) == "lmcache"
    if lm:
        files.update(_lmcache_docs(cfg, view, specs, master_addr))
    for idx, role in ((30, "prefill"), (31, "decode")):
        if role not in specs:
            continue
        s = specs[role]
        if master_addr and "MOONCAKE_MASTER" in s.env:
            s.env["MOONCAKE_MASTER"] = master_addr
        pool = pool_settings(launch, role)
        docs = _worker_statefulset(view, k, role, s, int(pool["count"]), int(pool["tp"]))
        if lm:
            _add_lmcache_sidecar(cfg, docs[1], specs["lmcache_server"], master_addr)
        files[f"{idx}-{role}.yaml"] = _dump(docs)
    if "router" in specs:
        files["40-router.yaml"] = _dump(_router_docs(cfg, view, specs["router"]))
    return files


def _router_docs(cfg: dict[str, Any], view: dict[str, Any], spec) -> list[dict]:
    """The router's Service, the headless Service Prometheus finds each replica by, its
    Deployment and its PodDisruptionBudget."""
    ns = _ns(cfg)
    launch = cfg["launch"]
    k = launch.get("k8s") or {}
    rc = cfg.get("router") or {}
    rport = int(rc.get("port", 8000))
    spec.argv = ["smetric", "router", "--config", f"{CONFIG_MOUNT}/router-config.yaml"]
    vols, mounts = _router_volumes(cfg, view)
    prestop = int(k.get("router_prestop_s", 15))
    # /health is 503 while no worker is healthy: readiness, not liveness (a router is not
    # restarted for its workers); liveness asks /metrics, which the router answers itself
    live = (
        _tcp_probe(rport, period=10, failures=6)
        if (rc.get("auth") or {}).get("protect_metrics")
        else _probe("/metrics", rport, 5, 10, 6, 5)
    )
    dep = _simple_deployment(
        cfg,
        "smetric-router",
        "router",
        spec,
        {"http": rport},
        str(k.get("router_image", DEFAULT_ROUTER_IMAGE)),
        extra_pod={
            "volumes": vols,
            "terminationGracePeriodSeconds": int(
                k.get("router_termination_grace_s", prestop + drain_grace_s(rc))
            ),
            "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001},
        },
        extra_container={
            "volumeMounts": mounts,
            "readinessProbe": _probe("/health", rport, 2, 5, 2, 3),
            "livenessProbe": live,
            # SIGTERM only once load balancers have stopped sending (the endpoint goes as the
            # preStop starts); the SIGTERM then drains what the replica holds
            "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(prestop)]}}},
            "securityContext": {"allowPrivilegeEscalation": False},
        },
    )
    c = dep["spec"]["template"]["spec"]["containers"][0]
    c["env"] = c["env"] + [
        _secret_ref(cfg, str(rc.get("admin_token_env", "SMETRIC_ADMIN_TOKEN")), optional=True)
    ]
    dep["spec"]["replicas"] = int((launch.get("router") or {}).get("replicas", 1))
    dep["spec"]["strategy"] = {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    return [
        _service("smetric-router", ns, "router", {"http": rport}, type_=k.get("service_type", "ClusterIP")),
        _service("smetric-router-pods", ns, "router", {"http": rport}, headless=True),
        dep,
        _pdb("smetric-router", ns, "router"),
    ]


def _router_volumes(cfg: dict[str, Any], view: dict[str, Any]) -> tuple[list[dict], list[dict]]:
    """The router's volumes and mounts: its config, the model (its tokenizer), the client keys
    Secret (with router.auth keys), the Redis TLS Secret (with launch.redis.tls)."""
    model_vols, model_mounts = _model_volume(cfg)
    vols = [{"name": "config", "configMap": {"name": "smetric-router-config"}}, model_vols[0]]
    mounts = [{"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True}, model_mounts[0]]
    auth = (cfg.get("router") or {}).get("auth") or {}
    if auth.get("keys_file") or auth.get("keys_env"):
        name = str((cfg["launch"].get("k8s") or {}).get("keys_secret", DEFAULT_KEYS_SECRET))
        vols.append({"name": "client-keys", "secret": {"secretName": name, "defaultMode": 0o440}})
        mounts.append({"name": "client-keys", "mountPath": KEYS_MOUNT, "readOnly": True})
    if replicas.redis_tls(view["launch"].get("redis")):
        vol, mount = _redis_tls_volume(cfg)
        vols.append(vol)
        mounts.append(mount)
    return vols, mounts


def _lmcache_docs(
    cfg: dict[str, Any], view: dict[str, Any], specs: dict, master_addr: str | None
) -> dict[str, str]:
    """``kv_tier: lmcache``: the workers' LMCache config (the server is a sidecar in each worker
    pod, so ``mp_host`` is the pod's loopback) and the LMCache controller."""
    ns = _ns(cfg)
    vlaunch = view["launch"]
    srv = lmcache_settings(vlaunch)["server"]
    data = {
        f"lmcache-{role}-pod.yaml": f"mp_host: 127.0.0.1\nmp_port: {int(srv['port'])}\n"
        for role in ("prefill", "decode")
        if role in specs
    }
    out = {
        "12-lmcache-config.yaml": _dump(
            [
                {
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "metadata": {
                        "name": "smetric-lmcache-config",
                        "namespace": ns,
                        "labels": _labels("lmcache"),
                    },
                    "data": data,
                }
            ]
        )
    }
    if "lmcache_controller" in specs:
        s = specs["lmcache_controller"]
        c = lmcache_settings(vlaunch)["controller"]
        ports = {"http": int(c["port"]), "pull": int(c["pull_port"]), "reply": int(c["reply_port"])}
        s.argv = [a if a != "prefill-pod" else "0.0.0.0" for a in s.argv]
        k = cfg["launch"].get("k8s") or {}
        dep = _simple_deployment(
            cfg,
            "lmcache-controller",
            "lmcache-controller",
            s,
            ports,
            str(k.get("lmcache_image", k.get("image", DEFAULT_IMAGE))),
            extra_container={"readinessProbe": _tcp_probe(ports["http"])},
        )
        out["22-lmcache-controller.yaml"] = _dump(
            [_service("lmcache-controller", ns, "lmcache-controller", ports), dep]
        )
    return out


def _add_lmcache_sidecar(cfg: dict[str, Any], sts: dict, spec, master_addr: str | None) -> None:
    """The node's LMCache server as a second container of a worker pod (same network and
    lifetime), the worker's --lmcache-config-file from the ConfigMap."""
    import json

    k = cfg["launch"].get("k8s") or {}
    argv = list(spec.argv)
    for flag in ("--host", "--http-host"):
        argv[argv.index(flag) + 1] = "127.0.0.1" if flag == "--host" else "0.0.0.0"
    if "--l2-adapter" in argv:
        i = argv.index("--l2-adapter") + 1
        l2 = json.loads(argv[i])
        l2["local_hostname"] = "$(POD_IP)"  # Kubernetes expands $(VAR) from the container env
        if master_addr:
            l2["master_server_addr"] = master_addr
        argv[i] = json.dumps(l2, separators=(",", ":"))
    http_port = int(argv[argv.index("--http-port") + 1])
    pod = sts["spec"]["template"]["spec"]
    env = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    env += [{"name": kk, "value": v} for kk, v in spec.env.items()]
    pod["containers"].append(
        {
            "name": "lmcache-server",
            "image": str(k.get("lmcache_image", k.get("image", DEFAULT_IMAGE))),
            "command": argv[:1],
            "args": argv[1:],
            "env": env,
            "resources": _resources(cfg, "lmcache-server"),
            "readinessProbe": _probe("/healthcheck", http_port, 5, 5),
        }
    )
    pod["volumes"].append({"name": "lmcache-config", "configMap": {"name": "smetric-lmcache-config"}})
    pod["containers"][0]["volumeMounts"].append(
        {"name": "lmcache-config", "mountPath": CONFIG_MOUNT, "readOnly": True}
    )


def secret_keys(config: Any) -> dict[str, list[str]]:
    """Secret name -> the keys the manifests read from it (:func:`secrets_script` makes them)."""
    cfg = as_dict(config)
    out: dict[str, list[str]] = {}
    for text in render_k8s(cfg).values():
        for doc in _load_all(text):
            for ref in _secret_refs(doc):
                keys = out.setdefault(ref[0], [])
                if ref[1] not in keys:
                    keys.append(ref[1])
    return out


def _load_all(text: str) -> list[dict]:
    import yaml

    return [d for d in yaml.safe_load_all(text) if d]


def _secret_refs(node: Any) -> list[tuple[str, str]]:
    """(Secret, key) of every secretKeyRef, and (Secret, "") of every secret volume, in ``node``."""
    out: list[tuple[str, str]] = []
    if isinstance(node, dict):
        if "secretKeyRef" in node:
            out.append((node["secretKeyRef"]["name"], node["secretKeyRef"]["key"]))
        if isinstance(node.get("secret"), dict) and "secretName" in node["secret"]:
            out.append((node["secret"]["secretName"], ""))
        for v in node.values():
            out += _secret_refs(v)
    elif isinstance(node, list):
        for v in node:
            out += _secret_refs(v)
    return out


def secrets_script(config: Any) -> str:
    """``create-secrets.sh``: makes every Secret the manifests read, unless it exists. Values come
    from the environment, else are generated (``openssl rand``); none is printed or written."""
    cfg = as_dict(config)
    ns = _ns(cfg)
    keys = secret_keys(cfg)
    lines = [
        "#!/usr/bin/env bash",
        "# The Secrets the manifests here read (stack/launch/k8s.py). Run once before `kubectl apply -f .`;",
        "# an existing Secret is left as it is (a new Redis password under a running Redis would lock the",
        "# routers out). Each value: the env var of the same name if set, else `openssl rand -hex 32`.",
        "# Read one back: kubectl -n NS get secret NAME -o jsonpath='{.data.KEY}' | base64 -d",
        "set -euo pipefail",
        f"NS={shlex.quote(ns)}",
        "gen() { openssl rand -hex 32; }",
        'have() { kubectl -n "$NS" get secret "$1" >/dev/null 2>&1; }',
        'kubectl get namespace "$NS" >/dev/null 2>&1 || kubectl create namespace "$NS"',
    ]
    for name, ks in keys.items():
        q = shlex.quote(name)
        if ks == [""] and name == str(
            (cfg["launch"].get("k8s") or {}).get("keys_secret", DEFAULT_KEYS_SECRET)
        ):
            lines += [
                "# client keys (router.auth): KEYS_FILE=path/to/keys.yaml (hashes preferred: sha256: <hex>)",
                f'have {q} || kubectl -n "$NS" create secret generic {q} '
                '--from-file=keys.yaml="${KEYS_FILE:?KEYS_FILE: the client keys file (router.auth)}"',
            ]
        elif ks == [""]:  # the Redis TLS Secret
            lines += [
                "# Redis TLS (launch.redis.tls): a certificate for redis.$NAMESPACE.svc.cluster.local and its CA",
                f'have {q} || kubectl -n "$NS" create secret generic {q} '
                '--from-file=tls.crt="${REDIS_TLS_CERT:?}" --from-file=tls.key="${REDIS_TLS_KEY:?}" '
                '--from-file=ca.crt="${REDIS_TLS_CA:?}"',
            ]
        else:
            lits = " ".join(f'--from-literal={k}="${{{k}:-$(gen)}}"' for k in ks if k)
            lines.append(f'have {q} || kubectl -n "$NS" create secret generic {q} {lits}')
    lines.append('echo "secrets in namespace $NS: ' + " ".join(keys) + '"')
    return "\n".join(lines) + "\n"


def write_k8s(config: Any, outdir: str | Path) -> list[Path]:
    """Write the manifests and ``create-secrets.sh`` under ``outdir`` (created); returns the
    paths written (the script last: ``kubectl apply -f`` reads only the YAML files)."""
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in render_k8s(config).items():
        p = out / name
        p.write_text(text)
        paths.append(p)
    script = out / "create-secrets.sh"
    script.write_text(secrets_script(config))
    script.chmod(0o755)
    return paths + [script]


def summary(paths: list[Path]) -> str:
    d = shlex.quote(str(paths[0].parent))
    return (
        "\n".join(f"wrote {p}" for p in paths)
        + f"\nfirst the Secrets: bash {d}/create-secrets.sh   (once; KEYS_FILE=... with router.auth)"
        + f"\napply with: kubectl apply -f {d}/\n"
    )
