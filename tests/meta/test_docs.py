"""The docs stay true: the README is a landing page that leads with its two commands, the configuration
reference is generated from the config models and lists every setting, the presets load, and the site
builds with `mkdocs build --strict` with every page in its nav."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from peer.config import OPTIONS, load_config
from tests.peers import REPO_ROOT

README = (REPO_ROOT / "README.md").read_text()
COMMANDS = re.findall(r"```bash\n(.+?)\n```", README)
DOCS = REPO_ROOT / "docs"
PRESETS = sorted((REPO_ROOT / "examples" / "configs").glob("*.toml"))
README_MAX_BYTES = 12_500
LINE_MAX_CHARACTERS = 300


def load_reference_hook():
    """docs/hooks/config_reference.py, loaded from its path as mkdocs loads it (docs/ is no package)."""
    spec = importlib.util.spec_from_file_location("config_reference", DOCS / "hooks" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_leads_with_install_and_run_then_tests():
    install_and_run, run_tests = COMMANDS[0], COMMANDS[1]
    assert install_and_run.endswith("peer start")
    assert "'.[test,hf]'" in run_tests and run_tests.endswith("pytest")


def test_ci_runs_the_readme_test_command():
    assert COMMANDS[1] in (REPO_ROOT / ".ci" / "run").read_text()


def test_readme_is_a_landing_page():
    size = len(README.encode())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; move reference material into docs/"
    long_lines = [number for number, line in enumerate(README.splitlines(), start=1)
                  if len(line) > LINE_MAX_CHARACTERS]
    assert not long_lines, f"README.md lines over {LINE_MAX_CHARACTERS} characters: {long_lines}"


def test_readme_links_point_at_files_that_exist():
    targets = [target for target in re.findall(r"\]\(([^)#\s]+)[^)]*\)", README) if "://" not in target]
    assert any(target.startswith("docs/") for target in targets)
    missing = [target for target in targets if not (REPO_ROOT / target).exists()]
    assert not missing


def test_the_docs_name_only_files_that_exist():
    """A path in a page (`averaging/registry.py`, `examples/configs/lan-swarm.toml`) is a promise: keep it true as
    modules move. Only paths under the repository's own folders are checked; `/etc/...` and `DIR/...` are examples."""
    roots = ("peer/", "averaging/", "dht/", "monitoring/", "deploy/", "tests/", "benchmarks/", "examples/", "docs/",
             ".ci/")
    pattern = re.compile(r"(?<![\w/.-])((?:%s)[\w./-]*\w)" % "|".join(re.escape(root) for root in roots))
    sources = [REPO_ROOT / "README.md", *DOCS.glob("*.md"), *PRESETS]
    missing = sorted({f"{source.name}: {path}" for source in sources for path in pattern.findall(source.read_text())
                      if not (REPO_ROOT / path).exists()})
    assert not missing, "the docs name files that do not exist:\n" + "\n".join(missing)


def test_the_generated_reference_has_a_row_for_every_setting():
    reference = load_reference_hook().config_reference_markdown()
    rows = {line.split("`")[1].split()[0]: line for line in reference.splitlines() if line.startswith("| `--")}
    for option in OPTIONS.values():
        row = rows.get(option.flag)
        assert row is not None, f"{option.flag} has no row in the generated reference"
        assert f"`{option.env}`" in row and f"`{option.dotted}`" in row, row
    assert len(rows) == len(OPTIONS)


def test_the_generated_reference_shows_defaults_from_the_models():
    reference = load_reference_hook().config_reference_markdown()
    rows = [
        "| `--target-batch-size N` | `PEER_TARGET_BATCH_SIZE` | `averaging.target_batch_size` | `4096` |",
        "| `--host-maddrs LIST` | `PEER_HOST_MADDRS` | `dht.host_maddrs` | `/ip4/0.0.0.0/tcp/0` |",  # a factory's
        "| `--client-mode / --no-client-mode` | `PEER_CLIENT_MODE` | `dht.client_mode` | `false` |",
        "| `--batch-size N` | `PEER_BATCH_SIZE` | `training.batch_size` | unset |",
    ]
    missing = [row for row in rows if row not in reference]
    assert not missing


def test_the_command_reference_covers_every_command_and_its_own_flags():
    from peer.cli.main import cli

    reference = load_reference_hook().command_reference_markdown()
    for name, command in cli.commands.items():
        assert f"### `peer {name}`" in reference
        own = [param.opts[0] for param in command.params
               if not getattr(param, "hidden", False) and param.name not in {o.cli_name for o in OPTIONS.values()}
               and param.opts[0] not in ("--config", "--help-all")]
        for flag in own:
            assert f"| `{flag}" in reference, f"peer {name} {flag} is missing from the command reference"


def test_the_presets_are_the_three_the_docs_use():
    names = {path.name for path in PRESETS}
    assert names == {"lan-swarm.toml", "diloco-wan.toml", "untrusted-swarm.toml"}
    docs_text = "\n".join(page.read_text() for page in DOCS.glob("*.md"))
    unused = [name for name in sorted(names) if name not in docs_text]
    assert not unused, f"no page of docs/ mentions {unused}"


@pytest.mark.parametrize("preset", PRESETS, ids=lambda path: path.stem)
def test_a_preset_loads_and_every_value_it_sets_differs_from_the_default(preset: Path, tmp_path: Path):
    values = tomllib.loads(preset.read_text())
    environ = {}
    if "swarm_key" in values.get("dht", {}):
        # the key file a preset names exists only on the swarm's machines: stand in a real one, by its variable
        key = tmp_path / "swarm.key"
        key.write_text("k" * 32)
        environ[OPTIONS["dht.swarm_key"].env] = str(key)
    config, defaults = load_config(preset, environ), load_config()
    assert values, f"{preset.name} sets nothing"
    for section, table in values.items():
        for name, value in table.items():
            loaded, default = getattr(getattr(config, section), name), getattr(getattr(defaults, section), name)
            assert loaded != default, f"{preset.name}: {section}.{name} = {value!r} is the default; drop it"


@pytest.mark.parametrize("preset", PRESETS, ids=lambda path: path.stem)
def test_a_preset_says_who_it_is_for_and_why_each_value(preset: Path):
    lines = preset.read_text().splitlines()
    assert lines[0].startswith("# "), f"{preset.name} must open with a comment saying who it is for"
    previous = ""
    for line in lines:
        if re.match(r"^\w+\s*=", line):
            assert previous.startswith("#"), f"{preset.name}: no comment says why {line.split('=')[0].strip()}"
        if line.strip():
            previous = line.strip()


class _IgnorePythonTags(yaml.SafeLoader):
    """mkdocs.yml names Python objects (!!python/name:...); the nav needs none of them."""


_IgnorePythonTags.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)


def nav_pages(nav) -> list:
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_docs_page_is_in_the_nav():
    config = yaml.load((REPO_ROOT / "mkdocs.yml").read_text(), Loader=_IgnorePythonTags)
    in_nav = nav_pages(config["nav"])
    on_disk = sorted(str(page.relative_to(DOCS)) for page in DOCS.rglob("*.md") if "hooks" not in page.parts)
    assert not sorted(set(on_disk) - set(in_nav)), "pages of docs/ missing from the nav in mkdocs.yml"
    assert not sorted(set(in_nav) - set(on_disk)), "nav entries in mkdocs.yml with no page in docs/"
    assert len(in_nav) == len(set(in_nav)), "a page is in the nav twice"


def test_the_site_builds_strictly_with_the_generated_reference(tmp_path: Path):
    for module in ("mkdocs", "material"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed: pip install -e '.[docs]' (the test extra includes it)")
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    page = (site / "configuration" / "index.html").read_text()
    missing = [option.flag for option in OPTIONS.values() if f"<code>{option.flag}" not in page]
    assert not missing, f"the built configuration page lacks {missing}"
    assert "config-reference" not in page, "the reference marker was not replaced"
