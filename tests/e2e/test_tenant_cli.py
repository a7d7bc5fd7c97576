"""`shardline tenant ...` as a user runs it: the key `add` prints authenticates against a real `shardline serve`
started on the file, `list` never shows a key, `rotate-key` and `remove` take keys away (and `--keep-old` does
not), hand-written comments and other tenants stay, and mistakes are one line."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Callable

import httpx
import orjson
import pytest
import yaml

from shardline.storage.registry import ModelRegistry
from shardline.tenants import hash_api_key, load_tenants_file
from tests.conftest import BuiltModel
from tests.e2e.conftest import SHARDLINE
from tests.support.serve_process import serving

Run = Callable[..., subprocess.CompletedProcess[str]]
KEY_FORMAT = re.compile(r"^sk-[A-Za-z0-9_-]{43}$")


@pytest.fixture
def tenant(tmp_path: Path) -> Run:
    """`shardline tenant ARGS...` in ``tmp_path`` with a user's environment (no SHARDLINE_* but ``env``)."""

    def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        shell = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDLINE_", "PREFECT_"))}
        return subprocess.run([*SHARDLINE, "tenant", *args], env={**shell, "DO_NOT_TRACK": "1", **env}, cwd=tmp_path,
                              capture_output=True, text=True, timeout=60)

    return run


def _key(done: subprocess.CompletedProcess[str]) -> str:
    """The key a command printed: its stdout, one line."""
    assert done.returncode == 0, done.stderr
    assert KEY_FORMAT.match(done.stdout.strip()) and done.stdout.count("\n") == 1, done.stdout
    assert "shown this once" in done.stderr
    return done.stdout.strip()


def _status(url: str, key: str, model: BuiltModel) -> int:
    rows = model.data.features[:3]
    body = {"inputs": [{"name": n, "datatype": "FP32", "shape": [3], "data": rows[:, j].tolist()}
                       for j, n in enumerate(model.data.names)]}
    answer = httpx.post(f"{url}/v2/models/breast-cancer/infer", content=orjson.dumps(body),
                        headers={"Authorization": f"Bearer {key}"}, timeout=30)
    if answer.status_code == 200:
        assert answer.json()["outputs"][0]["data"] == model.estimator.predict(rows.astype("float32")).tolist()
    return answer.status_code


def test_keys_added_authenticate_against_serve_list_hides_them_and_rotate_and_remove_revoke_them(
    tenant: Run, local_registry: ModelRegistry, shardline_home: Path, breast_cancer_model: BuiltModel, tmp_path: Path
) -> None:
    tenants = tmp_path / "tenants.yaml"
    acme = _key(tenant("add", "acme", "--models", "breast-cancer@prod", "--priority", "high", "--rate", "100"))
    globex = _key(tenant("add", "globex", "--models", "breast-cancer@prod,minilm@prod", "--max-concurrent", "8",
                         "--storage-prefix", str(tmp_path / "lake")))
    initech = _key(tenant("add", "initech", "--models", "breast-cancer@prod", "--file", str(tenants)))
    assert len({acme, globex, initech}) == 3
    text = tenants.read_text()  # ./tenants.yaml, made by the first add: digests only
    assert all(key not in text and hash_api_key(key) in text for key in (acme, globex, initech))
    loaded = {t.name: t for t in load_tenants_file(tenants).tenants}
    assert loaded["acme"].priority == "high" and loaded["acme"].rate is not None and loaded["acme"].rate.burst == 100
    assert loaded["globex"].models == ["breast-cancer@prod", "minilm@prod"] and loaded["globex"].max_concurrent == 8
    assert loaded["globex"].batch is not None and loaded["globex"].batch.storage_prefixes == [str(tmp_path / "lake")]

    listed = tenant("list")
    shown = tenant("list", "--json")
    assert listed.returncode == 0 and shown.returncode == 0, listed.stderr + shown.stderr
    for key in (acme, globex, initech):
        for output in (listed.stdout + listed.stderr, shown.stdout + shown.stderr):
            assert key not in output and hash_api_key(key) not in output
    assert re.search(r"acme\s+1\s+high\s+100/s \(burst 100\)\s+breast-cancer@prod", listed.stdout), listed.stdout
    assert {t["name"]: t["api_keys"] for t in json.loads(shown.stdout)} == {"acme": 1, "globex": 1, "initech": 1}

    with serving(shardline_home, tenants, tmp_path / "serve-1.log") as url:
        assert [_status(url, k, breast_cancer_model) for k in (acme, globex, initech, "sk-not-a-key")] == \
            [200, 200, 200, 401]

    acme_2 = _key(tenant("rotate-key", "acme"))
    globex_2 = _key(tenant("rotate-key", "globex", "--keep-old"))
    removed = tenant("remove", "initech")
    assert removed.returncode == 0 and "removed tenant 'initech'" in removed.stdout, removed.stderr
    assert [t["api_keys"] for t in json.loads(tenant("list", "--json").stdout)] == [1, 2]
    with serving(shardline_home, tenants, tmp_path / "serve-2.log") as url:
        assert [_status(url, k, breast_cancer_model) for k in (acme, acme_2, globex, globex_2, initech)] == \
            [401, 200, 200, 200, 401]

    revoked = tenant("revoke-old-keys", "globex")
    assert revoked.returncode == 0 and "1 old key(s) revoked" in revoked.stdout, revoked.stderr
    assert hash_api_key(globex) not in tenants.read_text() and hash_api_key(globex_2) in tenants.read_text()


HAND_WRITTEN = """\
# Production tenants: reviewed in PR #12
tenants:
  # the big customer
  - name: acme
    api_keys_sha256: ["{digest}"]   # printf %s "$KEY" | sha256sum
    models: ["breast-cancer@prod"]  # one reference per model name
    priority: high            # high | normal | low

  # batch only: no key
  - name: lake
    batch:
      storage_prefixes: ["/data/lake"]
"""


def test_edits_keep_other_tenants_and_their_comments_and_the_settings_variable_names_the_file(
    tenant: Run, tmp_path: Path
) -> None:
    tenants = tmp_path / "elsewhere" / "tenants.yaml"
    tenants.parent.mkdir()
    original = HAND_WRITTEN.format(digest="0" * 64)
    tenants.write_text(original)
    tenants.chmod(0o640)
    variable = {"SHARDLINE_TENANTS_FILE": str(tenants)}

    _key(tenant("add", "globex", "--models", "churn@prod", **variable))
    assert tenants.read_text().startswith(original)  # appended: every line before it as it was
    assert oct(tenants.stat().st_mode & 0o777) == oct(0o640) and not (tmp_path / "tenants.yaml").exists()
    _key(tenant("rotate-key", "acme", **variable))
    rotated = tenants.read_text()
    assert '"]   # printf %s "$KEY" | sha256sum' in rotated and "0" * 64 not in rotated
    assert tenant("remove", "lake", **variable).returncode == 0
    left = tenants.read_text()
    assert "# batch only" not in left and "/data/lake" not in left  # the comment above it went with it
    assert left.startswith("# Production tenants: reviewed in PR #12\ntenants:\n  # the big customer\n  - name: acme\n")
    assert [t["name"] for t in yaml.safe_load(left)["tenants"]] == ["acme", "globex"]
    assert not [p for p in tenants.parent.iterdir() if p.name != "tenants.yaml"]  # no temporary file left


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["add", "acme", "--models", "churn@prod"], "tenant 'acme' is in tenants.yaml already; give it a new key with "
                                                    "`shardline tenant rotate-key acme`"),
        (["add", "globex", "--models", "Churn Model"], "tenant 'globex' cannot be added: --models: entry 0: model "
                                                       "name 'Churn Model' is not allowed"),
        (["add", "globex", "--models", "churn@prod", "--priority", "urgent"],
         "--priority: Input should be 'high', 'normal' or 'low'"),
        (["add", "globex", "--models", "churn@prod", "--burst", "5"], "--burst goes with --rate"),
        (["add", "a b", "--models", "churn@prod"], "tenant 'a b' cannot be added: NAME:"),
        (["rotate-key", "nobody"], "there is no tenant 'nobody' in tenants.yaml (tenants: acme)"),
        (["remove", "acme"], "'acme' is the only tenant in tenants.yaml"),
        (["list", "--file", "missing.yaml"], "there is no tenants file missing.yaml; add a tenant first"),
    ],
)
def test_a_mistake_is_one_line_and_changes_nothing(tenant: Run, tmp_path: Path, args: list[str], says: str) -> None:
    _key(tenant("add", "acme", "--models", "churn@prod"))
    before = (tmp_path / "tenants.yaml").read_text()
    done = tenant(*args)
    assert done.returncode == 2 and done.stdout == "", done.stdout
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr, done.stderr
    assert says in done.stderr, done.stderr
    assert (tmp_path / "tenants.yaml").read_text() == before
