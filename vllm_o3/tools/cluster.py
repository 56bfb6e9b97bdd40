"""A scale-out set on one machine, loopback only: O3 replicas (`vllm serve`
with the plugin, O3Scheduler and the O3 middleware) per environment, one
Shepherd Model Gateway (`smg launch`, cache-aware) over each environment's
replicas, and nginx in front routing by `X-O3-Env`: `canary`, `staging`,
`prod` pick the environment, no header sends `canary_percent` % to canary and
the rest to prod, any other value gets 400. These are the rules of
deploy/k8s/o3-virtualservice.yaml. Everything started is stopped by PID.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from vllm_o3.tools.debian import debian_program
from vllm_o3.tools.server import (
    O3_SERVE_ARGS,
    Server,
    free_port,
    launch,
    launch_server,
    stop_servers,
    wait_healthy,
)

ENVIRONMENTS = ("prod", "canary", "staging")
REPLICA_ARGS = ("--served-model-name", "o3", *O3_SERVE_ARGS)
UNKNOWN_ENV = (
    '{"error": {"message": "X-O3-Env must be one of canary, staging, prod", '
    '"type": "BadRequestError", "param": "X-O3-Env", "code": 400}}'
)
NGINX_CONF = """\
worker_processes 1;
pid {folder}/nginx.pid;
error_log {folder}/nginx-error.log warn;
{user}
events {{ worker_connections 1024; }}
http {{
    access_log {folder}/nginx-access.log;
    client_body_temp_path {folder}/nginx-body;
    proxy_temp_path {folder}/nginx-proxy;
    fastcgi_temp_path {folder}/nginx-fastcgi;
    uwsgi_temp_path {folder}/nginx-uwsgi;
    scgi_temp_path {folder}/nginx-scgi;
{upstreams}
    split_clients "${{request_id}}" $o3_weighted {{
        {canary_percent}% o3_canary;
        * o3_prod;
    }}
    # smg forwards only tracing headers: X-O3-Tier and X-O3-Deadline-Ms cross
    # it as the `o3` member of tracestate (vllm_o3.scheduler.http).
    map $http_tracestate $o3_rest {{
        "" "";
        default ",$http_tracestate";
    }}
    map "$http_x_o3_tier|$http_x_o3_deadline_ms" $o3_tracestate {{
        "|" $http_tracestate;
        default "o3=tier:$http_x_o3_tier;deadline-ms:$http_x_o3_deadline_ms$o3_rest";
    }}
    map $http_x_o3_env $o3_upstream {{
        "" $o3_weighted;
{env_map}
        default "";
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            if ($o3_upstream = "") {{
                add_header Content-Type application/json always;
                return 400 '{unknown}';
            }}
            proxy_pass http://$o3_upstream;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header tracestate $o3_tracestate;
            proxy_buffering off;  # token streaming
            proxy_read_timeout 600s;
        }}
    }}
}}
"""


@dataclass
class Cluster:
    folder: Path
    replicas: dict[str, list[Server]] = field(default_factory=dict)
    gateways: dict[str, Server] = field(default_factory=dict)
    proxy: Server | None = None

    @property
    def url(self) -> str:
        return self.proxy.url

    def servers(self) -> list[Server]:
        """Front to back, the order they are sent SIGTERM in."""
        front = [self.proxy] if self.proxy else []
        return [
            *front,
            *self.gateways.values(),
            *(r for rs in self.replicas.values() for r in rs),
        ]

    def stop(self) -> None:
        stop_servers(list(self.servers()))


def start_gateway(env: str, replicas: list[Server], folder: Path) -> Server:
    smg = shutil.which("smg") or str(Path(sys.executable).with_name("smg"))
    port = free_port()
    command = [
        smg, "launch", "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *(r.url for r in replicas),
        "--policy", "cache_aware",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        # A replica that stops answering leaves the rotation within seconds.
        "--health-check-interval-secs", "2", "--health-failure-threshold", "2",
    ]  # fmt: skip
    return launch(command, folder / f"gateway-{env}.log", port)


def start_proxy(gateways: dict[str, Server], folder: Path, canary_percent: float):
    upstreams = "\n".join(
        f"    upstream o3_{env} {{ server 127.0.0.1:{gw.port}; keepalive 16; }}"
        for env, gw in gateways.items()
    )
    env_map = "\n".join(f"        {env} o3_{env};" for env in gateways)
    port = free_port()
    conf = folder / "nginx.conf"
    conf.write_text(
        NGINX_CONF.format(
            folder=folder,
            user="user root;" if os.geteuid() == 0 else "",
            upstreams=upstreams,
            canary_percent=canary_percent,
            env_map=env_map,
            port=port,
            unknown=UNKNOWN_ENV,
        )
    )
    nginx = debian_program("nginx", "usr/sbin/nginx", "nginx")
    command = [str(nginx), "-c", str(conf), "-p", str(folder), "-g", "daemon off;"]
    return launch(command, folder / "nginx.log", port)


def start_cluster(
    model: str | Path,
    sizes: dict[str, int],
    replica_args: tuple[str, ...] = (),
    canary_percent: float = 5,
    folder: Path | None = None,
    timeout: float = 900,
) -> Cluster:
    """Start replicas (all at once, each bound to one CPU core on the CPU
    backend), then the gateways, then nginx; wait until the front answers."""
    missing = set(ENVIRONMENTS) - {e for e, n in sizes.items() if n > 0}
    if missing:
        raise ValueError(f"every environment needs a replica; none for {missing}")
    folder = Path(folder or tempfile.mkdtemp(prefix="o3-cluster-"))
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)  # nginx's workers read and write their temp folders here
    cluster = Cluster(folder)
    cores = os.cpu_count() or 1
    try:
        n = 0
        for env in ENVIRONMENTS:
            cluster.replicas[env] = []
            for i in range(sizes[env]):
                log = folder / f"replica-{env}-{i}.log"
                cpu = {"VLLM_CPU_OMP_THREADS_BIND": str(n % cores)}
                server = launch_server(
                    model, log, *REPLICA_ARGS, *replica_args, env=cpu
                )
                cluster.replicas[env].append(server)
                n += 1
        for replicas in cluster.replicas.values():
            for replica in replicas:
                wait_healthy(replica, timeout)
        for env, replicas in cluster.replicas.items():
            cluster.gateways[env] = start_gateway(env, replicas, folder)
        for gateway in cluster.gateways.values():
            wait_healthy(gateway, 120, path="/v1/models")
        cluster.proxy = start_proxy(cluster.gateways, folder, canary_percent)
        wait_healthy(cluster.proxy, 60, path="/v1/models")
    except BaseException:
        cluster.stop()
        raise
    return cluster


def serve_cluster(model: str, sizes: dict[str, int], replica_args, canary_percent):
    """Run a cluster until Ctrl-C or SIGTERM, then stop all of it."""
    cluster = start_cluster(model, sizes, tuple(replica_args), canary_percent)
    with contextlib.suppress(KeyboardInterrupt):
        print(f"O3 cluster on {cluster.url} (logs in {cluster.folder})")
        for env, replicas in cluster.replicas.items():
            print(f"  {env}: gateway {cluster.gateways[env].url}, replicas "
                  + ", ".join(r.url for r in replicas))  # fmt: skip
        signal.pause()
    cluster.stop()
