"""Kubernetes manifests from the same deployment YAML as ``stack.launch.sglang``.

``render_k8s(config) -> dict[filename, yaml_text]`` and ``write_k8s(config, outdir)``.

What is rendered (namespace from ``launch.k8s.namespace``, default ``smetric``):

- ``00-namespace.yaml``       Namespace
- ``10-config.yaml``          ConfigMap ``smetric-router-config``: the router's resolved config
                              (the same worker lists as the per-node launch, with Service DNS names)
- ``20-mooncake-master.yaml`` Deployment + Service (when a master is launched)
- ``21-redis.yaml``           Deployment + Service (when ``launch.redis`` is set)
- ``12-lmcache-config.yaml``  (``launch.kv_tier: lmcache``) ConfigMap: the workers' LMCache config;
                              each worker pod then has an ``lmcache-server`` sidecar container
- ``22-lmcache-controller.yaml`` Deployment + Service ``lmcache-controller`` (kv_tier lmcache)
- ``30-prefill.yaml``         headless Service + StatefulSet ``prefill`` (replicas = count; each
                              pod ``tp`` GPUs; stable names prefill-0.prefill.<ns>.svc)
- ``31-decode.yaml``          headless Service + StatefulSet ``decode``
- ``40-router.yaml``          Deployment + Service ``smetric-router`` (``router.port``)

The SGLang argument lists are exactly those of the per-node launch for instance 0 of each pool
(so tests/integration/test_sglang_args.py covers them), except: each pod has its own IP, so every pod uses
the pool's base ports; ``--host 0.0.0.0``; ``SGLANG_HOST_IP`` / ``MOONCAKE_LOCAL_HOSTNAME`` come
from the pod IP; GPUs come from ``nvidia.com/gpu`` limits (no CUDA_VISIBLE_DEVICES). IB devices
are left to Mooncake's discovery unless ``launch.k8s.ib_devices`` lists them (GPU i of a pod ->
ib_devices[i]); with an RDMA device plugin set ``launch.k8s.rdma_resource`` (e.g. ``rdma/hca``).
``host_network: true`` is only accepted when one pod fills a node's GPUs (``tp`` = GPUs per node),
since every pod of a pool listens on the same ports.

``launch.k8s`` keys: namespace, image (SGLang, default lmsysorg/sglang:v0.5.23-cu130),
router_image, model_host_path (hostPath mounted at the model's directory) or model_pvc,
rdma_resource, host_network, shm_size (default 32Gi), node_selector (per pool or global),
service_type (router Service, default ClusterIP), python (default python3 in the image).
"""

from __future__ import annotations

import copy
import shlex
from pathlib import Path
from typing import Any

from stack.launch.lmcache_tier import kv_tier, lmcache_settings
from stack.launch.sglang import resolved_config, sglang_process_specs
from stack.launch.sglang_config import LaunchConfigError, as_dict, pool_settings, sglang_launch

DEFAULT_IMAGE = "lmsysorg/sglang:v0.5.23-cu130"
DEFAULT_ROUTER_IMAGE = "smetric/stack:latest"
CONFIG_MOUNT = "/etc/smetric"


def _k8s_view(cfg: dict[str, Any]) -> dict[str, Any]:
    """The same config squeezed onto one virtual node per pool (a pod's view of ports)."""
    c = copy.deepcopy(cfg)
    launch = c["launch"]
    k = launch.get("k8s") or {}
    # which NIC sits next to a pod's GPU is the device plugin's business: by default leave
    # --disaggregation-ib-device / MOONCAKE_DEVICE out (Mooncake discovers NICs itself);
    # launch.k8s.ib_devices forces a list (GPU i of the pod -> ib_devices[i]).
    ib = k.get("ib_devices") or []
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
    lm = launch.get("lmcache")
    if isinstance(lm, dict) and isinstance(lm.get("controller"), dict):
        launch["lmcache"] = {**lm, "controller": {**lm["controller"], "node": "prefill-pod"}}
    if launch.get("router") is not False:
        launch["router"] = {**(launch.get("router") or {}), "node": "prefill-pod"}
    return c


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


def _secret_env(cfg: dict[str, Any], spec) -> list[dict]:
    """Env entries of ``spec.secret_env`` from the Secret (never a value in the manifest);
    Kubernetes then expands the ``$(NAME)`` in the container's args."""
    name = str((cfg["launch"].get("k8s") or {}).get("secret", DEFAULT_SECRET))
    return [
        {"name": n, "valueFrom": {"secretKeyRef": {"name": name, "key": n}}}
        for n in getattr(spec, "secret_env", [])
    ]


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


def _probe(path: str, port: int, initial: int, period: int = 10, failures: int = 3) -> dict:
    return {
        "httpGet": {"path": path, "port": port},
        "initialDelaySeconds": initial,
        "periodSeconds": period,
        "failureThreshold": failures,
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
    limits: dict[str, Any] = {"nvidia.com/gpu": tp}
    if k.get("rdma_resource"):
        limits[str(k["rdma_resource"])] = 1
    container = {
        "name": "sglang",
        "image": str(k.get("image", DEFAULT_IMAGE)),
        "command": spec.argv[:1],
        "args": spec.argv[1:],
        "env": _pod_env(spec.env, ("SGLANG_HOST_IP", "MOONCAKE_LOCAL_HOSTNAME")) + _secret_env(cfg, spec),
        "ports": [{"name": n, "containerPort": p} for n, p in ports.items()],
        "resources": {"limits": limits},
        "volumeMounts": mounts,
        "readinessProbe": _probe("/health", ports["http"], 30),
        "startupProbe": _probe("/health", ports["http"], 30, 10, 90),
        "livenessProbe": _probe("/health", ports["http"], 0, 30, 5),
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
    return [_service(role, ns, role, ports, headless=True), sts]


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
    if launch.get("redis"):
        out["router"]["redis_url"] = (
            f"redis://redis.{ns}.svc.cluster.local:{launch['redis'].get('port', 6379)}/0"
        )
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
            extra_container={"readinessProbe": {"tcpSocket": {"port": ports["rpc"]}, "periodSeconds": 5}},
        )
        files["20-mooncake-master.yaml"] = _dump(
            [_service("mooncake-master", ns, "mooncake-master", ports), dep]
        )
        master_addr = f"mooncake-master.{ns}.svc.cluster.local:{ports['rpc']}"
    if "redis" in specs:
        s = specs["redis"]
        port = int(view["launch"]["redis"].get("port", 6379))
        s.argv = [a if a not in ("127.0.0.1",) else "0.0.0.0" for a in s.argv]
        dep = _simple_deployment(
            cfg,
            "redis",
            "redis",
            s,
            {"redis": port},
            str(k.get("redis_image", "redis:7")),
            extra_container={"readinessProbe": {"tcpSocket": {"port": port}, "periodSeconds": 5}},
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
        s = specs["router"]
        rport = int((cfg.get("router") or {}).get("port", 8000))
        s.argv = ["smetric", "router", "--config", f"{CONFIG_MOUNT}/router-config.yaml"]
        dep = _simple_deployment(
            cfg,
            "smetric-router",
            "router",
            s,
            {"http": rport},
            str(k.get("router_image", DEFAULT_ROUTER_IMAGE)),
            extra_pod={
                "volumes": [{"name": "config", "configMap": {"name": "smetric-router-config"}}]
                + (_model_volume(cfg)[0][:1])
            },
            extra_container={
                "volumeMounts": [
                    {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
                    _model_volume(cfg)[1][0],
                ],
                "readinessProbe": _probe("/health", rport, 5, 5),
            },
        )
        dep["spec"]["replicas"] = int((launch.get("router") or {}).get("replicas", 1))
        files["40-router.yaml"] = _dump(
            [
                _service(
                    "smetric-router", ns, "router", {"http": rport}, type_=k.get("service_type", "ClusterIP")
                ),
                dep,
            ]
        )
    return files


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
            extra_container={"readinessProbe": {"tcpSocket": {"port": ports["http"]}, "periodSeconds": 5}},
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
            "readinessProbe": _probe("/healthcheck", http_port, 5, 5),
        }
    )
    pod["volumes"].append({"name": "lmcache-config", "configMap": {"name": "smetric-lmcache-config"}})
    pod["containers"][0]["volumeMounts"].append(
        {"name": "lmcache-config", "mountPath": CONFIG_MOUNT, "readOnly": True}
    )


def write_k8s(config: Any, outdir: str | Path) -> list[Path]:
    """Write the manifests under ``outdir`` (created); returns the paths written."""
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in render_k8s(config).items():
        p = out / name
        p.write_text(text)
        paths.append(p)
    return paths


def summary(paths: list[Path]) -> str:
    return (
        "\n".join(f"wrote {p}" for p in paths)
        + f"\napply with: kubectl apply -f {shlex.quote(str(paths[0].parent))}/\n"
    )
