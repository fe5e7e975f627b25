"""deploy/ holds up: compose file, Prometheus config, Grafana dashboards, image and systemd unit.

There is no Docker engine here, so nothing is built or run in a container. Instead the
files are checked by the tools that consume them (`docker-compose config`, `promtool`,
`systemd-analyze verify`), and every dashboard query is sent to a real Prometheus that
scrapes a live 2-peer swarm with the scrape jobs of deploy/prometheus/prometheus.yml.
Missing tools are installed with apt-get when running as root; otherwise those tests skip.
"""
from __future__ import annotations

import configparser
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

import pytest
import yaml

from monitoring.metrics import CONTRACT_METRICS
from monitoring.swarm_metrics import SWARM_METRICS
from tests.peers import REPO_ROOT

DEPLOY = REPO_ROOT / "deploy"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
DASHBOARD_DIR = DEPLOY / "grafana" / "dashboards"
GENERATOR = DEPLOY / "grafana" / "generate_dashboards.py"
UNIT_FILE = DEPLOY / "systemd" / "peer.service"
SERVICES = {"bootstrap", "peer", "monitor", "prometheus", "grafana"}
TOOL_TIMEOUT_SECONDS = 60
LOCAL_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1 never goes via a proxy
GRAFANA_INTERVAL = "30s"  # stands in for $__rate_interval and friends when querying Prometheus directly

# Panels that may legitimately return no series on this CPU-only machine, and why.
CUDA_ONLY_PANELS = {
    ("swarmtrain / Peer detail", "GPU memory"):
        "peer_gpu_memory_* are exported only by peers on CUDA devices",
}


# --- system tools ------------------------------------------------------------------------

def run_tool(*command: str, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=TOOL_TIMEOUT_SECONDS)


# --- docker compose and the image --------------------------------------------------------

def command_of(service: Dict) -> List[str]:
    command = service.get("command", [])
    return shlex.split(command) if isinstance(command, str) else list(command)


def flag_value(command: List[str], flag: str) -> Optional[str]:
    for index, word in enumerate(command):
        if word == flag and index + 1 < len(command):
            return command[index + 1]
        if word.startswith(flag + "="):
            return word.split("=", 1)[1]
    return None


def test_compose_defines_the_swarm(compose: Dict):
    services = compose["services"]
    assert set(services) == SERVICES
    peer = services["peer"]
    assert "container_name" not in peer, "a fixed container name breaks --scale peer=N"
    assert not peer.get("ports"), "a host port on `peer` collides as soon as it has two replicas"
    assert mounts(services["prometheus"])["/etc/prometheus/prometheus.yml"] == str(PROMETHEUS_CONFIG)
    grafana = mounts(services["grafana"])
    provisioning = DEPLOY / "grafana" / "provisioning"
    assert grafana["/etc/grafana/provisioning"] == str(provisioning)
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "swarmtrain.yml").read_text())["providers"]
    assert grafana[provider["options"]["path"]] == str(DASHBOARD_DIR), "Grafana would find no dashboards"


def mounts(service: Dict) -> Dict[str, str]:
    """Container path -> host path of a service's volumes (docker-compose v1 prints strings, v2 mappings)."""
    pairs = [(volume["target"], volume["source"]) if isinstance(volume, dict) else tuple(volume.split(":")[1::-1])
             for volume in service.get("volumes", [])]
    return dict(pairs)


def test_compose_peers_read_the_address_the_bootstrap_writes(compose: Dict):
    services = compose["services"]
    written = flag_value(command_of(services["bootstrap"]), "--write-maddrs")
    assert written and command_of(services["bootstrap"])[0] == "bootstrap"
    assert "healthcheck" in services["bootstrap"]
    for name in ("peer", "monitor"):
        assert flag_value(command_of(services[name]), "--initial-peers-file") == written, name
        assert services[name]["depends_on"]["bootstrap"]["condition"] == "service_healthy", name
    assert command_of(services["peer"])[0] == "start" and command_of(services["monitor"])[0] == "monitor"
    for key in ("PEER_RUN_ID", "PEER_TARGET_BATCH_SIZE"):  # the monitor must look at the peers' run
        assert services["monitor"]["environment"][key] == services["peer"]["environment"][key], key


def test_promtool_accepts_the_prometheus_config(promtool: str):
    # The peer job's DNS name `peer` does not resolve here: promtool checks syntax, not DNS.
    result = run_tool(promtool, "check", "config", str(PROMETHEUS_CONFIG))
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_scrapes_what_compose_serves(compose: Dict):
    jobs = {job["job_name"]: job for job in yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]}
    assert set(jobs) == {"peer", "monitor"}
    metrics_port = int(compose["services"]["peer"]["environment"]["PEER_METRICS_PORT"])
    (discovery,) = jobs["peer"]["dns_sd_configs"]
    assert discovery["names"] == ["peer"] and discovery["type"] == "A" and discovery["port"] == metrics_port
    assert jobs["monitor"]["static_configs"] == [{"targets": ["monitor:9100"]}]
    assert flag_value(command_of(compose["services"]["monitor"]), "--metrics-port") == "9100"
    # a peer's metrics listen on 127.0.0.1 unless told otherwise: in a container, Prometheus is elsewhere
    for service in ("peer", "monitor"):
        assert compose["services"][service]["environment"]["PEER_METRICS_HOST"] == "0.0.0.0", service


def dockerfile_instructions() -> List[Tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def image_healthcheck(port: int) -> subprocess.CompletedProcess:
    """Run the Dockerfile's HEALTHCHECK command here, against a metrics port on 127.0.0.1."""
    command = json.loads(dict(dockerfile_instructions())["HEALTHCHECK"].split("CMD", 1)[1])
    assert command[0] == "python"
    env = {key: value for key, value in os.environ.items() if "proxy" not in key.lower()}
    return subprocess.run([sys.executable, *command[1:]], capture_output=True, text=True,
                          env={**env, "PEER_METRICS_PORT": str(port)}, timeout=TOOL_TIMEOUT_SECONDS)


def test_dockerfile_copies_dependencies_first_and_every_package():
    instructions = dockerfile_instructions()
    copies = [args.split() for op, args in instructions if op == "COPY"]
    assert copies[0][:-1] == ["pyproject.toml", "README.md"], "dependencies must install before the code is copied"
    dependencies = next(i for i, (op, args) in enumerate(instructions) if op == "RUN" and "pip install -r" in args)
    first_code_copy = next(i for i, (op, args) in enumerate(instructions) if op == "COPY" and "pyproject" not in args)
    assert dependencies < first_code_copy, "code copied before the dependencies: every edit reinstalls them"
    packages = {source for copy in copies[1:] for source in copy[:-1]}
    include = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    wanted = {pattern.rstrip("*") for pattern in include["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages == wanted, "the image must copy exactly the packages pyproject.toml installs"
    allowed = {line[1:].rstrip("/") for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
               if line.startswith("!")}
    assert {source for copy in copies for source in copy[:-1]} <= allowed, ".dockerignore hides a copied path"
    ops = dict(instructions)
    assert ops["ENTRYPOINT"] == '["peer"]'
    assert ops["USER"] not in ("root", "0") and "/var/lib/swarmtrain" in ops["VOLUME"]
    assert "/healthz" in ops["HEALTHCHECK"]


# --- dashboards --------------------------------------------------------------------------

def load_generator():
    spec = importlib.util.spec_from_file_location("generate_dashboards", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dashboards() -> Dict[str, Dict]:
    return {path.name: json.loads(path.read_text()) for path in sorted(DASHBOARD_DIR.glob("*.json"))}


def panel_queries() -> List[Tuple[str, str, str]]:
    """(dashboard title, panel title, expr) for every query of every panel."""
    return [(board["title"], panel["title"], query["expr"])
            for board in dashboards().values() for panel in board["panels"] for query in panel["targets"]]


def variable_queries() -> List[str]:
    """The series selector inside each label_values(selector, label) variable query."""
    selectors = []
    for board in dashboards().values():
        for variable in board["templating"]["list"]:
            match = re.fullmatch(r"label_values\((.+),\s*\w+\)", variable["query"])
            assert match, f"{board['title']}: unexpected variable query {variable['query']}"
            selectors.append(match.group(1))
    return selectors


def test_committed_dashboards_are_the_generator_output():
    generator = load_generator()
    generated = {name: generator.render(model) for name, model in generator.build_dashboards().items()}
    committed = {path.name: path.read_text() for path in DASHBOARD_DIR.glob("*.json")}
    assert set(committed) == set(generated)
    stale = [name for name in generated if committed[name] != generated[name]]
    assert not stale, f"run `python {GENERATOR.relative_to(REPO_ROOT)}` and commit: {stale} differ"


def test_dashboards_are_valid_with_unique_panel_ids_and_the_provisioned_datasource():
    datasource_file = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
    (datasource,) = yaml.safe_load(datasource_file.read_text())["datasources"]
    boards = dashboards()
    assert len(boards) == 3 and len({board["uid"] for board in boards.values()}) == 3
    for name, board in boards.items():
        ids = [panel["id"] for panel in board["panels"]]
        assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids), name
        for panel in board["panels"]:
            assert panel["targets"] and panel["datasource"]["uid"] == datasource["uid"], (name, panel["title"])
    assert boards["peer-detail.json"]["templating"]["list"][0]["name"] == "peer"


PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                   "offset"}


def metric_names(expr: str) -> Set[str]:
    """Metric names a PromQL expression selects (a small lexer; enough for dashboard queries)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\$\w+", " ", text)  # matchers, ranges, Grafana variables
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)  # label lists
    names = set()
    for match in re.finditer(r"(?<![\w.])[A-Za-z_:][\w:]*", text):
        if match.group() not in PROMQL_KEYWORDS and not text[match.end():].lstrip().startswith("("):
            names.add(match.group())
    return names


def test_metric_names_lexer():
    expr = ('histogram_quantile(0.9, sum by (instance, le) (rate(a_bucket{job="peer", x=~"$peer"}'
            '[$__rate_interval]))) / on(instance) group_left b + bottomk(5, sum(rate(c_total[1m])) by (le))')
    assert metric_names(expr) == {"a_bucket", "b", "c_total"}


def exposed_names(contract: Dict[str, str]) -> Set[str]:
    names = {"up"}
    for name, kind in contract.items():
        names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"} if kind == "histogram" else {name}
    return names


def test_queries_use_only_contract_metrics():
    # A peer exports monitoring.metrics; `peer monitor` exports monitoring.swarm_metrics.
    contracts = {"peer": (exposed_names(CONTRACT_METRICS), "monitoring.metrics"),
                 "monitor": (exposed_names(SWARM_METRICS), "monitoring.swarm_metrics")}
    for expr in [expr for _, _, expr in panel_queries()] + variable_queries():
        jobs = set(re.findall(r'job="(\w+)"', expr))
        assert len(jobs) == 1 and jobs <= set(contracts), f"{expr!r} must select job=\"peer\" or job=\"monitor\""
        allowed, source = contracts[jobs.pop()]
        names = metric_names(expr)
        assert names, f"no metric found in {expr!r}"
        assert names <= allowed, f"{expr!r} uses {sorted(names - allowed)}, not in {source}"


# --- systemd -----------------------------------------------------------------------------

def unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None, comment_prefixes=("#", ";"))
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string(UNIT_FILE.read_text())
    return parser


def seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+)\s*(s|sec|min|m)?", value.strip())
    assert match, f"unexpected time span {value!r}"
    return float(match.group(1)) * (60 if match.group(2) in ("min", "m") else 1)


def test_systemd_unit_restarts_on_failure_and_waits_for_the_checkpoint():
    service = unit()["Service"]
    assert service["Restart"] == "on-failure"
    assert "peer start --config /etc/swarmtrain/peer.toml" in service["ExecStart"]
    assert service["StateDirectory"] == "swarmtrain" and service["WorkingDirectory"] == "/var/lib/swarmtrain"
    assert seconds(service["TimeoutStopSec"]) >= 35, "the peer may take 30 s to checkpoint and leave"
    assert service["KillSignal"] == "SIGTERM" and service["User"] not in ("root", "0")
    assert service["NoNewPrivileges"] == "yes" and service["PrivateTmp"] == "yes"
    assert service["ProtectSystem"] == "strict" and "/var/lib/swarmtrain" in service["ReadWritePaths"].split()
    assert unit()["Install"]["WantedBy"] == "multi-user.target"


def test_systemd_analyze_verifies_the_unit(tmp_path: Path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed; the unit's keys are still checked by the test above")
    # verify also checks that ExecStart's binary exists: point it at a stand-in, nothing else changes.
    stand_in = tmp_path / "peer"
    stand_in.write_text("#!/bin/sh\n")
    stand_in.chmod(0o755)
    unit_copy = tmp_path / UNIT_FILE.name
    unit_copy.write_text(UNIT_FILE.read_text().replace("/opt/swarmtrain/bin/peer ", f"{stand_in} "))
    result = run_tool(analyze, "verify", str(unit_copy), cwd=tmp_path)
    output = result.stdout + result.stderr
    # Unknown keys and bad values are only warnings (exit 0): any line about the unit fails.
    assert result.returncode == 0 and UNIT_FILE.name not in output, output


def test_peer_toml_example_is_a_valid_config(tmp_path: Path):
    from peer.config import load_config

    state = tmp_path / "state"
    state.mkdir()
    text = (DEPLOY / "systemd" / "peer.toml.example").read_text()
    assert "/var/lib/swarmtrain" in text
    config_path = tmp_path / "peer.toml"  # the state dir does not exist here: use a temp one
    config_path.write_text(text.replace("/var/lib/swarmtrain", str(state)))
    config = load_config(config_path, {}, {})
    assert config.checkpoint.checkpoint_dir == state / "checkpoints"
    assert config.dht.initial_peers
    assert config.monitoring.metrics_host == "127.0.0.1"  # said explicitly, with what to give instead
