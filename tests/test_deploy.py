"""The operator's kit (deploy/), checked by real tools: Debian's promtool on the rules and their
unit tests, a real Prometheus scraping a gateway under traffic for every expression the rules
and the dashboard use, the dashboard against the code that writes it, and the Kubernetes
manifests against Kubernetes' schemas and yamllint."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import requests
import yaml

from emulator.process import EmulatorProcess, free_port, wait_until
from tests.helpers.servers import MODEL, gateway_process, starts_processes

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
RULES = DEPLOY / "prometheus" / "pd-gateway.rules.yml"
EXAMPLE = DEPLOY / "prometheus" / "prometheus.example.yml"


def _module(path: Path):
    spec = importlib.util.spec_from_file_location("pd_gateway_" + path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


dashboard = _module(DEPLOY / "grafana" / "dashboard.py")

PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
NEEDS_PROMETHEUS = "Debian's prometheus package (make test installs it): promtool, prometheus"


def _promtool(*args: str) -> subprocess.CompletedProcess:
    assert PROMTOOL, NEEDS_PROMETHEUS
    return subprocess.run(
        [PROMTOOL, *args], cwd=RULES.parent, capture_output=True, text=True, timeout=60
    )


@pytest.mark.processes
def test_promtool_accepts_the_rules():
    checked = _promtool("check", "rules", RULES.name)
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.processes
def test_every_alert_fires_and_clears_in_promtools_unit_tests():
    tested = _promtool("test", "rules", "pd-gateway.rules.test.yml")
    assert tested.returncode == 0, tested.stdout + tested.stderr
    alerts = {
        r["alert"]
        for g in yaml.safe_load(RULES.read_text())["groups"]
        for r in g["rules"]
        if "alert" in r
    }
    tests = yaml.safe_load((RULES.parent / "pd-gateway.rules.test.yml").read_text())["tests"]
    cases = [c for t in tests for c in t["alert_rule_test"]]
    fired = {c["alertname"] for c in cases if c["exp_alerts"]}
    cleared = {c["alertname"] for c in cases if not c["exp_alerts"]}
    assert alerts <= fired and alerts <= cleared, (alerts - fired, alerts - cleared)
    for rule in (
        r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r
    ):
        assert rule["annotations"].get("runbook"), f"{rule['alert']} has no runbook line"


# --- Kubernetes manifests ------------------------------------------------------------------------


@pytest.mark.processes
def test_the_manifests_pass_kubernetes_schemas_and_yamllint():
    import kubernetes_validate

    folder = DEPLOY / "kubernetes"
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    resources = {}
    # The oldest Kubernetes the kit states (kustomization.yaml), and the newest known.
    versions = ("1.25.0", kubernetes_validate.utils.latest_version())
    for name in kustomization["resources"]:
        for doc in yaml.safe_load_all((folder / name).read_text()):
            for version in versions:
                kubernetes_validate.validate(doc, version, strict=True)  # raises if not
            resources[doc["kind"], doc["metadata"]["name"]] = doc
    assert {k for k, _ in resources} >= {"Deployment", "Service", "PodDisruptionBudget", "Secret"}
    pod = resources["Deployment", "pd-gateway"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    # A pause before SIGTERM that any Kubernetes runs: the image's sleep (deploy/Dockerfile's
    # final stage is Debian's python slim image, with coreutils).
    assert container["lifecycle"]["preStop"] == {"exec": {"command": ["sleep", "5"]}}
    # Longer than the streams it lets finish.
    assert pod["terminationGracePeriodSeconds"] > int(env["GATEWAY_GRACEFUL_TIMEOUT"]["value"])
    assert env["GATEWAY_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "pd-gateway"
    # Prometheus scrapes the metrics listener, which needs no token.
    metrics_port = int(env["GATEWAY_METRICS_PORT"]["value"])
    annotations = resources["Deployment", "pd-gateway"]["spec"]["template"]["metadata"][
        "annotations"
    ]
    assert int(annotations["prometheus.io/port"]) == metrics_port
    assert {"name": "metrics", "containerPort": metrics_port} in container["ports"]
    # Memory (docs/operating.md, "Memory"): the limit is the master's and each worker's rest,
    # as measured (bench.pod_memory), and 15 times the bodies each worker may hold, and room.
    workers = int(env["GATEWAY_WORKERS"]["value"])
    bodies = (
        max(
            int(env[name]["value"])
            for name in ("GATEWAY_MAX_BODY_BYTES", "GATEWAY_MAX_BODIES_BYTES")
        )
        / 2**20
    )
    needed = 33 + workers * (96 + 15 * bodies)
    limit = _mebibytes(container["resources"]["limits"]["memory"])
    assert needed <= limit <= needed + 256, (needed, limit)
    for role in ("prefill", "decode"):  # headless: the gateway's DNS discovery
        assert resources["Service", f"vllm-{role}"]["spec"]["clusterIP"] == "None"
    linted = subprocess.run(
        [sys.executable, "-m", "yamllint", "-c", str(DEPLOY / ".yamllint"), str(DEPLOY)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert linted.returncode == 0, linted.stdout + linted.stderr


def _mebibytes(quantity: str) -> float:
    """A Kubernetes memory quantity (2560Mi, 2Gi, 1200M) in MiB."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "k": 10**3, "M": 10**6, "G": 10**9}
    number, unit = re.fullmatch(r"(\d+)([A-Za-z]*)", quantity).groups()
    return int(number) * units.get(unit, 1) / 2**20


# --- the restricted Pod Security Standard ----------------------------------------------------
# https://kubernetes.io/docs/concepts/security/pod-security-standards/ (restricted, with the
# baseline it includes), as the kit sets it: the restricted fields at pod and container level
# both, so no container depends on what its pod says.

POD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet")
RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def _manifests() -> list[dict]:
    folder = DEPLOY / "kubernetes"
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    return [
        doc
        for name in kustomization["resources"]
        for doc in yaml.safe_load_all((folder / name).read_text())
    ]


def _pods(docs: list[dict]) -> dict[str, dict]:
    """Every pod spec the manifests make, by the name of what makes it."""
    pods = {
        doc["metadata"]["name"]: doc["spec"]["template"]["spec"]
        for doc in docs
        if doc["kind"] in POD_KINDS
    }
    pods.update({doc["metadata"]["name"]: doc["spec"] for doc in docs if doc["kind"] == "Pod"})
    return pods


def pod_security_violations(pod: dict) -> list[str]:
    """What in a pod spec the restricted Pod Security Standard (or the kit's rule of setting
    its fields at both levels) refuses; [] when it passes."""
    found = []
    context = pod.get("securityContext") or {}
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            found.append(f"pod: {field}")
    if context.get("runAsNonRoot") is not True:
        found.append("pod: securityContext.runAsNonRoot is not true")
    if context.get("runAsUser") == 0:
        found.append("pod: securityContext.runAsUser is 0")
    if (context.get("seccompProfile") or {}).get("type") not in ("RuntimeDefault", "Localhost"):
        found.append("pod: securityContext.seccompProfile.type is not RuntimeDefault")
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            found.append(f"pod: volume {volume['name']} is {', '.join(sorted(kinds))}")
    for container in pod.get("initContainers", []) + pod["containers"]:
        name = f"container {container['name']}"
        own = container.get("securityContext") or {}
        if own.get("privileged"):
            found.append(f"{name}: privileged")
        if own.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: securityContext.allowPrivilegeEscalation is not false")
        if own.get("runAsNonRoot") is not True:
            found.append(f"{name}: securityContext.runAsNonRoot is not true")
        if own.get("runAsUser") == 0:
            found.append(f"{name}: securityContext.runAsUser is 0")
        if (own.get("seccompProfile") or {}).get("type") not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name}: securityContext.seccompProfile.type is not RuntimeDefault")
        capabilities = own.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            found.append(f"{name}: securityContext.capabilities.drop has no ALL")
        if set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}: securityContext.capabilities.add")
        if any("hostPort" in port for port in container.get("ports", [])):
            found.append(f"{name}: a hostPort")
    return found


def test_every_pod_passes_the_restricted_pod_security_standard():
    pods = _pods(_manifests())
    assert set(pods) == {"pd-gateway", "pd-gateway-redis"}
    assert {name: pod_security_violations(pod) for name, pod in pods.items()} == {
        name: [] for name in pods
    }


def _breakages(pods: dict[str, dict]):
    """Each rule of the check broken in one place of the kit's pods: (pod, what it breaks, how)."""

    def pop(*path):
        def breaking(pod):
            node = pod
            for key in path[:-1]:
                node = node[key]
            del node[path[-1]]

        return breaking

    def put(value, *path):
        def breaking(pod):
            node = pod
            for key in path[:-1]:
                node = node[key] if isinstance(node, list) else node.setdefault(key, {})
            node[path[-1]] = value

        return breaking

    for name, pod in pods.items():
        yield name, "pod: securityContext.runAsNonRoot", pop("securityContext", "runAsNonRoot")
        yield name, "pod: securityContext.seccompProfile", pop("securityContext", "seccompProfile")
        yield name, "pod: securityContext.runAsUser is 0", put(0, "securityContext", "runAsUser")
        yield name, "pod: hostNetwork", put(True, "hostNetwork")
        yield (
            name,
            "is hostPath",
            lambda pod: pod.setdefault("volumes", []).append(
                {"name": "host", "hostPath": {"path": "/"}}
            ),
        )
        for i, container in enumerate(pod["containers"]):
            here = ("containers", i, "securityContext")
            for key in ("allowPrivilegeEscalation", "runAsNonRoot", "seccompProfile"):
                yield name, f"container {container['name']}: securityContext.{key}", pop(*here, key)
            yield (
                name,
                f"container {container['name']}: securityContext.capabilities.drop",
                pop(*here, "capabilities", "drop"),
            )
            yield (
                name,
                f"container {container['name']}: securityContext.allowPrivilegeEscalation",
                put(True, *here, "allowPrivilegeEscalation"),
            )
            yield (
                name,
                f"container {container['name']}: securityContext.capabilities.add",
                put(["SYS_ADMIN"], *here, "capabilities", "add"),
            )
            yield name, f"container {container['name']}: privileged", put(True, *here, "privileged")
            yield (
                name,
                f"container {container['name']}: securityContext.runAsUser is 0",
                put(0, *here, "runAsUser"),
            )


def test_the_pod_security_check_finds_each_rule_broken():
    """The check can fail: every rule removed (or turned) in every pod and container of the
    kit, one at a time, is found and named."""
    import copy

    pods = _pods(_manifests())
    for name, what, breaking in _breakages(pods):
        pod = copy.deepcopy(pods[name])
        breaking(pod)
        assert any(what in found for found in pod_security_violations(pod)), (name, what)


# --- Redis: a password from the Secret, and only the gateway's pods reach it -----------------


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) in args and env values: a variable it knows, else left as it is."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), text)


def _env(container: dict, secret: dict[str, str]) -> dict[str, str]:
    """A container's environment as Kubernetes makes it: in order, each value's $(VAR) from
    the variables above it, secretKeyRef values from `secret`."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        ref = item.get("valueFrom", {}).get("secretKeyRef")
        env[item["name"]] = (
            secret[ref["key"]]
            if ref and ref["name"] == "pd-gateway"
            else _expand(item["value"], env)
        )
    return env


def test_only_the_gateways_pods_reach_redis():
    docs = _manifests()
    pods = {
        doc["metadata"]["name"]: doc["spec"]["template"]["metadata"]["labels"]
        for doc in docs
        if doc["kind"] in POD_KINDS
    }
    (policy,) = [doc["spec"] for doc in docs if doc["kind"] == "NetworkPolicy"]
    assert policy["podSelector"]["matchLabels"] == pods["pd-gateway-redis"]
    assert policy["policyTypes"] == ["Ingress"]
    (rule,) = policy["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": pods["pd-gateway"]}}]
    assert rule["ports"] == [{"port": "redis", "protocol": "TCP"}]


@pytest.mark.processes
def test_the_kits_redis_needs_the_password_its_gateways_store_url_carries(fresh_engines):
    """Redis's args and the gateway's GATEWAY_STORE as Kubernetes makes them from the Secret:
    a real redis-server refuses a client without the password, and a real gateway (the store
    and the per-key limits, both in Redis) works with the URL."""
    import secrets

    import redis as redis_py

    from devtools.processes import RedisProcess

    docs = _manifests()
    pods = _pods(docs)
    (secret,) = [doc["stringData"] for doc in docs if doc["kind"] == "Secret"]
    secret = {**secret, "redis-password": secrets.token_hex(32)}
    (redis_container,) = pods["pd-gateway-redis"]["containers"]
    (gateway_container,) = pods["pd-gateway"]["containers"]
    args = [_expand(arg, _env(redis_container, secret)) for arg in redis_container["args"]]
    assert args[args.index("--requirepass") + 1] == secret["redis-password"]
    store = _env(gateway_container, secret)["GATEWAY_STORE"]
    assert store == f"redis://:{secret['redis-password']}@pd-gateway-redis:6379/0"
    server = RedisProcess(extra=tuple(args), password=secret["redis-password"])
    try:
        with pytest.raises(redis_py.AuthenticationError):
            redis_py.Redis(host=server.host, port=server.port, socket_timeout=5).ping()
        store = store.replace("pd-gateway-redis:6379", f"{server.host}:{server.port}")
        p, d = fresh_engines
        with gateway_process(
            [p.url], [d.url], store=store, api_keys="tenant", key_rpm=3
        ) as gateway:
            report = gateway.status()
            assert report["store"] == "redis" and report["reachable"]
            messages = [{"role": "user", "content": "a conversation kept in Redis"}]
            caches = []
            for _ in range(4):
                reply = requests.post(
                    gateway.url + "/v1/chat/completions",
                    timeout=20,
                    headers={"Authorization": "Bearer tenant"},
                    json={"model": MODEL, "max_tokens": 4, "messages": messages},
                )
                caches.append((reply.status_code, reply.headers.get("X-Gateway-Cache")))
                if reply.status_code == 200:
                    messages += [
                        reply.json()["choices"][0]["message"],
                        {"role": "user", "content": "more"},
                    ]
            # The third turn hit through Redis; the fourth was over the key's rpm, counted there.
            assert caches[:3] == [(200, "miss"), (200, "hit"), (200, "hit")]
            assert caches[3][0] == 429
            assert any(key.startswith(b"pd-gateway:") for key in server.client.keys())
    finally:
        server.stop()


# --- the image: wheels built with a compiler, installed without one ---------------------------
# No Docker engine here (nor in CI) to build it: the Dockerfile's stages are read instead.

COMPILERS = re.compile(r"\b(gcc|g\+\+|cc|clang|build-essential|libc6-dev|python3?-dev|make)\b")


def _stages(text: str) -> list[dict]:
    """The Dockerfile's stages: each one's base, name and instructions (continuations joined)."""
    stages: list[dict] = []
    for line in re.sub(r"\\\n\s*", " ", text).splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        word, _, rest = line.strip().partition(" ")
        if word.upper() == "FROM":
            base, _, name = rest.partition(" AS ")
            stages.append({"base": base.strip(), "name": name.strip(), "steps": []})
        else:
            stages[-1]["steps"].append((word.upper(), rest.strip()))
    return stages


def test_the_images_final_stage_installs_built_wheels_and_no_compiler():
    *builders, final = _stages((DEPLOY / "Dockerfile").read_text())
    (builder,) = [stage for stage in builders if stage["name"] == "builder"]
    runs = [rest for word, rest in final["steps"] if word == "RUN"]
    assert not [run for run in runs if "apt-get" in run or COMPILERS.search(run)], runs
    assert not [
        rest
        for word, rest in final["steps"]
        if word in ("ADD", "COPY") and "--from=builder" not in rest
    ]  # nothing of the sources either
    # The builder makes wheels (and has the compiler: gunicorn-h1c compiles)...
    assert any(
        "pip wheel" in rest and "--wheel-dir /wheels" in rest
        for word, rest in builder["steps"]
        if word == "RUN"
    )
    assert any(COMPILERS.search(rest) for word, rest in builder["steps"] if word == "RUN")
    # ...the final stage installs them alone, building nothing (pip refuses to).
    (install,) = [run for run in runs if "pip install" in run]
    assert "from=builder" in install and "source=/wheels" in install
    assert "--no-index" in install and "--only-binary=:all:" in install
    # The same Python (the wheels' ABI), Debian's slim image (its sleep: the preStop hook).
    assert final["base"] == builder["base"] and re.fullmatch(r"python:3\.\d+-slim", final["base"])
    # The Deployment's user, and its ports.
    pod = _pods(_manifests())["pd-gateway"]
    assert ("USER", str(pod["securityContext"]["runAsUser"])) in final["steps"]
    (container,) = pod["containers"]
    exposed = {
        int(port) for word, rest in final["steps"] if word == "EXPOSE" for port in rest.split()
    }
    assert exposed == {port["containerPort"] for port in container["ports"]}


# --- the names, against what a gateway exports --------------------------------------------


def _recorded() -> set[str]:
    return {
        r["record"]
        for g in yaml.safe_load(RULES.read_text())["groups"]
        for r in g["rules"]
        if "record" in r
    }


def _expressions() -> list[str]:
    rules = [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    return rules + [q.replace("$job", ".+") for q in dashboard.queries(dashboard.dashboard())]


def _names(expr: str) -> set[str]:
    """The series names an expression selects (recording rules' names included)."""
    return set(re.findall(r"\b(pd_gateway(?::[a-z0-9_]+)+|pd_gateway_[a-z0-9_]+)", expr))


def _exported(text: str) -> set[str]:
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.add(name)
            if kind == "counter":
                names.add(name + "_total")
            if kind == "histogram":
                names |= {name + s for s in ("_bucket", "_sum", "_count")}
    return names


def test_the_dashboard_json_is_what_its_code_writes():
    assert (DEPLOY / "grafana" / "pd-gateway.json").read_text() == dashboard.render(), (
        "run python deploy/grafana/dashboard.py"
    )
    board = json.loads(dashboard.render())
    assert board["uid"] == "pd-gateway" and all(
        p["targets"] for p in board["panels"] if p["type"] != "row"
    )


# --- a real Prometheus scraping a gateway under traffic --------------------------------------


@pytest.fixture(scope="module")
@starts_processes
def scraped(tmp_path_factory):
    """A gateway (2 workers, client keys on) with traffic of every kind the rules look at,
    scraped every second on its metrics listener by a real Prometheus, with the scrape job of
    prometheus.example.yml (no token), that evaluates the rules every second."""
    assert PROMETHEUS, NEEDS_PROMETHEUS
    work = tmp_path_factory.mktemp("prometheus")
    keys = work / "keys"
    keys.write_text("tenant rpm=1000\nlimited rpm=1\n")
    metrics_port = free_port("127.0.0.1")
    with (
        EmulatorProcess("prefill", host="127.0.0.69", itl_ms=1, bidirectional_kv_xfer=True) as p,
        EmulatorProcess("decode", host="127.0.0.70", itl_ms=1, bidirectional_kv_xfer=True) as d,
        gateway_process(
            [p.url],
            [d.url],
            workers=2,
            api_keys_file=str(keys),
            engine_metrics_interval=0.5,
            metrics_port=metrics_port,
            metrics_host="127.0.0.1",
        ) as gateway,
    ):
        gateway.metrics_url = f"http://127.0.0.1:{metrics_port}"
        # The rules as deployed, evaluated every second.
        rules = yaml.safe_load(RULES.read_text())
        for group in rules["groups"]:
            group["interval"] = "1s"
        (work / "rules.yml").write_text(yaml.safe_dump(rules))
        # The example's scrape job as it is, aimed at this gateway's metrics listener.
        (job,) = yaml.safe_load(EXAMPLE.read_text())["scrape_configs"]
        job["static_configs"] = [{"targets": [gateway.metrics_url.split("//")[1]]}]
        port = free_port("127.0.0.1")
        (work / "prometheus.yml").write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "rule_files": [str(work / "rules.yml")],
                    "scrape_configs": [job],
                }
            )
        )
        log = open(work / "prometheus.log", "wb")
        server = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={work / 'prometheus.yml'}",
                f"--storage.tsdb.path={work / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until(
                lambda: requests.get(url + "/-/ready", timeout=2).status_code == 200,
                30,
                "Prometheus ready",
                server,
                str(work / "prometheus.log"),
            )
            _traffic(gateway, p)
            yield gateway, url
        finally:
            server.terminate()
            server.wait(10)
            log.close()


def _traffic(gateway, p) -> None:
    """Multi-turn conversations, a refusal for a key's rate, an engine failure: the series
    the rules and the dashboard read."""

    def chat(messages, key="tenant"):
        return requests.post(
            gateway.url + "/v1/chat/completions",
            timeout=20,
            headers={"Authorization": f"Bearer {key}"},
            json={"model": MODEL, "max_tokens": 4, "messages": messages},
        )

    for n in range(6):
        messages = [{"role": "user", "content": f"conversation {n}"}]
        for _ in range(3):
            reply = chat(messages)
            assert reply.status_code == 200
            messages += [reply.json()["choices"][0]["message"], {"role": "user", "content": "more"}]
        stream = requests.post(
            gateway.url + "/v1/chat/completions",
            timeout=20,
            stream=True,
            headers={"Authorization": "Bearer tenant"},
            json={"model": MODEL, "max_tokens": 4, "stream": True, "messages": messages},
        )
        assert stream.status_code == 200 and stream.content.endswith(b"[DONE]\n\n")
    assert chat([{"role": "user", "content": "a"}], "limited").status_code == 200
    assert chat([{"role": "user", "content": "b"}], "limited").status_code == 429
    p.set_fault("error500")
    try:
        assert chat([{"role": "user", "content": "failing"}]).status_code >= 500
    finally:
        p.set_fault("none")


def _query(url: str, expr: str) -> list:
    answer = requests.get(url + "/api/v1/query", params={"query": expr}, timeout=10).json()
    assert answer["status"] == "success", (expr, answer)
    return answer["data"]["result"]


def _left_side(expr: str) -> str:
    """An alert's condition without its threshold (`... > 0.05`): what must return data."""
    return re.split(r"\s(?:>|<|==)\s[\d.]+\s*(?:\n|$)", expr.strip())[0].split("\nand ")[0]


def test_prometheus_scrapes_the_metrics_listener_with_client_keys_on_and_no_token(scraped):
    gateway, url = scraped
    assert requests.get(gateway.url + "/metrics", timeout=10).status_code == 401
    wait_until(lambda: _query(url, 'up{job="pd-gateway"} == 1'), 30, "a successful scrape")
    (target,) = requests.get(url + "/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
    assert (target["health"], target["scrapeUrl"]) == ("up", gateway.metrics_url + "/metrics")


def test_every_expression_names_only_what_the_gateway_exports(scraped):
    gateway, _ = scraped
    text = requests.get(gateway.metrics_url + "/metrics", timeout=10).text
    exported, recorded = _exported(text), _recorded()
    unknown = {name for expr in _expressions() for name in _names(expr)} - exported - recorded
    assert not unknown, f"names the gateway does not export: {sorted(unknown)}"


def test_every_expression_returns_data_from_a_real_prometheus(scraped):
    _, url = scraped
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    expressions = [_left_side(r["expr"]) for r in rules] + [
        q.replace("$job", ".+") for q in dashboard.queries(dashboard.dashboard())
    ]
    pending = list(expressions)

    def all_have_data() -> bool:  # asked again after each scrape and evaluation
        pending[:] = [e for e in pending if not _query(url, e)]
        return not pending

    try:
        wait_until(all_have_data, 60, "data for every expression")
    except RuntimeError:
        pytest.fail(f"no data for: {pending}")
