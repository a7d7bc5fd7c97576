"""Storage isolation: what a batch job is admitted to use is exactly what the file system opens.

Every form below once passed the prefix check while fsspec opened another tenant's folder
(a query or fragment kept in the path, a file:// host read as a relative path, a link, an
S3 key with '//' or '..'). Local forms run on real folders; S3 forms are resolved by s3fs
itself (no request is sent: the path is decided before any I/O).
"""

from __future__ import annotations

import os
import posixpath
import re
from functools import partial
from pathlib import Path

import fsspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardline.errors import AccessDenied, InvalidSetting
from shardline.locations import check_separate, is_within
from shardline.storage.fs import resolve_location
from shardline.tenants import BatchPolicy, BatchTenant, admit_locations, check_locations

resolve = partial(resolve_location, storage_options=None)


@pytest.fixture()
def lake(tmp_path: Path) -> Path:
    for tenant in ("acme", "globex"):
        (tmp_path / tenant / "in").mkdir(parents=True)
        (tmp_path / tenant / "in" / "a.parquet").write_bytes(b"PAR1")
    (tmp_path / "acme" / "link-to-globex").symlink_to(tmp_path / "globex")
    return tmp_path


def acme(lake: Path) -> BatchTenant:
    return BatchTenant("acme", BatchPolicy(storage_prefixes=[str(lake / "acme"), "s3://lake/acme/"]))


@pytest.mark.parametrize("form", [
    "file://{lake}/acme?/../globex/in",
    "file://{lake}/acme#/../globex/in",
    "{lake}/acme?x=1",
    "s3://lake/acme#/../globex/x",
    "s3://lake/acme?versionId=1",
])
def test_a_query_or_fragment_is_refused_with_what_to_do(lake: Path, form: str) -> None:
    with pytest.raises(InvalidSetting, match=r"holds '\?' or '#' .*pass the plain folder"):
        check_locations(acme(lake), {"input": form.format(lake=lake)}, resolve)


def test_a_file_url_with_a_host_is_refused(lake: Path) -> None:
    # fsspec reads file://globex/in as the relative path globex/in (under the working directory)
    with pytest.raises(InvalidSetting, match=r"names the host 'globex' .*write file:///globex/in"):
        check_locations(acme(lake), {"input": "file://globex/in"}, resolve)


@pytest.mark.parametrize("form", ["s3://lake//acme/x", "s3://lake/acme/../globex/x", "s3://lake/acme/./x",
                                  "s3://lake/acme//x"])
def test_s3_keys_that_object_stores_would_take_literally_are_refused(lake: Path, form: str) -> None:
    with pytest.raises(InvalidSetting, match=r"empty, '\.' or '\.\.' path segment"):
        check_locations(acme(lake), {"output": form}, resolve)


@pytest.mark.parametrize("form", ["s3://key:secret@lake/acme/x", "s3://lake/acme/x\ny", "zip://a::s3://lake/acme/x",
                                  "s3://lake/acme/\x00x"])
def test_credentials_control_characters_and_chains_are_refused(lake: Path, form: str) -> None:
    with pytest.raises(InvalidSetting, match=r"the location .* (credentials|control character|chained)"):
        check_locations(acme(lake), {"output": form}, resolve)


@pytest.mark.parametrize(("form", "said"), [
    ("dir://x", "cannot be opened (AttributeError"), ("zip://x", "cannot be opened (IsADirectoryError"),
    ("tar://x", "cannot be opened (IsADirectoryError"), ("reference://x", "cannot be opened: ReferenceFileSystem"),
    ("http://127.0.0.1:1/x", "is a web address"), ("https://example.com/lake/acme", "is a web address"),
])
def test_a_scheme_that_names_no_folder_of_files_is_a_wrong_request(form: str, said: str) -> None:
    """fsspec schemes that wrap another file system and were given none, and web addresses: each a wrong request
    (InvalidSetting: exit 2, one line) before anything is opened, never a bare Python error (exit 1: 'run again')."""
    with pytest.raises(InvalidSetting, match=re.escape(said)) as refused:
        resolve_location(form)
    assert "\n" not in str(refused.value) and form in str(refused.value)


def test_a_link_inside_the_prefix_into_another_tenant_is_refused(lake: Path) -> None:
    with pytest.raises(AccessDenied, match=r"may not use .*link-to-globex/in.* \(which resolves to .*globex/in'\) "
                                           r"as its input"):
        check_locations(acme(lake), {"input": str(lake / "acme" / "link-to-globex" / "in")}, resolve)


def test_dot_dot_out_of_the_prefix_is_refused_and_inside_is_resolved(lake: Path) -> None:
    with pytest.raises(AccessDenied, match="as its output"):
        check_locations(acme(lake), {"output": f"{lake}/acme/../globex/x"}, resolve)
    got = check_locations(acme(lake), {"input": f"file://{lake}/acme/x/../in/", "output": "s3a://lake/acme/out/"},
                          resolve)
    assert got == {"input": str(lake / "acme" / "in"), "output": "s3://lake/acme/out"}


def test_a_relative_path_is_resolved_against_the_working_directory(lake: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(lake / "acme")
    assert check_locations(acme(lake), {"input": "in"}, resolve) == {"input": str(lake / "acme" / "in")}
    monkeypatch.chdir(lake / "globex")
    with pytest.raises(AccessDenied):
        check_locations(acme(lake), {"input": "in"}, resolve)


def test_a_prefix_that_is_itself_a_link_admits_what_lies_in_its_target(lake: Path) -> None:
    (lake / "team").symlink_to(lake / "acme")
    tenant = BatchTenant("acme", BatchPolicy(storage_prefixes=[str(lake / "team")]))
    assert check_locations(tenant, {"input": str(lake / "acme" / "in")}, resolve) == {"input": str(lake / "acme" / "in")}


@pytest.mark.parametrize(("prefix", "message"), [
    ("/", "is empty or the root"), ("s3://lake/acme?x", "holds '\\?', '#' or '::'"), ("  ", "is empty or the root"),
])
def test_a_bad_prefix_is_refused_when_the_tenants_file_is_read(prefix: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BatchPolicy(storage_prefixes=[prefix])


@pytest.mark.parametrize(("output", "how"), [
    ("{lake}/acme/in", "is the input"),
    ("{lake}/acme/in/scored", "lies inside the input"),
    ("{lake}/acme", "holds the input"),
    ("{lake}/acme/link-to-globex/../acme/in", None),  # the link's '..' leads to lake/acme/in: the input itself
])
def test_an_output_that_overlaps_the_input_is_refused(lake: Path, output: str, how: str | None) -> None:
    if how is None:  # the OS resolves 'link/..' to the link's target's parent, and so must the check
        out = resolve(output.format(lake=lake))
        assert out == str(lake / "acme" / "in")
        how = "is the input"
    with pytest.raises(InvalidSetting, match=f"the output .* {how} .*choose an --output folder outside the input"):
        admit_locations(None, f"{lake}/acme/in", output.format(lake=lake), resolve)
    assert admit_locations(None, f"{lake}/acme/in", f"{lake}/acme/in-scored", resolve) == (
        str(lake / "acme" / "in"), str(lake / "acme" / "in-scored"))


def test_whole_segments_are_compared() -> None:
    assert is_within("s3://lake/acme/in", "s3://lake/acme")
    assert is_within("s3://lake/acme", "s3://lake/acme/")
    assert not is_within("s3://lake/acme-old/in", "s3://lake/acme")
    assert not is_within("/srv/acmex", "/srv/acme")
    check_separate("/srv/in", "/srv/in-scored")


# What the property covers: any text a user may pass, built from segments that have broken
# such checks before (dots, empty segments, '?', '#', encoded dots, links, hosts).
_SEGMENT = st.sampled_from(["acme", "globex", "in", "..", ".", "", "acme?", "#", "%2e%2e", "link-to-globex", "x"])


@settings(max_examples=400, deadline=None)
@given(st.lists(_SEGMENT, min_size=1, max_size=6), st.sampled_from(["", "file://", "file://acme", "s3://lake",
                                                                       "s3a://lake", "s3://lake/", "s3://other"]))
def test_nothing_outside_a_prefix_is_admitted(tmp_path_factory: pytest.TempPathFactory, segments: list[str],
                                              head: str) -> None:
    lake = Path(os.path.realpath(tmp_path_factory.getbasetemp() / "prop-lake"))
    if not (lake / "acme").exists():
        (lake / "acme").mkdir(parents=True)
        (lake / "globex").mkdir()
        (lake / "acme" / "link-to-globex").symlink_to(lake / "globex")
    tail = "/".join(segments)
    location = f"{head}/{tail}" if head.startswith("s3") else f"{head}{lake}/acme/{tail}"
    tenant = BatchTenant("acme", BatchPolicy(storage_prefixes=[str(lake / "acme"), "s3://lake/acme"]))
    try:
        check_locations(tenant, {"input": location}, resolve)
    except (InvalidSetting, AccessDenied):
        return
    # Admitted: where the file system itself will go must lie under a prefix.
    fs, path = fsspec.url_to_fs(location)
    if location.startswith("s3"):
        assert path == "lake/acme" or path.startswith("lake/acme/"), (location, path)
        assert not any(s in ("", ".", "..") for s in path.split("/")), (location, path)
    else:
        real = os.path.realpath(path)
        assert real == str(lake / "acme") or real.startswith(f"{lake}/acme/"), (location, real)
        assert posixpath.normpath(real) == real


def test_a_write_below_the_output_never_follows_a_link_out_of_it(lake: Path) -> None:
    from shardline.storage.fs import inside, links_out

    out = lake / "acme" / "out"
    (out / "ok").mkdir(parents=True)
    (out / "_ledger").symlink_to(lake / "globex")
    (out / "same").symlink_to(out / "ok")  # a link that stays inside is fine
    fs = fsspec.filesystem("file")
    assert links_out(fs, str(out)) == [(str(out / "_ledger"), str(lake / "globex"))]
    assert inside(fs, str(out), str(out / "same" / "a.json")) == str(out / "same" / "a.json")
    with pytest.raises(InvalidSetting, match=r"_ledger/x.json' leads outside the output folder .* \(to '.*globex/x.json'\)"):
        inside(fs, str(out), str(out / "_ledger" / "x.json"))
    from shardline.storage.output import OutputLayout

    layout = OutputLayout(str(out), job_id="j1")
    assert layout.part_path("same/a.parquet") == str(out / "same" / "a.parquet")
    for _ in range(2):  # a layout resolves its root once, and still checks every path it gives
        with pytest.raises(InvalidSetting, match=r"_ledger/x.json' leads outside the output folder"):
            layout.ledger_path("x")
    memory = fsspec.filesystem("memory")
    assert links_out(memory, "/out") == [] and inside(memory, "/out", "/out/_ledger/x") == "/out/_ledger/x"
