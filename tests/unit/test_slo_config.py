"""SLOs as configuration (``shardline.observability``): the shipped SLO file, its checks, what is generated from it
(the rules and dashboards in deploy/observability/ are what it renders today), and that every series a rule or a
dashboard reads is one the code exports, a recorded one or a DCGM exporter's."""

from __future__ import annotations

import json
import shutil
import subprocess
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from shardline.cli.commands import app
from shardline.cli.slo_commands import histogram_bounds
from shardline.errors import InvalidSetting
from shardline.observability.render import RULES_FILE, alert_names, check_thresholds, load_slos, parse_slos, render
from shardline.observability.dashboards import dashboards
from shardline.observability.rules import PAGE, TICKET, rule_groups
from tests.support.metric_names import exported_names, promql_metric_names

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = "deploy/observability/slos.yaml"
DEPLOYED = ROOT / "deploy" / "observability"
# The DCGM exporter's series the GPU dashboard and rule read (its default and profiling counters).
DCGM = frozenset({"DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE",
                  "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_XID_ERRORS",
                  "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"})
PROMETHEUS_OWN = frozenset({"up"})


@pytest.fixture(scope="module")
def shipped() -> Any:
    return load_slos(ROOT / SHIPPED)


def _minimal(**changes: Any) -> dict[str, Any]:
    cls = {"name": "classifier", "models": [".+"], "objectives": [{"sli": "availability", "target": 0.999}]}
    cls.update(changes)
    return {"version": 1, "runbook_url": "docs/runbooks.md", "classes": [cls]}


def test_the_shipped_file_has_a_class_per_model_type_with_the_slis_it_names(shipped: Any) -> None:
    objectives = {c.name: {o.sli: (o.threshold_seconds, o.target) for o in c.objectives} for c in shipped.classes}
    assert objectives == {
        "llm-interactive": {"availability": (None, 0.999), "ttft": (0.5, 0.99), "tpot": (0.05, 0.99)},
        "llm-standard": {"availability": (None, 0.999), "ttft": (2.5, 0.99), "tpot": (0.2, 0.99)},
        "embeddings": {"availability": (None, 0.999), "latency": (0.1, 0.99)},
        "classifier": {"availability": (None, 0.999), "latency": (0.025, 0.99)},
        "batch": {"deadline": (None, 0.99)},
    }
    check_thresholds(shipped, histogram_bounds())  # every threshold is a bucket bound of its histogram


def test_a_model_is_counted_by_the_first_class_of_its_tier_that_names_it(shipped: Any) -> None:
    def classes_of(model: str, tier: str) -> set[str]:
        held = set()
        for slo in shipped.slos:
            if slo.cls.tier != tier:
                continue
            named = any(re.fullmatch(p, model) for p in slo.cls.models)
            excluded = any(re.fullmatch(p, model) for p in slo.excluded)
            if named and not excluded:
                held.add(slo.cls.name)
        return held

    assert classes_of("support-chat", "online") == {"llm-interactive"}
    assert classes_of("tiny-llm", "online") == {"llm-standard"}
    assert classes_of("minilm", "online") == {"embeddings"}
    assert classes_of("breast-cancer", "online") == {"classifier"}  # the catch-all, last
    assert classes_of("breast-cancer", "batch") == {"batch"}  # another tier: counted there too
    classifier = next(s for s in shipped.slos if s.id == "classifier-latency")
    assert classifier.selector().startswith('model=~".+", model!~".*-chat|chat-.*|tiny|')


@pytest.mark.parametrize(("change", "message"), [
    ({"objectives": [{"sli": "latency", "target": 0.99}]},
     "classes[0].objectives[0]: Value error, the latency SLI needs threshold_seconds"),
    ({"objectives": [{"sli": "availability", "target": 0.999, "threshold_seconds": 0.1}]},
     "the availability SLI takes no threshold_seconds"),
    ({"objectives": [{"sli": "speed", "target": 0.99}]}, "classes[0].objectives[0].sli: Value error, is not an SLI"),
    ({"objectives": [{"sli": "availability", "target": 99.9}]},
     "classes[0].objectives[0].target: Input should be less than 1 (got 99.9)"),
    ({"models": ["churn("]}, "classes[0].models: Value error, 'churn(' is not a regular expression"),
    ({"models": ["(?!churn).*"]}, "'(?!churn).*' uses a lookahead, which PromQL's RE2 does not have"),
    ({"models": ["(m)\\1", "x++"]}, "classes[0].models: Value error, '(m)\\\\1' uses a backreference (\\1)"),
    ({"models": ["ok", "x++"]}, "'x++' uses a possessive quantifier (++), which PromQL's RE2 does not have"),
    ({"models": ["(?>churn)"]}, "'(?>churn)' uses an atomic group"),
    ({"models": ["(?<=a)b"]}, "uses a lookbehind"),
    ({"models": ["(?x)churn"]}, "uses the inline flag x"),
    ({"models": ["churn\\Z"]}, "uses \\Z (write $)"),
    ({"models": ["m{,3}"]}, "uses {,3} (RE2 reads it as text; write {0,3})"),
    ({"name": "Big Models"}, "classes[0].name: Value error, must be lowercase letters"),
    ({"objectives": [{"sli": "availability", "target": 0.999}, {"sli": "deadline", "target": 0.99}]},
     "mixes online and batch SLIs; make a class for each tier"),
    ({"objectives": [{"sli": "latency", "target": 0.99, "threshold_seconds": 0.1},
                     {"sli": "latency", "target": 0.9, "threshold_seconds": 0.5}]},
     "has more than one objective on latency"),
    ({"colour": "red"}, "classes[0].colour: Extra inputs are not permitted"),
])
def test_a_wrong_field_is_refused_in_one_line_that_names_it(change: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidSetting) as refused:
        parse_slos(_minimal(**change), "slos.yaml")
    text = str(refused.value)
    assert text.startswith("the SLO file slos.yaml is not valid: ") and message in text and "\n" not in text
    assert text.endswith("see docs/slo.md for the format")


@pytest.mark.parametrize("change", [{"objectives": [{"sli": "availability", "target": 99}]}, {"models": ["churn("]}])
def test_a_wrong_item_is_said_once_not_again_as_an_empty_list(change: dict[str, Any]) -> None:
    with pytest.raises(InvalidSetting) as refused:
        parse_slos(_minimal(**change), "slos.yaml")
    text = str(refused.value)
    assert text.count("; ") == 1 and "Tuple should have at least 1 item" not in text and "'name'" not in text, text
    assert text.startswith(("the SLO file slos.yaml is not valid: classes[0].objectives[0].target: Input should be "
                            "less than 1 (got 99); ", "the SLO file slos.yaml is not valid: classes[0].models: Value "
                            "error, 'churn(' is not a regular expression (missing ), unterminated subpattern at "
                            "position 5); "))


def test_a_file_of_another_kind_is_refused_briefly_naming_its_unknown_fields(tmp_path: Path) -> None:
    manifest = {"format_version": 1, "name": "bc", "version": None, "runtime": "onnx",
                "signature": {"inputs": [{"name": f"feature {i}", "type": "float32"} for i in range(30)]},
                "artifacts": [{"path": "model.onnx", "sha256": "4d" * 32}], "lineage": {"training_data": "x" * 200},
                "tags": {}, "environment": {"python": "3.11"}, "created_at": "2026-12-07T08:15:24Z"}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(InvalidSetting) as refused:
        load_slos(tmp_path / "manifest.json")
    assert str(refused.value) == (
        f"the SLO file {tmp_path / 'manifest.json'} is not valid: version: Input should be 1 (got None); runbook_url: "
        "Field required; classes: Field required; the file: format_version, name, runtime, signature, artifacts and 4 "
        "more are not fields of it (Extra inputs are not permitted); see docs/slo.md for the format")


def test_a_long_value_is_cut_short() -> None:
    with pytest.raises(InvalidSetting) as refused:
        parse_slos({**_minimal(), "runbook_url": ["x" * 500] * 50}, "slos.yaml")
    text = str(refused.value)
    assert "runbook_url: Input should be a valid string (got ['xxxxxx" in text and len(text) < 250, text


@pytest.mark.parametrize(("scrape_jobs", "message"), [
    ("shardline[.*", "scrape_jobs: Value error, 'shardline[.*' is not a regular expression"),
    ("shardline(?!-dev)", "scrape_jobs: Value error, 'shardline(?!-dev)' uses a lookahead"),
    ("(shard)line-\\1", "scrape_jobs: Value error, '(shard)line-\\\\1' uses a backreference"),
    ("", "scrape_jobs: String should have at least 1 character"),
])
def test_a_scrape_jobs_pattern_prometheus_would_refuse_is_refused(scrape_jobs: str, message: str) -> None:
    with pytest.raises(InvalidSetting) as refused:
        parse_slos({**_minimal(), "scrape_jobs": scrape_jobs}, "slos.yaml")
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_two_classes_of_one_name_a_missing_file_and_bad_yaml_are_refused(tmp_path: Path) -> None:
    twice = _minimal()
    twice["classes"] = twice["classes"] * 2
    with pytest.raises(InvalidSetting, match="class names must differ; classifier is used more than once"):
        parse_slos(twice, "slos.yaml")
    with pytest.raises(InvalidSetting, match=r"the SLO file .*nope.yaml cannot be read \(No such file or directory\); "
                                             "pass the file with --config"):
        load_slos(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("classes: [\n")
    with pytest.raises(InvalidSetting, match="is not valid YAML"):
        load_slos(tmp_path / "bad.yaml")


def test_a_threshold_between_bucket_bounds_is_refused_with_the_bounds_it_may_take() -> None:
    config = parse_slos(_minimal(objectives=[{"sli": "ttft", "target": 0.99, "threshold_seconds": 0.45}]), "x")
    with pytest.raises(InvalidSetting) as refused:
        check_thresholds(config, histogram_bounds())
    assert str(refused.value) == (
        "class 'classifier': the ttft threshold 0.45 s is not a bucket bound of "
        "shardline_llm_time_to_first_token_seconds, so its share could not be read off the buckets; use one of "
        "0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10")


def test_the_bounds_the_cli_checks_against_are_the_buckets_the_replicas_export() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from shardline.online.metrics import Metrics

    metrics = Metrics()
    metrics.observe_request("v2", "m", "1", "t", 200, 0.01)
    metrics.llm_first_token("m", "1", "t", 0.1)
    metrics.llm_between_tokens("m", "1", 0.01)
    text = metrics.exposition()[0].decode()
    exported: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket") and sample.labels["le"] != "+Inf":
                exported.setdefault(family.name, []).append(float(sample.labels["le"]))
    for histogram, bounds in histogram_bounds().items():
        assert exported[histogram] == list(bounds), histogram


def test_every_alert_pages_on_the_workbooks_fast_windows_and_tickets_on_the_slow_one(shipped: Any) -> None:
    assert PAGE == ((14.4, "1h", "5m"), (6.0, "6h", "30m")) and TICKET == ((1.0, "3d", "6h"),)
    alerts = [r for group, _ in rule_groups(shipped) for r in group["rules"] if "alert" in r]
    ttft = [a for a in alerts if a["labels"].get("slo") == "llm-interactive-ttft" and a["alert"] == "ShardlineTTFTBudgetBurn"]
    page, ticket = sorted(ttft, key=lambda a: a["labels"]["severity"])
    assert page["labels"]["severity"] == "page" and ticket["labels"]["severity"] == "ticket"
    assert re.sub(r"\s+", " ", page["expr"]).strip() == (
        '( model:shardline_slo_errors:ratio_rate1h{slo="llm-interactive-ttft"} > (14.4 * 0.01) and '
        'model:shardline_slo_errors:ratio_rate5m{slo="llm-interactive-ttft"} > (14.4 * 0.01) ) or '
        '( model:shardline_slo_errors:ratio_rate6h{slo="llm-interactive-ttft"} > (6 * 0.01) and '
        'model:shardline_slo_errors:ratio_rate30m{slo="llm-interactive-ttft"} > (6 * 0.01) )')
    assert re.sub(r"\s+", " ", ticket["expr"]).strip() == (
        '( model:shardline_slo_errors:ratio_rate3d{slo="llm-interactive-ttft"} > (1 * 0.01) and '
        'model:shardline_slo_errors:ratio_rate6h{slo="llm-interactive-ttft"} > (1 * 0.01) )')
    # per model and per tenant, except the time between tokens, whose histogram has no tenant label
    assert alert_names(shipped) == [
        "ShardlineAvailabilityBudgetBurn", "ShardlineTenantAvailabilityBudgetBurn", "ShardlineTTFTBudgetBurn",
        "ShardlineTenantTTFTBudgetBurn", "ShardlineTPOTBudgetBurn", "ShardlineLatencyBudgetBurn",
        "ShardlineTenantLatencyBudgetBurn", "ShardlineBatchDeadlineBudgetBurn", "ShardlineTenantBatchDeadlineBudgetBurn",
        "ShardlineBatchJobWillBeLate", "ShardlineScrapeTargetDown"]


def test_the_latency_ratio_reads_the_threshold_bucket_as_the_replicas_write_le(shipped: Any) -> None:
    records = {r["record"]: r["expr"] for group, _ in rule_groups(shipped) if group["name"] ==
               "shardline-slo-llm-standard-ttft" for r in group["rules"] if "record" in r}
    expr = records["model_tenant:shardline_slo_errors:ratio_rate30m"]
    assert 'shardline_llm_time_to_first_token_seconds_bucket{model=~"tiny|tiny-llm|' in expr
    assert 'le="2.5"}[30m]' in expr and "sum by (model, tenant)" in expr  # prometheus_client writes le="2.5"


def test_the_files_in_deploy_are_what_the_shipped_file_renders(shipped: Any) -> None:
    files = render(shipped, SHIPPED)
    on_disk = {str(p.relative_to(DEPLOYED)) for p in DEPLOYED.rglob("*")
               if p.is_file() and p.parent.name != "tests"} - {"slos.yaml", "README.md"}  # tests/: promtool's, by hand
    assert on_disk == set(files), "run `shardline slo render` and commit what it writes"
    for path, text in files.items():
        assert (DEPLOYED / path).read_text() == text, f"{path} is out of date: run `shardline slo render`"
    assert "groups" in yaml.safe_load(files[RULES_FILE])


def _rule_exprs(config: Any) -> list[str]:
    return [r["expr"] for group, _ in rule_groups(config) for r in group["rules"]]


def _dashboard_exprs() -> list[str]:
    exprs = []
    for model in dashboards().values():
        exprs += [t["expr"] for p in model["panels"] for t in p.get("targets", [])]
        exprs += [v["query"]["query"].removeprefix("label_values(").split(",")[0]
                  for v in model["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_every_series_a_rule_or_dashboard_reads_is_exported_recorded_or_dcgms(shipped: Any) -> None:
    exported = exported_names()
    recorded = {r["record"] for group, _ in rule_groups(shipped) for r in group["rules"] if "record" in r}
    read = {name for expr in _rule_exprs(shipped) + _dashboard_exprs() for name in promql_metric_names(expr)}
    unknown = read - exported - recorded - DCGM - PROMETHEUS_OWN
    assert not unknown, f"rules or dashboards read series nothing exports: {sorted(unknown)}"
    assert {"shardline_requests_total", "shardline_request_seconds_bucket", "shardline_router_requests_total",
            "shardline_llm_time_to_first_token_seconds_bucket", "shardline_tenant_in_flight",
            "shardline_batch_job_deadlines_total", "shardline_batch_job_running",
            "shardline_batch_job_projected_finish_timestamp_seconds"} <= read
    assert {"DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_DEV_GPU_UTIL"} <= read
    # every recorded series a dashboard reads is recorded
    assert {n for e in _dashboard_exprs() for n in promql_metric_names(e) if ":" in n} <= recorded


def test_the_metric_name_parser_skips_functions_labels_strings_and_ranges() -> None:
    expr = ('histogram_quantile(0.99, sum by (model, le) (rate(shardline_request_seconds_bucket{model=~"a|b", '
            'le!="x"}[$__rate_interval]))) / on (slo) group_left () (1 - shardline:slo_objective:ratio) > (14.4 * 1e-05)'
            ' or vector(0) unless up offset 5m')
    assert promql_metric_names(expr) == {"shardline_request_seconds_bucket", "shardline:slo_objective:ratio", "up"}


def test_each_alert_links_to_its_own_section_of_the_runbooks(shipped: Any) -> None:
    runbooks = (ROOT / "docs" / "runbooks.md").read_text()
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
               for h in re.findall(r"^#{2,3} (.+)$", runbooks, re.M)}
    urls = {r["alert"]: r["annotations"]["runbook_url"] for group, _ in rule_groups(shipped) for r in group["rules"]
            if "alert" in r}
    assert set(urls) == set(alert_names(shipped))
    for alert, url in urls.items():
        assert url == f"docs/runbooks.md#{alert.lower()}" and alert.lower() in anchors, alert


def test_the_dashboards_are_grafana_models_with_unique_ids_and_a_datasource_variable() -> None:
    models = dashboards()
    assert set(models) == {"shardline-online.json", "shardline-llm.json", "shardline-tenants.json",
                           "shardline-batch.json", "shardline-gpus.json"}
    for name, model in models.items():
        json.dumps(model)
        ids = [p["id"] for p in model["panels"]]
        assert len(ids) == len(set(ids)) and model["uid"] == name.removesuffix(".json")
        assert model["templating"]["list"][0]["type"] == "datasource"
        for panel in model["panels"]:
            grid = panel["gridPos"]
            assert grid["x"] + grid["w"] <= 24
            if panel["type"] == "timeseries":
                assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}"
    gpu = json.dumps(models["shardline-gpus.json"])
    assert "DCGM_FI_PROF_GR_ENGINE_ACTIVE" in gpu and "or on (Hostname, gpu)" in gpu


def test_slo_render_writes_the_files_and_check_finds_a_stale_one(tmp_path: Path) -> None:
    runner = CliRunner()
    done = runner.invoke(app, ["slo", "render", "--config", str(ROOT / SHIPPED), "--out", str(tmp_path)])
    assert done.exit_code == 0, done.output
    assert (tmp_path / RULES_FILE).is_file() and len(list((tmp_path / "dashboards").glob("*.json"))) == 5
    assert "11 SLOs in 5 classes" in done.output
    check = ["slo", "render", "--config", str(ROOT / SHIPPED), "--out", str(tmp_path), "--check"]
    assert runner.invoke(app, check).exit_code == 0
    (tmp_path / "dashboards" / "shardline-llm.json").write_text("{}")
    stale = runner.invoke(app, check)
    assert stale.exit_code == 1 and "out of date: " in stale.output and "shardline-llm.json" in stale.output


def test_slo_render_check_finds_the_committed_files_current_however_the_config_is_spelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = CliRunner()
    before = (DEPLOYED / RULES_FILE).read_text()
    for cwd, config in [(ROOT, SHIPPED), (ROOT, str(ROOT / SHIPPED)), (DEPLOYED, "slos.yaml"),
                        (DEPLOYED / "rules", "../slos.yaml"), (tmp_path, str(ROOT / SHIPPED))]:
        monkeypatch.chdir(cwd)
        checked = runner.invoke(app, ["slo", "render", "--config", config, "--check"])
        assert checked.exit_code == 0, (cwd, config, checked.output)
        assert checked.output.startswith("6 files in ") and f"match {config}" in checked.output
    monkeypatch.chdir(tmp_path)
    copy = tmp_path / "deploy" / "observability"
    shutil.copytree(DEPLOYED, copy)
    done = runner.invoke(app, ["slo", "render", "--config", str(copy / "slos.yaml")])  # an absolute path
    assert done.exit_code == 0, done.output
    assert (copy / RULES_FILE).read_text() == before


def test_slo_render_into_a_file_or_a_folder_it_cannot_write_is_one_line(tmp_path: Path) -> None:
    blocked = tmp_path / "key.txt"
    blocked.write_text("not a folder")
    done = CliRunner().invoke(app, ["slo", "render", "--config", str(ROOT / SHIPPED), "--out", str(blocked)])
    assert done.exit_code == 2 and done.output.count("\n") == 1, done.output
    assert done.output.startswith(f"error: cannot write the generated files into {blocked}: Not a directory (")
    assert done.output.rstrip().endswith("pass a writable folder with --out") and blocked.read_text() == "not a folder"
    checked = CliRunner().invoke(app, ["slo", "render", "--config", str(ROOT / SHIPPED), "--out", str(blocked), "--check"])
    assert checked.exit_code == 2 and checked.output == (f"error: --out {blocked} is a file; --check compares the files "
                                                         "in a folder: pass the folder the rules and dashboards are in\n")


def test_slo_render_refuses_a_wrong_file_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "slos.yaml"
    bad.write_text(yaml.safe_dump(_minimal(objectives=[{"sli": "latency", "target": 0.99, "threshold_seconds": 0.3}])))
    done = CliRunner().invoke(app, ["slo", "render", "--config", str(bad)])
    assert done.exit_code == 2 and not (tmp_path / "rules").exists()
    assert done.output.startswith("error: class 'classifier': the latency threshold 0.3 s is not a bucket bound")
    assert done.output.count("\n") == 1


def test_slo_rules_writes_only_the_rules_file_render_writes_or_prints_it(tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "prometheus" / "shardline.rules.yaml"
    done = runner.invoke(app, ["slo", "rules", "--config", str(ROOT / SHIPPED), "-o", str(out)])
    assert done.exit_code == 0, done.output
    # the header names the file it read by its name: the same text as the committed file, wherever it is run from
    assert out.read_text() == (DEPLOYED / RULES_FILE).read_text()
    assert out.read_text().startswith("# Generated by `shardline slo rules` (or `slo render`) from slos.yaml: ")
    assert sorted(tmp_path.rglob("*")) == [out.parent, out]
    assert f"wrote {out}: 11 SLOs in 5 classes" in done.output
    printed = runner.invoke(app, ["slo", "rules", "--config", str(ROOT / SHIPPED)])
    assert printed.exit_code == 0 and printed.stdout == out.read_text()
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    refused = runner.invoke(app, ["slo", "rules", "--config", str(ROOT / SHIPPED), "-o", str(blocked / "x.yaml")])
    assert refused.exit_code == 2 and refused.output.startswith(f"error: cannot write the rules file {blocked}/x.yaml")


PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="no promtool here: apt-get install prometheus "
                                    "(`make test` does, as root)")


@needs_promtool
def test_promtool_checks_the_generated_rules() -> None:
    done = subprocess.run([str(PROMTOOL), "check", "rules", str(DEPLOYED / RULES_FILE)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr


@needs_promtool
def test_patterns_with_backslashes_and_quotes_make_rules_promtool_accepts(tmp_path: Path) -> None:
    config = {**_minimal(models=["churn\\d+", 'say"hi', "[[:alpha:]]+-v[0-9]{2,}"]), "scrape_jobs": 'shard"line\\d+'}
    (tmp_path / "slos.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "rules.yaml"
    done = CliRunner().invoke(app, ["slo", "rules", "--config", str(tmp_path / "slos.yaml"), "-o", str(out)])
    assert done.exit_code == 0, done.output
    text = out.read_text()
    assert 'up{job=~"shard\\"line\\\\d+"} == 0' in text
    assert 'model=~"churn\\\\d+|say\\"hi|[[:alpha:]]+-v[0-9]{2,}"' in text
    checked = subprocess.run([str(PROMTOOL), "check", "rules", str(out)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0 and "SUCCESS" in checked.stdout, checked.stdout + checked.stderr


def test_slo_rules_refuses_a_pattern_re2_lacks_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "slos.yaml").write_text(yaml.safe_dump({**_minimal(models=["(m)\\1", "x++"])}))
    done = CliRunner().invoke(app, ["slo", "rules", "--config", str(tmp_path / "slos.yaml")])
    assert done.exit_code == 2 and done.output.count("\n") == 1, done.output
    assert done.output.startswith(f"error: the SLO file {tmp_path / 'slos.yaml'} is not valid: classes[0].models: ")
    assert "uses a backreference (\\1), which PromQL's RE2 does not have" in done.output


@needs_promtool
@pytest.mark.parametrize("unit", sorted(p.name for p in (DEPLOYED / "tests").glob("*.test.yaml")))
def test_each_alert_fires_and_stays_silent_on_given_series(unit: str) -> None:
    """promtool's own rule unit tests (deploy/observability/tests): fast, slow and steady burns of the availability
    budget per model and per tenant, within the budget silent and 4xx not errors; slow first tokens paging and a
    budget kept silent; a running batch job projected past its deadline, one on time and one finished."""
    done = subprocess.run([str(PROMTOOL), "test", "rules", unit], cwd=DEPLOYED / "tests", capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr


@needs_promtool
def test_a_rule_test_that_expects_the_wrong_alert_fails(tmp_path: Path) -> None:
    """The promtool tests above can fail: a batch job on time expected to be late is reported."""
    unit = yaml.safe_load((DEPLOYED / "tests" / "llm_and_batch.test.yaml").read_text())
    unit["rule_files"] = [str(DEPLOYED / RULES_FILE)]
    late = next(t for t in unit["tests"] if "will be late" in t["name"])
    late["alert_rule_test"][0]["exp_alerts"] = [{"exp_labels": {"severity": "ticket", "job_id": "ontime"}}]
    unit["tests"] = [late]
    (tmp_path / "wrong.test.yaml").write_text(yaml.safe_dump(unit))
    done = subprocess.run([str(PROMTOOL), "test", "rules", "wrong.test.yaml"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1 and "FAILED" in done.stdout + done.stderr
