"""Reading the clouds' preemption notices: pure functions over the metadata services' answers."""

from __future__ import annotations

import pickle

import pytest
from pydantic import ValidationError

from shardline.settings import DaskSettings
from shardline.tasks.preemption import (
    METADATA_HOST,
    AwsSpotNotice,
    AzurePreemptNotice,
    NoticeSources,
    aws_spot_notice,
    azure_preempt_notice,
)


def test_aws_instance_action_is_a_notice_and_404_is_none() -> None:
    body = b'{"action": "terminate", "time": "2026-11-30T12:00:00Z"}'
    assert aws_spot_notice(200, body) == "AWS spot terminate at 2026-11-30T12:00:00Z"
    assert aws_spot_notice(200, b'{"action": "stop", "time": "2026-11-30T12:00:00Z"}').startswith("AWS spot stop")
    assert aws_spot_notice(404, b"Not Found") is None  # no interruption scheduled
    assert aws_spot_notice(401, b"") is None  # a token that expired: no answer, not a notice
    assert aws_spot_notice(200, b"") is None
    assert aws_spot_notice(200, b"terminate") == "AWS spot instance-action"  # something, not JSON: still a notice


def _document(*events: dict[str, object]) -> bytes:
    import json

    return json.dumps({"DocumentIncarnation": 2, "Events": list(events)}).encode()


PREEMPT = {
    "EventId": "A123BC45-1234-5678-AB90-ABCDEF123456", "EventStatus": "Scheduled", "EventType": "Preempt",
    "ResourceType": "VirtualMachine", "Resources": ["worker-vmss_3"], "NotBefore": "Mon, 30 Nov 2026 12:00:30 GMT",
    "Description": "", "EventSource": "Platform", "DurationInSeconds": -1,
}


def test_an_azure_preempt_event_for_this_vm_is_a_notice() -> None:
    assert azure_preempt_notice(_document(PREEMPT), "worker-vmss_3") == (
        "Azure Preempt event A123BC45-1234-5678-AB90-ABCDEF123456 (not before Mon, 30 Nov 2026 12:00:30 GMT)"
    )
    assert azure_preempt_notice(_document(PREEMPT), None) is not None  # the VM's name unknown: any Preempt


def test_other_azure_events_and_other_vms_are_not_notices() -> None:
    reboot = {**PREEMPT, "EventType": "Reboot"}
    assert azure_preempt_notice(_document(reboot), "worker-vmss_3") is None
    assert azure_preempt_notice(_document(PREEMPT), "worker-vmss_4") is None  # same placement group, other VM
    assert azure_preempt_notice(_document(), "worker-vmss_3") is None
    assert azure_preempt_notice(b"<html>", "worker-vmss_3") is None
    assert azure_preempt_notice(b'{"Events": "none"}', None) is None


def test_sources_parse_the_cloud_forms_and_travel_to_workers() -> None:
    sources = NoticeSources.parse(("sigterm", "aws", "azure", "aws:http://127.0.0.1:8080/"))
    assert sources.sigterm and sources.polled
    aws, azure, local = sources.clouds
    assert isinstance(aws, AwsSpotNotice) and aws.base == METADATA_HOST
    assert isinstance(azure, AzurePreemptNotice) and azure.base == METADATA_HOST
    assert isinstance(local, AwsSpotNotice) and local.base == "http://127.0.0.1:8080"
    assert pickle.loads(pickle.dumps(sources)).clouds[2].base == "http://127.0.0.1:8080"  # the plugin is pickled
    assert not NoticeSources.parse(("sigterm",)).polled
    with pytest.raises(ValueError, match="after 'aws:' comes the metadata service's http"):
        NoticeSources.parse(("aws:169.254.169.254",))


def test_settings_take_the_cloud_forms_and_refuse_others_early() -> None:
    assert DaskSettings(preemption_notices=("aws", "azure:http://127.0.0.1:9")).preemption_notices[0] == "aws"
    with pytest.raises(ValidationError, match="unknown"):
        DaskSettings(preemption_notices=("gcp",))
    with pytest.raises(ValidationError, match="after 'azure:' comes an http"):
        DaskSettings(preemption_notices=("azure:metadata",))
